"""Microseconds per projection of the e2e shapes at decode batch sizes: bf16 ``F.linear`` against
the engine's FP8 linear (:func:`megarl.rollout.local.fp8_layers.fp8_linear`: activation
quantization + block-scaled GEMM) and the activation quantization alone, each replayed in a CUDA
graph (as the engine's decode runs them). Tells a slow block-scaled GEMM from graphs that did
not capture when FP8 decode lags bf16 (issue 31). Writes JSON to ``--out``.

    python benchmarks/h200/fp8_gemm_micro.py --out /tmp/fp8_gemm_micro.json
"""

from __future__ import annotations

import argparse
import json
from functools import partial

import torch
import torch.nn.functional as F

from megarl.rollout.local.fp8_layers import fp8_linear, gemm_backend
from megarl.weights.fp8 import quantize_activations, quantize_blockwise

# (name, N, K): Qwen3-1.7B's projections (e2e dense) and the e2e MoE slice's attention
SHAPES = [("dense.qkv_q", 2048, 2048), ("dense.k", 1024, 2048), ("dense.o", 2048, 2048),
          ("dense.gate", 6144, 2048), ("dense.down", 2048, 6144),
          ("moe.q", 4096, 2048), ("moe.o", 2048, 4096)]


def graph_us(fn, repeats: int = 200) -> float:
    """Mean microseconds of one replay of ``fn`` captured in a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / repeats


def eager_us(fn, repeats: int = 50) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 512])
    args = parser.parse_args()
    rows_out = []
    for name, n, k in SHAPES:
        weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        qweight, scale = quantize_blockwise(weight)
        for m in args.rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            row = {"shape": name, "n": n, "k": k, "m": m}
            for label, fn in (("bf16", partial(F.linear, x, weight)),
                              ("fp8", partial(fp8_linear, x, qweight, scale)),
                              ("quantize_acts", partial(quantize_activations, x))):
                row[f"{label}_graph_us"] = graph_us(fn)
                row[f"{label}_eager_us"] = eager_us(fn)
            row["fp8_vs_bf16_graph"] = row["bf16_graph_us"] / row["fp8_graph_us"]
            print(json.dumps(row), flush=True)
            rows_out.append(row)
    result = {"gemm_backend": gemm_backend("cuda"), "torch": torch.__version__,
              "device": torch.cuda.get_device_name(), "rows": rows_out}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print("gemm backend:", result["gemm_backend"])


if __name__ == "__main__":
    main()
