"""Schedulers: what overlaps with what, and when weights move (``scheduler.mode``).

- ``colocate_sync``: generate, train, push weights; nothing overlaps.
- ``one_step_off``: step k trains while the engines generate step k+1 (staleness <= 1).
- ``fully_async``: the engines generate continuously into a bounded queue; the trainer consumes
  it; weights move every ``trigger_parameter_sync_step`` steps; stale samples are dropped;
  partial rollouts resume under new weights.

The step itself lives in :class:`~megarl.trainer.Trainer` (``train_on``, ``rollout``); the
schedulers only arrange it, and see the trainer through :class:`~megarl.scheduler.driver.StepDriver`
(they do not import the trainer module).
"""

from megarl.scheduler.base import ColocateSync, Scheduler
from megarl.scheduler.factory import build_scheduler
from megarl.scheduler.queue import SampleGroup, SampleQueue
from megarl.scheduler.staleness import staleness, staleness_metrics

__all__ = ["ColocateSync", "SampleGroup", "SampleQueue", "Scheduler", "build_scheduler",
           "staleness", "staleness_metrics"]
