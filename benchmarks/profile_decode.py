"""Where the embedded engine's decode step spends its time on a GPU.

For one model shape of ``rollout_throughput.SHAPES`` and a full batch of rows (prefilled with
random prompts), times with CUDA events: the captured decode graph's replay, the sampler on its
logits (with the host copy of the picks), and a whole engine step as the scheduler runs it
(decode + sampling + the host's bookkeeping); then profiles one eager decode step and one
sampling call kernel by kernel (torch.profiler) and writes the kernel tables.

    python benchmarks/profile_decode.py --shape moe --out DIR
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from rollout_throughput import build_model, make_prompts

from megarl.rollout.local.model_runner import ModelRunner
from megarl.rollout.local.sampling import BatchSampling, RowSampling, sample_next


def cuda_ms(fn, repeats: int = 30, warmup: int = 3) -> float:
    """Median milliseconds of ``fn`` between CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def kernel_table(fn, path: Path, steps: int = 3) -> dict[str, float]:
    """Profile ``steps`` calls of ``fn``; write the kernel table; kernels and device ms per call."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    averages = prof.key_averages()
    path.write_text(averages.table(sort_by="self_cuda_time_total", row_limit=60))
    return {"kernels_per_call": len(kernels) / steps,
            "device_ms_per_call": sum(e.device_time for e in kernels) / steps / 1e3}


def main(argv: list[str] | None = None) -> int:
    """Run the measurements for one shape; print and save a JSON summary."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="moe")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--prefill-tokens", type=int, default=65536,
                   help="prompt tokens per prefill call (the rows are prefilled in chunks)")
    p.add_argument("--quantization", choices=["fp8"], default=None)
    p.add_argument("--baseline", action="store_true", help=(
        "without decode_ops' grouped experts (transformers' experts above ALL_EXPERTS_ROWS)"))
    p.add_argument("--flash-attention", action="store_true", help=(
        "decode attention by FlashAttention's varlen kernel, not the split-K Triton kernel"))
    p.add_argument("--out", default=".")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = f"{args.shape}_{args.rows}_{args.quantization or 'bf16'}"
    if args.baseline:
        from megarl.rollout.local import decode_ops

        decode_ops.ENABLED = False
        tag += "_baseline"
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(Path(tmp), args.shape, "cuda")
        runner = ModelRunner(model_dir, device="cuda", dtype="bfloat16",
                             quantization=args.quantization)
    native = runner.native
    assert native is not None, "the native decode path is not in use"
    if args.flash_attention:
        native.split_attention = False
        tag += "_flash"
    prompts = make_prompts(args.rows, args.prompt_len, args.prompt_len, runner.vocab_size)
    chunk = max(1, args.prefill_tokens // args.prompt_len)  # rows per prefill call
    prefill_ms = cuda_ms(lambda: runner.prefill(prompts[:chunk], False), repeats=3, warmup=1)
    for first in range(0, args.rows, chunk):
        _, kv = runner.prefill(prompts[first:first + chunk], False)
        runner.append_rows(kv, list(range(len(prompts[first:first + chunk]))))
        del kv
    gen = torch.Generator().manual_seed(0)
    batch = BatchSampling.build([RowSampling(1.0, 1.0, 0, 0.0)] * args.rows, native.device)
    tokens = [5] * args.rows
    for _ in range(3):  # fast-path check, graph capture
        logits = runner.decode(tokens, False).logits
    graph = native.graphs.captured[min(native.graphs.captured)] if native.graphs.captured else None
    result: dict[str, float | str | bool | None] = {
        "shape": args.shape, "rows": args.rows, "prompt_len": args.prompt_len,
        "quantization": args.quantization, "baseline": args.baseline,
        "cuda_graphs": native.use_graphs, "fast_kernels": native.fast_kernels,
        "prefill_ms": prefill_ms, "prefill_rows": min(chunk, args.rows),
    }
    if graph is not None:
        result["graph_replay_ms"] = cuda_ms(graph.graph.replay, repeats=50)
    result["sample_ms"] = cuda_ms(lambda: sample_next(logits, batch, gen), repeats=50)

    fused = batch.fused if runner.fused_sampling else None
    result["fused_sampling"] = fused is not None
    result["grouped_experts"] = native.grouped_experts
    result["split_attention"] = native.split_attention

    def engine_step() -> None:
        nonlocal tokens
        out = runner.decode(tokens, False, sampling=fused)
        if out.sampled is not None:
            tokens = out.sampled[0]
        else:
            tokens = sample_next(out.logits, batch, gen)[0].tolist()

    engine_step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(50):
        engine_step()
    torch.cuda.synchronize()
    result["engine_step_ms"] = (time.perf_counter() - t0) * 1e3 / 50
    result["engine_tokens_per_s"] = args.rows / result["engine_step_ms"] * 1e3
    result["length_after"] = int(native.lengths.max())
    positions = native.lengths.to(native.device)
    ids = torch.tensor(tokens, device=native.device)
    span = native._longest() + 1
    result.update({f"eager_{k}": v for k, v in kernel_table(
        lambda: native.step(ids, positions, span,
                             None if fused is None else (fused.temperatures, fused.seeds)),
        out / f"kernels_{tag}_step.txt").items()})
    result.update({f"sample_{k}": v for k, v in kernel_table(
        lambda: sample_next(logits, batch, gen), out / f"kernels_{tag}_sample.txt").items()})
    print(json.dumps(result, indent=1))
    (out / f"decode_{tag}.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
