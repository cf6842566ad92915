"""``megarl bench``: benchmarks by name, each printing its figures next to a floor or baseline.

- ``weight-sync``: Megatron export -> transport -> embedded engines (:mod:`megarl.bench_weights`);
- ``rollout``, ``actor``, ``scheduler``: the scripts ``benchmarks/<name>_throughput.py`` (found
  next to the ``megarl`` package in a source checkout): embedded engine vs HF ``generate``,
  native-spec Megatron actor vs HF transformers (forward+backward), and the three schedulers on
  long-tailed response lengths;
- ``step``: ``benchmarks/e2e_step.py``, a whole colocated GRPO step phase by phase against the
  floors measured in the same run, and the same step in TRL's ``GRPOTrainer``.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "benchmarks"
NOT_BUILT: dict[str, str] = {}


def _weight_sync(argv: list[str]) -> int:
    from megarl.bench_weights import weight_sync_main

    return weight_sync_main(argv)


def _script(name: str, file: str | None = None) -> Callable[[list[str]], int]:
    """Run ``benchmarks/<file>.py``'s ``main`` (``<name>_throughput.py`` by default)."""
    def run(argv: list[str]) -> int:
        script = SCRIPTS / f"{file or name + '_throughput'}.py"
        if not script.is_file():
            print(f"megarl bench {name}: {script} is not there; the {name} benchmark ships with "
                  "the source checkout (run it from a clone of megarl)", file=sys.stderr)
            return 3
        spec = importlib.util.spec_from_file_location(f"megarl_bench_{script.stem}", script)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return int(module.main(argv) or 0)

    return run


BENCHMARKS: dict[str, tuple[str, Callable[[list[str]], int]]] = {
    "weight-sync": ("weights from Megatron ranks to embedded engines, per transport", _weight_sync),
    "rollout": ("embedded engine generation throughput vs HF generate", _script("rollout")),
    "actor": ("Megatron actor (native spec) fwd+bwd vs HF transformers, MFU", _script("actor")),
    "scheduler": ("colocate_sync vs one_step_off vs fully_async on long-tailed lengths",
                  _script("scheduler")),
    "step": ("a whole colocated GRPO step per phase against its floors, and TRL's step",
             _script("step", "e2e_step")),
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
