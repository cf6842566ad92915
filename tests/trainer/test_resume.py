"""Kill the training process with SIGKILL mid-generation, mid-update and mid-save, restart it
with ``trainer.resume=auto`` each time, and the run's per-step metrics equal an uninterrupted
run's (CPU, fp32, per-prompt sampling seeds: deterministic). The crashing run saves in the
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

from megarl.metrics.trackers import read_metrics_jsonl


def published(checkpoints) -> list[str]:
    """The published checkpoint directories (not the temporary ones of a save in progress)."""
    return sorted(p.name for p in checkpoints.iterdir() if re.fullmatch(r"step_\d{8}", p.name))


def test_resumed_run_equals_uninterrupted_run(demo_assets, expected, tmp_path):
    """With background saves (``trainer.async_save``): the checkpoint of step k is written while
    step k+1 generates and published at the start of step k+1's training, so where ``latest``
    stands after a crash depends only on the phase the crash hit. The uninterrupted run saves
    blocking; the metrics must be the same."""
    out = tmp_path / "crashy"
    checkpoints = out / "checkpoints"
    run = functools.partial(train, demo_assets, out, "trainer.async_save=true")
    # killed halfway through generating step 2: step 1 was still unpublished (none to resume)
    assert run(crash="gen:2:1.0") == -signal.SIGKILL
    assert not (checkpoints / "latest").exists() and published(checkpoints) == []
    # starts over; killed in the update of step 3 (step 2 published when step 3 began training)
    assert run(crash="update_actor:3:0.3") == -signal.SIGKILL
    assert (checkpoints / "latest").read_text().strip() == "step_00000002"
    # resumed at step 3; killed while the checkpoint of step 3 is being written
    assert run(crash="save:3:0.05") == -signal.SIGKILL
    assert (checkpoints / "latest").read_text().strip() == "step_00000002"
    # resumed again; runs to the end (the last save is published before the run exits)
    assert run() == 0

    assert_same_metrics(run_metrics(out), expected)
    # rotated to keep_last=2, no half-written directory left
    names = sorted(p.name for p in checkpoints.iterdir())
    assert names == ["latest", "step_00000003", "step_00000004"]
    assert (checkpoints / "latest").read_text().strip() == "step_00000004"
    # a save's blocking time is logged with the next step of the same process: steps 2 and 4
    # (step 3 was the resumed run's first)
    rows = read_metrics_jsonl(out / "metrics.jsonl")
    saving = {row["step"]: row.get("timing/save_blocking") for row in rows}
    assert saving[1] is None and saving[3] is None and saving[2] > 0 and saving[4] > 0, saving


def test_dead_train_rank_stops_the_run_and_resume_continues(demo_assets, expected, tmp_path):
    """SIGKILL one actor rank after step 2 was logged: the driver stops with the role, rank and
    host of the dead rank; the restarted run continues from the step-2 checkpoint."""
    out = tmp_path / "rank_dies"
    proc, tag = start_train(demo_assets, out)
    jsonl = out / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (jsonl.exists() and len(jsonl.read_text().splitlines()) >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, "step 2 never logged"
        time.sleep(0.2)
    # every worker log starts with "=== megarl actor rank 1/2 pid P on HOST ..."
    header = (out / "logs" / "actor_rank1.log").read_text().splitlines()[0]
    rank = psutil.Process(int(re.search(r" pid (\d+) ", header).group(1)))
    assert tag_of(rank) == tag, header
    rank.send_signal(signal.SIGKILL)
    code, err = finish(proc, tag, expect_ok=False)
    assert code not in (0, -signal.SIGKILL)
    assert re.search(r"actor rank \d \(host [^,]+, pid \d+\) died during", err), err[-3000:]
    assert train(demo_assets, out) == 0
    assert_same_metrics(run_metrics(out), expected)
