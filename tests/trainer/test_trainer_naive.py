"""No-Ray mode (PITFALLS M4): the same 3 steps under torchrun give the same metrics as on Ray.

Two real runs of the demo config on the same seed: ``torchrun --nproc-per-node=2 ... train
trainer.worker_group=naive`` (both Megatron ranks in the torchrun group, rank 0 drives and starts
the engine) and ``megarl train`` (Ray pools, actor workers, an engine worker)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml
from run_metrics import assert_same_metrics, run_metrics

from megarl.demo import DEMO_CONFIG

BIN = Path(sys.executable).parent


def train(cmd: list[str], out: Path, assets: Path, *overrides: str) -> dict:
    """Run 3 steps of the demo; the resolved config the run saved."""
    args = [f"model.path={assets / 'model'}", f"data.train_files=[{assets / 'data/train.parquet'}]",
            f"data.val_files=[{assets / 'data/val.parquet'}]", f"trainer.output_dir={out}",
            "trainer.total_steps=3", "trainer.loggers=[jsonl]", "data.train_batch_size=8",
            "rollout.n=4", "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size_per_gpu=8",
            "trainer.phase_timeout_s=120", *overrides]
    done = subprocess.run([*cmd, "train", "--config", str(DEMO_CONFIG), *args],
                          check=False, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return yaml.safe_load((out / "config.yaml").read_text())


def test_naive_mode_matches_ray_mode(demo_assets, tmp_path):
    torchrun = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node=2", "-m", "megarl.cli"]
    naive_cfg = train(torchrun, tmp_path / "naive", demo_assets, "trainer.worker_group=naive")
    ray_cfg = train([sys.executable, "-m", "megarl.cli"], tmp_path / "ray", demo_assets,
                    "ray.address=local")
    assert naive_cfg["trainer"]["worker_group"] == "naive"
    assert ray_cfg["trainer"]["worker_group"] == "ray"
    assert not (tmp_path / "naive" / "logs" / "actor_rank0.log").exists()  # no Ray workers
    assert (tmp_path / "ray" / "logs" / "actor_rank0.log").exists()

    naive, on_ray = run_metrics(tmp_path / "naive"), run_metrics(tmp_path / "ray")
    assert sorted(on_ray) == [1, 2, 3]
    assert assert_same_metrics(naive, on_ray) > 40
    # the runs trained: the same non-trivial values, not two empty or constant logs
    assert len({m["actor/pg_loss"] for m in on_ray.values()}) == 3
    assert on_ray[3]["rollout/weight_version"] == 3.0
