"""Kill the training process with SIGKILL mid-generation, mid-update and mid-save, restart it
with ``trainer.resume=auto`` each time, and the run's per-step metrics equal an uninterrupted
run's (CPU, fp32, per-prompt sampling seeds: deterministic).

Each run is a real ``megarl train`` process (Ray, two Megatron ranks, an embedded engine). A
killed driver leaves its Ray processes and engine behind, as a real crash would; the test finds
them by an environment tag and kills them before the restart."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

from megarl.demo import DEMO_CONFIG, prepare_demo_assets
from megarl.metrics.trackers import read_metrics_jsonl

TOTAL_STEPS = 4
# metrics that measure time or depend on it
VARYING = ("timing/", "throughput/", "perf/", "health/")
# engine-vs-trainer log-prob gaps: the engine's batching (which depends on timing) moves its
# log-probs by ~1e-9, so these are compared to an absolute 1e-6
ENGINE_GAPS = ("rollout_corr/", "training/rollout_probs_diff")


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tiny")
    prepare_demo_assets(root)
    return root


def _tag_of(proc: psutil.Process) -> str | None:
    try:
        return proc.environ().get("MEGARL_TEST_TAG")
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


def _kill_tagged(tag: str) -> None:
    """SIGKILL every process whose environment carries ``tag`` (a crashed run's leftovers)."""
    for proc in psutil.process_iter(["pid"]):
        if proc.pid != os.getpid() and _tag_of(proc) == tag:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.send_signal(signal.SIGKILL)


def start_train(assets: Path, out: Path, crash: str | None = None) -> tuple[subprocess.Popen, str]:
    """A ``megarl train`` process of the test's run (4 steps, a checkpoint after each) and the
    environment tag its descendants carry; its output goes to ``out``/../<tag>.log."""
    tag = uuid.uuid4().hex
    env = {**os.environ, "MEGARL_TEST_TAG": tag, "OMP_NUM_THREADS": "1"}
    env.pop("MEGARL_CRASH_AT", None)
    if crash:
        env["MEGARL_CRASH_AT"] = crash
    args = [sys.executable, "-m", "megarl.cli", "train", "--config", str(DEMO_CONFIG),
            f"model.path={assets / 'model'}", f"data.train_files=[{assets / 'data/train.parquet'}]",
            f"data.val_files=[{assets / 'data/val.parquet'}]",
            f"trainer.output_dir={out}", "trainer.loggers=[jsonl]",
            f"trainer.total_steps={TOTAL_STEPS}", "trainer.save_every=1", "trainer.resume=auto",
            "trainer.keep_last=2", "trainer.phase_timeout_s=120", "ray.address=local",
            "data.train_batch_size=8", "rollout.n=4", "actor.ppo_mini_batch_size=4",
            "actor.ppo_micro_batch_size_per_gpu=8"]
    # a file, not a pipe: processes a crash leaves behind would hold a pipe open
    log = open(out.parent / f"{out.name}-{tag}.log", "w")  # noqa: SIM115 (closed by the child)
    with log:
        proc = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    proc.log_path = Path(log.name)
    return proc, tag


def finish(proc: subprocess.Popen, tag: str, expect_ok: bool) -> tuple[int, str]:
    """Wait for the run, kill what it left behind; returns (exit code, output)."""
    try:
        proc.wait(timeout=600)
    finally:
        proc.kill()
        _kill_tagged(tag)
    output = proc.log_path.read_text()
    if expect_ok and proc.returncode != 0:
        raise AssertionError(f"megarl train failed:\n{output[-5000:]}")
    return proc.returncode, output


def train(assets: Path, out: Path, crash: str | None = None) -> int:
    """One ``megarl train`` run; its exit code: 0, or -9 when it crashed as asked."""
    proc, tag = start_train(assets, out, crash)
    code, output = finish(proc, tag, expect_ok=crash is None)
    if crash is not None and code != -signal.SIGKILL:
        raise AssertionError(f"expected a crash at {crash}, got exit {code}:\n{output[-5000:]}")
    return code


def comparable(rows: list[dict]) -> dict[int, dict[str, float]]:
    """step -> the metrics that do not depend on time."""
    return {int(row["step"]): {k: v for k, v in row.items() if k != "step"
                               and not k.startswith(VARYING) and not k.endswith("idle_ratio")}
            for row in rows}


@pytest.fixture(scope="module")
def expected(assets, tmp_path_factory) -> dict[int, dict[str, float]]:
    """The per-step metrics of the run without interruptions."""
    out = tmp_path_factory.mktemp("straight")
    train(assets, out)
    metrics = comparable(read_metrics_jsonl(out / "metrics.jsonl"))
    assert sorted(metrics) == list(range(1, TOTAL_STEPS + 1))
    return metrics


def assert_same_metrics(out: Path, expected: dict[int, dict[str, float]]) -> None:
    """The run in ``out`` logged the same per-step metrics as the uninterrupted one."""
    got = comparable(read_metrics_jsonl(out / "metrics.jsonl"))
    assert sorted(got) == sorted(expected)
    for step, metrics in expected.items():
        assert set(got[step]) == set(metrics), step
        for name, value in metrics.items():
            tolerance = 1e-6 if name.startswith(ENGINE_GAPS) else 1e-9
            assert got[step][name] == pytest.approx(value, rel=1e-6, abs=tolerance), (step, name)


def test_resumed_run_equals_uninterrupted_run(assets, expected, tmp_path):
    out = tmp_path / "crashy"
    checkpoints = out / "checkpoints"
    # killed halfway through generating step 2 (step 1 is saved)
    assert train(assets, out, crash="gen:2:1.0") == -signal.SIGKILL
    assert (checkpoints / "latest").read_text().strip() == "step_00000001"
    # resumed at step 2; killed in the update of step 3 (steps 1-2 saved)
    assert train(assets, out, crash="update_actor:3:0.3") == -signal.SIGKILL
    assert (checkpoints / "latest").read_text().strip() == "step_00000002"
    # resumed at step 3; killed while the checkpoint of step 3 is being written
    assert train(assets, out, crash="save:3:0.05") == -signal.SIGKILL
    assert (checkpoints / "latest").read_text().strip() in ("step_00000002", "step_00000003")
    # resumed again; runs to the end
    assert train(assets, out) == 0

    assert_same_metrics(out, expected)
    # rotated to keep_last=2, no half-written directory left
    names = sorted(p.name for p in checkpoints.iterdir())
    assert names == ["latest", "step_00000003", "step_00000004"]
    assert (checkpoints / "latest").read_text().strip() == "step_00000004"


def test_dead_train_rank_stops_the_run_and_resume_continues(assets, expected, tmp_path):
    """SIGKILL one actor rank after step 2 was logged: the driver stops with the role, rank and
    host of the dead rank; the restarted run continues from the step-2 checkpoint."""
    out = tmp_path / "rank_dies"
    proc, tag = start_train(assets, out)
    jsonl = out / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (jsonl.exists() and len(jsonl.read_text().splitlines()) >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, "step 2 never logged"
        time.sleep(0.2)
    # every worker log starts with "=== megarl actor rank 1/2 pid P on HOST ..."
    header = (out / "logs" / "actor_rank1.log").read_text().splitlines()[0]
    rank = psutil.Process(int(re.search(r" pid (\d+) ", header).group(1)))
    assert _tag_of(rank) == tag, header
    rank.send_signal(signal.SIGKILL)
    code, err = finish(proc, tag, expect_ok=False)
    assert code not in (0, -signal.SIGKILL)
    assert re.search(r"actor rank \d \(host [^,]+, pid \d+\) died during", err), err[-3000:]
    assert train(assets, out) == 0
    assert_same_metrics(out, expected)
