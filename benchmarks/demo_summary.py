"""What a demo run's ``metrics.jsonl`` says, as JSON: whether it learned (the mean reward of the
last 20% of steps against the first 20%'s, the demos' criterion), the train/rollout mismatch
(``training/rollout_probs_diff_*``, ``rollout_corr/*``: mean over the steps and the worst step),
the median seconds of each phase and the peak memory. One entry per run directory given.

    python benchmarks/demo_summary.py RUN_DIR [RUN_DIR ...] --out summary.json

The H200 calls (``benchmarks/h200/call_fp8_demo.sh``) run it on the FP8 and bf16 GPU demos."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

REWARD = "critic/score/mean"
GAIN_REQUIRED = 0.15
"""The demos' criterion: last 20% of steps > first 20% + 0.15."""
MISMATCH_PREFIXES = ("training/rollout_probs_diff", "rollout_corr/")


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The summary of one run's metric rows (one per step, in order)."""
    if not rows:
        return {"steps": 0}
    fifth = max(1, len(rows) // 5)
    rewards = [row[REWARD] for row in rows if REWARD in row]
    out: dict[str, Any] = {"steps": len(rows)}
    if rewards:
        first, last = sum(rewards[:fifth]) / fifth, sum(rewards[-fifth:]) / fifth
        out.update(reward_first_20pct=round(first, 4), reward_last_20pct=round(last, 4),
                   reward_gain=round(last - first, 4), learned=last > first + GAIN_REQUIRED)
    keys = sorted({k for row in rows for k in row})
    worst = {"rollout_corr/rollout_is_min": min}  # the smallest IS weight is the worst one
    out["mismatch"] = {
        k: {"mean": statistics.fmean(v), "worst": worst.get(k, max)(v)}
        for k in keys if k.startswith(MISMATCH_PREFIXES)
        for v in [[row[k] for row in rows if k in row]]}
    out["median_phase_s"] = {k.removeprefix("timing/"): round(statistics.median(v), 3)
                             for k in keys if k.startswith("timing/")
                             for v in [[row[k] for row in rows if k in row]]}
    out["peak_memory_gb"] = {k: max(row[k] for row in rows if k in row)
                             for k in keys if k.startswith("perf/max_memory")}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="directories holding metrics.jsonl")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    from megarl.metrics.trackers import METRICS_FILE, read_metrics_jsonl

    result = {}
    for run in args.runs:
        path = run / METRICS_FILE
        result[run.name] = summarize(read_metrics_jsonl(path)) if path.exists() else {
            "missing": str(path)}
        brief = {k: v for k, v in result[run.name].items() if k.startswith(("reward", "learned",
                                                                            "steps", "missing"))}
        diff = result[run.name].get("mismatch", {}).get("training/rollout_probs_diff_mean")
        print(f"{run.name}: {brief} rollout_probs_diff_mean {diff}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
