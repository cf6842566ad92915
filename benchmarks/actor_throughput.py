"""Actor training-step throughput: megarl's Megatron model (native spec) vs HF transformers.

Both sides are built from the same random HF checkpoint (bf16 on GPU) and run forward + backward
of the per-token log-prob loss on the same random tokens (never zeros):

- ``hf``: ``AutoModelForCausalLM`` with SDPA attention and transformers' own MoE experts, loss
  ``cross_entropy(logits.float(), targets)`` (what HF does when given labels);
- ``megatron``: megarl's actor path, i.e. :func:`megarl.megatron.model.build_actor_model` with the
  native spec, a packed (THD) micro-batch, ``gpt_forward`` and ``logits_to_log_probs``.

Each step is timed with CUDA events after warm-up (median of ``--steps``). Reported per shape:
tokens/s of both, their ratio, achieved TFLOP/s (model FLOPs: 6 x active matmul parameters per
token + causal attention) and MFU against the bf16 matmul rate measured in the same run.

    python benchmarks/actor_throughput.py --smoke          # tiny shapes on CPU, seconds
    python benchmarks/actor_throughput.py                  # dense ~1B and small MoE on GPU
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megarl.data.tiny_model import make_tiny_model
from megarl.net import free_port

# HF config overrides per shape: arch plus tiny_config_dict fields.
SHAPES: dict[str, dict[str, Any]] = {
    "dense": {
        "arch": "qwen3",
        "hidden_size": 2048,
        "num_hidden_layers": 16,
        "intermediate_size": 5632,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 32000,
        "max_position_embeddings": 8192,
    },
    "moe": {
        "arch": "qwen3_moe",
        "hidden_size": 1024,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 32,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 512,
        "intermediate_size": 2816,
        "vocab_size": 32000,
        "max_position_embeddings": 8192,
    },
}
SMOKE_SHAPES: dict[str, dict[str, Any]] = {
    "dense": {"arch": "qwen3", "num_hidden_layers": 2},
    "moe": {"arch": "qwen3_moe", "num_hidden_layers": 2},
}


def shape_of(name: str, shapes: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A shape of this benchmark, or ``e2e_<shape>``: that of ``benchmarks/e2e_step.py``."""
    if name.startswith("e2e_"):
        from benchmarks.e2e_step import SHAPES as E2E_SHAPES

        return E2E_SHAPES[name.removeprefix("e2e_")]
    return shapes[name]


def measure_ceilings(device: str) -> dict[str, float]:
    """Measured bf16 matmul rate (TFLOP/s, 8192^3 on random data) and device-to-device copy
    bandwidth (GB/s, bytes read + written) of this GPU."""
    n = 8192
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    matmul_s = time_cuda(lambda: a @ b, warmup=3, repeats=10)
    src = torch.randn(1 << 30, device=device, dtype=torch.bfloat16)  # 2 GiB
    dst = torch.empty_like(src)
    copy_s = time_cuda(lambda: dst.copy_(src), warmup=3, repeats=10)
    return {
        "bf16_matmul_tflops": 2 * n**3 / matmul_s / 1e12,
        "copy_gb_per_s": 2 * src.numel() * src.element_size() / copy_s / 1e9,
    }


def time_cuda(fn: Callable[[], Any], warmup: int, repeats: int) -> float:
    """Median seconds per call of ``fn`` (CUDA events on GPU, wall clock on CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def train_flops_per_token(cfg: Any, seq_len: int) -> float:
    """Model FLOPs of forward + backward per token: 6 x active matmul parameters (attention
    projections, MLP or routed experts and router, output layer) + causal attention scores."""
    h, d = cfg.hidden_size, cfg.head_dim
    nq, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    attn_params = h * nq * d * 2 + h * nkv * d * 2
    if getattr(cfg, "num_experts", None):
        mlp_params = (
            h * cfg.num_experts + cfg.num_experts_per_tok * 3 * h * cfg.moe_intermediate_size
        )
    else:
        mlp_params = 3 * h * cfg.intermediate_size
    params = cfg.num_hidden_layers * (attn_params + mlp_params) + h * cfg.vocab_size
    attention = cfg.num_hidden_layers * 2 * 2 * nq * d * (seq_len + 1) / 2
    return 3 * (2 * params + attention)


def write_hf_model(root: Path, shape: dict[str, Any], device: str, dtype: torch.dtype) -> Path:
    """A random HF checkpoint of ``shape`` (initialised on ``device``) saved under ``root``."""
    overrides = dict(shape)
    make_tiny_model(root, overrides.pop("arch"), with_tokenizer=False, dtype=dtype,
                    device=device, **overrides)  # frees its GPU memory: a preflight comes next
    return root


class HFStep:
    """One forward + backward of HF transformers' causal LM loss on one sequence."""

    def __init__(
        self, model_dir: Path, tokens: torch.Tensor, device: str, dtype: torch.dtype
    ) -> None:
        from transformers import AutoModelForCausalLM

        self.model = (
            AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa")
            .to(device)
            .train()
        )
        self.ids = tokens[None, :-1].to(device)
        self.targets = tokens[1:].to(device)
        self.experts = getattr(self.model.config, "_experts_implementation", None)

    def __call__(self) -> None:
        self.model.zero_grad(set_to_none=True)
        logits = self.model(input_ids=self.ids).logits
        loss = F.cross_entropy(logits[0].float(), self.targets)
        loss.backward()


class MegatronStep:
    """One forward + backward of megarl's actor log-prob loss on one packed micro-batch; with
    ``graphs`` through :class:`~megarl.megatron.cuda_graphs.GraphedChunk` (what
    ``actor.cuda_graphs=true`` runs; ``"emulate"``: its buffers without CUDA graphs, CPU)."""

    def __init__(self, model_dir: Path, sequences: list[torch.Tensor], dtype: torch.dtype,
                 graphs: bool | str = False, hidden: bool = False, fast: bool = True) -> None:
        from megarl.megatron.cuda_graphs import GraphedChunk
        from megarl.megatron.logprobs import gpt_forward, make_micro_batches
        from megarl.megatron.model import build_actor_model
        from megarl.megatron.parallel import ParallelSizes

        self.model = build_actor_model(model_dir, ParallelSizes(), dtype, spec="native")
        (self.batch,), _ = make_micro_batches(self.model, sequences, None)
        self.hidden = hidden  # the update's path: hidden states, log-probs a chunk at a time
        self.actor = None
        if hidden:  # and the update's DDP wrapping: fp32 gradient buffers, fused accumulation
            from megarl.megatron.optimizer import OptimizerSettings, TrainableActor

            self.actor = TrainableActor(self.model, OptimizerSettings(lr=1e-5), fuse_wgrad=fast)
        self.fast = fast  # False: the update's torch path (no Triton log-prob kernels)
        self.chunk = self.model.chunks[0].train()
        self.forward: Callable[[Any], torch.Tensor] = lambda batch: gpt_forward(
            self.chunk, batch, hidden=hidden)
        if graphs:  # one bucket of exactly this micro-batch
            self.forward = GraphedChunk(self.chunk, bucket_tokens=self.batch.num_tokens,
                                        emulate=graphs == "emulate")

    def eager_repeat(self) -> float:
        """Largest |log-prob difference| between two eager forwards (the run-to-run noise of
        the kernels, e.g. atomics in the MoE combine; the yardstick for :meth:`graphs_vs_eager`)."""
        from megarl.megatron.logprobs import gpt_forward, logits_to_log_probs

        with torch.no_grad():
            a, b = (logits_to_log_probs(self.model, gpt_forward(self.chunk, self.batch),
                                        self.batch.targets, 1.0)[0] for _ in range(2))
        return float((a - b).abs().max())

    def graphs_vs_eager(self) -> float:
        """Largest |log-prob difference| between the graphed and the eager forward."""
        from megarl.megatron.logprobs import gpt_forward, logits_to_log_probs

        with torch.enable_grad():
            graphed = logits_to_log_probs(self.model, self.forward(self.batch), self.batch.targets,
                                          1.0)[0]
            graphed.sum().backward()  # graphed forwards and backwards alternate
            eager = logits_to_log_probs(self.model, gpt_forward(self.chunk, self.batch),
                                        self.batch.targets, 1.0)[0]
        return float((graphed - eager).detach().abs().max())

    def __call__(self) -> None:
        from megarl import kernels

        if self.fast:
            return self._step()
        saved = kernels._LOADED.get("triton_vocab")
        kernels._LOADED["triton_vocab"] = None
        try:
            return self._step()
        finally:
            kernels._LOADED["triton_vocab"] = saved

    def _step(self) -> None:
        from megarl.megatron.logprobs import token_log_probs

        if self.actor is not None:
            self.actor.zero_grad()
        else:
            self.chunk.zero_grad(set_to_none=True)
        output = self.forward(self.batch)
        log_probs, _ = token_log_probs(self.model, output, self.batch.targets, 1.0,
                                       hidden=self.hidden)
        loss = -log_probs.mean()
        loss.backward()


def profile_step(step: Callable[[], None], path: Path, steps: int = 3) -> dict[str, float]:
    """Profile ``steps`` calls; write the op table to ``path``; return device-busy and wall
    milliseconds per step."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) * 1e3 / steps
    averages = prof.key_averages()
    sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    text = [
        averages.table(sort_by=sort, row_limit=45),
        averages.table(sort_by="cpu_time_total", row_limit=30),
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n\n".join(text))
    busy_us = (
        sum(
            getattr(e, "self_device_time_total", 0.0)
            for e in averages
            if e.device_type == torch.autograd.DeviceType.CPU
        )
        / steps
    )
    return {"profiled_wall_ms": wall_ms, "device_busy_ms": busy_us / 1e3}


def find_host_syncs(step: Callable[[], None], path: Path) -> int:
    """Run ``step`` once with CUDA's sync debug mode on; write where it synchronised with the
    device to ``path``; returns the number of synchronisations."""
    import collections
    import warnings

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    sites = collections.Counter(
        f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)
    )
    path.write_text("\n".join(f"{n:4d} {site}" for site, n in sites.most_common()))
    return sum(sites.values())


def run_shape(
    name: str,
    shape: dict[str, Any],
    args: argparse.Namespace,
    root: Path,
    ceilings: dict[str, float],
) -> dict[str, Any]:
    """Build both sides of one shape and time them; returns the figures."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model_dir = write_hf_model(root / name, shape, device, dtype)
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(3, cfg.vocab_size, (args.seq_len + 1,), generator=gen)
    # the packed side scores the same seq_len predicted tokens as HF: its sequences overlap by one
    bounds = torch.linspace(0, args.seq_len, args.packed_seqs + 1).long().tolist()
    sequences = [tokens[a : b + 1] for a, b in itertools.pairwise(bounds)]
    sides = {
        "hf": lambda: HFStep(model_dir, tokens, device, dtype),
        "megatron": lambda: MegatronStep(model_dir, sequences, dtype),
        "megatron_graphs": lambda: MegatronStep(
            model_dir, sequences, dtype, graphs=True if device == "cuda" else "emulate"),
        "megatron_update": lambda: MegatronStep(model_dir, sequences, dtype, hidden=True),
        "megatron_update_torch": lambda: MegatronStep(model_dir, sequences, dtype, hidden=True,
                                                      fast=False),
    }
    chosen = args.sides.split(",")
    if args.no_graphs:
        chosen = [side for side in chosen if side != "megatron_graphs"]
    sides = {side: build for side, build in sides.items() if side in chosen}
    flops = train_flops_per_token(cfg, args.seq_len // args.packed_seqs)
    out: dict[str, Any] = {
        "shape": name,
        "seq_len": args.seq_len,
        "packed_seqs": args.packed_seqs,
        "train_gflop_per_token": flops / 1e9,
    }
    for side, build in sides.items():
        step = build()
        if side == "hf":
            out["hf_experts_implementation"] = step.experts
        if side == "megatron":
            out["eager_repeat_max_abs_log_prob"] = step.eager_repeat()
        if side == "megatron_graphs":
            out["graphs_vs_eager_max_abs_log_prob"] = step.graphs_vs_eager()
        seconds = time_cuda(step, warmup=args.warmup, repeats=args.steps)
        tps = args.seq_len / seconds
        out[f"{side}_tokens_per_s"] = tps
        out[f"{side}_tflops"] = tps * flops / 1e12
        if ceilings:
            out[f"{side}_mfu"] = tps * flops / 1e12 / ceilings["bf16_matmul_tflops"]
        if device == "cuda":
            out[f"{side}_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        if args.profile:
            folder = Path(args.profile)
            prof = profile_step(step, folder / f"profile_{name}_{side}.txt")
            out.update({f"{side}_{k}": v for k, v in prof.items()})
            if device == "cuda":
                out[f"{side}_host_syncs"] = find_host_syncs(
                    step, folder / f"syncs_{name}_{side}.txt"
                )
        del step
        if device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    if "hf_tokens_per_s" not in out or "megatron_tokens_per_s" not in out:
        return out
    out["ratio"] = out["megatron_tokens_per_s"] / out["hf_tokens_per_s"]
    if "megatron_graphs_tokens_per_s" in out:
        out["ratio_graphs"] = out["megatron_graphs_tokens_per_s"] / out["hf_tokens_per_s"]
    if device == "cuda":
        from megarl.megatron import native_ops

        kernels = native_ops.triton_kernels()
        out["triton_kernels"] = kernels.verdicts() if kernels is not None else {}
    return out


def init_single_rank() -> None:
    """A one-rank process group (NCCL on GPU, gloo on CPU) for megatron's parallel state."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    port = free_port()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(0)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def print_table(rows: list[dict[str, Any]], ceilings: dict[str, float]) -> None:
    """One line per shape and side."""
    if ceilings:
        print(
            f"ceilings: bf16 matmul {ceilings['bf16_matmul_tflops']:.0f} TFLOP/s, "
            f"copy {ceilings['copy_gb_per_s']:.0f} GB/s"
        )
    for r in rows:
        for side in ("hf", "megatron", "megatron_graphs", "megatron_update",
                     "megatron_update_torch"):
            if f"{side}_tokens_per_s" not in r:
                continue
            mfu = f"  MFU {r[side + '_mfu']:6.1%}" if f"{side}_mfu" in r else ""
            print(
                f"{r['shape']:>6} {side:>21}: {r[side + '_tokens_per_s']:10.0f} tokens/s  "
                f"{r[side + '_tflops']:7.1f} TFLOP/s{mfu}"
            )
        graphed = f", {r['ratio_graphs']:.2f}x with CUDA graphs" if "ratio_graphs" in r else ""
        if "ratio" in r:
            print(f"{r['shape']:>6}           ratio: {r['ratio']:.2f}x megatron/hf eager{graphed}")


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print a table and one JSON line."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (CI)")
    p.add_argument("--shapes", default="dense,moe",
                   help="comma-separated: dense, moe, or e2e_dense / e2e_moe (e2e_step.py's)")
    p.add_argument("--sides", default="hf,megatron,megatron_graphs",
                   help="comma-separated: hf, megatron (whole logits), megatron_graphs, "
                        "megatron_update (the update's path: DDP's fp32 gradient buffers, "
                        "log-probs from the hidden states a chunk of rows at a time), "
                        "megatron_update_torch (the same without the fused weight-gradient "
                        "accumulation and the Triton log-prob kernels)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per micro-batch")
    p.add_argument(
        "--packed-seqs",
        type=int,
        default=1,
        help="sequences packed into the megatron micro-batch (THD)",
    )
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--steps", type=int, default=None, help="timed steps (median kept)")
    p.add_argument("--profile", default=None, help="folder for torch.profiler op tables")
    p.add_argument("--no-graphs", action="store_true",
                   help="skip the CUDA-graphed megatron side (actor.cuda_graphs)")
    p.add_argument("--out", default=None, help="write the JSON summary to this file")
    args = p.parse_args(argv)
    on_gpu = torch.cuda.is_available()
    if not on_gpu and not args.smoke:
        p.error("no CUDA device: run with --smoke (tiny shapes on CPU)")
    args.seq_len = args.seq_len or (64 if args.smoke else 4096)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.smoke else 3)
    args.steps = args.steps or (2 if args.smoke else 10)
    if not on_gpu:
        torch.set_num_threads(min(2, torch.get_num_threads()))
    init_single_rank()
    ceilings = measure_ceilings("cuda") if on_gpu else {}
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.shapes.split(","):
            rows.append(run_shape(name, shape_of(name, shapes), args, Path(tmp), ceilings))
            from megarl.megatron.parallel import destroy_parallel

            destroy_parallel()
    print_table(rows, ceilings)
    summary = {
        "bench": "actor_throughput",
        "device": torch.cuda.get_device_name() if on_gpu else "cpu",
        "torch": torch.__version__,
        "ceilings": ceilings,
        "rows": rows,
    }
    print(json.dumps(summary))
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
