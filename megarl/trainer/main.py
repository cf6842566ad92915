"""The RL trainer: ``megarl train --config CONFIG [a.b.c=value ...]``.

Loads and validates the config, prints the per-GPU memory estimate, runs the device preflight,
then sets up a :class:`~megarl.trainer.step.Trainer` and runs it."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from megarl.config import RunConfig, load_config, validate_config
from megarl.config.loader import ConfigError
from megarl.memory import PhaseOutOfMemory
from megarl.metrics.health import NonFiniteUpdates
from megarl.trainer.step import Trainer


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="megarl train", description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="YAML run config")
    parser.add_argument("overrides", nargs="*", metavar="a.b.c=value")
    return parser.parse_intermixed_args(argv)


def load_run_config(path: str, overrides: list[str],
                    echo: Callable[[str], None] = print) -> tuple[RunConfig, dict] | None:
    """Load and validate; print every problem and return None when the config is invalid."""
    try:
        cfg, sources = load_config(path, overrides)
    except ConfigError as err:
        for line in err.lines:
            echo(f"error: {line}")
        return None
    problems = validate_config(cfg, sources=sources)
    for problem in problems:
        echo(problem.line() if problem.severity == "error" else f"warning: {problem.line()}")
    if any(p.severity == "error" for p in problems):
        return None
    return cfg, sources


def startup_text(cfg: RunConfig) -> list[str]:
    """The lines ``megarl train`` prints before it starts: the per-GPU memory estimate and the
    host memory per node (T1)."""
    from megarl.config.estimates_report import startup_estimates
    from megarl.config.host_estimates import host_rows
    from megarl.config.validate import build_context

    ctx = build_context(cfg)
    host = host_rows(cfg, ctx.model, ctx.sizes)
    return [f"megarl: {line}" for line in startup_estimates(cfg, ctx.model, ctx.sizes, host)]


def preflight_refuses(cfg: RunConfig, first: bool) -> bool:
    """The device preflight (``trainer.preflight``, :mod:`megarl.memory_preflight`): print its
    lines (the refusal on every process, the rest on the ``first`` only); whether it refuses."""
    from megarl.config.validate import build_context
    from megarl.memory_preflight import device_preflight

    lines, refused = device_preflight(cfg, build_context(cfg).model)
    if refused:
        print("\n".join(lines), file=sys.stderr, flush=True)
    elif lines and first:
        print("\n".join(f"megarl: {line}" for line in lines), flush=True)
    return refused


def train_main(argv: list[str]) -> int:
    """``megarl train --config CONFIG [overrides]``; exit 2 on an invalid config or one whose
    phases do not fit the GPUs' free memory (the preflight)."""
    args = _parse(argv)
    loaded = load_run_config(args.config, args.overrides,
                             echo=lambda line: print(line, file=sys.stderr))
    if loaded is None:
        return 2
    cfg, sources = loaded
    first = os.environ.get("RANK", "0") == "0"  # prints once, not by every torchrun rank
    if first:
        print("\n".join(startup_text(cfg)), flush=True)
    if preflight_refuses(cfg, first):  # before any worker starts
        return 2
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from megarl.cluster import init_naive, torchrun_world_size

    launched = torchrun_world_size()
    if cfg.trainer.worker_group == "ray" and launched > 1:
        print(f"error: trainer.worker_group: ray, but this driver is one of {launched} processes "
              "started by torchrun, and each would start a Ray job of its own — run `megarl "
              "train` without torchrun for Ray mode, or set trainer.worker_group=naive",
              file=sys.stderr)
        return 2
    if cfg.trainer.worker_group == "naive":
        init_naive(timeout_s=cfg.trainer.phase_timeout_s)
    from megarl.cluster.errors import WorkerDiedError, WorkerTimeoutError
    from megarl.cluster.preflight import NodeMemoryError, NodePathError
    from megarl.data.dataset import DatasetError

    trainer = Trainer(cfg, sources)
    try:
        trainer.setup()
        trainer.fit()
    except (DatasetError, NodePathError, NodeMemoryError) as err:  # before any worker started
        print(f"error: {err}", file=sys.stderr)
        return 2
    # the knobs (T1, T5), or the ranks, phase and logs (T2, T6): the driver's stack adds nothing
    except (PhaseOutOfMemory, NonFiniteUpdates, WorkerTimeoutError, WorkerDiedError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    finally:
        trainer.close()
    return 0
