"""``actor.router_replay.diagnose_no_replay``: with R3 the no-replay forward (and its
``_no_replay`` metrics) runs only when the switch is on; off, one replayed forward per step."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from megarl.batch import StepBatch
from megarl.config import load_config_dict
from megarl.rollout.interface import RolloutSample
from megarl.trainer import Trainer

BASE: dict[str, Any] = {
    "model": {"path": "/m"},
    "data": {"train_files": ["/t.parquet"], "train_batch_size": 1, "max_prompt_length": 8,
             "max_response_length": 6},
    "actor": {"ppo_mini_batch_size": 1, "ppo_micro_batch_size_per_gpu": 2,
              "router_replay": {"mode": "R3"}},
    "rollout": {"n": 2, "enable_return_routed_experts": True},
    "resources": {"train_pool": {"nnodes": 1, "gpus_per_node": 1}},
}


def r3_batch() -> StepBatch:
    """One prompt x 2 samples with engine log-probs and routes (2 layers, top-2)."""
    gen = torch.Generator().manual_seed(0)
    samples = [RolloutSample(
        prompt_index=0, sample_index=j, prompt_ids=[5, 6, 7], response_ids=[8, 9, 10][:2 + j],
        log_probs=[-0.5, -1.0, -2.0][:2 + j], finish_reason="stop", weight_version="0",
        routed_experts=torch.randint(0, 4, (4 + j, 2, 2), generator=gen, dtype=torch.int16))
        for j in range(2)]
    return StepBatch(samples=samples, prompts=[{"input_ids": [5, 6, 7]}], n=2)


def run_old_log_probs(monkeypatch, *overrides: str) -> tuple[list, dict[str, float]]:
    """compute_old_log_probs with a fake trainer forward; (the forwards' route args, metrics)."""
    cfg, sources = load_config_dict(BASE, list(overrides))
    trainer = Trainer(cfg, sources)
    batch, calls = r3_batch(), []

    def forward(b: StepBatch, use_ref: bool = False, routes=None,
                record_routes: bool = False) -> dict[str, list]:
        calls.append(routes)
        return {"log_probs": [list(s.log_probs) for s in b.samples],
                "routes": routes if routes is not None else b.engine_routes()}

    monkeypatch.setattr(trainer, "compute_log_probs", forward)
    try:
        metrics = trainer.compute_old_log_probs(batch)
    finally:
        trainer.loop.close()
    return calls, metrics


@pytest.mark.parametrize("switch", [None, "false"])
def test_off_runs_one_replayed_forward(monkeypatch, switch) -> None:
    extra = [] if switch is None else [f"actor.router_replay.diagnose_no_replay={switch}"]
    calls, metrics = run_old_log_probs(monkeypatch, *extra)
    assert len(calls) == 1 and calls[0] is not None  # the engine's routes are replayed
    assert "rollout/moe/router_agreement" in metrics
    assert not any("no_replay" in k for k in metrics)


def test_on_adds_the_no_replay_forward_and_its_metrics(monkeypatch) -> None:
    calls, metrics = run_old_log_probs(monkeypatch, "actor.router_replay.diagnose_no_replay=true")
    assert len(calls) == 2 and calls[0] is None and calls[1] is not None
    assert "rollout/moe/router_agreement_no_replay" in metrics
    assert "training/rollout_probs_diff_no_replay_mean" in metrics
