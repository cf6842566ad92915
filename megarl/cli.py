"""The ``megarl`` command: ``train | config | convert | doctor | serve | bench | demo``.

Each subcommand hands its arguments to the module that owns it; the import happens only when
the subcommand runs, so ``megarl --help`` is fast and a part that is not built yet says so
instead of crashing.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence

# subcommand -> (help line, "module:function" taking argv and returning an exit code)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "train": ("run an RL job from a config file", "megarl.trainer.main:train_main"),
    "config": ("show or validate a config: `config show|validate CONFIG [a.b=v ...]`",
               "megarl.cli:config_main"),
    "convert": ("HF <-> Megatron checkpoint conversion (same as megarl-convert)",
                "bridge.cli:main"),
    "doctor": ("check the environment (versions, devices, distributed init, Ray)",
               "megarl.doctor:doctor_main"),
    "serve": ("serve a model with the embedded rollout engine over SGLang's HTTP API",
              "megarl.rollout.local.server:serve_main"),
    "bench": ("benchmarks: `bench weight-sync|actor|rollout ...`", "megarl.bench:bench_main"),
    "demo": ("the README's demo: build a tiny MoE model and data, then run the demo job",
             "megarl.demo:demo_main"),
}

# The part of megarl that provides a subcommand, for the message when it is missing.
MISSING_PART = {
    "train": "the RL trainer (megarl/trainer/)",
    "convert": "the conversion CLI (bridge/)",
    "doctor": "the environment doctor (megarl/doctor.py)",
    "serve": "the embedded rollout engine (megarl/rollout/local/)",
    "bench": "the benchmark entry points (megarl/bench.py)",
}


class MissingPart(RuntimeError):
    """A subcommand whose implementation is not part of this build yet."""


def resolve(command: str) -> Callable[[list[str]], int]:
    """Import and return the function that implements ``command``."""
    module_name, func_name = SUBCOMMANDS[command][1].split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        # Only a missing megarl module means "not built yet"; a missing dependency is re-raised.
        if err.name and (err.name == module_name or module_name.startswith(err.name + ".")):
            part = MISSING_PART.get(command, module_name)
            raise MissingPart(f"`megarl {command}` is not available yet: {part} is not built "
                              f"in this version of megarl") from err
        raise
    func = getattr(module, func_name, None)
    if func is None:
        part = MISSING_PART.get(command, module_name)
        raise MissingPart(f"`megarl {command}` is not available yet: {part} has no {func_name}")
    return func


def config_main(argv: list[str]) -> int:
    """``megarl config show|validate CONFIG [overrides]``."""
    from megarl.config import cli as config_cli

    actions = {"show": config_cli.show_main, "validate": config_cli.validate_main}
    if not argv or argv[0] not in actions:
        print("usage: megarl config {show,validate} CONFIG [a.b.c=value ...]", file=sys.stderr)
        return 2
    return actions[argv[0]](argv[1:])


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser; subcommand arguments are parsed by the subcommand itself."""
    parser = argparse.ArgumentParser(
        prog="megarl",
        description="Megatron-centric RL post-training for Mixture-of-Experts language models.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (help_line, _) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_line, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``megarl`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    command, rest = argv[0], argv[1:]
    if command not in SUBCOMMANDS:
        parser.print_usage(sys.stderr)
        print(f"megarl: unknown command {command!r}; choose one of {', '.join(SUBCOMMANDS)}",
              file=sys.stderr)
        return 2
    try:
        func = resolve(command)
    except MissingPart as err:
        print(f"megarl: {err}", file=sys.stderr)
        return 3
    return int(func(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
