"""No-Ray mode (PITFALLS M4): the same steps under torchrun give the same metrics as on Ray.

``torchrun --nproc-per-node=2 -m megarl.cli train ... trainer.worker_group=naive`` (both Megatron
ranks in the torchrun group; rank 0 drives and starts the engine) against the session's
``reference_run``: ``megarl train`` on Ray pools with the same config and seed (conftest.py)."""

from __future__ import annotations

import yaml
from trainer_runs import TOTAL_STEPS, assert_same_metrics, run_metrics, train


def test_naive_mode_matches_ray_mode(demo_assets, reference_run, expected, tmp_path):
    out = tmp_path / "naive"
    assert train(demo_assets, out, "trainer.worker_group=naive", torchrun=True) == 0
    config = yaml.safe_load((out / "config.yaml").read_text())
    assert config["trainer"]["worker_group"] == "naive"
    assert yaml.safe_load((reference_run / "config.yaml").read_text())["trainer"][
        "worker_group"] == "ray"
    assert not (out / "logs" / "actor_rank0.log").exists()  # no Ray workers
    assert (reference_run / "logs" / "actor_rank0.log").exists()

    assert sorted(expected) == list(range(1, TOTAL_STEPS + 1))
    assert assert_same_metrics(run_metrics(out), expected) > 40
    # the runs trained: the same non-trivial values, not two empty or constant logs
    assert len({m["actor/pg_loss"] for m in expected.values()}) == TOTAL_STEPS
    assert expected[TOTAL_STEPS]["rollout/weight_version"] == TOTAL_STEPS
    # the no-Ray run saved its checkpoints too (the actor ranks write them together)
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step_{TOTAL_STEPS:08d}"
