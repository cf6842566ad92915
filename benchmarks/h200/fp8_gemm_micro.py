"""Microseconds per projection of the e2e shapes at decode batch sizes: bf16 ``F.linear`` against
the engine's FP8 linear (:func:`megarl.rollout.local.fp8_layers.fp8_linear`: activation
quantization + block-scaled GEMM) and the activation quantization alone, each replayed in a CUDA
graph (as the engine's decode runs them). Tells a slow block-scaled GEMM from graphs that did
not capture when FP8 decode lags bf16 (issue 31). Each projection is also timed through the
one-launch Triton w8a8 linear (:func:`megarl.rollout.local.fp8_quant_triton.fp8_linear_triton`,
not used by the engine yet) under each of ``LINEAR_LAUNCHES``. ``--moe`` also times one expert layer of the
e2e MoE slice (128 experts, hidden 2048, width 768, top-8): the FP8 grouped GEMMs
(:mod:`megarl.rollout.local.fp8_moe_triton`) under each launch setting of ``MOE_LAUNCHES``
against the bf16 paths of the same layer: the all-experts GEMMs the native decoder runs at few
rows and transformers' ``grouped_mm`` experts (what it ran above ``ALL_EXPERTS_ROWS`` until
:func:`megarl.rollout.local.decode_ops.grouped_experts`). ``--moe-only`` skips the projections.
Writes JSON to ``--out``. (A bf16 Triton grouped GEMM on the FP8 kernel's plan measured 504-695
us a layer on an H100 against 483-684 for the faster of these two, and was dropped:
benchmarks/RESULTS.md.)

    python benchmarks/h200/fp8_gemm_micro.py --moe --out /tmp/fp8_gemm_micro.json
    python benchmarks/h200/fp8_gemm_micro.py --moe-only --rows 64 128 256 512 --out ...
"""

from __future__ import annotations

import argparse
import json
from functools import partial
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from megarl.rollout.local import fp8_moe_triton, fp8_quant_triton
from megarl.rollout.local.fp8_layers import Fp8Experts, fp8_linear, gemm_backend
from megarl.weights.fp8 import quantize_activations, quantize_blockwise

# (name, N, K): Qwen3-1.7B's projections (e2e dense) and the e2e MoE slice's attention
SHAPES = [("dense.qkv_q", 2048, 2048), ("dense.k", 1024, 2048), ("dense.o", 2048, 2048),
          ("dense.gate", 6144, 2048), ("dense.down", 2048, 6144),
          ("moe.q", 4096, 2048), ("moe.o", 2048, 4096)]
LINEAR_LAUNCHES = [{"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": 4, "num_stages": st}
                   for bm in (16, 64) for bn in (64, 128) for st in (3, 4)]
MOE = {"experts": 128, "hidden": 2048, "width": 768, "top_k": 8}
MOE_LAUNCHES = [{"BLOCK_N": n, "num_warps": w, "num_stages": st}
                for n in (64, 128) for w in (4, 8) for st in (2, 3, 4)]


def _mean_us(run, repeats: int) -> float:
    """Mean microseconds of ``run()`` over ``repeats`` calls, by CUDA events."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / repeats


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
    return _mean_us(graph.replay, repeats)


def eager_us(fn, repeats: int = 50) -> float:
    for _ in range(3):
        fn()
    return _mean_us(fn, repeats)


def sweep(settings: dict, launches: list[dict], fn) -> tuple[list[dict], dict | None]:
    """``fn`` replayed in a CUDA graph under each launch setting written into ``settings`` (a
    kernel module's launch dict, restored after): (a row per setting, the fastest one)."""
    default = dict(settings)
    out = []
    for launch in launches:
        settings.update(launch)
        try:
            us = graph_us(fn)
        except Exception as err:  # noqa: BLE001 - a setting that does not compile
            us = f"failed: {str(err).splitlines()[0][:120]}"
        out.append({**launch, "graph_us": us})
    settings.update(default)
    timed = [r for r in out if isinstance(r["graph_us"], float)]
    return out, min(timed, key=lambda r: r["graph_us"], default=None)


def _hf_grouped_mm_experts(gate_up: torch.Tensor, down: torch.Tensor, top_k: int):
    """transformers' Qwen3-MoE expert block holding these weights, on its ``grouped_mm``
    implementation (the engine's path above ``ALL_EXPERTS_ROWS`` rows)."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    e, two_i, h = gate_up.shape
    config = Qwen3MoeConfig(hidden_size=h, moe_intermediate_size=two_i // 2, num_experts=e,
                            num_experts_per_tok=top_k)
    config._experts_implementation = "grouped_mm"
    experts = Qwen3MoeExperts(config).to(device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        experts.gate_up_proj.copy_(gate_up)
        experts.down_proj.copy_(down)
    return lambda x, index, weights: experts(x, index, weights)


def moe_rows(rows: list[int]) -> list[dict]:
    """One e2e MoE expert layer: bf16 all-experts GEMMs against the FP8 grouped GEMMs under
    each launch setting, replayed in CUDA graphs (us a layer)."""
    e, h, i, top_k = MOE["experts"], MOE["hidden"], MOE["width"], MOE["top_k"]
    g = torch.Generator(device="cuda").manual_seed(0)
    block = SimpleNamespace(
        num_experts=e, hidden_dim=h, intermediate_dim=i, act_fn=F.silu,
        gate_up_proj=torch.randn(e, 2 * i, h, device="cuda", generator=g) * 0.02,
        down_proj=torch.randn(e, h, i, device="cuda", generator=g) * 0.02)
    fp8 = Fp8Experts(block)
    up_bf16 = block.gate_up_proj.to(torch.bfloat16)
    down_bf16 = block.down_proj.to(torch.bfloat16)
    hf_experts = _hf_grouped_mm_experts(up_bf16, down_bf16, top_k)
    default = dict(fp8_moe_triton.LAUNCH)
    out = []
    for m in rows:
        x = torch.randn(m, h, device="cuda", dtype=torch.bfloat16)
        index = torch.stack([torch.randperm(e, device="cuda")[:top_k] for _ in range(m)])
        weights = torch.softmax(torch.randn(m, top_k, device="cuda"), -1).to(torch.bfloat16)

        def bf16_all_experts(x: torch.Tensor = x, m: int = m) -> torch.Tensor:
            gate_up = F.linear(x, up_bf16.view(-1, h)).view(m * e, 2 * i)
            gate, up = gate_up.chunk(2, dim=-1)
            act = (F.silu(gate) * up).view(m, e, i).transpose(0, 1)
            return torch.bmm(act, down_bf16.transpose(1, 2))

        row = {"shape": "moe.experts", "m": m, "bf16_all_experts_graph_us":
               graph_us(bf16_all_experts)}
        try:
            row["bf16_grouped_mm_graph_us"] = graph_us(partial(hf_experts, x, index, weights))
        except Exception as err:  # noqa: BLE001 - transformers' path did not capture
            row["bf16_grouped_mm_graph_us"] = f"failed: {str(err).splitlines()[0][:160]}"
        row["fp8_grouped"], row["fp8_best"] = sweep(
            fp8_moe_triton.LAUNCH, MOE_LAUNCHES, partial(fp8.fused, x, index, weights))
        row["fp8_default_graph_us"] = next(
            (r["graph_us"] for r in row["fp8_grouped"]
             if all(r[k] == v for k, v in default.items())), None)
        print(json.dumps({k: v for k, v in row.items()
                          if k != "fp8_grouped"}), flush=True)
        out.append(row)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 512])
    parser.add_argument("--moe", action="store_true", help="also the FP8 grouped expert GEMMs")
    parser.add_argument("--moe-only", action="store_true", help="only the expert layer")
    args = parser.parse_args()
    rows_out = []
    for name, n, k in [] if args.moe_only else SHAPES:
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
            row["fp8_triton"], row["fp8_triton_best"] = sweep(
                fp8_quant_triton.LINEAR_LAUNCH, LINEAR_LAUNCHES,
                partial(fp8_quant_triton.fp8_linear_triton, x, qweight, scale))
            print(json.dumps({k: v for k, v in row.items() if k != "fp8_triton"}), flush=True)
            rows_out.append(row)
    result = {"gemm_backend": gemm_backend("cuda"), "torch": torch.__version__,
              "device": torch.cuda.get_device_name(), "rows": rows_out,
              "moe": moe_rows(args.rows) if args.moe or args.moe_only else None}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print("gemm backend:", result["gemm_backend"])


if __name__ == "__main__":
    main()
