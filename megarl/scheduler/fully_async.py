"""``fully_async``: the engines generate continuously into a bounded queue; the trainer consumes.

The producer is a :class:`~megarl.scheduler.rollouter.Rollouter` on a background event loop.
Per step, on the trainer thread:

1. take ``data.train_batch_size`` groups from the queue in the order they finished, waiting
   while fewer are ready; drop (and count) groups older than ``ceil(staleness_threshold)``
   weight pushes (by the group's newest segment, see :mod:`.staleness`); with
   dynamic sampling (``algorithm.filter_groups``) score them and drop groups whose rewards all
   agree; the rollout generates a replacement for every group dropped;
2. train on them (:meth:`Trainer.train_on`), in prompt order;
3. every ``trigger_parameter_sync_step`` steps: quiesce the rollout (pause with partial
   rollout, else let in-flight groups finish), push the weights, resume.

With ``staleness_threshold=0`` and ``trigger_parameter_sync_step=1`` the rollout generates exactly
one step's prompts per push, with the seeds a synchronous step would use, so a run equals
``colocate_sync`` step for step.

Metrics: ``tq/queue_len`` (samples queued after the take), ``tq/wait_time_ms`` (mean time the
consumed groups waited in the queue), ``fully_async/trainer/idle_ratio``,
``fully_async/rollouter/idle_ratio`` (the trainer is idle while it waits for samples or for the
rollout to quiesce before a push; the rollout while no request is in flight), ``staleness/*``, ``fully_async/count/stale_dropped``,
``fully_async/count/filtered``, ``fully_async/count/stale_samples_processed`` (consumed samples
with staleness > 0), ``fully_async/partial/count`` and ``fully_async/partial/partial_ratio``
(consumed samples that were resumed after a sync).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from megarl.batch import StepBatch
from megarl.config.schema import SchedulerConfig
from megarl.metrics.timing import timer
from megarl.scheduler.background import BusyClock, RolloutLoop
from megarl.scheduler.base import IdleWindow, Scheduler
from megarl.scheduler.dynamic_sampling import zero_variance
from megarl.scheduler.queue import SampleGroup, SampleQueue
from megarl.scheduler.rollouter import PromptJob, Rollouter, StalenessBudget
from megarl.scheduler.staleness import (
    newest_version,
    staleness,
    staleness_metrics,
    within_bound,
)

if TYPE_CHECKING:
    from megarl.scheduler.driver import StepDriver


def queue_capacity(cfg: SchedulerConfig, groups_per_step: int, n: int) -> int:
    """``scheduler.max_queue_length``, or what the staleness budget can have in flight."""
    if cfg.max_queue_length is not None:
        return cfg.max_queue_length
    groups = cfg.trigger_parameter_sync_step * groups_per_step
    return math.floor((1 + cfg.staleness_threshold) * groups + 1e-9) * n


class FullyAsync(Scheduler):
    """Streams groups from continuously running engines into training steps."""

    mode = "fully_async"

    def __init__(self, trainer: StepDriver, cfg: SchedulerConfig,
                 make_client: Callable[[], Any]) -> None:
        super().__init__(trainer)
        self.cfg = cfg
        self.groups_per_step = trainer.cfg.data.train_batch_size
        self.n = trainer.cfg.rollout.n
        self.max_lag = math.ceil(cfg.staleness_threshold - 1e-9)
        self.timeout_s = trainer.cfg.trainer.phase_timeout_s
        capacity = queue_capacity(cfg, self.groups_per_step, self.n)
        if capacity < self.groups_per_step * self.n:
            raise ValueError(f"scheduler.max_queue_length={capacity} holds less than one step "
                             f"({self.groups_per_step} prompts x {self.n} samples); set it to "
                             f">= {self.groups_per_step * self.n} or null")
        self.clock = BusyClock()
        self.queue = SampleQueue(capacity, on_space=self._wake_rollouter)
        self.since_sync = 0
        self.stopped = False
        self.marks: list[tuple[int, dict[str, int]]] = []
        """(first ordinal, loader position before it) of every prompt batch drawn."""
        self.consumed: set[int] = set()
        """Ordinals of groups taken from the queue (trained on, dropped or filtered)."""
        self.rollout = RolloutLoop(make_client)
        try:
            client = self.rollout.client
            self.rollout.run(client.update_weight_version(str(trainer.weight_version)),
                             self.timeout_s, "stamp the engines' weight version")
            self.rollouter = Rollouter(
                client, self._jobs(), trainer.sampling_params(), self.queue,
                StalenessBudget(cfg.trigger_parameter_sync_step * self.groups_per_step,
                                cfg.staleness_threshold),
                version=trainer.weight_version, partial_rollout=cfg.partial_rollout,
                options=trainer.generation_options(), clock=self.clock,
                agent=getattr(trainer, "agent", None))
            self.producer = self.rollout.submit(self.rollouter.run())
        except BaseException:
            self.rollout.close()
            raise

    def _wake_rollouter(self) -> None:
        self.rollout.call_soon(self.rollouter.wake)

    def _jobs(self) -> Iterator[PromptJob]:
        """Prompts in loader order, seeded as the synchronous step of the same index would."""
        trainer, ordinal, step_index = self.trainer, 0, self.trainer.steps_done
        while True:
            self.marks.append((ordinal, trainer.loader.state_dict()))
            prompts = trainer.loader.next_batch()
            for row, seed in zip(prompts, trainer.prompt_seeds(step_index, len(prompts))):
                yield PromptJob(ordinal, row, seed)
                ordinal += 1
            step_index += 1

    def checkpoint_state(self) -> dict[str, Any]:
        """Resume from the start of the oldest prompt batch with a group not yet taken: the
        groups of that batch and later ones are generated again (those already trained on
        among them are trained on twice; none is lost)."""
        oldest = 0
        while oldest in self.consumed:
            oldest += 1
        starts = [mark for mark in self.marks if mark[0] <= oldest]
        position = starts[-1][1] if starts else self.trainer.loader.state_dict()
        return {"loader": position, "unsynced": self.since_sync > 0}

    # ----- a step -----
    def step(self, last: bool = False) -> dict[str, float]:
        """Take a batch from the queue, train on it, push weights when due."""
        trainer = self.trainer
        metrics: dict[str, float] = {}
        start, window = time.perf_counter(), IdleWindow(self.clock)
        with timer("wait_batch", metrics):
            groups, scores = self._take(metrics)
        batch = StepBatch(samples=[s for g in groups for s in g.samples],
                          prompts=[g.prompt for g in groups], n=self.n)
        if scores is not None:
            batch.scores = scores
        trainer.train_on(batch, metrics)
        self.since_sync += 1
        if self.since_sync >= self.cfg.trigger_parameter_sync_step:
            self._sync(metrics)
        waited = metrics["timing/wait_batch"] + metrics.get("timing/pause_rollout", 0.0)
        metrics.update(window.metrics(self.mode, waited))
        trainer.end_step(batch, metrics, start)
        return metrics

    def _take(self, metrics: dict[str, float]) -> tuple[list[SampleGroup], torch.Tensor | None]:
        """This step's groups (prompt order) and, with dynamic sampling, their scores."""
        trainer, need = self.trainer, self.groups_per_step
        filtering = trainer.cfg.algorithm.filter_groups
        kept: list[tuple[SampleGroup, torch.Tensor | None]] = []
        dropped = filtered = examined = 0
        taken_all: list[SampleGroup] = []
        last_kept = time.monotonic()
        while len(kept) < need:
            taken = self.queue.take(need - len(kept), self.timeout_s)
            taken_all += taken
            examined += len(taken)
            version = trainer.weight_version
            fresh = [g for g in taken if within_bound(g.samples, version, self.max_lag)]
            dropped += len(taken) - len(fresh)
            if fresh:
                last_kept = time.monotonic()
            elif time.monotonic() - last_kept > self.timeout_s:
                raise TimeoutError(self._all_stale(taken, dropped, version))
            scored: list[tuple[SampleGroup, torch.Tensor | None]] = [(g, None) for g in fresh]
            if filtering.enable and fresh:
                scored = [(g, s) for g, s in self._score(fresh, metrics)
                          if not zero_variance(s)]
                filtered += len(fresh) - len(scored)
            if len(taken) > len(scored):
                self.rollout.call_soon(self.rollouter.discard, len(taken) - len(scored))
            kept += scored
            limit = filtering.max_num_gen_batches * need
            if filtering.enable and limit and examined >= limit and len(kept) < need:
                raise RuntimeError(
                    f"dynamic sampling examined {examined} groups "
                    f"({filtering.max_num_gen_batches} x {need}) and kept only {len(kept)}: "
                    "most groups have identical rewards; raise algorithm.filter_groups."
                    "max_num_gen_batches (0 = no limit) or check the reward function")
        kept.sort(key=lambda item: item[0].ordinal)
        self.consumed.update(g.ordinal for g in taken_all)
        groups = [g for g, _ in kept]
        self._consumption_metrics(groups, metrics, dropped, filtered)
        if not filtering.enable:
            return groups, None
        scores = torch.cat([s for _, s in kept])
        metrics.update({"critic/score/mean": float(scores.mean()),
                        "critic/score/max": float(scores.max()),
                        "critic/score/min": float(scores.min())})
        return groups, scores

    def _all_stale(self, taken: list[SampleGroup], dropped: int, version: int) -> str:
        """Why the trainer has kept no group for ``trainer.phase_timeout_s``: every group came
        back older than the staleness bound (engines generating under old weights)."""
        seen = sorted({newest_version(s) for g in taken for s in g.samples})
        return (f"fully_async: for {self.timeout_s:.0f} s (trainer.phase_timeout_s) every sample "
                f"group was older than the staleness bound ({dropped} dropped this step): the "
                f"trainer is at weight version {version}, the groups' newest tokens at "
                f"{seen}, and scheduler.staleness_threshold={self.cfg.staleness_threshold} "
                f"allows {self.max_lag}. The engines do not report the synced version: check "
                "that the weight sync reaches them (rollout engine logs)")

    def _score(self, groups: list[SampleGroup],
               metrics: dict[str, float]) -> list[tuple[SampleGroup, torch.Tensor]]:
        """Rewards of the groups' samples, per group."""
        batch = StepBatch(samples=[s for g in groups for s in g.samples],
                          prompts=[g.prompt for g in groups], n=self.n)
        with timer("reward", metrics):
            rewards = self.trainer.score(batch)
        timeouts = rewards.pop("reward/timeouts", 0.0)
        metrics["reward/timeouts"] = metrics.get("reward/timeouts", 0.0) + timeouts
        metrics.update(rewards)
        assert batch.scores is not None
        return [(g, batch.scores[i * self.n:(i + 1) * self.n]) for i, g in enumerate(groups)]

    def _consumption_metrics(self, groups: list[SampleGroup], metrics: dict[str, float],
                             dropped: int, filtered: int) -> None:
        samples = [s for g in groups for s in g.samples]
        values = staleness(samples, self.trainer.weight_version)
        now = time.monotonic()
        partial = sum(g.num_partial for g in groups)
        metrics.update(staleness_metrics(values))
        metrics.update({
            "tq/queue_len": float(self.queue.queued_samples),
            "tq/wait_time_ms": 1000.0 * sum(now - g.enqueued for g in groups) / len(groups),
            "fully_async/count/stale_dropped": float(dropped),
            "fully_async/count/filtered": float(filtered),
            "fully_async/count/stale_samples_processed": float(sum(v > 0 for v in values)),
            "fully_async/partial/count": float(partial),
            "fully_async/partial/partial_ratio": partial / len(samples),
        })

    # ----- weight pushes -----
    def _sync(self, metrics: dict[str, float]) -> None:
        """Quiesce the rollout, push the weights, resume it under the new version."""
        trainer = self.trainer
        with timer("pause_rollout", metrics):
            self.rollout.run(self.rollouter.pause_for_sync(), self.timeout_s,
                             "pause the rollout for a weight sync")
        with timer("sync_weights", metrics):
            metrics.update(trainer.sync_weights())
        self.rollout.run(self.rollouter.resume_after_sync(trainer.weight_version),
                         self.timeout_s, "resume the rollout after a weight sync")
        self.since_sync = 0

    def _stop(self) -> None:
        if not self.stopped:
            self.stopped = True
            self.rollout.run(self.rollouter.stop(), self.timeout_s, "stop the rollout")
            self.queue.clear()

    def finish(self) -> None:
        """Stop generating and push the updates the engines do not hold yet."""
        self._stop()
        if self.since_sync:
            self.trainer.sync_weights()
            self.since_sync = 0

    def close(self) -> None:
        """Stop the rollout (aborting requests in flight) and its event loop."""
        try:
            self._stop()
        finally:
            self.rollout.close()
