"""fully_async's staleness policy on a scripted engine: long partial rollouts are trained.

The engine generates ``PER_VERSION`` tokens per weight version: a sample whose cap is within
that returns at once; a longer one returns its tokens when a weight sync pauses the engine
(``mode=abort``) and is continued under the next version. Every fourth prompt asks for
``LONG`` tokens in its first sample (``SHORT`` in the second), which spans two pushes. With
``staleness_threshold=1`` and a push every step, bounding the *oldest* token of every sample
dropped every such group (the length bias of issue 20), and so would bounding each sample's
newest token (the short sibling finished two pushes before the group did); a group is as fresh
as its newest segment, so they are trained now, each token keeping the version that generated
it.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from megarl.config.schema import RunConfig, SchedulerConfig
from megarl.rollout.interface import RolloutSample, SamplingParams
from megarl.scheduler.fully_async import FullyAsync

PER_VERSION, SHORT, LONG = 4, 3, 10  # a long sample: 4 + 4 + 2 tokens under three versions
STEPS, GROUPS, N = 6, 2, 2


class ScriptedEngine:
    """Stands for the engines: a prompt ``[cap]`` gets ``cap`` tokens with an even seed,
    ``SHORT`` with an odd one, ``PER_VERSION`` per weight version (the rest after the next
    sync)."""

    def __init__(self) -> None:
        self.version = "0"
        self.sync = asyncio.Event()

    async def update_weight_version(self, version: str) -> None:
        self.version = version

    async def generate_one(self, prompt_ids: list[int], params: SamplingParams,
                           **_: Any) -> list[RolloutSample]:
        cap = prompt_ids[0] if params.seed % 2 == 0 else SHORT
        done = len(prompt_ids) - 1
        count = min(PER_VERSION, cap - done)
        version = self.version
        if count < cap - done:
            await self.sync.wait()  # aborted at the next weight sync
        reason = "abort" if done + count < cap else "length"
        return [RolloutSample(prompt_index=0, sample_index=0, prompt_ids=list(prompt_ids),
                              response_ids=[7] * count, log_probs=[-1.0] * count,
                              finish_reason=reason, weight_version=version)]

    async def pause(self, mode: str = "abort") -> None:
        self.sync.set()

    async def resume(self) -> None:
        self.sync = asyncio.Event()

    async def abort(self, rid: str | None = None) -> None:
        self.sync.set()

    async def close(self) -> None:
        pass


class Loader:
    """Prompts ``[cap]``; every fourth has a long first sample."""

    def __init__(self) -> None:
        self.offset = 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": 0, "offset": self.offset}

    def next_batch(self) -> list[dict[str, Any]]:
        caps = [LONG if (self.offset + i) % 4 == 2 else SHORT for i in range(GROUPS)]
        self.offset += GROUPS
        return [{"input_ids": [cap]} for cap in caps]


def fake_trainer(engine: ScriptedEngine) -> SimpleNamespace:
    """The parts of :class:`~megarl.trainer.Trainer` that fully_async uses; records batches."""
    cfg = RunConfig.model_validate({
        "model": {"path": "unused"},
        "data": {"train_files": ["unused"], "train_batch_size": GROUPS},
        "rollout": {"n": N}, "trainer": {"phase_timeout_s": 20}})
    trainer = SimpleNamespace(cfg=cfg, weight_version=0, steps_done=0, loader=Loader(),
                              trained=[])

    def sync_weights() -> dict[str, float]:
        trainer.weight_version += 1
        engine.version = str(trainer.weight_version)  # the engines are paused meanwhile
        return {}

    def end_step(batch: Any, metrics: dict[str, float], start: float) -> None:
        trainer.steps_done += 1

    trainer.sync_weights = sync_weights
    trainer.end_step = end_step
    trainer.train_on = lambda batch, metrics: trainer.trained.append(
        (trainer.weight_version, batch.samples))
    trainer.sampling_params = lambda: SamplingParams(max_new_tokens=LONG, n=N)
    trainer.generation_options = lambda: {"return_logprob": True}
    trainer.prompt_seeds = lambda step, count: [100 * step + N * i for i in range(count)]
    return trainer


def test_long_partial_rollouts_spanning_pushes_are_trained_not_dropped():
    engine = ScriptedEngine()
    trainer = fake_trainer(engine)
    scheduler = FullyAsync(trainer, SchedulerConfig(
        mode="fully_async", staleness_threshold=1, trigger_parameter_sync_step=1,
        partial_rollout=True), make_client=lambda: engine)
    try:
        history = [scheduler.step(last=k == STEPS - 1) for k in range(STEPS)]
    finally:
        scheduler.close()
    assert sum(m["fully_async/count/stale_dropped"] for m in history) == 0
    long = [(version, s) for version, samples in trainer.trained for s in samples
            if len(s.response_ids) == LONG]
    assert long, "no long sample was trained"
    for version, s in long:
        first = int(s.token_weight_versions[0])
        assert s.token_weight_versions == [str(first)] * 4 + [str(first + 1)] * 4 + [
            str(first + 2)] * 2
        assert version - int(s.weight_version) <= 1  # the newest segment is within the bound
    # the metrics report the oldest token's staleness, which partial rollouts push past 1
    assert max(m["staleness/max"] for m in history) >= 2
    assert sum(m["fully_async/partial/count"] for m in history) == len(long)
    groups_with_long = [samples[i:i + N] for _, samples in trainer.trained
                        for i in range(0, len(samples), N)
                        if len(samples[i].response_ids) == LONG]
    assert len(groups_with_long) == len(long)
    assert all(len(g[1].response_ids) == SHORT for g in groups_with_long)


def test_a_sync_that_does_not_reach_the_engines_stops_the_trainer_with_the_versions():
    """Weight syncs that leave the engines reporting the old version (the adapter sync once
    did) make every group stale: the trainer dropped them and waited again, forever, each
    wait well inside its timeout. Once no group was kept for ``trainer.phase_timeout_s`` it
    stops with the versions on both sides."""
    import threading

    import pytest

    engine = ScriptedEngine()
    trainer = fake_trainer(engine)
    trainer.cfg.trainer.phase_timeout_s = 4.0  # step 1 takes ~0.1 s
    trainer.loader.next_batch = lambda: [{"input_ids": [SHORT]}] * GROUPS  # all answered at once

    def sync_not_reaching_the_engines() -> dict[str, float]:
        trainer.weight_version += 1  # the engines keep reporting "0"
        return {}

    trainer.sync_weights = sync_not_reaching_the_engines
    scheduler = FullyAsync(trainer, SchedulerConfig(
        mode="fully_async", staleness_threshold=0, trigger_parameter_sync_step=1,
        partial_rollout=False), make_client=lambda: engine)
    outcome: list[BaseException | dict] = []

    def run() -> None:
        try:
            outcome.append(scheduler.step())  # version 0 groups, then a sync to version 1
            outcome.append(scheduler.step())  # only version 0 groups come
        except BaseException as err:  # noqa: BLE001 - checked below
            outcome.append(err)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(60)
    try:
        assert not thread.is_alive(), "the trainer still waits for a fresh group"
    finally:
        scheduler.close()
    assert isinstance(outcome[0], dict) and len(outcome) == 2
    with pytest.raises(TimeoutError, match=r"trainer is at weight version 1, the groups' "
                       r"newest tokens at \[0\].*staleness_threshold=0(\.0)? allows 0"):
        raise outcome[1]
