"""Dynamic sampling in colocate_sync and one_step_off: zero-variance groups are dropped and
further prompts generated until the step holds data.train_batch_size groups; the number of
generation rounds is logged. Fake engines and rewards: each prompt says its group's scores."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from megarl.batch import StepBatch
from megarl.rollout.interface import RolloutSample
from megarl.scheduler.base import ColocateSync
from megarl.scheduler.one_step_off import OneStepOff
from tests.trainer.test_kl_in_reward import trainer_with

FLAT, MIXED = [1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 1.0]
# train_batch_size 2, rollout.n 4: the first batch holds one useful group, the second none, the
# third two (one of which is discarded).
PATTERNS = [FLAT, MIXED, FLAT, FLAT, MIXED, MIXED, FLAT, FLAT, FLAT, FLAT, FLAT, FLAT]


class Loader:
    """Prompts in order, ``data.train_batch_size`` at a time; each names its scores."""

    def __init__(self) -> None:
        self.offset = 0

    def next_batch(self) -> list[dict[str, Any]]:
        rows = [{"input_ids": [1, 2], "scores": PATTERNS[i], "id": i}
                for i in range(self.offset, self.offset + 2)]
        self.offset += 2
        return rows

    def state_dict(self) -> dict[str, int]:
        return {"offset": self.offset}


def samples_of(prompts: list[dict[str, Any]]) -> list[RolloutSample]:
    return [RolloutSample(prompt_index=p, sample_index=j, prompt_ids=[1, 2],
                          response_ids=[3, 4, 5], log_probs=[-1.0] * 3, finish_reason="stop",
                          weight_version="0")
            for p in range(len(prompts)) for j in range(4)]


def fake_trainer(monkeypatch, *overrides: str):
    """A Trainer whose engines, rewards and training are fakes; returns it and the batches it
    trained on."""
    trainer = trainer_with("algorithm.filter_groups.enable=true", *overrides)
    trainer.loader = Loader()
    trained: list[StepBatch] = []

    def score(batch: StepBatch) -> dict[str, float]:
        batch.scores = torch.tensor([s for p in batch.prompts for s in p["scores"]])
        return {"reward/timeouts": 0.0}

    async def rollout(client, prompts, step_index):
        return samples_of(prompts)

    for name, fn in {
        "score": score, "rollout": rollout,
        "generate": lambda prompts: StepBatch(samples=samples_of(prompts), prompts=prompts, n=4),
        "train_on": lambda batch, metrics: trained.append(batch),
        "sync_weights": dict, "engine_memory": lambda action, tags: None,
        "free_train_cache": lambda: None,
        "end_step": lambda batch, metrics, start: metrics.setdefault("timing/step", 1.0),
    }.items():
        monkeypatch.setattr(trainer, name, fn)
    return trainer, trained


def assert_full_of_varied_groups(batch: StepBatch, metrics: dict[str, float]) -> None:
    assert [p["id"] for p in batch.prompts] == [1, 4]  # prompt 5 came too late: discarded
    assert len(batch.samples) == 8
    scores = batch.scores.view(-1, 4)
    assert torch.all(scores.max(dim=1).values > scores.min(dim=1).values)
    assert metrics["train/num_gen_batches"] == 3.0
    assert metrics["dynamic_sampling/filtered_groups"] == 3.0


def test_colocate_sync_refills_until_the_batch_is_full(monkeypatch) -> None:
    trainer, trained = fake_trainer(monkeypatch)
    metrics = ColocateSync(trainer).step()
    assert len(trained) == 1
    assert_full_of_varied_groups(trained[0], metrics)
    assert trainer.loader.offset == 6


class Client:
    async def update_weight_version(self, version: str) -> None:
        return None

    async def close(self) -> None:
        return None


def test_one_step_off_refills_before_prefetching(monkeypatch) -> None:
    trainer, trained = fake_trainer(monkeypatch)
    scheduler = OneStepOff(trainer, Client)
    try:
        metrics = scheduler.step(last=True)
    finally:
        scheduler.close()
    assert len(trained) == 1
    assert_full_of_varied_groups(trained[0], metrics)


def test_the_round_limit_stops_a_hopeless_step(monkeypatch) -> None:
    trainer, trained = fake_trainer(monkeypatch, "algorithm.filter_groups.max_num_gen_batches=2")
    with pytest.raises(RuntimeError, match="max_num_gen_batches=2"):
        ColocateSync(trainer).step()
    assert not trained
