"""Kill the training process with SIGKILL mid-generation, mid-update and mid-save, and one of
its actor ranks between steps; restart it with ``trainer.resume=auto`` each time, and the run's
per-step metrics equal an uninterrupted run's (CPU, fp32, per-prompt sampling seeds: deterministic). The crashing run saves in the
background, the others block (tests/megatron/test_checkpoint.py covers a crash mid-publication
of a blocking save).

Each run is a real ``megarl train`` process (Ray, two Megatron ranks, an embedded engine); the
uninterrupted run is the session's ``reference_run`` (conftest.py)."""

from __future__ import annotations

import functools
import re
import signal
import time

import psutil
from trainer_runs import assert_same_metrics, finish, run_metrics, start_train, tag_of, train

from megarl.faults import ENGINE_DELAY_ENV, WRITE_DELAY_ENV
from megarl.metrics.trackers import read_metrics_jsonl


def published(checkpoints) -> list[str]:
    """The published checkpoint directories (not the temporary ones of a save in progress)."""
    return sorted(p.name for p in checkpoints.iterdir() if re.fullmatch(r"step_\d{8}", p.name))


def kill_a_rank_after_step(assets, out, step: int, *overrides: str) -> None:
    """Start a run, SIGKILL actor rank 1 once ``step`` was logged: the driver must stop with the
    role, rank and host of the dead rank (not hang, not exit 0)."""
    jsonl = out / "metrics.jsonl"

    def logged() -> bool:
        return jsonl.exists() and any(row["step"] == step for row in read_metrics_jsonl(jsonl))

    assert not logged()  # no earlier run got this far
    proc, tag = start_train(assets, out, *overrides)
    deadline = time.monotonic() + 300
    while not logged():
        assert proc.poll() is None and time.monotonic() < deadline, f"step {step} never logged"
        time.sleep(0.2)
    # each start of a worker appends "=== megarl actor rank 1/2 pid P on HOST ..." to its log
    pids = re.findall(r"=== megarl actor rank 1/2 pid (\d+) ",
                      (out / "logs" / "actor_rank1.log").read_text())
    rank = psutil.Process(int(pids[-1]))
    assert tag_of(rank) == tag, pids
    rank.send_signal(signal.SIGKILL)
    code, err = finish(proc, tag, expect_ok=False)
    assert code == 1  # a clean exit (T6), not a hang, a signal or a driver traceback
    assert re.search(r"^error: actor rank \d \(host [^,]+, pid \d+\) died during", err,
                     re.MULTILINE), err[-3000:]


def test_resumed_run_equals_uninterrupted_run(demo_assets, expected, tmp_path):
    """With background saves (``trainer.async_save``): the checkpoint of step k is written while
    step k+1 generates and published at the start of step k+1's training, so where ``latest``
    stands after a crash depends only on the phase the crash hit. The run is killed mid-
    generation, loses an actor rank, is killed mid-update and mid-save, and each time restarted
    with ``trainer.resume=auto``. The uninterrupted run saves blocking; the metrics must be the
    same."""
    out = tmp_path / "crashy"
    checkpoints = out / "checkpoints"
    overrides = ("trainer.async_save=true",)
    run = functools.partial(train, demo_assets, out, *overrides)
    # killed halfway through generating step 2: step 1 was still unpublished (none to resume).
    # Each engine step of this run lasts >= 0.3 s, so 0.1 s after step 2's generation began it
    # is surely under way, however fast the machine (a crash delay alone can land after it)
    assert run(crash="gen:2:0.1", env={ENGINE_DELAY_ENV: "0.3"}) == -signal.SIGKILL
    assert not (checkpoints / "latest").exists() and published(checkpoints) == []
    # starts over; an actor rank dies after step 2 was logged: step 1 is published (step 2 too
    # if step 3 had begun training)
    kill_a_rank_after_step(demo_assets, out, 2, *overrides)
    after_dead_rank = (checkpoints / "latest").read_text().strip()
    assert after_dead_rank in ("step_00000001", "step_00000002")
    # resumed; killed in the update of step 3 (step 2 published when step 3 began training;
    # step 3 would be when step 4 began training, ~0.5 s after step 3's update began here)
    assert run(crash="update_actor:3:0.05") == -signal.SIGKILL
    assert (checkpoints / "latest").read_text().strip() == "step_00000002"
    # resumed at step 3; killed while the checkpoint of step 3 is being written (each rank's
    # writer waits 2 s before it writes: a slow file system)
    assert run(crash="save:3:0.05", env={WRITE_DELAY_ENV: "2"}) == -signal.SIGKILL
    assert (checkpoints / "latest").read_text().strip() == "step_00000002"
    # resumed again; runs to the end (the last save is published before the run exits)
    assert run() == 0

    assert_same_metrics(run_metrics(out), expected)
    # rotated to keep_last=2, no half-written directory left
    names = sorted(p.name for p in checkpoints.iterdir())
    assert names == ["latest", "step_00000003", "step_00000004"]
    assert (checkpoints / "latest").read_text().strip() == "step_00000004"
    # a save's blocking time is logged with the next step of the same process: none for the
    # first step of a run (1, 3, and 2 when the run after the dead rank resumed from step 1)
    rows = read_metrics_jsonl(out / "metrics.jsonl")
    saving = {row["step"]: row.get("timing/save_blocking") for row in rows}
    first_of_a_run = {1, 3} | ({2} if after_dead_rank == "step_00000001" else set())
    assert all((saving[step] is None) == (step in first_of_a_run) for step in saving), saving
    assert all(v > 0 for v in saving.values() if v is not None), saving
