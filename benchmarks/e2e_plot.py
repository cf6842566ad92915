"""The PNG of ``benchmarks/e2e_step.py``'s report: each shape's step as stacked phase seconds
(megarl, and TRL's whole step with the ratio), each phase's fraction of its floor, and where the
generation phase's seconds went (the engine's step profile) against its bandwidth floor."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot(results: dict[str, dict[str, Any]], path: Path, title: str) -> None:
    """Stacked phase seconds per shape (megarl, and TRL's whole step), and each phase's
    fraction of its floor."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = ["gen_s", "old_log_prob_s", "update_actor_s", "sync_s", "release_s", "resume_s",
              "reward_s", "other_s"]
    fig, (left, right, gen) = plt.subplots(1, 3, figsize=(18, 4.8))
    labels, x = [], 0
    for shape, r in results.items():
        bottom = 0.0
        for i, phase in enumerate(phases):
            value = max(0.0, r[phase])
            left.bar(x, value, bottom=bottom, color=f"C{i}",
                     label=phase.removesuffix("_s") if x == 0 else None)
            bottom += value
        labels.append(f"{shape}\nmegarl")
        x += 1
        if "trl_step_s" in r:  # on megarl's whole step (TRL's seconds scaled by tokens/s)
            trl_s = r.get("trl_step_s_all_prompts", r["trl_step_s"])
            left.bar(x, trl_s, color="#444444", label="TRL step" if x == 1 else None)
            left.text(x, trl_s, f"{r['megarl_over_trl']:.1f}x", ha="center", va="bottom")
            labels.append(f"{shape}\nTRL" + (f" ({r['trl_prompts']} prompts)"
                                               if trl_s != r["trl_step_s"] else ""))
            x += 1
    left.set_xticks(range(len(labels)), labels)
    left.set_ylabel("seconds per step")
    left.set_title("step breakdown")
    left.legend(fontsize=8)
    keys = [("gen_floor_fraction", "gen / floor"), ("old_log_prob_mfu", "old_lp MFU"),
            ("update_actor_mfu", "update MFU"), ("sync_copy_fraction", "sync / copy")]
    width = 0.8 / max(1, len(results))
    for i, (shape, r) in enumerate(results.items()):
        right.bar([k + i * width for k in range(len(keys))], [r[k] for k, _ in keys], width,
                  label=shape)
    right.set_xticks([k + width * (len(results) - 1) / 2 for k in range(len(keys))],
                     [name for _, name in keys])
    right.set_ylabel("fraction of the measured floor")
    right.set_title("phases against their floors")
    right.legend()
    _generation(gen, results)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


GEN_PARTS = [("prefill_s", "prefill"), ("decode_s", "decode steps (less captures)"),
             ("graph_capture_s", "decode graph captures"), ("schedule_s", "scheduling"),
             ("outside_steps_s", "outside engine steps")]


def _generation(ax: Any, results: dict[str, dict[str, Any]]) -> None:
    """Per shape: the generation phase's seconds by kind of engine step, and its floor."""
    for x, (shape, r) in enumerate(results.items()):
        prof = r.get("gen_profile") or {}
        if not prof:
            continue
        bottom = 0.0
        capture = prof.get("graph_capture_s", 0.0)
        for i, (key, name) in enumerate(GEN_PARTS):
            value = max(0.0, prof.get(key, 0.0) - (capture if key == "decode_s" else 0.0))
            ax.bar(x, value, bottom=bottom, color=f"C{i}", label=name if x == 0 else None)
            bottom += value
        ax.hlines(r["gen_floor_s"], x - 0.4, x + 0.4, colors="black",
                  label="bandwidth floor" if x == 0 else None)
        ax.text(x, bottom, f"{prof.get('decode_ms_per_step', 0):.1f} ms/step,\n"
                f"{prof.get('decode_rows_per_step', 0):.0f} rows", ha="center", va="bottom",
                fontsize=8)
    ax.set_xticks(range(len(results)), list(results))
    ax.set_ylabel("seconds per step")
    ax.margins(y=0.15)
    ax.set_title("generation (the engine's step profile)")
    ax.legend(fontsize=8)
