"""The end-of-run plot: a PNG of the expected size, also when metrics are missing."""

import struct

from megarl.metrics.plot import draw_run, plot_run
from megarl.metrics.trackers import JsonlTracker

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def write_run(out_dir, metrics_of_step, steps=30):
    tracker = JsonlTracker(out_dir)
    for step in range(1, steps + 1):
        tracker.log(metrics_of_step(step), step)
    tracker.close()
    return out_dir / "metrics.jsonl"


def test_plot_writes_png_with_all_panels(tmp_path):
    def metrics(step):
        return {"critic/score/mean": 0.1 + 0.02 * step, "response_length/mean": 100.0 + step,
                "actor/kl_loss": 0.001 * step, "actor/ppo_kl": 0.0005 * step,
                "timing/gen": 2.0, "timing/update_actor": 1.0, "timing/sync_weights": 0.2,
                "timing/step": 3.4, "actor/entropy": float("nan") if step == 3 else 3.0}

    jsonl = write_run(tmp_path / "run", metrics)
    out = plot_run(jsonl, tmp_path / "run" / "plot.png")
    assert out == tmp_path / "run" / "plot.png"
    assert out.stat().st_size > 20_000  # four drawn panels, not an empty canvas
    assert png_size(out) == (1200, 800)


def test_plot_survives_missing_metrics(tmp_path):
    jsonl = write_run(tmp_path, lambda step: {"timing/step": 1.0} if step % 2 else {}, steps=5)
    out = plot_run(jsonl, tmp_path / "sub" / "plot.png")
    assert png_size(out) == (1200, 800)
    assert out.stat().st_size > 5_000


def panel_texts(fig) -> list[tuple[str, str]]:
    return [(ax.get_title(), " ".join(t.get_text() for t in ax.texts)) for ax in fig.axes]


def test_missing_panels_say_not_logged():
    rows = [{"step": 1, "critic/score/mean": 0.5, "timing/step": 2.0},
            {"step": 2, "critic/score/mean": None, "timing/step": 2.5}]
    texts = panel_texts(draw_run(rows))
    assert texts[0] == ("reward", "")
    assert texts[1][0] == "response length" and "not logged" in texts[1][1]
    assert texts[2][0] == "KL" and "not logged" in texts[2][1] and "actor/kl_loss" in texts[2][1]
    assert texts[3] == ("step time breakdown (no phase timings logged)", "")
    empty = panel_texts(draw_run([{"step": 1}]))
    assert all("not logged" in text for _, text in empty)


def test_episode_seconds_are_not_stacked_as_a_phase():
    """``timing/env`` sums the environment time of concurrent episodes (inside generation): it
    is no slice of the step's wall clock, so the breakdown leaves it out."""
    rows = [{"step": i, "timing/gen": 2.0, "timing/env": 40.0, "timing/step": 2.5}
            for i in (1, 2)]
    ax = draw_run(rows).axes[3]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["gen", "step (total)"]
