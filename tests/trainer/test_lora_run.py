"""``megarl train`` with ``actor.lora``: the demo (two Megatron ranks with EP=2, an embedded
engine, Ray) trains adapters and syncs the merged weights; and (``slow``) a run killed mid-update
and resumed from its checkpoint logs the same per-step metrics as an uninterrupted one."""

from __future__ import annotations

import signal

import pytest
from trainer_runs import TOTAL_STEPS, assert_same_metrics, run_metrics, train

LORA = ("actor.lora.rank=8", "actor.lora.alpha=16")


def test_lora_run_syncs_merged_weights(demo_assets, expected, tmp_path):
    whole = tmp_path / "whole"
    assert train(demo_assets, whole, *LORA) == 0
    metrics = run_metrics(whole)
    assert sorted(metrics) == list(range(1, TOTAL_STEPS + 1))
    for step, row in metrics.items():
        # the engine serves the merged weights: it scores the samples as the actor does
        assert row["training/rollout_probs_diff_max"] < 1e-6, step
        assert row["rollout/weight_version"] == step
    # adapters, not the full weights, trained: the run differs from the full-weight one
    assert metrics[2]["actor/grad_norm"] != expected[2]["actor/grad_norm"]
    assert len({m["actor/pg_loss"] for m in metrics.values()}) == TOTAL_STEPS


@pytest.mark.slow  # the parts run every time: test_resume.py (a run killed mid-update resumes
# exactly) and test_lora_checkpoint.py (adapters and the next Adam step come back exactly)
def test_lora_run_killed_mid_update_resumes_exactly(demo_assets, tmp_path):
    whole = tmp_path / "whole"
    assert train(demo_assets, whole, *LORA) == 0
    metrics = run_metrics(whole)
    crashy = tmp_path / "crashy"
    assert train(demo_assets, crashy, *LORA, crash="update_actor:3:0.3") == -signal.SIGKILL
    assert (crashy / "checkpoints" / "latest").read_text().strip() == "step_00000002"
    assert train(demo_assets, crashy, *LORA) == 0
    assert assert_same_metrics(run_metrics(crashy), metrics) > 40
