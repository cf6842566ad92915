"""``one_step_off``: step k trains while the engines generate the samples of step k+1.

Per step, on the trainer thread:

1. wait for this step's samples (generated in the background during the previous step);
2. push the weights of the previous update to the engines (once per step, never while a
   generation runs, so every sample comes from one set of weights);
3. start generating the next step's samples with those weights, in the background;
4. train on this step's samples (:meth:`Trainer.train_on`).

With dynamic sampling (``algorithm.filter_groups``) step 1 is followed by refill rounds, still
with the old weights, until the step holds ``data.train_batch_size`` groups with reward
variance (:mod:`megarl.scheduler.dynamic_sampling`).

This step's samples were generated with the weights from before the previous update, so their
staleness is 1 (0 at the first step) by construction. The first step has nothing to overlap
with; the last one prefetches nothing, and :meth:`OneStepOff.finish` pushes its update.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from megarl.batch import StepBatch
from megarl.metrics.timing import timer
from megarl.scheduler.background import BusyClock, RolloutLoop
from megarl.scheduler.base import IdleWindow, Scheduler
from megarl.scheduler.dynamic_sampling import fill_with_varied_groups
from megarl.scheduler.staleness import staleness, staleness_metrics

if TYPE_CHECKING:
    from megarl.scheduler.driver import StepDriver


class OneStepOff(Scheduler):
    """Overlaps generation of step k+1 with training of step k (staleness <= 1)."""

    mode = "one_step_off"

    def __init__(self, trainer: StepDriver, make_client: Callable[[], Any]) -> None:
        super().__init__(trainer)
        self.clock = BusyClock()
        self.timeout_s = trainer.cfg.trainer.phase_timeout_s
        self.pending: concurrent.futures.Future | None = None
        self.unsynced = False
        """Whether the actor has an update the engines do not hold yet."""
        self.position: dict[str, int] | None = None
        """The loader's position before the prompts of the prefetch in flight."""
        self.rollout = RolloutLoop(make_client)
        try:
            self.rollout.run(
                self.rollout.client.update_weight_version(str(trainer.weight_version)),
                self.timeout_s, "stamp the engines' weight version")
        except BaseException:
            self.rollout.close()
            raise

    def _start(self, prompts: list[dict[str, Any]], step_index: int) -> concurrent.futures.Future:
        """Generate step ``step_index``'s samples in the background."""
        trainer, client = self.trainer, self.rollout.client

        async def generate() -> tuple[StepBatch, float]:
            began = time.perf_counter()
            with self.clock.track():
                samples = await trainer.rollout(client, prompts, step_index)
            batch = StepBatch(samples=samples, prompts=prompts, n=trainer.cfg.rollout.n)
            return batch, time.perf_counter() - began

        return self.rollout.submit(generate())

    def _generate_more(self) -> StepBatch:
        """Dynamic sampling's next round: the next prompts, generated now (before the weight
        push, so with the same weights as the step's first batch)."""
        future = self._start(self.trainer.loader.next_batch(), self.trainer.steps_done)
        try:
            return future.result(self.timeout_s)[0]
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"one_step_off: a dynamic-sampling round took over "
                               f"{self.timeout_s:.0f} s (trainer.phase_timeout_s)") from None

    def step(self, last: bool = False) -> dict[str, float]:
        """One step: wait for its samples, push weights, prefetch the next, train."""
        trainer = self.trainer
        metrics: dict[str, float] = {}
        start, window = time.perf_counter(), IdleWindow(self.clock)
        if self.pending is None:
            self.pending = self._start(trainer.loader.next_batch(), trainer.steps_done)
        with timer("wait_gen", metrics):
            try:
                batch, metrics["timing/gen"] = self.pending.result(self.timeout_s)
            except concurrent.futures.TimeoutError:
                raise TimeoutError(f"one_step_off: the samples of step {trainer.steps_done + 1} "
                                   f"took over {self.timeout_s:.0f} s (trainer.phase_timeout_s)"
                                   ) from None
            finally:
                self.pending = None
        if trainer.cfg.algorithm.filter_groups.enable:  # refill with this step's weights
            batch = fill_with_varied_groups(trainer, batch, self._generate_more, metrics)
        if self.unsynced:
            with timer("sync_weights", metrics):
                metrics.update(trainer.sync_weights())
            self.unsynced = False
        if not last:
            self.position = trainer.loader.state_dict()  # before the prefetched prompts
            self.pending = self._start(trainer.loader.next_batch(), trainer.steps_done + 1)
        metrics.update(staleness_metrics(staleness(batch.samples, trainer.weight_version)))
        trainer.train_on(batch, metrics)
        self.unsynced = True
        metrics.update(window.metrics(self.mode, metrics["timing/wait_gen"]))
        trainer.end_step(batch, metrics, start)
        return metrics

    def checkpoint_state(self) -> dict[str, Any]:
        """The prefetched prompts are generated again after a resume (from the checkpoint's
        weights, so that step's samples are 0 versions old instead of 1)."""
        position = self.position if self.pending is not None else None
        return {"loader": position or self.trainer.loader.state_dict(),
                "unsynced": self.unsynced}

    def finish(self) -> None:
        """Push the last update, so the engines end with the final weights."""
        if self.pending is not None:
            self.pending.cancel()
            self.pending = None
        if self.unsynced:
            self.trainer.sync_weights()
            self.unsynced = False

    def close(self) -> None:
        """Abort a prefetch still running and stop the background loop."""
        if self.pending is not None:
            self.pending.cancel()
            self.pending = None
        self.rollout.close()
