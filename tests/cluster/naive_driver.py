"""SPMD driver for the no-Ray test, run by torchrun: the Ray test's calls on NaiveWorkerGroups.

Usage: torchrun --nproc-per-node 2 naive_driver.py OUT_DIR  (writes OUT_DIR/rank<r>.json)
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from cluster_workers import EchoWorker

from megarl.cluster import NaiveWorkerGroup, WorkerError, WorkerTimeoutError, init_naive


def main(out_dir: Path) -> None:
    """Run every call on every rank and write what this rank saw."""
    start = time.monotonic()
    ctx = init_naive(backend="gloo", timeout_s=60)
    train = NaiveWorkerGroup(EchoWorker, "train", args=("t",), env={"MEGARL_TEST_ENV": "on"},
                             call_timeout_s=30)
    rollout = NaiveWorkerGroup(EchoWorker, "rollout", kwargs={"tag": "r"})
    out = {
        "startup_s": time.monotonic() - start,
        "identity": train.execute_all("identity"),
        "rollout_identity": rollout.execute_all("identity"),
        "all_reduce": train.execute_all("all_reduce"),
        "split": train.execute_rank_split("echo", [(1, "a"), {"x": 2}], common=7),
    }
    try:
        train.execute_all("fail_on", 1, "boom from rank 1")
        out["error"] = None
    except WorkerError as err:
        out["error"] = {"ranks": err.ranks, "text": str(err)}
    release = out_dir / "release"  # rank 1 is stuck until rank 0 has given up on it
    try:
        train.execute_all_async("stuck_on", 1, str(release)).get(timeout_s=1.0,
                                                                 phase="update_actor")
        out["timeout"] = None
    except WorkerTimeoutError as err:
        out["timeout"] = {"ranks": err.ranks, "text": str(err)}
        release.touch()
    out["after"] = train.execute_all("echo", 1)
    (out_dir / f"rank{ctx.rank}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
