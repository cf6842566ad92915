"""The benchmarks' ``--smoke`` modes run on the CPU (tiny models, seconds) and report figures."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megarl.net import free_port

ROOT = Path(__file__).resolve().parents[2]


def load(script: str):
    """Import ``benchmarks/<script>.py`` as a module."""
    spec = importlib.util.spec_from_file_location(f"bench_{script}",
                                                  ROOT / "benchmarks" / f"{script}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rollout_smoke_reports_engine_and_generate(tmp_path, capsys):
    out = tmp_path / "rollout.json"
    assert load("rollout_throughput").main(
        ["--smoke", "--no-http", "--repeats", "1", "--scenarios", "fixed",
         "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert set(row["results"]["fixed"]) == {"hf_generate", "engine"}
    assert all(v > 0 for v in row["results"]["fixed"].values())


@pytest.mark.parametrize("ignored", [[], ["--fp8-ignored-layers", "self_attn"]])
def test_rollout_smoke_compares_an_fp8_engine(tmp_path, ignored):
    """``--quantization fp8``: the same prompts through a block-FP8 engine, its ratio to the
    plain engine; the e2e shapes are e2e_step.py's. ``--fp8-ignored-layers self_attn``: the
    attention stays in the model dtype (its floor counts those bytes)."""
    bench = load("rollout_throughput")
    out = tmp_path / "rollout_fp8.json"
    assert bench.main(["--smoke", "--no-http", "--repeats", "1", "--hf-repeats", "0",
                       "--scenarios", "fixed", "--quantization", "fp8", *ignored,
                       "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    fixed = row["results"]["fixed"]
    assert fixed["hf_generate"] == 0 and fixed["engine"] > 0 and fixed["engine_fp8"] > 0
    assert row["fp8_vs_bf16"]["fixed"] == fixed["engine_fp8"] / fixed["engine"]
    e2e = load("e2e_step").SHAPES
    assert bench.SHAPES["e2e_moe"] == e2e["moe"] and bench.SHAPES["e2e_dense"] == e2e["dense"]


def test_actor_smoke_reports_both_sides(tmp_path):
    # its own process: the benchmark joins a one-rank gloo group and builds megatron state
    out = tmp_path / "actor.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "actor_throughput.py"), "--smoke",
                    "--steps", "1", "--warmup", "0", "--out", str(out)],
                   check=True, env=env, cwd=ROOT, capture_output=True, timeout=120)
    rows = json.loads(out.read_text())["rows"]
    assert [r["shape"] for r in rows] == ["dense", "moe"]
    for r in rows:
        assert r["hf_tokens_per_s"] > 0 and r["megatron_tokens_per_s"] > 0 and r["ratio"] > 0
        # the CUDA-graph side runs GraphedChunk's buffers (emulated on the CPU): same log-probs
        assert r["megatron_graphs_tokens_per_s"] > 0
        assert r["graphs_vs_eager_max_abs_log_prob"] < 1e-5


def test_client_requests_smoke_compares_both_ways(capsys):
    assert load("client_requests").main(["--smoke"]) == 0
    out = capsys.readouterr().out
    row = json.loads(out.splitlines()[0])
    assert row["batched_s"] > 0 and row["per_sample_s"] > 0
    assert "median per-sample / batched" in out


def test_export_benchmark_reports_all_three_paths(tmp_path):
    out = tmp_path / "export.json"
    port = free_port()  # for the benchmark's one-rank group
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
           "MASTER_PORT": str(port)}
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "export_weights.py"), "--experts",
                    "4", "--layers", "2", "--repeats", "1", "--out", str(out)],
                   check=True, env=env, cwd=ROOT, capture_output=True, timeout=120)
    result = json.loads(out.read_text())
    assert result["hf_tensors"] > 20 and result["bytes"] > 0
    assert all(result[f"{k}_ms"] > 0 for k in ("direct", "mbridge", "copy"))


def test_demo_summary_judges_learning_and_reports_the_mismatch(tmp_path):
    """``demo_summary.py`` on a metrics.jsonl written by hand: the first and last 20% of 10 steps
    are steps 1-2 and 9-10, the mismatch mean and worst are over the steps that logged it."""
    run = tmp_path / "fp8"
    run.mkdir()
    rows = [{"step": i, "critic/score/mean": 0.1 * i, "timing/gen": 1.0 + i,
             "training/rollout_probs_diff_mean": 0.01 * (i % 3),
             "rollout_corr/rollout_is_min": 1.0 - 0.05 * i} for i in range(10)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "summary.json"
    assert load("demo_summary").main([str(run), str(tmp_path / "none"), "--out", str(out)]) == 0
    summary = json.loads(out.read_text())
    fp8 = summary["fp8"]
    assert fp8["reward_first_20pct"] == 0.05 and fp8["reward_last_20pct"] == 0.85
    assert fp8["learned"] is True and fp8["median_phase_s"]["gen"] == 5.5
    diff = fp8["mismatch"]["training/rollout_probs_diff_mean"]
    assert abs(diff["mean"] - 0.009) < 1e-12 and diff["worst"] == 0.02
    assert fp8["mismatch"]["rollout_corr/rollout_is_min"]["worst"] == 0.55
    assert "missing" in summary["none"]


def test_lora_demo_summary_reads_the_log_and_the_metrics_beside_it(tmp_path):
    """``lora_demo_summary.py`` on a demo log and its metrics written by hand: setup from the
    start line, the update estimate from the memory lines, phases averaged over the steps after
    the first, peaks and the mismatch over every step, a PNG."""
    log = tmp_path / "lora_demo_merged.log"
    log.write_text("megarl:   actor update    weights 18.6 GB + grads 34.0 MB = 26.0 GB\n"
                   "megarl: started in actor 59.6 s, engines 110.6 s, weight sync setup 0.3 s\n")
    rows = [{"step": i + 1, "timing/step": 7.0 if i == 0 else 1.0 + i / 10,
             "timing/gen": 2.0 if i == 0 else 0.5, "checkpoint_engine/bytes": 2e9,
             "perf/max_memory_allocated_gb/update_actor": 40.0 + i,
             "training/rollout_probs_diff_mean": [0.001, 0.07, 0.002, 0.003, 0.0001][i],
             "critic/score/mean": 0.1 * i, "actor/entropy": 4.0 - i} for i in range(5)]
    (tmp_path / "lora_demo_merged_metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows))
    out, png = tmp_path / "s.json", tmp_path / "s.png"
    assert load("lora_demo_summary").main(["--out", str(out), "--png", str(png),
                                           f"merged={log}"]) == 0
    r = json.loads(out.read_text())["merged"]
    assert (r["setup_actor_s"], r["setup_engines_s"], r["update_estimate_gb"]) == (59.6, 110.6,
                                                                                  26.0)
    assert r["first_step_s"] == 7.0 and abs(r["step_s"] - 1.25) < 1e-12  # steps 2-5
    assert r["gen_s"] == 0.5 and r["sync_bytes"] == 2e9 and r["old_log_prob_s"] is None
    assert r["update_peak_allocated_gb"] == 44.0 and r["probs_diff_max"] == 0.07
    assert (r["score_first_fifth"], r["score_last_fifth"]) == (0.0, 0.4)
    assert png.stat().st_size > 10_000


def test_optimizer_step_smoke_streams_the_same_parameters(tmp_path):
    """``optimizer_step.py``: the whole offloaded state against the streamed moments on the CPU
    (copies without streams): the same parameters after the steps, several chunks, a ratio."""
    out = tmp_path / "optimizer_step.json"
    assert load("optimizer_step").main(["--device", "cpu", "--gb", "0.1", "--chunk-mb", "8",
                                        "--repeats", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["same_parameters"] and report["streamed"]["chunks"] >= 5
    assert report["whole"]["chunks"] == 0
    assert report["streamed_over_whole_s"] == (report["streamed"]["seconds"]
                                               / report["whole"]["seconds"])
