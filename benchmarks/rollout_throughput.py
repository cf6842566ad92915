"""Embedded rollout engine generation throughput vs plain HF ``generate``, same prompts, same run.

Measures tokens/s of (1) one batched, left-padded ``model.generate`` call over all prompts (the
baseline), (2) megarl's embedded engine in-process (continuous batching, per-token log-probs),
and (3) the same engine behind its HTTP server driven by megarl's SGLang client (skipped with
``--no-http`` or when fastapi/uvicorn are missing); each with its ratio to the baseline.
All runs sample (temperature 1, no top-k/top-p) and ignore EOS. Scenarios:
- ``fixed``: every prompt gets ``max_new_tokens`` tokens (static batching's best case);
- ``varied``: prompt i gets its own length in [max_new_tokens / 8, max_new_tokens], as RL
  responses end at EOS at different lengths; ``generate`` must run the batch to the longest, and
  only the requested tokens count for every method.
The best of ``--repeats`` timed rounds is kept per method (``--hf-repeats`` for ``generate``),
after one warm-up round.

On GPU (``--device cuda``) the models are random ``--shapes``: ``dense`` (Qwen3-0.6B: 28 layers,
hidden 1024, tied 151936 vocabulary) and ``moe`` (12 layers, hidden 1024, 32 experts, top-4), in
bf16, 64 prompts of 256 tokens, 256 sampled tokens each. Each engine figure is also given as a
fraction of the decode memory-bandwidth floor: the weights plus every row's KV cache read once
per decode step, over the device-to-device copy bandwidth measured in the same run.

With ``--quantization fp8`` a second in-process engine runs the same model in block FP8
(``engine_fp8``; docs/fp8.md) and each row adds its ratio to the bf16 engine and, on GPU, its
fraction of the FP8 floor (the same reads with the FP8 weights' bytes). ``e2e_dense`` and
``e2e_moe`` are the shapes of ``benchmarks/e2e_step.py`` (issue 31's decode comparison).

    python benchmarks/rollout_throughput.py --smoke            # seconds, CPU
    python benchmarks/rollout_throughput.py --device cuda --no-http
    python benchmarks/rollout_throughput.py --device cuda --no-http --quantization fp8 \
        --shapes e2e_moe,e2e_dense --num-prompts 64 --hf-repeats 0
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.util
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megarl.data.tiny_model import make_tiny_model, tiny_config_dict
from megarl.rollout.interface import SamplingParams
from megarl.rollout.local.engine import LocalEngine, Request
from megarl.rollout.local.model_runner import ModelRunner

# Random model shapes: make_tiny_model arch plus config overrides.
SHAPES: dict[str, dict[str, Any]] = {
    "smoke": {
        "arch": "qwen3_moe",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_experts": 4,
        "moe_intermediate_size": 32,
        "vocab_size": 128,
    },
    "cpu": {
        "arch": "qwen3_moe",
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_experts": 8,
        "moe_intermediate_size": 128,
        "intermediate_size": 1024,
        "vocab_size": 1024,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 32,
    },
    "tensors": {  # the e2e MoE slice's 3,147 HF tensors (8 layers x 128 experts), tiny ones:
        "arch": "qwen3_moe",  # a weight sync's per-tensor costs on their own
        "hidden_size": 64,
        "num_hidden_layers": 8,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 32,
        "vocab_size": 512,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
    },
    "dense": {
        "arch": "qwen3",
        "hidden_size": 1024,
        "num_hidden_layers": 28,
        "intermediate_size": 3072,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "rope_theta": 1e6,
    },
    "moe": {
        "arch": "qwen3_moe",
        "hidden_size": 1024,
        "num_hidden_layers": 12,
        "num_experts": 32,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 768,
        "intermediate_size": 3072,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "rope_theta": 1e6,
    },
}
SAMPLING = SamplingParams(temperature=1.0, ignore_eos=True)


def _e2e_shapes() -> dict[str, dict[str, Any]]:
    """``e2e_<shape>``: the model shapes of benchmarks/e2e_step.py."""
    spec = importlib.util.spec_from_file_location(
        "bench_e2e_step_shapes", Path(__file__).with_name("e2e_step.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return {f"e2e_{name}": dict(dims) for name, dims in module.SHAPES.items()}


SHAPES.update(_e2e_shapes())


def build_model(root: Path, shape: str, device: str) -> Path:
    """A random model directory of the given shape (on GPU: initialised there, saved in bf16)."""
    overrides = dict(SHAPES[shape])
    arch = overrides.pop("arch")
    overrides.setdefault("max_position_embeddings", 4096)
    if not device.startswith("cuda"):
        return make_tiny_model(root / shape, arch=arch, with_tokenizer=False, **overrides)
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = tiny_config_dict(arch, **overrides)
    cfg["torch_dtype"] = "bfloat16"
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(root / shape, safe_serialization=True)
    return root / shape


def make_prompts(count: int, low: int, high: int, vocab: int) -> list[list[int]]:
    """Random prompts with lengths in [low, high]."""
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(low, high + 1, (count,), generator=gen).tolist()
    return [torch.randint(5, vocab, (n,), generator=gen).tolist() for n in lengths]


def sync(device: str) -> None:
    """Wait for queued GPU work."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class HFGenerate:
    """Plain ``generate``: one left-padded batch run to the longest requested length."""

    def __init__(self, model: torch.nn.Module, prompts: list[list[int]], device: str) -> None:
        width = max(map(len, prompts))
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        self.model, self.width = model, width
        self.ids, self.mask = ids.to(device), mask.to(device)

    def __call__(self, lengths: list[int]) -> None:
        longest = max(lengths)
        out = self.model.generate(
            self.ids,
            attention_mask=self.mask,
            max_new_tokens=longest,
            min_new_tokens=longest,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            eos_token_id=None,
            pad_token_id=0,
        )
        assert out.shape[1] - self.width == longest


class InProcessEngine:
    """The embedded engine in this process, every prompt submitted at once."""

    def __init__(self, engine: LocalEngine, prompts: list[list[int]]) -> None:
        self.engine, self.prompts = engine, prompts

    def __call__(self, lengths: list[int]) -> None:
        futures = [
            self.engine.submit(Request(f"r{i}", p, dataclasses.replace(SAMPLING, max_new_tokens=n)))
            for i, (p, n) in enumerate(zip(self.prompts, lengths))
        ]
        assert [len(f.result()[0].output_ids) for f in futures] == lengths


class OverHTTP:
    """The embedded engine's HTTP server driven by megarl's SGLang client."""

    def __init__(self, url: str, prompts: list[list[int]]) -> None:
        self.url, self.prompts = url, prompts

    async def _run(self, lengths: list[int]) -> None:
        from megarl.rollout.sglang.client import SGLangClient

        client = SGLangClient([self.url])
        try:
            groups = await asyncio.gather(
                *(
                    client.generate_one(p, dataclasses.replace(SAMPLING, max_new_tokens=n))
                    for p, n in zip(self.prompts, lengths)
                )
            )
        finally:
            await client.close()
        assert [len(g[0].response_ids) for g in groups] == lengths

    def __call__(self, lengths: list[int]) -> None:
        asyncio.run(self._run(lengths))


def native_state(native) -> dict[str, Any]:
    """What the native decoder actually ran with: its fast paths, and whether its decode steps
    ran as CUDA graphs (``cuda_graphs`` turns off after a failed capture)."""
    return {"flash_decode": native.flash, "fast_kernels": native.fast_kernels,
            "cuda_graphs": native.use_graphs, "capture_failures": native.graphs.capture_failures,
            "graphs_captured": len(native.graphs.captured)}


def measure(
    methods: dict[str, Callable[[list[int]], None]],
    scenarios: dict[str, list[int]],
    repeats: dict[str, int],
    device: str,
) -> dict[str, dict[str, float]]:
    """Best tokens/s per scenario and method after one warm-up call each (``generate`` warms up
    on 8 tokens); methods alternate within a round so drifting machine conditions (clocks,
    neighbours) hit all of them alike."""
    best: dict[str, dict[str, float]] = {s: {m: float("inf") for m in methods} for s in scenarios}
    for round_ in range(max(repeats.values()) + 1):
        for scenario, lengths in scenarios.items():
            for name, method in methods.items():
                if round_ > repeats[name]:
                    continue
                warm = round_ == 0
                sync(device)
                start = time.perf_counter()
                method([min(n, 8) for n in lengths] if warm and name == "hf_generate" else lengths)
                sync(device)
                print(f"  {scenario} {name} {'warm-up' if warm else f'round {round_}'}: "
                      f"{time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
                if not warm:
                    best[scenario][name] = min(best[scenario][name], time.perf_counter() - start)
    return {s: {m: sum(scenarios[s]) / t for m, t in by.items()} for s, by in best.items()}


def copy_bandwidth(device: str) -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read + written), median of 10."""
    src = torch.randn(1 << 30, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    times = []
    for i in range(13):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() * src.element_size() / sorted(times)[len(times) // 2]


def decode_floor_tokens_per_s(
    model: torch.nn.Module, prompts: list[list[int]], lengths: list[int], bandwidth: float
) -> float:
    """Generated tokens/s if every decode step only read the weights (the input embedding table
    aside, unless tied) and each running row's KV cache once, at ``bandwidth``."""
    cfg = model.config
    params = {id(p): p for p in model.parameters()}
    weight_bytes = sum(p.numel() * p.element_size() for p in params.values())
    embed = model.get_input_embeddings().weight
    if embed is not model.get_output_embeddings().weight:
        weight_bytes -= embed.numel() * embed.element_size()
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_per_token = (
        cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * embed.element_size()
    )
    total_bytes = 0.0
    for step in range(max(lengths)):
        cached = sum(len(p) + step for p, n in zip(prompts, lengths) if step < n)
        total_bytes += weight_bytes + cached * kv_per_token
    return sum(lengths) / (total_bytes / bandwidth)


def run_shape(args: argparse.Namespace, shape: str, root: Path) -> dict[str, Any]:
    """Set up every method for one model shape, measure, tear down; returns the figures."""
    on_gpu = args.device.startswith("cuda")
    model_dir = Path(args.model) if args.model else build_model(root, shape, args.device)
    runner = ModelRunner(
        model_dir, device=args.device, dtype=args.dtype or ("bfloat16" if on_gpu else "float32")
    )
    low, high = args.prompt_len
    prompts = make_prompts(args.num_prompts, low, high, runner.vocab_size)
    gen = torch.Generator().manual_seed(1)
    new = args.max_new_tokens
    scenarios = {
        "fixed": [new] * args.num_prompts,
        "varied": torch.randint(
            max(1, new // 8), new + 1, (args.num_prompts,), generator=gen
        ).tolist(),
    }
    scenarios = {k: v for k, v in scenarios.items() if k in args.scenarios.split(",")}
    engine = LocalEngine(runner, seed=0)
    engine.start()
    methods: dict[str, Callable[[list[int]], None]] = {
        "hf_generate": HFGenerate(runner.model, prompts, args.device),
        "engine": InProcessEngine(engine, prompts),
    }
    repeats = {"hf_generate": args.hf_repeats, "engine": args.repeats, "engine_http": args.repeats,
               "engine_fp8": args.repeats}
    fp8_runner = fp8_engine = None
    if args.quantization == "fp8":
        fp8_runner = ModelRunner(model_dir, device=args.device, dtype=str(runner.dtype).removeprefix(
            "torch."), quantization="fp8", fp8_ignored=tuple(args.fp8_ignored_layers))
        fp8_engine = LocalEngine(fp8_runner, seed=0)
        fp8_engine.start()
        methods["engine_fp8"] = InProcessEngine(fp8_engine, prompts)
    server = None
    if not args.no_http and all(importlib.util.find_spec(m) for m in ("fastapi", "uvicorn")):
        from megarl.rollout.local.launch import launch_local_engines

        (server,) = launch_local_engines(
            str(model_dir),
            1,
            device=args.device,
            num_threads=torch.get_num_threads(),
            extra_args=["--random-seed", "0", "--dtype", str(runner.dtype).removeprefix("torch.")],
        )
        methods["engine_http"] = OverHTTP(server.url, prompts)
    try:
        results = measure(methods, scenarios, repeats, args.device)
    finally:
        engine.shutdown()
        if fp8_engine is not None:
            fp8_engine.shutdown()
        if server is not None:
            server.stop()
    row: dict[str, Any] = {
        "shape": args.model or shape,
        "backend": runner.backend,
        "prompts": args.num_prompts,
        "prompt_len": list(args.prompt_len),
        "max_new_tokens": new,
        "results": results,
    }
    if runner.native is not None:
        row["native"] = native_state(runner.native)
    if fp8_runner is not None:
        row["fp8_backend"] = fp8_runner.backend
        if fp8_runner.native is not None:  # did its decode graphs capture? (after the runs)
            row["fp8_native"] = native_state(fp8_runner.native)
        row["fp8_vs_bf16"] = {s: by["engine_fp8"] / by["engine"] for s, by in results.items()}
    if on_gpu:
        bandwidth = copy_bandwidth(args.device)
        row["copy_gb_per_s"] = bandwidth / 1e9
        row["floor_tokens_per_s"] = {
            s: decode_floor_tokens_per_s(runner.model, prompts, lengths, bandwidth)
            for s, lengths in scenarios.items()
        }
        if fp8_runner is not None:
            from megarl.rollout.local.fp8_layers import experts_backend, gemm_backend

            row["fp8_gemm"] = gemm_backend()
            row["fp8_experts"] = experts_backend()
            row["floor_tokens_per_s_fp8"] = {
                s: decode_floor_tokens_per_s(fp8_runner.model, prompts, lengths, bandwidth)
                for s, lengths in scenarios.items()
            }
    return row


def print_row(row: dict[str, Any]) -> None:
    """One line per scenario and method."""
    for scenario, by_method in row["results"].items():
        base = by_method["hf_generate"]
        for method, tps in by_method.items():
            key = "floor_tokens_per_s_fp8" if method == "engine_fp8" else "floor_tokens_per_s"
            floor = row.get(key, {}).get(scenario)
            extra = f"   {tps / floor:6.1%} of floor" if floor and method != "hf_generate" else ""
            ratio = f"ratio vs hf_generate {tps / base:6.2f}x" if base > 0 else "(no generate)"
            print(f"{row['shape']:>6} {scenario:>7} {method:>12}: {tps:10.1f} tokens/s   "
                  f"{ratio}{extra}")
        if "fp8_vs_bf16" in row:
            print(f"{row['shape']:>6} {scenario:>7} {'fp8 / bf16':>12}: "
                  f"{row['fp8_vs_bf16'][scenario]:.2f}x ({row['fp8_backend']} decode)")
        floor = row.get("floor_tokens_per_s", {}).get(scenario)
        if floor:
            print(
                f"{row['shape']:>6} {scenario:>7} {'floor':>12}: {floor:10.1f} tokens/s   "
                f"(copy {row['copy_gb_per_s']:.0f} GB/s)"
            )


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print one line per scenario and method plus a JSON summary."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny model, few prompts (seconds)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="model dtype (default: fp32 on CPU, bf16 on GPU)")
    p.add_argument("--model", default=None, help="HF model dir (default: random --shapes)")
    p.add_argument("--shapes", default=None, help="comma-separated keys of SHAPES")
    p.add_argument("--scenarios", default=None, help="comma-separated: fixed, varied")
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--prompt-len", type=int, nargs=2, default=None, metavar=("LOW", "HIGH"))
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--no-http", action="store_true", help="skip the HTTP server measurement")
    p.add_argument("--repeats", type=int, default=3, help="timed engine runs (best kept)")
    p.add_argument("--hf-repeats", type=int, default=None, help="timed generate runs")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (all methods)")
    p.add_argument("--out", default=None, help="write the JSON summary to this file")
    p.add_argument("--quantization", choices=["fp8"], default=None,
                   help="also run the engine in block FP8 (engine_fp8) and compare")
    p.add_argument("--fp8-ignored-layers", nargs="*", default=[], metavar="MODULE",
                   help="modules the FP8 engine keeps in the model dtype (self_attn: what "
                        "rollout.fp8_attention=false keeps)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    on_gpu = args.device.startswith("cuda")
    args.shapes = args.shapes or ("smoke" if args.smoke else "dense,moe" if on_gpu else "cpu")
    args.scenarios = args.scenarios or ("fixed" if on_gpu else "fixed,varied")
    args.num_prompts = args.num_prompts or (16 if args.smoke else 64)
    args.prompt_len = args.prompt_len or (
        (4, 16) if args.smoke else (256, 256) if on_gpu else (16, 64)
    )
    args.max_new_tokens = args.max_new_tokens or (16 if args.smoke else 256 if on_gpu else 128)
    if args.hf_repeats is None:
        args.hf_repeats = 1 if on_gpu else args.repeats
    with tempfile.TemporaryDirectory() as tmp:
        rows = [run_shape(args, shape, Path(tmp)) for shape in args.shapes.split(",")]
    print(
        f"device={args.device} prompts={args.num_prompts} prompt_len={args.prompt_len} "
        f"max_new_tokens={args.max_new_tokens} threads={torch.get_num_threads()} "
        f"best of {args.repeats} (generate: {args.hf_repeats})"
    )
    for row in rows:
        print_row(row)
    summary = {"bench": "rollout_throughput", "device": args.device, "rows": rows}
    print(json.dumps(summary))
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
