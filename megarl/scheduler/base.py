"""What every scheduler offers the trainer's loop, and the synchronous one.

A scheduler decides what overlaps with what and when weights move; it never carries its own
copy of the step. Every scheduler trains through :meth:`Trainer.train_on` and generates through
:meth:`Trainer.rollout` (the prompts, seeds and sampling parameters of a step live there), and
:meth:`Trainer.fit` drives any of them the same way: ``step(last)`` per step, then ``finish()``,
and ``close()`` in every case.

Idle ratios (per step, over the step's wall time): the trainer is idle while it waits for
samples; the rollout is idle while no generation request is in flight.
"""

from __future__ import annotations

import abc
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from megarl.scheduler.background import BusyClock
    from megarl.scheduler.driver import StepDriver


class Scheduler(abc.ABC):
    """Runs RL steps on a set-up :class:`~megarl.trainer.Trainer`."""

    mode: str = ""

    def __init__(self, trainer: StepDriver) -> None:
        self.trainer = trainer

    @abc.abstractmethod
    def step(self, last: bool = False) -> dict[str, float]:
        """One training step; ``last`` says no step follows (nothing is prefetched)."""

    def checkpoint_state(self) -> dict[str, Any]:
        """What a checkpoint after the current step must hold for this scheduler: ``loader``,
        the data position to resume from (prompts drawn for generation but not yet trained on
        lie after it and are generated again), and ``unsynced``, whether the actor's weights
        are newer than the engines' (the resume then pushes them as the next version)."""
        return {"loader": self.trainer.loader.state_dict(), "unsynced": False}

    def finish(self) -> None:
        """After the last step: leave the engines holding the final weights."""

    def close(self) -> None:
        """Stop background generation (always called, also after an error)."""


class ColocateSync(Scheduler):
    """Generate, then train, then push weights: nothing overlaps (:meth:`Trainer.step`)."""

    mode = "colocate_sync"

    def step(self, last: bool = False) -> dict[str, float]:
        """:meth:`Trainer.step` on the next prompts, plus the idle ratios."""
        trainer = self.trainer
        metrics = trainer.step(trainer.loader.next_batch())
        gen_share = metrics["timing/gen"] / max(metrics["timing/step"], 1e-9)
        metrics[f"{self.mode}/trainer/idle_ratio"] = gen_share
        metrics[f"{self.mode}/rollouter/idle_ratio"] = 1.0 - gen_share
        return metrics


class IdleWindow:
    """Idle ratios of the trainer and the rollout over one step."""

    def __init__(self, clock: BusyClock) -> None:
        self.clock = clock
        self.start = time.monotonic()
        self.busy = clock.busy_seconds()

    def metrics(self, mode: str, trainer_wait_s: float) -> dict[str, float]:
        """``<mode>/trainer/idle_ratio`` and ``<mode>/rollouter/idle_ratio`` since creation."""
        wall = max(time.monotonic() - self.start, 1e-9)
        busy = self.clock.busy_seconds() - self.busy
        return {f"{mode}/trainer/idle_ratio": min(1.0, trainer_wait_s / wall),
                f"{mode}/rollouter/idle_ratio": max(0.0, 1.0 - busy / wall)}
