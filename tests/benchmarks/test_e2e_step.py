"""``benchmarks/e2e_step.py``: the forced response lengths, and its ``--smoke`` run (megarl's real
colocated-step stack and TRL's GRPOTrainer on the same tiny model, prompts and lengths)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import pytest

from tests.benchmarks.test_smoke import ROOT, load


def test_forced_lengths_are_deterministic_and_long_tailed():
    bench = load("e2e_step")
    prompts = [[7 + i % 50, 9, 11 + i] for i in range(250)]
    lengths = [bench.response_length(p, j, 512.0, 0.8, 2048) for p in prompts for j in range(8)]
    assert lengths == [bench.response_length(p, j, 512.0, 0.8, 2048)
                       for p in prompts for j in range(8)]
    assert 440 < statistics.median(lengths) < 590  # log-normal median 512
    assert max(lengths) == 2048 and min(lengths) >= 1  # capped; the tail reaches the cap
    assert statistics.mean(lengths) > statistics.median(lengths) * 1.15  # long right tail
    # the samples of one group differ: the key includes the sample's index
    assert len({bench.response_length(prompts[0], j, 512.0, 0.8, 2048) for j in range(8)}) > 4


@pytest.mark.timeout(600)
def test_smoke_step_runs_both_systems_on_the_same_forced_lengths(tmp_path):
    pytest.importorskip("trl")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "e2e_step.py"), "--smoke",
                           "--shape", "moe", "--out", str(tmp_path)],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=540,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "e2e_step.json").read_text())
    r = report["results"]["moe"]
    bench = load("e2e_step")
    prompts = [json.loads(line)["input_ids"]
               for line in (tmp_path / "moe" / "prompts.jsonl").read_text().splitlines()]
    forced = [bench.response_length(p, j, 6.0, 0.8, 16) for p in prompts for j in range(2)]
    assert r["response_tokens"] == sum(forced)
    # megarl trained exactly the forced lengths; TRL generated them plus its EOS
    assert r["trained_response_length"] == pytest.approx(sum(forced) / len(forced), abs=1e-9)
    assert r["trl_mean_completion_length"] == pytest.approx(sum(forced) / len(forced) + 1,
                                                            abs=1e-3)
    for phase in ("gen_s", "old_log_prob_s", "update_actor_s", "sync_s", "step_s", "trl_step_s"):
        assert r[phase] > 0, phase
    assert r["megarl_over_trl"] == pytest.approx(r["trl_step_s"] / r["step_s"])
    assert 0 < r["gen_floor_fraction"] and 0 < r["update_actor_mfu"] < 1
    # the CPU smoke runs separate pools: no release/resume, and the report says so
    assert "timing/release_rollout" in r["phases_not_run"]
    assert report["floors"]["matmul_flops"] > 0 and report["floors"]["copy_bytes_per_s"] > 0
    assert (tmp_path / "e2e_step.png").stat().st_size > 10_000
