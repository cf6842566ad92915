"""An offloaded optimizer step, the whole state brought back against the moments streamed, same run.

A module of fp32 parameters of the e2e MoE slice's sizes (``--gb`` of Adam moments: 8 bytes a
parameter; the slice has 5.6B parameters, 44.8 GB of moments) takes fused torch Adam steps whose
moments live in host memory between steps (``actor.offload.optimizer_offload``, as the worker
does: offload after the step, reload for the next). ``whole``: the moments come back at once,
then the step, then they leave (``optimizer_step_chunk_mb=0``); ``streamed``: the step streams
them ``--chunk-mb`` at a time (in on one CUDA stream, out on another, while a chunk is updated).
Reported per mode (median of ``--repeats`` after one warm-up): seconds from the reload to the
end of the offload, the host<->device GB/s over the moments' bytes moved both ways, the peak
device memory above the parameters and gradients, and streamed / whole. The parameters after
the last step are compared between the two modes (same gradients: equal bit for bit).

    python benchmarks/optimizer_step.py --gb 8 --out /tmp/optimizer_step.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megarl.megatron.offload import StateOffloader
from megarl.megatron.optimizer import fuse_torch_adam

# the slice's parameter sizes: an expert's projection (2048 x 768) dominates the count
ROWS, COLS = 2048, 768


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_mode(args: argparse.Namespace, chunk_bytes: int) -> dict:
    """``--repeats`` offloaded steps (after a warm-up that makes the moments); their times."""
    torch.manual_seed(0)
    count = max(1, int(args.gb * 2**30 / 8 / (ROWS * COLS)))
    module = torch.nn.ParameterList(
        [torch.nn.Parameter(torch.randn(ROWS, COLS, device=args.device) * 0.02)
         for _ in range(count)])
    for p in module:
        p.grad = torch.randn_like(p) * 1e-3
    adam = torch.optim.AdamW(module.parameters(), lr=1e-4)
    if args.device == "cuda":
        fuse_torch_adam(adam)
    offloader = StateOffloader([module], adam, stream_bytes=chunk_bytes)
    base = torch.cuda.memory_allocated() if args.device == "cuda" else 0
    times, peaks = [], []
    for repeat in range(args.repeats + 1):
        _sync(args.device)
        if args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        offloader.reload_for_step(["optimizer"])
        adam.step()
        offloader.offload(["optimizer"])
        _sync(args.device)
        if repeat:  # the warm-up makes the moments and allocates the host slabs
            times.append(time.perf_counter() - start)
            peaks.append(torch.cuda.max_memory_allocated() - base if args.device == "cuda" else 0)
        print(f"  {'streamed' if chunk_bytes else 'whole'} step {repeat}: "
              f"{time.perf_counter() - start:.3f} s", flush=True)
    moment_bytes = 2 * sum(p.numel() * 4 for p in module)
    median = statistics.median(times)
    offloader.reload(["optimizer"])
    return {"seconds": median, "times": times, "moment_gb": moment_bytes / 1e9,
            "gb_per_s_both_ways": 2 * moment_bytes / median / 1e9,
            "peak_above_params_gb": max(peaks) / 1e9, "chunks": offloader.stream_chunks,
            "params": [p.detach().clone() for p in module[:4]]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--gb", type=float, default=8.0, help="GB (2^30) of Adam moments")
    p.add_argument("--chunk-mb", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    whole = run_mode(args, 0)
    streamed = run_mode(args, args.chunk_mb << 20)
    same = all(torch.equal(a, b) for a, b in zip(whole.pop("params"), streamed.pop("params")))
    out = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
           "settings": {k: str(v) for k, v in vars(args).items()}, "whole": whole,
           "streamed": streamed, "streamed_over_whole_s": streamed["seconds"] / whole["seconds"],
           "same_parameters": same}
    print(json.dumps({k: v for k, v in out.items() if k != "settings"}, indent=1))
    if args.out:
        args.out.write_text(json.dumps(out, indent=2))
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
