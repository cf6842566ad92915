"""The bounded sample queue between the rollout and the trainer (``fully_async``).

The rollout puts whole groups (the ``n`` samples of one prompt, the unit GRPO normalises over)
into the queue as they finish; the trainer takes them in the order they finished. The bound is
in samples and covers generation in flight too: the rollout *reserves* room for a group before
it starts generating it, so queued plus in-flight samples never exceed the capacity and a full
queue stops new generation instead of piling up finished work. The queue is thread-safe: the
rollout runs on its own event-loop thread, the trainer on the main thread.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megarl.rollout.interface import RolloutSample


@dataclass
class SampleGroup:
    """The finished samples of one prompt, as the trainer consumes them."""

    ordinal: int
    """Position of the prompt in the order the rollout took prompts from the loader."""
    prompt: dict[str, Any]
    """The prompt row (``input_ids``, ``data_source``, ``ground_truth``, ...)."""
    samples: list[RolloutSample]
    enqueued: float = 0.0
    """``time.monotonic()`` when the group entered the queue."""

    @property
    def num_partial(self) -> int:
        """Samples that were paused at a weight sync and resumed under newer weights."""
        return sum(s.token_weight_versions is not None for s in self.samples)


class SampleQueue:
    """Thread-safe FIFO of finished groups, bounded in samples (queued + reserved)."""

    def __init__(self, capacity: int, on_space: Callable[[], None] | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"scheduler.max_queue_length: {capacity} must be >= 1")
        self.capacity = capacity
        self.on_space = on_space
        """Called (on the taking thread) whenever room frees up."""
        self._groups: deque[SampleGroup] = deque()
        self._queued = 0
        self._reserved = 0
        self._error: BaseException | None = None
        self._cond = threading.Condition()

    @property
    def queued_samples(self) -> int:
        """Samples waiting for the trainer."""
        return self._queued

    @property
    def reserved_samples(self) -> int:
        """Samples of groups being generated (room held for them)."""
        return self._reserved

    def __len__(self) -> int:
        return len(self._groups)

    def try_reserve(self, samples: int) -> bool:
        """Hold room for a group about to be generated; False when it does not fit."""
        with self._cond:
            if self._queued + self._reserved + samples > self.capacity:
                return False
            self._reserved += samples
            return True

    def release(self, samples: int) -> None:
        """Give back room reserved for a group that will never be put (generation stopped)."""
        with self._cond:
            self._reserved -= samples
        self._notify_space()

    def put(self, group: SampleGroup) -> None:
        """Queue a finished group whose room was reserved."""
        with self._cond:
            size = len(group.samples)
            self._reserved -= size
            self._queued += size
            group.enqueued = time.monotonic()
            self._groups.append(group)
            self._cond.notify_all()

    def take(self, count: int, timeout_s: float | None = None) -> list[SampleGroup]:
        """The ``count`` oldest groups, waiting until that many are queued; raise TimeoutError
        after ``timeout_s``."""
        with self._cond:
            ready = self._cond.wait_for(
                lambda: len(self._groups) >= count or self._error is not None, timeout_s)
            if self._error is not None:
                raise RuntimeError(f"the rollout stopped: {self._error!r}") from self._error
            if not ready:
                raise TimeoutError(
                    f"the trainer waited {timeout_s:.0f} s (trainer.phase_timeout_s) for {count} "
                    f"sample groups but {len(self._groups)} are queued and {self._reserved} "
                    "samples are being generated; see the rollout engine logs")
            taken = [self._groups.popleft() for _ in range(count)]
            self._queued -= sum(len(g.samples) for g in taken)
        self._notify_space()
        return taken

    def fail(self, error: BaseException) -> None:
        """The producer failed: every waiting and later :meth:`take` raises with ``error``."""
        with self._cond:
            self._error = error
            self._cond.notify_all()

    def clear(self) -> list[SampleGroup]:
        """Remove and return every queued group."""
        with self._cond:
            taken = list(self._groups)
            self._groups.clear()
            self._queued = 0
        self._notify_space()
        return taken

    def _notify_space(self) -> None:
        if self.on_space is not None:
            self.on_space()
