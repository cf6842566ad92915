"""``megarl bench``: benchmarks by name, each printing its figures next to a floor or baseline.

- ``weight-sync``: Megatron export -> transport -> embedded engines (:mod:`megarl.weights.benchmark`);
- ``rollout``: embedded engine generation throughput (``benchmarks/rollout_throughput.py``,
  found next to the ``megarl`` package in a source checkout).
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

ROLLOUT_SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "rollout_throughput.py"
NOT_BUILT = {"actor": "the actor (train step) benchmark"}


def _weight_sync(argv: list[str]) -> int:
    from megarl.weights.benchmark import weight_sync_main

    return weight_sync_main(argv)


def _rollout(argv: list[str]) -> int:
    if not ROLLOUT_SCRIPT.is_file():
        print(f"megarl bench rollout: {ROLLOUT_SCRIPT} is not there; the rollout benchmark ships "
              "with the source checkout (run it from a clone of megarl)", file=sys.stderr)
        return 3
    spec = importlib.util.spec_from_file_location("megarl_rollout_throughput", ROLLOUT_SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return int(module.main(argv) or 0)


BENCHMARKS: dict[str, tuple[str, Callable[[list[str]], int]]] = {
    "weight-sync": ("weights from Megatron ranks to embedded engines, per transport", _weight_sync),
    "rollout": ("embedded engine generation throughput vs HF generate", _rollout),
}


def usage() -> str:
    """The list of benchmarks."""
    lines = ["usage: megarl bench BENCHMARK [options]  (BENCHMARK --help for its options)", ""]
    lines += [f"  {name:<12} {help_line}" for name, (help_line, _) in BENCHMARKS.items()]
    lines += [f"  {name:<12} not built yet ({part})" for name, part in NOT_BUILT.items()]
    return "\n".join(lines)


def bench_main(argv: list[str]) -> int:
    """Run the benchmark named by ``argv[0]`` with the rest of ``argv``; its exit code."""
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = argv[0], list(argv[1:])
    if name in NOT_BUILT:
        print(f"megarl bench {name}: {NOT_BUILT[name]} is not built in this version of megarl; "
              f"available: {', '.join(BENCHMARKS)}", file=sys.stderr)
        return 3
    if name not in BENCHMARKS:
        print(f"megarl bench: unknown benchmark {name!r}\n{usage()}", file=sys.stderr)
        return 2
    return BENCHMARKS[name][1](rest)
