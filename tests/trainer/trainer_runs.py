"""Comparing the per-step metrics of two runs that must be the same run (same seed, fp32, CPU).

Shared by the no-Ray-vs-Ray test and the crash/resume tests (a uniquely named module: conftest.py
names collide across test folders)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megarl.metrics.trackers import read_metrics_jsonl

# metrics that measure time or depend on it
VARYING = ("timing/", "throughput/", "perf/", "health/")
VARYING_SUFFIXES = ("idle_ratio",)
# engine-vs-trainer log-prob gaps: the engine's batching (which depends on timing) moves its
# log-probs by ~1e-9, so these are compared to an absolute 1e-6
ENGINE_GAPS = ("rollout_corr/", "training/rollout_probs_diff")


def comparable(rows: list[dict]) -> dict[int, dict[str, float]]:
    """step -> the metrics that do not depend on time."""
    return {int(row["step"]): {k: v for k, v in row.items() if k != "step" and v is not None
                               and not k.startswith(VARYING) and not k.endswith(VARYING_SUFFIXES)}
            for row in rows}


def run_metrics(out: Path) -> dict[int, dict[str, float]]:
    """The comparable metrics of the run whose output directory is ``out``."""
    return comparable(read_metrics_jsonl(out / "metrics.jsonl"))


def assert_same_metrics(got: dict[int, dict[str, float]],
                        expected: dict[int, dict[str, float]]) -> int:
    """Both runs logged the same steps with the same metrics (names and values: rel 1e-6, and
    absolute 1e-9, or 1e-6 for the engine gaps); returns how many values were compared."""
    assert sorted(got) == sorted(expected)
    compared = 0
    for step, metrics in expected.items():
        assert set(got[step]) == set(metrics), (step, set(got[step]) ^ set(metrics))
        for name, value in metrics.items():
            tolerance = 1e-6 if name.startswith(ENGINE_GAPS) else 1e-9
            assert got[step][name] == pytest.approx(value, rel=1e-6, abs=tolerance), \
                (step, name, got[step][name], value)
            compared += 1
    return compared
