"""No-Ray mode: the Ray test's worker calls under a real torchrun of 2 processes (gloo)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def test_naive_mode_matches_ray_mode_results(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH"))
                                         if p)}
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         str(HERE / "naive_driver.py"), str(tmp_path)],
        capture_output=True, text=True, timeout=180, env=env, check=False)
    elapsed = time.monotonic() - start
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    print(f"\ntorchrun of 2 ranks: {elapsed:.1f} s in all, groups ready after "
          f"{max(r['startup_s'] for r in ranks):.1f} s")

    for out in ranks:  # SPMD: every rank sees every rank's results, as the Ray driver does
        # The same all-reduce as on Ray: rank r adds [r+1, 10(r+1)] -> [3, 30].
        assert out["all_reduce"] == [[0, 2, 3.0, 30.0], [1, 2, 3.0, 30.0]]
        assert [i["rank"] for i in out["identity"]] == [0, 1]
        assert [i["env"]["RANK"] for i in out["identity"]] == ["0", "1"]
        assert {i["tag"] for i in out["identity"]} == {"t"}
        assert {i["env"]["MEGARL_TEST_ENV"] for i in out["identity"]} == {"on"}
        # Every role spans all torchrun ranks in naive mode.
        assert [(i["role"], i["rank"], i["world_size"], i["tag"])
                for i in out["rollout_identity"]] == [("rollout", 0, 2, "r"),
                                                      ("rollout", 1, 2, "r")]
        assert out["split"] == [[0, [1, "a"], {"common": 7}], [1, [{"x": 2}], {"common": 7}]]
        assert out["error"]["ranks"] == [1]
        text = out["error"]["text"]
        assert "train rank 1 (host " in text and "raised in 'fail_on'" in text
        assert "in _inner_failure" in text and text.rstrip().endswith(
            "ValueError: boom from rank 1")
        assert out["after"] == [[0, [1], {}], [1, [1], {}]]
    # Rank 0 gave up on rank 1 after 1 s and let it go; rank 1 (stuck until then) found rank
    # 0's result waiting.
    assert ranks[0]["timeout"]["ranks"] == [1]
    assert "phase 'update_actor' of role train did not finish within 1 s" in \
        ranks[0]["timeout"]["text"]
    assert ranks[1]["timeout"] is None
    assert "in stuck_on" in proc.stderr  # rank 1's stacks, printed at rank 0's request
