"""Summary of ``megarl demo --device cuda --lora`` runs (``benchmarks/h200/call_lora_demo.sh``):
per run, the setup, the mean step and its phases after the first step, what the sync sent, the
memory peaks per phase, and the engine/trainer mismatch; as JSON and as a PNG (phase seconds,
update peak against the estimate, ``training/rollout_probs_diff_mean`` per step).

    python benchmarks/lora_demo_summary.py --out benchmarks/results/x.json --png x.png \\
        merged=/path/lora_demo_merged.log adapter=/path/lora_demo_adapter.log

Each ``LABEL=LOG`` names the demo's log; its metrics are the ``metrics.jsonl`` beside it
(``<log stem>_metrics.jsonl``, as the call script copies them).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.demo_summary import summarize as summarize_run

PHASES = ("gen", "old_log_prob", "update_actor", "sync_weights", "release_rollout",
          "resume_rollout", "reward")
PROBS_DIFF = "training/rollout_probs_diff_mean"


def summarize(log: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One run's figures: setup from the log's start line, phases as means over the steps after
    the first (which compiles and captures); the reward, the mismatch and the memory peaks over
    every step as ``demo_summary`` reads them."""
    started = re.search(r"started in actor ([\d.]+) s, engines ([\d.]+) s", log)
    estimate = re.search(r"actor update .*= ([\d.]+) GB", log)
    timed = rows[1:] or rows
    run = summarize_run(rows)
    peaks, mismatch = run["peak_memory_gb"], run["mismatch"].get(PROBS_DIFF, {})

    def mean(key: str) -> float | None:
        values = [r[key] for r in timed if key in r]
        return statistics.mean(values) if values else None

    return {
        "steps": run["steps"],
        "setup_actor_s": float(started.group(1)) if started else None,
        "setup_engines_s": float(started.group(2)) if started else None,
        "first_step_s": rows[0]["timing/step"],
        "step_s": mean("timing/step"),
        **{f"{phase}_s": mean(f"timing/{phase}") for phase in PHASES},
        "sync_bytes": mean("checkpoint_engine/bytes"),
        "update_peak_allocated_gb": peaks.get("perf/max_memory_allocated_gb/update_actor"),
        "update_estimate_gb": float(estimate.group(1)) if estimate else None,
        "sync_peak_allocated_gb": peaks.get("perf/max_memory_allocated_gb/sync_weights"),
        "old_log_prob_peak_allocated_gb": peaks.get("perf/max_memory_allocated_gb/old_log_prob"),
        "probs_diff_max": mismatch.get("worst"),
        "probs_diff_mean": mismatch.get("mean"),
        "probs_diff": [r.get(PROBS_DIFF) for r in rows],
        "score_first_fifth": run.get("reward_first_20pct"),
        "score_last_fifth": run.get("reward_last_20pct"),
        "entropy_first": rows[0].get("actor/entropy"),
        "entropy_last": rows[-1].get("actor/entropy"),
    }


def plot(runs: dict[str, dict[str, Any]], path: Path, title: str) -> None:
    """Phase seconds per run, the update's peak against its estimate, the mismatch per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(16, 4.8))
    for x, r in enumerate(runs.values()):
        bottom = 0.0
        for i, phase in enumerate(PHASES):
            value = r[f"{phase}_s"] or 0.0
            left.bar(x, value, bottom=bottom, color=f"C{i}", label=phase if x == 0 else None)
            bottom += value
        left.text(x, r["step_s"], f"step {r['step_s']:.2f} s", ha="center", va="bottom")
    left.set_xticks(range(len(runs)), list(runs), fontsize=8)
    left.set_ylabel("seconds (mean over the steps after the first)")
    left.set_title("step phases")
    left.legend(fontsize=7)
    xs = range(len(runs))
    middle.bar([x - 0.2 for x in xs], [r["update_peak_allocated_gb"] for r in runs.values()],
               0.4, label="measured peak (allocated)")
    middle.bar([x + 0.2 for x in xs], [r["update_estimate_gb"] or 0 for r in runs.values()],
               0.4, label="megarl's estimate")
    middle.set_xticks(list(xs), list(runs), fontsize=8)
    middle.set_ylabel("GB in the update")
    middle.set_title("update memory")
    middle.legend(fontsize=8)
    for name, r in runs.items():
        right.semilogy(range(1, len(r["probs_diff"]) + 1), r["probs_diff"], marker=".",
                       label=name)
    right.set_xlabel("step")
    right.set_ylabel("training/rollout_probs_diff_mean")
    right.set_title("engine vs trainer probabilities")
    right.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--png", type=Path)
    parser.add_argument("--title", default="megarl demo --device cuda --lora")
    parser.add_argument("runs", nargs="+", metavar="LABEL=LOG")
    args = parser.parse_args(argv)
    from megarl.metrics.trackers import read_metrics_jsonl

    runs = {}
    for item in args.runs:
        label, _, log = item.partition("=")
        log_path = Path(log)
        metrics = log_path.with_name(log_path.stem + "_metrics.jsonl")
        runs[label] = summarize(log_path.read_text(), read_metrics_jsonl(metrics))
    args.out.write_text(json.dumps(runs, indent=1) + "\n")
    if args.png:
        plot(runs, args.png, args.title)
    for label, r in runs.items():
        print(f"{label}: " + ", ".join(f"{key} {r[key]:.4g}" for key in (
            "step_s", "sync_weights_s", "sync_bytes", "update_peak_allocated_gb",
            "update_estimate_gb", "probs_diff_max") if r[key] is not None))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
