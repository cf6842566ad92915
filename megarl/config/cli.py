"""``megarl config show|validate CONFIG [a.b.c=value ...]`` (called by megarl/cli.py).

``show`` prints the resolved config with the source of every non-default value, the derived
sizes, the parameter and memory estimates and the problems found; it exits 0 whenever the config
loads. ``validate`` exits 0 and prints ``OK`` (and any warnings) when the run may start, or exits
2 with one line per problem. ``--allow-missing-files`` turns a missing model directory, data file
or checkpoint (a model card without weights) into a warning, for configs whose files a later step
creates (the demo builds its model and data first) or that are checked before the download.
"""

from __future__ import annotations

import argparse
import sys

from megarl.config.estimates_report import format_estimates
from megarl.config.host_estimates import host_rows
from megarl.config.loader import ConfigError, load_config
from megarl.config.render import render_report
from megarl.config.validate import build_context, run_rules, validate_config

EXIT_OK = 0
EXIT_INVALID = 2


def _parser(action: str, what: str) -> argparse.ArgumentParser:
    """Arguments shared by show and validate."""
    parser = argparse.ArgumentParser(prog=f"megarl config {action}", description=what)
    parser.add_argument("config", help="YAML run config")
    parser.add_argument("overrides", nargs="*", metavar="a.b.c=value",
                        help="overrides; they win over the file, which wins over the defaults")
    parser.add_argument("--allow-missing-files", action="store_true",
                        help="report a missing model directory, data file or checkpoint (a "
                        "model card) as a warning")
    return parser


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace | int:
    """Parse ``argv``; an int is the exit code argparse chose (help or usage error)."""
    try:
        return parser.parse_intermixed_args(argv)
    except SystemExit as stop:
        return int(stop.code or 0)


def show_main(argv: list[str]) -> int:
    """``megarl config show``: resolved config with sources, derived sizes, problems."""
    args = _parse(_parser("show", "Print the resolved config, its derived sizes and problems."),
                  argv)
    if isinstance(args, int):
        return args
    try:
        cfg, sources = load_config(args.config, args.overrides)
    except ConfigError as err:
        print("\n".join(err.lines))
        return EXIT_INVALID
    ctx = build_context(cfg, sources=sources, allow_missing_files=args.allow_missing_files)
    overrides = f" + {len(args.overrides)} override(s)" if args.overrides else ""
    title = f"megarl config show: {args.config}{overrides}"
    estimates = format_estimates(ctx.cfg, ctx.model, ctx.sizes,
                                 host_rows(ctx.cfg, ctx.model, ctx.sizes))
    sys.stdout.write(render_report(cfg, sources, ctx.sizes, run_rules(ctx), title, estimates))
    return EXIT_OK


def validate_main(argv: list[str]) -> int:
    """``megarl config validate``: exit 0 with OK (and warnings), or 2 with one line per problem."""
    args = _parse(_parser("validate", "Check a config; exit 0 when valid, 2 otherwise."), argv)
    if isinstance(args, int):
        return args
    try:
        cfg, sources = load_config(args.config, args.overrides)
    except ConfigError as err:
        print("\n".join(err.lines))
        return EXIT_INVALID
    problems = validate_config(cfg, sources=sources, allow_missing_files=args.allow_missing_files)
    errors = [p for p in problems if p.is_error]
    for p in errors:
        print(p.line())
    if not errors:
        print("OK")
    for p in problems:
        if not p.is_error:
            print(f"warning: {p.line()}")
    return EXIT_INVALID if errors else EXIT_OK
