"""``megarl-convert`` (also ``megarl convert``): HF <-> Megatron conversion and its parity check.

    megarl-convert hf-to-mcore --hf PATH --out DIR [--tp N --pp N --ep N --etp N] [--dtype D]
    megarl-convert mcore-to-hf --mcore DIR --out DIR [--hf-config PATH] [--dtype D]
    megarl-convert verify --hf PATH [--mcore DIR] [--tp N --pp N --ep N --etp N] [--dtype D]

Exit codes: 0 success, 1 ``verify`` found differences above the tolerance, 2 a problem with the
input (printed as one line: what is wrong, where, and what to do), 3 a rank crashed (traceback).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence

from bridge.checks import DTYPE_CHOICES, SUPPORTED_FAMILIES, ConversionError, Layout

EXIT_OK, EXIT_MISMATCH, EXIT_INPUT, EXIT_CRASH = 0, 1, 2, 3
SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
              "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str) -> int:
    """``5GB``, ``500MB``, ``2GiB`` or a number of bytes -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).upper() not in SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a size like 5GB, 500MB or 2GiB")
    return int(float(match.group(1)) * SIZE_UNITS[match.group(2).upper()])


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: must be >= 1")
    return value


def _add_layout(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tp", type=_positive, default=1, help="tensor-parallel size")
    parser.add_argument("--pp", type=_positive, default=1, help="pipeline-parallel size")
    parser.add_argument("--ep", type=_positive, default=1, help="expert-parallel size")
    parser.add_argument("--etp", type=_positive, default=None,
                        help="expert tensor-parallel size (default: equal to --tp)")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``megarl-convert``."""
    parser = argparse.ArgumentParser(
        prog="megarl-convert",
        description="HF <-> Megatron checkpoint conversion. Families: "
        + ", ".join(sorted(SUPPORTED_FAMILIES)) + ".")
    sub = parser.add_subparsers(dest="command", required=True)
    to_mcore = sub.add_parser("hf-to-mcore", help="HF safetensors -> megatron dist checkpoint")
    to_mcore.add_argument("--hf", required=True, help="HF model directory")
    to_mcore.add_argument("--out", required=True, help="new checkpoint directory")
    _add_layout(to_mcore)
    to_mcore.add_argument("--dtype", choices=sorted(DTYPE_CHOICES),
                          help="parameter dtype (default: the weights' own)")
    to_hf = sub.add_parser("mcore-to-hf", help="megatron dist checkpoint -> HF safetensors")
    to_hf.add_argument("--mcore", required=True,
                       help="dist checkpoint directory (or a directory holding one)")
    to_hf.add_argument("--out", required=True, help="new HF model directory")
    to_hf.add_argument("--hf-config", help="HF config.json or model directory (default: the "
                       "one stored with the checkpoint)")
    to_hf.add_argument("--dtype", choices=sorted(DTYPE_CHOICES),
                       help="output dtype (default: the checkpoint's)")
    to_hf.add_argument("--max-shard-size", type=parse_size, default="5GB",
                       help="largest output file, e.g. 5GB (default) or 500MB")
    peft = sub.add_parser("lora-to-peft", help="a LoRA run checkpoint's adapters -> PEFT adapter")
    peft.add_argument("--mcore", required=True,
                      help="run checkpoint (a step directory, or a root: its latest)")
    peft.add_argument("--hf", required=True, help="HF model directory the run trained on")
    peft.add_argument("--out", required=True, help="new PEFT adapter directory")
    check = sub.add_parser("verify", help="Megatron vs HF transformers log-probs on fixed prompts")
    check.add_argument("--hf", required=True, help="HF model directory (the reference)")
    check.add_argument("--mcore", help="dist checkpoint to load instead of the HF weights")
    _add_layout(check)
    check.add_argument("--cp", type=_positive, default=1,
                       help="context-parallel size: every sequence split over cp ranks")
    check.add_argument("--dtype", choices=sorted(DTYPE_CHOICES), default="fp32",
                       help="dtype of both models (default fp32)")
    check.add_argument("--tolerance", type=float,
                       help="largest allowed |log-prob difference| (default 1e-3 fp32, 0.1 bf16)")
    return parser


def _layout(args: argparse.Namespace) -> Layout:
    return Layout(tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp, cp=getattr(args, "cp", 1))


def _gb(nbytes: int) -> str:
    return f"{nbytes / 1e9:.3f} GB"


def _run(args: argparse.Namespace) -> int:
    """Dispatch one subcommand; returns the exit code."""
    import torch

    dtype = DTYPE_CHOICES.get(args.dtype) if getattr(args, "dtype", None) else None
    if args.command == "hf-to-mcore":
        from bridge.hf_to_mcore import hf_to_mcore

        s = hf_to_mcore(args.hf, args.out, _layout(args), dtype)
        phases = ", ".join(f"{k} {v:.1f} s" for k, v in s["rank0_phases"].items())
        print(f"wrote {s['out']}: {s['tensors']} tensors, {_gb(s['bytes'])} ({s['dtype']}) in "
              f"{s['seconds']:.1f} s ({s['bytes'] / 1e9 / s['seconds']:.3f} GB/s; rank 0: "
              f"{phases})")
        if s["skipped_mtp_tensors"]:
            print(f"skipped {s['skipped_mtp_tensors']} tensors of multi-token-prediction layers "
                  "(HF transformers does not load them either)")
        return EXIT_OK
    if args.command == "mcore-to-hf":
        from bridge.mcore_to_hf import mcore_to_hf

        s = mcore_to_hf(args.mcore, args.out, args.hf_config,
                        getattr(torch, dtype) if dtype else None, args.max_shard_size)
        print(f"wrote {s['out']}: {s['tensors']} tensors in {s['files']} files, "
              f"{_gb(s['bytes'])} in {s['seconds']:.1f} s "
              f"({s['bytes'] / 1e9 / s['seconds']:.3f} GB/s) from {s['checkpoint']}")
        return EXIT_OK
    if args.command == "lora-to-peft":
        from bridge.lora_to_peft import lora_to_peft

        s = lora_to_peft(args.mcore, args.out, args.hf)
        print(f"wrote {s['out']}: rank-{s['rank']} LoRA adapters of {s['checkpoint']} "
              "(load with peft.PeftModel.from_pretrained)")
        return EXIT_OK
    from bridge.verify import verify

    result = verify(args.hf, args.mcore, _layout(args), dtype, args.tolerance)
    source = args.mcore or args.hf
    print(f"verify {source} ({_layout(args).describe()}, {dtype}): {result.tokens} tokens, "
          f"max |diff| {result.max_abs_diff:.3e}, mean |diff| {result.mean_abs_diff:.3e}, "
          f"tolerance {result.tolerance:.1e}: {'PASS' if result.passed else 'FAIL'}")
    return EXIT_OK if result.passed else EXIT_MISMATCH


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``megarl-convert``; returns the process exit code."""
    args = build_parser().parse_args(argv)
    from bridge.launch import RankFailure, quiet_library_warnings

    quiet_library_warnings()
    try:
        return _run(args)
    except ConversionError as err:
        print(f"megarl-convert {args.command}: error: {err}", file=sys.stderr)
        return EXIT_INPUT
    except RankFailure as err:
        print(f"megarl-convert {args.command}: a rank failed\n{err}", file=sys.stderr)
        return EXIT_CRASH


if __name__ == "__main__":
    sys.exit(main())
