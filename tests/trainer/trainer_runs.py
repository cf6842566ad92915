"""Real ``megarl train`` runs of the demo for the trainer tests, and comparing their metrics.

Every run is a process of its own (Ray or torchrun, two Megatron ranks, an embedded engine) on
the same seed in fp32 on CPU, so two runs that must be the same run log the same per-step
metrics. A killed driver leaves its Ray processes and engine behind, as a real crash would; each
run carries an environment tag by which :func:`finish` finds and kills them. (A uniquely named
module: conftest.py names collide across test folders.)"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import psutil
import pytest

from megarl.demo import DEMO_CONFIG
from megarl.metrics.trackers import read_metrics_jsonl

TOTAL_STEPS = 4
TORCHRUN = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node=2"]
# metrics that measure time or depend on it
VARYING = ("timing/", "throughput/", "perf/", "health/")
VARYING_SUFFIXES = ("idle_ratio", "_s")  # _s: seconds (checkpoint_engine/pack_s, ...)
# engine-vs-trainer log-prob gaps: the engine's batching (which depends on timing) moves its
# log-probs by ~1e-9, so these are compared to an absolute 1e-6
ENGINE_GAPS = ("rollout_corr/", "training/rollout_probs_diff")


def tag_of(proc: psutil.Process) -> str | None:
    """The test tag in a process's environment (None when it has none or is gone)."""
    try:
        return proc.environ().get("MEGARL_TEST_TAG")
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


def kill_tagged(tag: str) -> None:
    """SIGKILL every process whose environment carries ``tag`` (a crashed run's leftovers)."""
    for proc in psutil.process_iter(["pid"]):
        if proc.pid != os.getpid() and tag_of(proc) == tag:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.send_signal(signal.SIGKILL)


def run_overrides(assets: Path, out: Path, total_steps: int = TOTAL_STEPS) -> list[str]:
    """The settings of every run here: the demo's model and data, a checkpoint after each step
    (resumed automatically), 8 prompts x 4 samples a step, a private Ray."""
    return [f"model.path={assets / 'model'}",
            f"data.train_files=[{assets / 'data/train.parquet'}]",
            f"data.val_files=[{assets / 'data/val.parquet'}]",
            f"trainer.output_dir={out}", "trainer.loggers=[jsonl]",
            f"trainer.total_steps={total_steps}", "trainer.save_every=1", "trainer.resume=auto",
            "trainer.keep_last=2", "trainer.phase_timeout_s=120", "ray.address=local",
            "data.train_batch_size=8", "rollout.n=4", "actor.ppo_mini_batch_size=4",
            "actor.ppo_micro_batch_size_per_gpu=8"]


def demo_trainer(assets: Path, out: Path, *overrides: str, total_steps: int = TOTAL_STEPS,
                 config: Path = DEMO_CONFIG):
    """The Trainer of :func:`start_train`'s run, in this process: where Ray is already up here
    (a module's shared instance) it attaches to it instead of starting its own, and it needs no
    interpreter, imports or Ray of its own (a few seconds of each test on 2 cores)."""
    from megarl.config import load_config
    from megarl.trainer import Trainer

    cfg, sources = load_config(str(config), [*run_overrides(assets, out, total_steps), *overrides])
    return Trainer(cfg, sources)


def start_train(assets: Path, out: Path, *overrides: str, crash: str | None = None,
                torchrun: bool = False, config: Path = DEMO_CONFIG,
                total_steps: int = TOTAL_STEPS,
                env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """A ``megarl train`` process (``total_steps`` steps of ``config``, a checkpoint after each;
    ``torchrun`` launches it under a torchrun of 2 processes; ``env``: more environment for it
    and its descendants) and the environment tag they carry; its output goes to
    ``out``/../<name>-<tag>.log."""
    tag = uuid.uuid4().hex
    env = {**os.environ, **(env or {}), "MEGARL_TEST_TAG": tag, "OMP_NUM_THREADS": "1"}
    env.pop("MEGARL_CRASH_AT", None)
    if crash:
        env["MEGARL_CRASH_AT"] = crash
    launcher = [*TORCHRUN, "-m", "megarl.cli"] if torchrun else [sys.executable, "-m",
                                                                  "megarl.cli"]
    args = [*launcher, "train", "--config", str(config),
            *run_overrides(assets, out, total_steps), *overrides]
    out.parent.mkdir(parents=True, exist_ok=True)
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
        kill_tagged(tag)
    output = proc.log_path.read_text()
    if expect_ok and proc.returncode != 0:
        raise AssertionError(f"megarl train failed:\n{output[-5000:]}")
    return proc.returncode, output


def train(assets: Path, out: Path, *overrides: str, crash: str | None = None,
          torchrun: bool = False, config: Path = DEMO_CONFIG,
          total_steps: int = TOTAL_STEPS, env: dict[str, str] | None = None) -> int:
    """One ``megarl train`` run; its exit code: 0, or -9 when it crashed as asked."""
    proc, tag = start_train(assets, out, *overrides, crash=crash, torchrun=torchrun,
                            config=config, total_steps=total_steps, env=env)
    code, output = finish(proc, tag, expect_ok=crash is None)
    if crash is not None and code != -signal.SIGKILL:
        raise AssertionError(f"expected a crash at {crash}, got exit {code}:\n{output[-5000:]}")
    return code


def comparable(rows: list[dict]) -> dict[int, dict[str, float]]:
    """step -> the metrics that do not depend on time."""
    return {int(row["step"]): {k: v for k, v in row.items() if k != "step" and v is not None
                               and not k.startswith(VARYING) and not k.endswith(VARYING_SUFFIXES)}
            for row in rows}


def run_metrics(out: Path) -> dict[int, dict[str, float]]:
    """The comparable metrics of the run whose output directory is ``out``."""
    return comparable(read_metrics_jsonl(out / "metrics.jsonl"))


def assert_same_metrics(got: dict[int, dict[str, float]],
                        expected: dict[int, dict[str, float]], engine_gap_abs: float = 1e-6) -> int:
    """Both runs logged the same steps with the same metrics (names and values: rel 1e-6, and
    absolute 1e-9; the engine gaps, functions of the engine's log-probs, to ``engine_gap_abs``
    absolute or relative: a perplexity is exp of a mean log-prob, so a log-prob gap of e moves it by
    a factor of about 1 + e); returns how many values were compared."""
    assert sorted(got) == sorted(expected)
    compared, wrong = 0, []
    for step, metrics in expected.items():
        assert set(got[step]) == set(metrics), (step, set(got[step]) ^ set(metrics))
        for name, value in metrics.items():
            engine = name.startswith(ENGINE_GAPS)
            rel, tolerance = (max(1e-6, engine_gap_abs), engine_gap_abs) if engine else (1e-6, 1e-9)
            if got[step][name] != pytest.approx(value, rel=rel, abs=tolerance):
                wrong.append((step, name, got[step][name], value))
            compared += 1
    assert not wrong, f"{len(wrong)} of {compared} values differ (step, name, got, expected): {wrong}"
    return compared


def fit(trainer) -> list[dict[str, float]]:
    """A Trainer's whole run in this process (setup, fit, close): its per-step metrics."""
    try:
        trainer.setup()
        return trainer.fit()
    finally:
        trainer.close()


def first_and_last_fifth(history: list[dict[str, float]], key: str) -> tuple[float, float]:
    """Mean of ``key`` over the first and over the last 20% of the steps (at least one each):
    how the demos' learning is judged."""
    values = [m[key] for m in history]
    k = max(1, len(values) // 5)
    return sum(values[:k]) / k, sum(values[-k:]) / k
