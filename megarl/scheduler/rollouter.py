"""The ``fully_async`` producer: keeps the rollout engines generating into the sample queue.

A :class:`Rollouter` runs on the :class:`~megarl.scheduler.background.RolloutLoop`. It takes
prompts in loader order and starts a group (the prompt's ``n`` samples, one request per sample
with seed ``seed + j``, the same seeds a synchronous step would use) whenever two limits allow:

- the queue has room for the group (queued plus in-flight samples stay within
  ``scheduler.max_queue_length``);
- the staleness budget: with ``G`` groups consumed per weight push, at most
  ``floor((u + 1 + staleness_threshold) * G)`` groups (minus those the trainer discarded) may have
  been started by the time the engines hold the ``u``-th push since the start. With threshold 0
  the rollout generates exactly what the trainer consumes before the next push, so training is
  on-policy; with threshold ``s`` a sample is normally consumed within ``ceil(s)`` pushes of its
  group's last segment (the trainer drops any group that is older).

At a weight sync :meth:`Rollouter.pause_for_sync` either pauses the engines with ``mode=abort``
(``partial_rollout``: in-flight samples return their tokens so far and are continued after the
sync, see :mod:`megarl.scheduler.partial`) or stops starting groups and waits for the ones in
flight to finish. No request ever runs across a weight change: the engines hold requests that
arrive while paused until :meth:`Rollouter.resume_after_sync`, and stamp every token with the
version of the weights that produced it.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

from megarl.rollout.interface import RolloutSample, SamplingParams
from megarl.scheduler.background import BusyClock
from megarl.scheduler.partial import continuation, merge
from megarl.scheduler.queue import SampleGroup, SampleQueue


@dataclass(frozen=True)
class PromptJob:
    """A prompt to generate a group for."""

    ordinal: int
    """Position of the prompt in the order the rollout takes prompts."""
    prompt: dict[str, Any]
    seed: int
    """Sampling seed of sample 0; sample j uses ``seed + j``."""


@dataclass(frozen=True)
class StalenessBudget:
    """How far generation may run ahead of training, in groups."""

    groups_per_version: int
    """Groups the trainer consumes between two weight pushes."""
    staleness_threshold: float

    def limit(self, pushes_since_start: int) -> int:
        """Groups that may have been started (net of discarded ones) while the engines hold
        the weights of push ``pushes_since_start``."""
        ahead = (pushes_since_start + 1 + self.staleness_threshold) * self.groups_per_version
        return math.floor(ahead + 1e-9)


@dataclass
class RolloutCounters:
    """What the rollout did since it started."""

    started: int = 0
    """Groups started."""
    discarded: int = 0
    """Groups the trainer took but did not train on (too stale, or filtered)."""
    resumed: int = 0
    """Continuations of samples paused at a weight sync after generating some tokens."""


class Rollouter:
    """Starts prompt groups on the engines within the queue and staleness limits."""

    def __init__(self, client: Any, jobs: Iterator[PromptJob], params: SamplingParams,
                 queue: SampleQueue, budget: StalenessBudget, *, version: int,
                 partial_rollout: bool, options: dict[str, bool], clock: BusyClock,
                 agent: Any | None = None) -> None:
        self.client = client
        self.jobs = jobs
        self.params = params
        self.n = params.n
        self.queue = queue
        self.budget = budget
        self.version = version
        """Weight version the engines hold."""
        self.start_version = version
        self.partial_rollout = partial_rollout
        self.options = options
        self.clock = clock
        self.agent = agent
        """The :class:`~megarl.rollout.agent.AgentLoop` of multi-turn episodes, or None."""
        self.counters = RolloutCounters()
        self._wake = asyncio.Event()
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._syncing = False
        self._stopping = False
        self._tasks: set[asyncio.Task] = set()

    # ----- called on the loop thread (others go through RolloutLoop.call_soon) -----
    def wake(self) -> None:
        """Re-check whether a group may start (room freed, budget grew)."""
        self._wake.set()

    def discard(self, groups: int) -> None:
        """The trainer took ``groups`` groups it will not train on: generate replacements."""
        self.counters.discarded += groups
        self.wake()

    async def run(self) -> None:
        """Start groups whenever the limits allow, until :meth:`stop`."""
        try:
            while not self._stopping:
                self._wake.clear()
                while self._may_start():
                    self._start(next(self.jobs))
                await self._wake.wait()
        except Exception as err:
            self.queue.fail(err)
            raise

    def _may_start(self) -> bool:
        if self._stopping or self._syncing:
            return False
        allowed = self.budget.limit(self.version - self.start_version)
        if self.counters.started - self.counters.discarded >= allowed:
            return False
        return self.queue.try_reserve(self.n)

    def _start(self, job: PromptJob) -> None:
        self.counters.started += 1
        task = asyncio.create_task(self._group(job))
        self._tasks.add(task)
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.queue.fail(task.exception())
        self.wake()

    async def _group(self, job: PromptJob) -> None:
        try:
            samples = await asyncio.gather(*(self._sample(job, j) for j in range(self.n)))
        except asyncio.CancelledError:
            self.queue.release(self.n)
            raise
        if self._stopping:
            self.queue.release(self.n)
            return
        self.queue.put(SampleGroup(job.ordinal, job.prompt, list(samples)))

    async def _sample(self, job: PromptJob, j: int) -> RolloutSample:
        """Sample j of a group (a multi-turn episode with an agent loop, each model turn
        continued after a weight sync as a single-turn sample is)."""
        params = replace(self.params, n=1, seed=job.seed + j)
        key = tuple(job.prompt["input_ids"])
        if self.agent is not None:
            sample = await self.agent.episode(
                lambda ids, p: self._turn(ids, p, key), job.prompt, params)
        else:
            sample = await self._turn(job.prompt["input_ids"], params, key)
        return replace(sample, prompt_index=0, sample_index=j)

    async def _turn(self, prompt_ids: list[int], params: SamplingParams,
                    key: tuple[int, ...]) -> RolloutSample:
        """One generation from ``prompt_ids``; continued after every weight sync that paused
        it, its tokens keeping the version that generated each."""
        sample = await self._generate(prompt_ids, params, key)
        while sample.finish_reason == "abort" and self.partial_rollout and not self._stopping:
            follow = continuation(sample, params)
            if follow is None:
                sample = replace(sample, finish_reason="length")
                break
            await self._resumed.wait()
            piece = await self._generate(*follow, key)
            if sample.response_ids:
                self.counters.resumed += 1
                sample = merge(sample, piece)
            else:
                sample = piece  # aborted before its first token: an ordinary sample
        return sample

    async def _generate(self, prompt_ids: list[int], params: SamplingParams,
                        key: tuple[int, ...]) -> RolloutSample:
        with self.clock.track():
            samples = await self.client.generate_one(list(prompt_ids), params, group_key=key,
                                                     **self.options)
        return samples[0]

    # ----- weight syncs -----
    async def pause_for_sync(self) -> None:
        """Quiesce generation before the trainer pushes weights (see the module docstring)."""
        self._syncing = True
        if self.partial_rollout:
            self._resumed.clear()
            await self.client.pause("abort")
            return
        while self._tasks:
            await asyncio.wait(set(self._tasks))

    async def resume_after_sync(self, version: int) -> None:
        """The engines now hold ``version``: continue paused samples, start groups again."""
        self.version = version
        if self.partial_rollout:
            await self.client.resume()
            self._resumed.set()
        self._syncing = False
        self.wake()

    async def stop(self) -> None:
        """Stop starting groups and abort every request in flight; unfinished groups are
        dropped (their queue room is given back)."""
        self._stopping = True
        self._resumed.set()
        self.wake()
        if self._tasks:
            await self.client.abort()
        tasks = set(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._syncing and self.partial_rollout:
            await self.client.resume()
        self._syncing = False
