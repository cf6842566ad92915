"""The RL step, read top to bottom in :meth:`Trainer.step` (``colocate_sync``): generate, then
(the engines leave the devices when colocated) score, old/reference log-probs, advantages and
the updates in :meth:`Trainer.train_on`, then the weight sync and the engines' return, then the
step's metrics. :meth:`Trainer.fit` runs the steps through the scheduler of ``scheduler.mode``,
which decides what overlaps; it validates, checks health, logs and saves on schedule. The
phases themselves are in :mod:`megarl.trainer.phases`."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from megarl.batch import StepBatch
from megarl.faults import set_step
from megarl.memory import PhaseOutOfMemory, find_out_of_memory, memory_metrics, phase_memory
from megarl.metrics.timing import timer
from megarl.rollout.interface import RolloutSample
from megarl.scheduler import build_scheduler
from megarl.scheduler.dynamic_sampling import fill_with_varied_groups
from megarl.trainer.checkpoint import publish_checkpoint, save_due, save_run_checkpoint
from megarl.trainer.critic import compute_values, critic_data_metrics, update_critic
from megarl.trainer.phases import StepPhases


class Trainer(StepPhases):
    """Drives the train and rollout pools through RL steps."""

    def fit(self) -> list[dict[str, float]]:
        """Run ``trainer.total_steps`` steps; ``scheduler.mode`` decides what overlaps with
        what (:mod:`megarl.scheduler`). Returns every step's metrics."""
        history = []
        val_every, total = self.cfg.trainer.val_every, self.cfg.trainer.total_steps
        scheduler = self.scheduler = build_scheduler(self, self.cfg.scheduler)
        saving_s = 0.0  # the last save's time, logged with the next step (saved after logging)
        try:
            for step in range(self.steps_done + 1, total + 1):
                set_step(step)
                metrics = self.reporting_oom(lambda s=step: scheduler.step(last=s == total))
                if val_every and (step % val_every == 0 or step == total):
                    with timer("validate", metrics):
                        metrics.update(self.validate())
                for line in self.health.check(metrics, step):
                    self.tracker.warn(line)
                metrics.update(self.health.metrics())
                if saving_s or "timing/save_blocking" in metrics:
                    metrics["timing/save_blocking"] = metrics.get("timing/save_blocking",
                                                                  0.0) + saving_s
                self.tracker.log(metrics, step)
                history.append(metrics)
                saving_s = save_run_checkpoint(self)["timing/save_blocking"] if save_due(
                    self) else 0.0
            scheduler.finish()
            publish_checkpoint(self)  # a background save still being written
        except BaseException:
            scheduler.close()
            try:  # the plot and the timeline of the steps until the failure
                self.finish()
            except Exception as err:  # noqa: BLE001 - the step's own error is the one raised
                self.warn(f"after the failure, the plot and timeline were not written: {err}")
            raise
        scheduler.close()
        self.finish()
        return history

    @staticmethod
    def reporting_oom(fn: Callable[[], Any]) -> Any:
        """``fn()``; an out-of-memory error of any rank in any phase comes out as one
        :class:`PhaseOutOfMemory` that names the phase, the rank and the knobs (PITFALLS T1)."""
        try:
            return fn()
        except PhaseOutOfMemory:
            raise
        except Exception as err:
            oom = find_out_of_memory(err)
            if oom is None:
                raise
            raise oom from err

    def step(self, prompts: list[dict[str, Any]]) -> dict[str, float]:
        """One colocate_sync RL step on a batch of prompt rows; returns its metrics."""
        metrics: dict[str, float] = {}
        start = time.perf_counter()
        with timer("gen", metrics):
            batch = self.generate(prompts)
        if self.cfg.algorithm.filter_groups.enable:  # before the engines leave the devices
            batch = fill_with_varied_groups(
                self, batch, lambda: self.generate(self.loader.next_batch()), metrics)
        if self.cfg.rollout.colocate:
            with timer("release_rollout", metrics):  # the engines leave the devices to training
                self.engine_memory("release", ["kv_cache", "weights"])
        self.train_on(batch, metrics)  # offloads what actor.offload switches on
        if self.cfg.rollout.colocate:
            with timer("resume_rollout", metrics):  # weights first: the sync writes into them
                self.free_train_cache()
                self.engine_memory("resume", ["weights"])
        with timer("sync_weights", metrics):
            metrics.update(self.sync_weights())  # then offloads the parameters if configured
        if self.cfg.rollout.colocate:
            with timer("resume_rollout_kv", metrics):  # the sync's buckets were cached blocks
                self.free_train_cache()
                self.engine_memory("resume", ["kv_cache"])
        self.end_step(batch, metrics, start)
        return metrics

    def train_on(self, batch: StepBatch, metrics: dict[str, float]) -> None:
        """Steps 3-6 on generated samples: rewards (unless already scored), old (and reference)
        log-probs, advantages, the actor update; their metrics go into ``metrics``. Every
        scheduler trains through this one method. A background checkpoint of the previous
        step is published first (``trainer.async_save``: written while this step generated)."""
        metrics.update(publish_checkpoint(self))
        if batch.scores is None:
            with timer("reward", metrics):
                metrics.update(self.score(batch))
        values = None
        if self.workers.critic is not None:
            with timer("values", metrics):
                values = compute_values(self.workers.critic, batch)
        with timer("old_log_prob", metrics):
            metrics.update(self.compute_old_log_probs(batch))
        if self.cfg.ref.enabled:
            with timer("ref", metrics):
                batch.ref_log_probs = self.compute_log_probs(batch, use_ref=True)["log_probs"]
        with timer("adv", metrics):  # after old/ref: the in-reward KL penalty needs both
            targets = self.compute_advantages(batch, values, metrics)
        if targets is not None:
            with timer("update_critic", metrics):
                metrics.update(update_critic(self.workers.critic, batch, targets, self.cfg))
            metrics.update(critic_data_metrics(targets, batch.response_mask()))
        with timer("update_actor", metrics):
            metrics.update(self.update_actor(batch))
        self.offload_actor(["grad", "optimizer"])

    def end_step(self, batch: StepBatch, metrics: dict[str, float], start: float) -> None:
        """Close a step that began at ``start`` (``time.perf_counter()``): its wall time, the
        batch metrics, and the step counter."""
        metrics["timing/step"] = time.perf_counter() - start
        stats = self.workers.actor.execute_all("memory_stats")
        metrics.update(memory_metrics([s["peaks"] for s in stats]))
        for name in ("offload_actor", "reload_actor"):  # seconds inside the step, max over ranks
            metrics[f"timing/{name}"] = max(s["seconds"][name] for s in stats)
        metrics.update(self.batch_metrics(batch, metrics))
        self.steps_done += 1

    def generate(self, prompts: list[dict[str, Any]]) -> StepBatch:
        """``rollout.n`` samples per prompt from the engines."""
        samples = self.on_driver(lambda: self.run(
            self.rollout(self.workers.client, prompts, self.steps_done)))
        return StepBatch(samples=samples, prompts=prompts, n=self.cfg.rollout.n)

    async def rollout(self, client: Any, prompts: list[dict[str, Any]],
                      step_index: int) -> list[RolloutSample]:
        """The samples of step ``step_index``'s prompts, generated through ``client`` (the
        schedulers call it from their own event loop)."""
        with phase_memory("gen", "the rollout engines"):
            if self.agent is not None:  # multi-turn episodes (rollout.multi_turn)
                return await self.agent.rollout(client, prompts, self.sampling_params(),
                                                self.prompt_seeds(step_index, len(prompts)),
                                                self.generation_options())
            return await client.generate([p["input_ids"] for p in prompts],
                                         self.sampling_params(),
                                         seeds=self.prompt_seeds(step_index, len(prompts)),
                                         **self.generation_options())

    def sync_weights(self) -> dict[str, float]:
        """Stream the actor's weights to every engine; bump ``weight_version``. Engines that
        died since the last sync (their requests went to the others) are restarted first, get
        the weights with the rest, and take requests again once they report this version."""
        client = self.workers.client
        self.weight_version += 1
        version = str(self.weight_version)
        down = self.on_driver(lambda: sorted(client.down))
        sync_metrics = self.workers.weight_sync(version, down)
        for engine in down:
            self.on_driver(lambda e=engine: self.run(client.readmit(e, version)))
        stats = self.on_driver(lambda: client.stats)
        self.offload_actor(["param"])
        return {**sync_metrics,
                "rollout/weight_version": float(self.weight_version),
                "rollout/engine_restarts": float(len(down)),
                "rollout/engine_failures": float(stats.engine_failures),
                "rollout/failovers": float(stats.failovers)}
