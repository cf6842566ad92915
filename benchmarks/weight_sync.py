"""Weight-sync throughput per transport, against this machine's memory-copy bandwidth.

A synthetic bf16 state dict (~500 MB, transformer-shaped) is streamed from this process to
``--engines`` engine processes over each backend. The first update of each backend is checked
tensor by tensor (checksums on both sides) and not timed; the best of ``--repeats`` further
updates is reported as GB/s (model bytes landed in every engine per second) and as a ratio to
the floor measured in the same run: a torch copy of a large buffer (the best any transport that
moves bytes through memory could do per engine).

    python benchmarks/weight_sync.py [--size-mb 500] [--bucket-mb 64] [--engines 2]
                                     [--backends nccl nixl ipc disk] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.multiprocessing as mp

from megarl.weights import (
    StateDictReceiver,
    WeightSender,
    WeightUpdateEndpoint,
    dtype_name,
    parse_dtype,
    specs_of,
)
from megarl.weights.links import PipeLink, serve
from megarl.weights.transports import SENDERS, SenderTransport

BACKENDS = ("nccl", "nixl", "ipc", "disk")


def synthetic_state(size_mb: float, hidden: int = 2048) -> dict[str, torch.Tensor]:
    """Transformer-shaped bf16 tensors adding up to about ``size_mb`` megabytes."""
    g = torch.Generator().manual_seed(0)
    inter = hidden * 11 // 4
    square = (hidden, hidden)
    layer = {"self_attn.q_proj.weight": square, "self_attn.k_proj.weight": square,
             "self_attn.v_proj.weight": square, "self_attn.o_proj.weight": square,
             "mlp.gate_proj.weight": (inter, hidden), "mlp.up_proj.weight": (inter, hidden),
             "mlp.down_proj.weight": (hidden, inter), "input_layernorm.weight": (hidden,)}
    layer_bytes = 2 * sum(torch.Size(shape).numel() for shape in layer.values())
    layers = max(1, round(size_mb * (1 << 20) / layer_bytes))
    return {f"model.layers.{i}.{name}": torch.randn(shape, generator=g).to(torch.bfloat16)
            for i in range(layers) for name, shape in layer.items()}


def copy_bandwidth_gbs(nbytes: int = 512 << 20, repeats: int = 5) -> float:
    """GB/s of ``dst.copy_(src)`` on a large CPU buffer (best of ``repeats``)."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def _engine(conn: Any, specs: list[dict[str, Any]]) -> None:
    torch.set_num_threads(1)
    state = {s["name"]: torch.zeros(s["shape"], dtype=parse_dtype(s["dtype"])) for s in specs}
    serve(conn, WeightUpdateEndpoint(StateDictReceiver(state)).handle)


def _sender(kind: str, disk_dir: str) -> SenderTransport:
    return SENDERS[kind](root=disk_dir) if kind == "disk" else SENDERS[kind]()


def measure(state: dict[str, torch.Tensor], backends: Sequence[str], engines: int,
            bucket_mb: float, repeats: int, disk_dir: str) -> list[dict[str, Any]]:
    """One row per backend: seconds, GB/s per engine, tensors checked."""
    specs = [{"name": s.name, "shape": list(s.shape), "dtype": dtype_name(s.dtype)}
             for s in specs_of(state)]
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(engines)]
    procs = [ctx.Process(target=_engine, args=(child, specs), daemon=True) for _, child in pipes]
    for proc in procs:
        proc.start()
    link = PipeLink([parent for parent, _ in pipes], timeout_s=600)
    rows = []
    try:
        for kind in backends:
            sender = WeightSender(_sender(kind, disk_dir), link, bucket_size_mb=bucket_mb)
            sender.connect()
            try:
                check = sender.update(state, version=f"{kind}-check", verify_checksums=True)
                bad = {i: m for i, m in (check.mismatches or {}).items() if m}
                if bad:
                    raise RuntimeError(f"{kind}: engines differ from the sender: {bad}")
                best = min(sender.update(state, version=f"{kind}-{r}").seconds
                           for r in range(repeats))
            finally:
                sender.close()
            rows.append({"backend": kind, "seconds": best, "gb_per_s": check.bytes / best / 1e9,
                         "tensors_checked": check.num_tensors * engines,
                         "buckets": check.num_buckets,
                         "peak_buffer_mb": check.peak_buffer_bytes / (1 << 20)})
    finally:
        link.post([{"op": "shutdown"}] * engines)()
        for proc in procs:
            proc.join(timeout=30)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=float, default=500.0)
    parser.add_argument("--bucket-mb", type=float, default=64.0)
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--disk-dir", default=None,
                        help="directory for the disk backend (default: a new temporary one)")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    state = synthetic_state(args.size_mb)
    nbytes = sum(t.nbytes for t in state.values())
    floor = copy_bandwidth_gbs()
    with tempfile.TemporaryDirectory(dir=args.disk_dir) as disk_dir:
        rows = measure(state, args.backends, args.engines, args.bucket_mb, args.repeats, disk_dir)
    print(f"state dict: {len(state)} tensors, {nbytes / 1e6:.0f} MB bf16; {args.engines} engines;"
          f" buckets of {args.bucket_mb:g} MB; {torch.get_num_threads()} torch threads")
    print(f"floor: torch copy of a 512 MB buffer = {floor:.2f} GB/s")
    print(f"{'backend':<8} {'seconds':>8} {'GB/s':>7} {'x floor':>8} {'buckets':>8} "
          f"{'peak buf MB':>12} {'checked':>8}")
    for row in rows:
        print(f"{row['backend']:<8} {row['seconds']:>8.3f} {row['gb_per_s']:>7.2f} "
              f"{row['gb_per_s'] / floor:>8.2f} {row['buckets']:>8} "
              f"{row['peak_buffer_mb']:>12.0f} {row['tensors_checked']:>8}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
