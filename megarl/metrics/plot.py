"""The end-of-run plot: reward, response length, KL and where the step time went."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megarl.metrics.trackers import read_metrics_jsonl

FIGSIZE_INCHES = (12.0, 8.0)
DPI = 100
SMOOTHING_WINDOW = 10


def _series(rows: Sequence[dict[str, Any]], name: str) -> tuple[list[int], list[float]] | None:
    """(steps, values) of a metric, NaN where a row lacks it or holds null; None if never logged."""
    if not any(row.get(name) is not None for row in rows):
        return None
    steps = [int(row["step"]) for row in rows]
    values = [math.nan if row.get(name) is None else float(row[name]) for row in rows]
    return steps, values


def _moving_average(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over the last ``window`` finite values."""
    out = []
    for i in range(len(values)):
        recent = [v for v in values[max(0, i - window + 1): i + 1] if math.isfinite(v)]
        out.append(sum(recent) / len(recent) if recent else math.nan)
    return out


def _not_logged(ax: Any, title: str, names: Sequence[str]) -> None:
    ax.set_title(title)
    ax.text(0.5, 0.5, "not logged\n(" + ", ".join(names) + ")", ha="center", va="center",
            transform=ax.transAxes, color="gray")
    ax.set_xticks([])
    ax.set_yticks([])


def _line_panel(ax: Any, rows: Sequence[dict[str, Any]], title: str, names: Sequence[str],
                smooth: bool) -> None:
    """Plot every metric of ``names`` that was logged, or say that none was."""
    plotted = False
    for name in names:
        series = _series(rows, name)
        if series is None:
            continue
        steps, values = series
        alpha = 0.35 if smooth else 1.0
        line, = ax.plot(steps, values, alpha=alpha, label=name)
        if smooth:
            ax.plot(steps, _moving_average(values, SMOOTHING_WINDOW), color=line.get_color(),
                    label=f"{name} (mean of {SMOOTHING_WINDOW})")
        plotted = True
    if not plotted:
        _not_logged(ax, title, names)
        return
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


# timings that are not a phase of the step's wall clock: ``timing/env`` sums the environment
# seconds of all episodes, which run concurrently inside generation; the actor's offload and
# reload seconds are spent inside other phases (old_log_prob, update_actor, sync_weights)
NOT_PHASES = {"timing/step", "timing/env", "timing/offload_actor", "timing/reload_actor"}


def _timing_panel(ax: Any, rows: Sequence[dict[str, Any]]) -> None:
    """Stacked seconds per phase (``timing/*`` except :data:`NOT_PHASES`), with the step
    total."""
    phases = sorted({k for row in rows for k in row
                     if k.startswith("timing/") and k not in NOT_PHASES})
    total = _series(rows, "timing/step")
    title = "step time breakdown"
    if not phases and total is None:
        _not_logged(ax, title, ["timing/*"])
        return
    if phases:
        steps = [int(row["step"]) for row in rows]
        stacks = [[float(row.get(p) or 0.0) for row in rows] for p in phases]
        ax.stackplot(steps, stacks, labels=[p.removeprefix("timing/") for p in phases],
                     alpha=0.8)
    else:
        title += " (no phase timings logged)"
    if total is not None:
        ax.plot(total[0], total[1], color="black", linestyle="--", label="step (total)")
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")


def draw_run(rows: Sequence[dict[str, Any]], title: str = "megarl run") -> Any:
    """A matplotlib Figure (Agg canvas) of the four panels for metric rows of a run."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = sorted(rows, key=lambda r: int(r["step"]))
    fig = Figure(figsize=FIGSIZE_INCHES, dpi=DPI)
    FigureCanvasAgg(fig)  # Agg canvas on this figure only: pyplot's global backend is untouched
    axes = fig.subplots(2, 2)
    _line_panel(axes[0][0], rows, "reward", ["critic/score/mean"], smooth=True)
    _line_panel(axes[0][1], rows, "response length", ["response_length/mean"], smooth=True)
    _line_panel(axes[1][0], rows, "KL", ["actor/kl_loss", "actor/ppo_kl"], smooth=False)
    _timing_panel(axes[1][1], rows)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_run(metrics_jsonl_path: str | os.PathLike, out_png: str | os.PathLike) -> Path:
    """Write a 2x2 PNG (1200x800 px) of reward, response length, KL and step time; return it."""
    rows = read_metrics_jsonl(metrics_jsonl_path)
    fig = draw_run(rows, title=f"megarl run: {Path(metrics_jsonl_path).parent.name}")
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=DPI)
    return out
