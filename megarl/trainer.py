"""The RL trainer: ``megarl train --config CONFIG [a.b.c=value ...]``.

One step (``colocate_sync``), read top to bottom in :meth:`Trainer.step`:

1. take ``data.train_batch_size`` prompts;
2. generate ``rollout.n`` responses per prompt on the rollout engines (token ids, the engine's
   log-probs, the ``weight_version`` of every sample);
3. score them (batched reward manager);
4. recompute old log-probs on the actor (and reference log-probs when a KL term needs them);
   compare with the engine's log-probs; rollout correction when configured;
5. compute advantages on the driver (``megarl.algo``) from token-level rewards: the score on
   the last response token, minus beta x KL(old || ref) per token with
   ``algorithm.use_kl_in_reward``;
6. update the actor: ``ppo_epochs`` x mini-batches, each split over the data-parallel ranks;
7. stream the new weights to every engine; ``weight_version += 1``;
8. log metrics, run the health monitor.

Colocated (``rollout.colocate``), memory changes hands around steps 3-7: the engines release
their KV cache and weights; the actor trains, offloads its gradients and optimizer state
(``actor.offload.*``, on by default when colocated) and hands its allocator cache back to the
driver; the engines resume their weights; the sync writes into them (then the actor's
parameters are offloaded when ``param_offload`` is on) and the actor hands back its cache again,
the sync's buckets included; the engines resume their KV cache.

Steps 2 (:meth:`Trainer.rollout`), 3-6 (:meth:`Trainer.train_on`) and 7
(:meth:`Trainer.sync_weights`) are written once; ``scheduler.mode`` picks a scheduler
(:mod:`megarl.scheduler`) that only decides what overlaps with what: ``one_step_off`` trains
step k while the engines generate step k+1, ``fully_async`` feeds training from a queue that
the engines fill continuously.

Workers: one :class:`~megarl.megatron.worker.ActorWorker` per train-pool slot and one
:class:`~megarl.rollout.server_worker.RolloutServerWorker` per engine, in Ray placement groups.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from megarl.algo import (
    KLController,
    apply_kl_in_reward,
    compute_advantages,
    compute_rollout_correction,
    make_kl_controller,
    outcome_to_token_rewards,
    rollout_probs_diff_metrics,
    router_agreement,
)
from megarl.batch import StepBatch, even_shares
from megarl.config import RunConfig, load_config, validate_config
from megarl.config.loader import ConfigError
from megarl.config.render import render_config
from megarl.faults import set_step
from megarl.memory import PhaseOutOfMemory, find_out_of_memory, memory_metrics, phase_memory
from megarl.metrics.health import (
    HealthMonitor,
    HealthThresholds,
    NonFiniteGuard,
    NonFiniteUpdates,
)
from megarl.metrics.timing import reduce_metrics, throughput_metrics, timer
from megarl.metrics.trackers import MultiTracker, TrackerSettings
from megarl.rollout.agent import AgentLoop, AgentSettings, agent_metrics
from megarl.rollout.interface import RolloutSample, SamplingParams
from megarl.scheduler import build_scheduler
from megarl.scheduler.dynamic_sampling import fill_with_varied_groups
from megarl.trainer_checkpoint import (
    publish_checkpoint,
    resume_run,
    save_due,
    save_run_checkpoint,
)
from megarl.trainer_critic import (
    CriticTargets,
    compute_values,
    critic_data_metrics,
    gae_advantages_of,
    update_critic,
)
from megarl.trainer_setup import Workers, build_workers, shutdown_workers


class Trainer:
    """Drives the train and rollout pools through RL steps."""

    def __init__(self, cfg: RunConfig, sources: dict[str, str] | None = None) -> None:
        self.cfg = cfg
        self.sources = sources or {}
        self.output_dir = Path(cfg.trainer.output_dir)
        self.loop = asyncio.new_event_loop()
        self.weight_version = 0
        self.steps_done = 0
        self.workers: Workers | None = None
        self.nonfinite = NonFiniteGuard(cfg.trainer.max_nonfinite_updates)
        ctrl = cfg.algorithm.kl_ctrl  # the in-reward KL coefficient; None when that KL is off
        self.kl_ctrl: KLController | None = make_kl_controller(
            ctrl.type, ctrl.kl_coef, ctrl.target_kl, ctrl.horizon) if (
            cfg.algorithm.use_kl_in_reward) else None

    # ----- setup -----
    def setup(self) -> None:
        """Start pools, workers and engines; load data; open trackers."""
        from megarl.data.dataset import load_prompt_dataset
        from megarl.data.loader import PromptLoader
        from megarl.reward import RewardManager

        cfg = self.cfg
        self.dataset = load_prompt_dataset(cfg.data.train_files, cfg.model.path,
                                           max_prompt_length=cfg.data.max_prompt_length,
                                           prompt_key=cfg.data.prompt_key,
                                           trust_remote_code=cfg.model.trust_remote_code)
        self.loader = PromptLoader(self.dataset, cfg.data.train_batch_size, seed=cfg.data.seed,
                                   shuffle=cfg.data.shuffle)
        self.tokenizer = self.dataset.tokenizer
        self.agent = make_agent_loop(cfg, self.tokenizer)
        if self.is_driver:  # outputs only once the inputs were read without error
            self.save_config()
        self.val_dataset = None
        if cfg.trainer.val_every:
            self.val_dataset = load_prompt_dataset(
                cfg.data.val_files, cfg.model.path, max_prompt_length=cfg.data.max_prompt_length,
                prompt_key=cfg.data.prompt_key, trust_remote_code=cfg.model.trust_remote_code)
        self.rewards = RewardManager(cfg.reward.function, batched=cfg.reward.batched,
                                     num_workers=cfg.reward.num_workers,
                                     timeout_s=cfg.reward.timeout_s,
                                     format_score=cfg.reward.format_score)
        self.workers = build_workers(cfg, self.output_dir)
        self.health = HealthMonitor(thresholds=HealthThresholds(
            clip_ratio=cfg.actor.clip_ratio_high))
        resumed_step = resume_run(self)
        loggers = cfg.trainer.loggers if self.is_driver else []
        self.tracker = MultiTracker.from_names(loggers, TrackerSettings(
            output_dir=self.output_dir, total_steps=cfg.trainer.total_steps,
            project_name=cfg.trainer.project_name, experiment_name=cfg.trainer.experiment_name,
            wandb_proxy=cfg.trainer.wandb_proxy, run_config=cfg.model_dump(mode="json"),
            resume_from_step=resumed_step or 0))  # a fresh run replaces old rows

    def save_config(self) -> Path:
        """Write the resolved config (secrets redacted) to ``<output_dir>/config.yaml``."""
        self.output_dir.mkdir(parents=True, exist_ok=True)
        path = self.output_dir / "config.yaml"
        path.write_text(render_config(self.cfg, self.sources))
        return path

    def close(self) -> None:
        """Stop workers and engines, close trackers."""
        if self.workers is not None:
            shutdown_workers(self.workers, self.loop)
            self.workers = None
        if getattr(self, "rewards", None) is not None:
            self.rewards.close()
        if getattr(self, "tracker", None) is not None:
            self.tracker.close()

    def on_driver(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the driver. In the no-Ray mode every torchrun rank runs the trainer:
        rank 0 runs ``fn`` and the others receive its result, so all ranks see the same data."""
        if self.cfg.trainer.worker_group != "naive":
            return fn()
        import torch.distributed as dist

        box = [fn() if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    @property
    def is_driver(self) -> bool:
        """Whether this process logs and writes outputs (always with Ray; rank 0 under
        torchrun)."""
        if self.cfg.trainer.worker_group != "naive":
            return True
        import torch.distributed as dist

        return dist.get_rank() == 0

    def run(self, coro: Any) -> Any:
        """Run a coroutine of the async rollout client on the trainer's event loop."""
        return self.loop.run_until_complete(coro)

    # ----- the step -----
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
        finally:
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

    def validate(self) -> dict[str, float]:
        """Greedy answers to every validation prompt; mean score overall and per data source."""
        from megarl.data.loader import PromptLoader
        from megarl.reward import RewardSample

        tok, cfg = self.tokenizer, self.cfg
        rows = list(self.val_dataset)
        params = SamplingParams(max_new_tokens=cfg.data.max_response_length, temperature=0.0,
                                n=1, stop_token_ids=[tok.eos_token_id])
        size = cfg.data.val_batch_size or len(rows)
        samples = []
        for batch in PromptLoader(rows, size, shuffle=False, drop_last=False):
            if self.agent is not None:  # greedy episodes, the same tools as in training
                samples += self.on_driver(lambda b=batch: self.run(self.agent.rollout(
                    self.workers.client, b, params, [0] * len(b), {"return_logprob": False})))
                continue
            samples += self.on_driver(lambda b=batch: self.run(self.workers.client.generate(
                [p["input_ids"] for p in b], params, return_logprob=False)))
        result = self.on_driver(lambda: self.rewards.score([
            RewardSample(row["data_source"], tok.decode(s.response_ids, skip_special_tokens=True),
                         row["ground_truth"], row.get("extra_info") or {})
            for row, s in zip(rows, samples)]))
        totals = [x + s.extra.get("agent", {}).get("env_reward", 0.0)
                  for x, s in zip(result.scores, samples)]
        metrics = {"val/score/mean": sum(totals) / len(totals)}
        metrics.update({f"val/{k}": v for k, v in agent_metrics(samples).items()
                        if k.startswith("agent/")})
        for source in sorted({row["data_source"] for row in rows}):
            scores = [x for row, x in zip(rows, totals) if row["data_source"] == source]
            metrics[f"val/{source}/score/mean"] = sum(scores) / len(scores)
        return metrics

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

    def free_train_cache(self) -> None:
        """Every train-pool process (actor, critic) hands its allocator's cached blocks back to
        the driver, so that colocated engines can resume into them."""
        self.workers.actor.execute_all("free_cache")
        if self.workers.critic is not None:
            self.workers.critic.group.execute_all("free_cache")

    def engine_memory(self, action: str, tags: list[str]) -> None:
        """Release or resume (``action``) the engines' memory regions ``tags`` (SGLang's
        ``/release_memory_occupation`` and ``/resume_memory_occupation``)."""
        client = self.workers.client
        call = client.release_memory if action == "release" else client.resume_memory
        self.on_driver(lambda: self.run(call(tags)))

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

    def offload_actor(self, parts: list[str]) -> None:
        """Move those of ``parts`` that ``actor.offload`` switches on to host memory (the next
        phase that needs them brings them back)."""
        off = self.cfg.actor.offload
        on = {"param": off.param_offload, "grad": off.grad_offload,
              "optimizer": off.optimizer_offload}
        chosen = [part for part in parts if on[part]]
        if chosen:
            self.workers.actor.execute_all("offload", chosen)

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

    def sampling_params(self) -> SamplingParams:
        """How every prompt of a training step is sampled (``rollout.n`` samples each)."""
        cfg, tok = self.cfg, self.tokenizer
        stop = [tok.eos_token_id] if tok.eos_token_id is not None else []
        return SamplingParams(max_new_tokens=cfg.data.max_response_length,
                              temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                              top_k=cfg.rollout.top_k, n=cfg.rollout.n, stop_token_ids=stop)

    def generation_options(self) -> dict[str, bool]:
        """What the engines return with every training sample (log-probs; routes for R3)."""
        return {"return_logprob": True,
                "return_routed_experts": bool(self.cfg.rollout.enable_return_routed_experts)}

    def prompt_seeds(self, step_index: int, count: int) -> list[int]:
        """Sampling seeds of the prompts of step ``step_index`` (sample j of a prompt uses
        seed + j): from the run seed and the step, so the samples do not depend on how the
        engines batch requests and a run is reproducible."""
        n = self.cfg.rollout.n
        base = (self.cfg.trainer.seed * 1_000_003 + step_index * 10_007) % 2**31
        return [base + i * n for i in range(count)]

    def score(self, batch: StepBatch) -> dict[str, float]:
        """Rewards of every sample; returns the reward metrics."""
        from megarl.reward import RewardSample

        items = []
        for i, sample in enumerate(batch.samples):
            row = batch.prompts[i // batch.n]
            text = self.tokenizer.decode(sample.response_ids, skip_special_tokens=True)
            items.append(RewardSample(row["data_source"], text, row["ground_truth"],
                                      row.get("extra_info") or {}))
        result = self.on_driver(lambda: self.rewards.score(items))
        env_rewards = [s.extra.get("agent", {}).get("env_reward", 0.0) for s in batch.samples]
        batch.scores = torch.tensor(result.scores, dtype=torch.float32) + torch.tensor(
            env_rewards, dtype=torch.float32)  # an environment's rewards (multi-turn) add up
        return dict(result.metrics)

    def token_level_rewards(self, batch: StepBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """``[B, T]`` rewards: each sample's score on its last response token, minus beta x the
        per-token KL of the old to the reference log-probs when ``algorithm.use_kl_in_reward``
        is on (then with ``actor/reward_kl_penalty{,_coeff}``; the controller steps once)."""
        if batch.scores is None:
            raise ValueError("token_level_rewards: the batch has no scores; score it first")
        mask = batch.response_mask()
        scores = outcome_to_token_rewards(batch.scores, mask)
        if self.kl_ctrl is None:
            return scores, {}
        if not batch.old_log_probs or batch.ref_log_probs is None:
            raise ValueError("algorithm.use_kl_in_reward: the old and reference log-probs must "
                             "be computed before the advantages")
        return apply_kl_in_reward(scores, batch.padded(batch.old_log_probs),
                                  batch.padded(batch.ref_log_probs), mask, self.kl_ctrl,
                                  self.cfg.algorithm.kl_penalty)

    def compute_advantages(self, batch: StepBatch, values: list[list[float]] | None = None,
                           metrics: dict[str, float] | None = None) -> CriticTargets | None:
        """Advantages per response token (the estimator of ``algorithm.adv_estimator``) from the
        token-level rewards (outcome estimators: their sum per sample; reinforce_plus_plus: the
        token-level rewards themselves); with gae, from the critic's
        ``values``, returning the critic's targets. The KL metrics go into ``metrics``."""
        alg = self.cfg.algorithm
        if alg.adv_estimator == "remax":
            raise ValueError("algorithm.adv_estimator=remax needs a greedy baseline rollout, "
                             "which this trainer does not generate; use grpo, rloo or opo")
        rewards, kl_metrics = self.token_level_rewards(batch)
        if metrics is not None:
            metrics.update(kl_metrics)
        if alg.adv_estimator == "gae":
            if values is None:
                raise ValueError("algorithm.adv_estimator=gae needs the critic's values; set "
                                 "critic.enabled=true (or leave it null)")
            batch.advantages, targets = gae_advantages_of(batch, values, gamma=alg.gamma,
                                                          lam=alg.lam, token_level_rewards=rewards)
            return targets
        mask = batch.response_mask()
        if alg.adv_estimator == "reinforce_plus_plus":  # token-level: returns-to-go, whitened
            inputs: dict[str, Any] = {"token_level_rewards": rewards * mask,
                                      "response_mask": mask, "gamma": alg.gamma}
        else:  # outcome estimators over the groups of one prompt
            inputs = {"scores": (rewards * mask).sum(dim=-1), "response_mask": mask,
                      "index": batch.group_index()}
        if alg.adv_estimator in ("grpo", "grpo_passk"):
            inputs["norm_adv_by_std_in_grpo"] = alg.norm_adv_by_std_in_grpo
        batch.advantages, _ = compute_advantages(alg.adv_estimator, **inputs)
        return None

    def compute_log_probs(self, batch: StepBatch, use_ref: bool = False,
                          routes: list[torch.Tensor] | None = None,
                          record_routes: bool = False) -> dict[str, list]:
        """Trainer log-probs (response part) of every sample, computed over the DP ranks.
        ``routes`` (per sample, rows aligned with ``batch.sequences()``) are replayed; with
        ``record_routes`` the result's ``routes`` are the ones the forward used."""
        w = self.workers
        sequences = batch.sequences()
        shares = even_shares(len(sequences), w.dp_size)
        per_rank = [([sequences[i] for i in share], use_ref, False,
                     None if routes is None else [routes[i] for i in share], record_routes)
                    for share in (shares[w.dp_rank[r]] for r in range(w.actor.world_size))]
        results = w.actor.execute_rank_split("compute_log_probs", per_rank)
        full: list[list[float]] = [[] for _ in sequences]
        used: list[torch.Tensor | None] = [None] * len(sequences)
        for rank, result in enumerate(results):
            if w.reports[rank]:
                for k, i in enumerate(shares[w.dp_rank[rank]]):
                    full[i] = result["log_probs"][k]
                    if record_routes:
                        used[i] = result["routes"][k]
        out: dict[str, list] = {
            "log_probs": [batch.response_slice(full[i], i) for i in range(len(full))]}
        if record_routes:
            out["routes"] = used
        return out

    def compute_old_log_probs(self, batch: StepBatch) -> dict[str, float]:
        """Old log-probs and the routes the update replays (R2: recorded in this forward; R3:
        the engine's, replayed in it), the engine/trainer log-prob and routing gaps, and
        rollout correction. In bypass mode the engine's log-probs are the old ones."""
        mode = self.cfg.actor.router_replay.mode
        engine = batch.engine_routes() if self.cfg.rollout.enable_return_routed_experts else None
        if self.cfg.algorithm.rollout_correction.bypass_mode:
            if any(s.log_probs is None for s in batch.samples):
                raise ValueError("algorithm.rollout_correction.bypass_mode: a sample came back "
                                 "without the engine's log-probs, which bypass mode trains on")
            batch.old_log_probs = [list(s.log_probs) for s in batch.samples]
            batch.loss_mask, batch.rollout_is_weights = batch.response_mask(), None
            batch.replay_routes = engine if mode == "R3" else None
            return {}
        metrics: dict[str, float] = {}
        if mode == "R3":
            if self.cfg.actor.router_replay.diagnose_no_replay:
                own = self.compute_log_probs(batch, record_routes=True)
                metrics.update(self._mismatch_metrics(batch, own, engine, suffix="_no_replay"))
            used = self.compute_log_probs(batch, routes=engine, record_routes=True)
        else:
            used = self.compute_log_probs(batch, record_routes=engine is not None
                                          or mode == "R2")
        metrics.update(self._mismatch_metrics(batch, used, engine))
        batch.old_log_probs = used["log_probs"]
        batch.replay_routes = used["routes"] if mode != "disabled" else None
        metrics.update(self._rollout_correction(batch))
        return metrics

    def _mismatch_metrics(self, batch: StepBatch, forward: dict[str, list],
                          engine: list[torch.Tensor] | None, suffix: str = "") -> dict[str, float]:
        """``training/rollout_probs_diff{suffix}_*`` and ``rollout/moe/router_agreement{suffix}``
        of one trainer forward against the engine's log-probs and routes."""
        diff = rollout_probs_diff_metrics(batch.padded(forward["log_probs"]),
                                          batch.rollout_log_probs(), batch.response_mask())
        metrics = {f"training/{k.replace('diff_', f'diff{suffix}_')}": float(v)
                   for k, v in diff.items()}
        if engine is not None:
            metrics[f"rollout/moe/router_agreement{suffix}"] = float(
                router_agreement(engine, forward["routes"]))
        return metrics

    def _rollout_correction(self, batch: StepBatch) -> dict[str, float]:
        """IS weights and the rejection mask between old and rollout log-probs; their
        ``rollout_corr/*`` metrics."""
        rc = self.cfg.algorithm.rollout_correction
        is_lower, is_upper = rc.is_bounds()
        weights, batch.loss_mask, corr = compute_rollout_correction(
            batch.padded(batch.old_log_probs), batch.rollout_log_probs(), batch.response_mask(),
            rollout_is=rc.rollout_is, rollout_is_threshold=is_upper,
            rollout_is_threshold_lower=is_lower,
            rollout_is_batch_normalize=rc.rollout_is_batch_normalize,
            rollout_rs=rc.rs_criteria() or None, rollout_rs_threshold=rc.rs_bounds())
        batch.rollout_is_weights = weights
        return {f"rollout_corr/{k}": float(v) for k, v in corr.items()
                if not k.startswith("rollout_probs_diff")}

    def update_actor(self, batch: StepBatch) -> dict[str, float]:
        """``ppo_epochs`` passes of mini-batch updates; each mini-batch is split over DP."""
        w, cfg = self.workers, self.cfg
        per_mini = cfg.actor.ppo_mini_batch_size * batch.n
        minis = [list(range(s, min(s + per_mini, len(batch)))) for s in range(0, len(batch),
                                                                              per_mini)]
        records = [batch.train_record(i) for i in range(len(batch))]
        per_dp: list[list[list[dict]]] = [[] for _ in range(w.dp_size)]
        for _ in range(cfg.actor.ppo_epochs):
            for mini in minis:
                for d, share in enumerate(even_shares(len(mini), w.dp_size)):
                    per_dp[d].append([records[mini[j]] for j in share])
        per_rank = [(per_dp[w.dp_rank[r]],) for r in range(w.actor.world_size)]
        results = w.actor.execute_rank_split("update", per_rank)
        skipped = [m.get("actor/update_skipped", 0.0) for m in results[0]]
        for line in self.nonfinite.observe(skipped, self.steps_done + 1, batch.prompts):
            self.warn(line)
        return reduce_metrics(results[0])

    def warn(self, line: str) -> None:
        """A one-line warning on the trackers (stderr before they are open)."""
        tracker = getattr(self, "tracker", None)
        if tracker is not None:
            tracker.warn(line)
        else:
            print(f"warning: {line}", file=sys.stderr)

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

    def batch_metrics(self, batch: StepBatch, metrics: dict[str, float]) -> dict[str, float]:
        """Response lengths, score and advantage statistics, throughput."""
        lengths = torch.tensor([len(s.response_ids) for s in batch.samples], dtype=torch.float32)
        max_len = self.cfg.data.max_response_length
        out = {
            "response_length/mean": float(lengths.mean()),
            "response_length/max": float(lengths.max()),
            "response_length/min": float(lengths.min()),
            "response_length/clip_ratio": float((lengths >= max_len).float().mean()),
            "response/aborted_ratio": float(sum(s.finish_reason == "abort"
                                                for s in batch.samples) / len(batch)),
            "critic/advantages/mean": float(batch.advantages[batch.response_mask() > 0].mean()),
        }
        out.update(agent_metrics(batch.samples))
        prompt_tokens = sum(len(s.prompt_ids) for s in batch.samples)
        out.update(throughput_metrics(
            metrics, prompt_tokens=prompt_tokens, response_tokens=int(lengths.sum()),
            num_train_gpus=self.workers.actor.world_size,
            num_rollout_gpus=self.workers.num_rollout_gpus, ppo_epochs=self.cfg.actor.ppo_epochs))
        return out

    def finish(self) -> None:
        """End of run: the PNG of the run's metrics and the Ray timeline."""
        if not self.is_driver:
            return
        from megarl.metrics.plot import plot_run

        jsonl = self.output_dir / "metrics.jsonl"
        if jsonl.exists():
            png = plot_run(jsonl, self.output_dir / "run.png")
            print(f"megarl: metrics in {jsonl}, plot in {png}")
        if self.cfg.ray.timeline_file and self.cfg.trainer.worker_group == "ray":
            from megarl.cluster import write_timeline

            write_timeline(self.cfg.ray.timeline_file)


def make_agent_loop(cfg: RunConfig, tokenizer: Any) -> AgentLoop | None:
    """The agent loop of ``rollout.multi_turn`` (None when it is off)."""
    mt = cfg.rollout.multi_turn
    if not mt.enable:
        return None
    settings = AgentSettings(max_assistant_turns=mt.max_assistant_turns,
                             max_user_turns=mt.max_user_turns,
                             max_tokens_per_turn=mt.max_tokens_per_turn,
                             max_response_length=cfg.data.max_response_length, format=mt.format)
    return AgentLoop(settings, tokenizer, tools=mt.tools, env=mt.env,
                     max_tool_response_length=mt.max_tool_response_length)


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="megarl train", description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="YAML run config")
    parser.add_argument("overrides", nargs="*", metavar="a.b.c=value")
    return parser.parse_intermixed_args(argv)


def load_run_config(path: str, overrides: list[str],
                    echo: Callable[[str], None] = print) -> tuple[RunConfig, dict] | None:
    """Load and validate; print every problem and return None when the config is invalid."""
    try:
        cfg, sources = load_config(path, overrides)
    except ConfigError as err:
        for line in err.lines:
            echo(f"error: {line}")
        return None
    problems = validate_config(cfg, sources=sources)
    for problem in problems:
        echo(problem.line() if problem.severity == "error" else f"warning: {problem.line()}")
    if any(p.severity == "error" for p in problems):
        return None
    return cfg, sources


def startup_text(cfg: RunConfig) -> list[str]:
    """The lines ``megarl train`` prints before it starts: the per-GPU memory estimate (T1)."""
    from megarl.config.estimates import startup_estimates
    from megarl.config.validate import build_context

    ctx = build_context(cfg)
    return [f"megarl: {line}" for line in startup_estimates(cfg, ctx.model, ctx.sizes)]


def preflight_refuses(cfg: RunConfig, first: bool) -> bool:
    """The device preflight (``trainer.preflight``, :mod:`megarl.memory_preflight`): print its
    lines (the refusal on every process, the rest on the ``first`` only); whether it refuses."""
    from megarl.config.validate import build_context
    from megarl.memory_preflight import device_preflight

    lines, refused = device_preflight(cfg, build_context(cfg).model)
    if refused:
        print("\n".join(lines), file=sys.stderr, flush=True)
    elif lines and first:
        print("\n".join(f"megarl: {line}" for line in lines), flush=True)
    return refused


def train_main(argv: list[str]) -> int:
    """``megarl train --config CONFIG [overrides]``; exit 2 on an invalid config or one whose
    phases do not fit the GPUs' free memory (the preflight)."""
    args = _parse(argv)
    loaded = load_run_config(args.config, args.overrides,
                             echo=lambda line: print(line, file=sys.stderr))
    if loaded is None:
        return 2
    cfg, sources = loaded
    first = os.environ.get("RANK", "0") == "0"  # prints once, not by every torchrun rank
    if first:
        print("\n".join(startup_text(cfg)), flush=True)
    if preflight_refuses(cfg, first):  # before any worker starts
        return 2
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from megarl.cluster import init_naive, torchrun_world_size

    launched = torchrun_world_size()
    if cfg.trainer.worker_group == "ray" and launched > 1:
        print(f"error: trainer.worker_group: ray, but this driver is one of {launched} processes "
              "started by torchrun, and each would start a Ray job of its own — run `megarl "
              "train` without torchrun for Ray mode, or set trainer.worker_group=naive",
              file=sys.stderr)
        return 2
    if cfg.trainer.worker_group == "naive":
        init_naive(timeout_s=cfg.trainer.phase_timeout_s)
    from megarl.data.dataset import DatasetError

    trainer = Trainer(cfg, sources)
    try:
        trainer.setup()
        trainer.fit()
    except DatasetError as err:  # bad input data: one line, nothing written
        print(f"error: {err}", file=sys.stderr)
        return 2
    except (PhaseOutOfMemory, NonFiniteUpdates) as err:  # one line with the knobs (T1, T5)
        print(f"error: {err}", file=sys.stderr)
        return 1
    finally:
        trainer.close()
    return 0
