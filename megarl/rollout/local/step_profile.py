"""Where the embedded engine's thread spends its time: the profile of a generation phase.

The engine counts, from its start, the seconds and work of each kind of step: prefills (prompt
tokens, rows), decode steps (running rows, and the finished rows still decoded until the batch
is compacted) by the row bucket the step ran at, the scheduling between steps (admission,
retraction) and the time the thread waited for work. ``/get_server_info`` reports the counters
(``internal_states[0]["step_profile"]``); the difference of two snapshots is the profile of what
ran between them (:func:`profile_delta`), e.g. one rollout phase, which is how
``benchmarks/e2e_step.py`` explains a generation phase against its bandwidth floor.

A step's time is wall time on the engine thread: a decode or prefill step ends with its sampled
tokens on the host, so it covers the device's work too.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, Self

from megarl.rollout.local.kv_cache import row_bucket


class StepProfile:
    """Cumulative counters of the engine thread's steps (reset only with the engine)."""

    def __init__(self) -> None:
        self.counts: dict[str, float] = {
            "prefill_steps": 0, "prefill_tokens": 0, "prefill_rows": 0, "prefill_s": 0.0,
            "decode_steps": 0, "decode_rows": 0, "decode_finished_rows": 0, "decode_s": 0.0,
            "schedule_s": 0.0, "idle_s": 0.0}
        self.by_rows: dict[int, list[float]] = {}
        """Per row bucket: [decode steps, seconds, rows decoded]."""

    def prefill(self, tokens: int, rows: int, seconds: float) -> None:
        c = self.counts
        c["prefill_steps"] += 1
        c["prefill_tokens"] += tokens
        c["prefill_rows"] += rows
        c["prefill_s"] += seconds

    def decode(self, rows: int, finished: int, seconds: float) -> None:
        """One decode step of ``rows`` rows, ``finished`` of them already done (decoded only
        until the batch is compacted)."""
        c = self.counts
        c["decode_steps"] += 1
        c["decode_rows"] += rows
        c["decode_finished_rows"] += finished
        c["decode_s"] += seconds
        entry = self.by_rows.setdefault(row_bucket(rows), [0, 0.0, 0])
        entry[0] += 1
        entry[1] += seconds
        entry[2] += rows

    def add(self, key: str, seconds: float) -> None:
        """Seconds of ``schedule_s`` or ``idle_s``."""
        self.counts[key] += seconds

    def snapshot(self) -> dict[str, Any]:
        """The counters, JSON-ready (``by_rows`` keyed by the bucket as a string)."""
        return {**self.counts,
                "by_rows": {str(b): {"steps": e[0], "s": e[1], "rows": e[2]}
                            for b, e in sorted(self.by_rows.items())}}


class Timer:
    """``with Timer() as t: ...``; then ``t.s`` is the seconds it took."""

    def __enter__(self) -> Self:
        self._start = time.perf_counter()
        self.s = 0.0
        return self

    def __exit__(self, *exc: object) -> None:
        self.s = time.perf_counter() - self._start


def profile_delta(after: Mapping[str, Any], before: Mapping[str, Any] | None) -> dict[str, Any]:
    """What ran between two :meth:`StepProfile.snapshot` s (``before`` None: since the start)."""
    before = before or {}
    out: dict[str, Any] = {k: v - before.get(k, 0) for k, v in after.items() if k != "by_rows"}
    old = before.get("by_rows", {})
    rows = {}
    for bucket, entry in after.get("by_rows", {}).items():
        prev = old.get(bucket, {})
        delta = {k: entry[k] - prev.get(k, 0) for k in ("steps", "s", "rows")}
        if delta["steps"]:
            rows[bucket] = delta
    out["by_rows"] = rows
    return out


def profile_summary(delta: Mapping[str, Any]) -> dict[str, float]:
    """Flat figures of a :func:`profile_delta` (means per step in milliseconds), for metrics."""
    steps = delta.get("decode_steps", 0)
    out = {k: float(v) for k, v in delta.items() if k != "by_rows"}
    out["decode_ms_per_step"] = 1e3 * delta.get("decode_s", 0.0) / steps if steps else 0.0
    out["decode_rows_per_step"] = delta.get("decode_rows", 0) / steps if steps else 0.0
    rows = delta.get("decode_rows", 0)
    out["decode_finished_fraction"] = delta.get("decode_finished_rows", 0) / rows if rows else 0.0
    for bucket, entry in delta.get("by_rows", {}).items():
        out[f"decode_steps@{bucket}"] = float(entry["steps"])
        out[f"decode_s@{bucket}"] = float(entry["s"])
    return out
