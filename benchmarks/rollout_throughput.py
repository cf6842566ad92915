"""Embedded rollout engine generation throughput vs plain HF ``generate``, same prompts, same run.

Measures tokens/s of (1) one batched, left-padded ``model.generate`` call over all prompts (the
baseline), (2) megarl's embedded engine in-process (continuous batching, per-token log-probs),
and (3) the same engine behind its HTTP server driven by megarl's SGLang client (skipped with
``--no-http`` or when fastapi/uvicorn are missing); each with its ratio to the baseline.
All runs sample (temperature 1, no top-k/top-p) and ignore EOS. Two scenarios:
- ``fixed``: every prompt gets ``max_new_tokens`` tokens (static batching's best case);
- ``varied``: prompt i gets its own length in [max_new_tokens / 8, max_new_tokens], as RL
  responses end at EOS at different lengths; ``generate`` must run the batch to the longest, and
  only the requested tokens count for every method.
The best of ``--repeats`` timed rounds is kept per method, after one warm-up round; methods
alternate within a round (the machine may be shared, GPU clocks ramp up).

    python benchmarks/rollout_throughput.py --smoke            # seconds, CPU
    python benchmarks/rollout_throughput.py --device cuda      # a larger random MoE on GPU
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

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megarl.data.tiny_model import make_tiny_model
from megarl.rollout.interface import SamplingParams
from megarl.rollout.local.engine import LocalEngine, Request
from megarl.rollout.local.model_runner import ModelRunner

# Random Qwen3-MoE sizes: (hidden, layers, experts, moe_intermediate, vocab).
PRESETS = {"smoke": (64, 2, 4, 32, 128), "cpu": (256, 4, 8, 128, 1024),
           "gpu": (1024, 8, 32, 512, 32000)}
SAMPLING = SamplingParams(temperature=1.0, ignore_eos=True)


def build_model(root: Path, preset: str) -> Path:
    """A random Qwen3-MoE directory of the given preset size."""
    hidden, layers, experts, inter, vocab = PRESETS[preset]
    return make_tiny_model(
        root / preset, arch="qwen3_moe", with_tokenizer=False, hidden_size=hidden,
        num_hidden_layers=layers, num_experts=experts, moe_intermediate_size=inter,
        intermediate_size=4 * hidden, vocab_size=vocab, num_attention_heads=8,
        num_key_value_heads=4, head_dim=hidden // 8, max_position_embeddings=4096)


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
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        self.model, self.width = model, width
        self.ids, self.mask = ids.to(device), mask.to(device)

    def __call__(self, lengths: list[int]) -> None:
        longest = max(lengths)
        out = self.model.generate(self.ids, attention_mask=self.mask, max_new_tokens=longest,
                                  min_new_tokens=longest, do_sample=True, temperature=1.0,
                                  top_k=0, top_p=1.0, eos_token_id=None, pad_token_id=0)
        assert out.shape[1] - self.width == longest


class InProcessEngine:
    """The embedded engine in this process, every prompt submitted at once."""

    def __init__(self, engine: LocalEngine, prompts: list[list[int]]) -> None:
        self.engine, self.prompts = engine, prompts

    def __call__(self, lengths: list[int]) -> None:
        futures = [self.engine.submit(Request(f"r{i}", p, dataclasses.replace(
            SAMPLING, max_new_tokens=n))) for i, (p, n) in enumerate(zip(self.prompts, lengths))]
        assert [len(f.result()[0].output_ids) for f in futures] == lengths


class OverHTTP:
    """The embedded engine's HTTP server driven by megarl's SGLang client."""

    def __init__(self, url: str, prompts: list[list[int]]) -> None:
        self.url, self.prompts = url, prompts

    async def _run(self, lengths: list[int]) -> None:
        from megarl.rollout.sglang.client import SGLangClient

        client = SGLangClient([self.url])
        try:
            groups = await asyncio.gather(*(
                client.generate_one(p, dataclasses.replace(SAMPLING, max_new_tokens=n))
                for p, n in zip(self.prompts, lengths)))
        finally:
            await client.close()
        assert [len(g[0].response_ids) for g in groups] == lengths

    def __call__(self, lengths: list[int]) -> None:
        asyncio.run(self._run(lengths))


def measure(methods: dict[str, Callable[[list[int]], None]], scenarios: dict[str, list[int]],
            repeats: int, device: str) -> dict[str, dict[str, float]]:
    """Best tokens/s per scenario and method; methods alternate within each round so drifting
    machine conditions (clocks, neighbours) hit all of them alike; round 0 is a warm-up."""
    best: dict[str, dict[str, float]] = {s: {m: float("inf") for m in methods} for s in scenarios}
    for round_ in range(repeats + 1):
        for scenario, lengths in scenarios.items():
            for name, method in methods.items():
                sync(device)
                start = time.perf_counter()
                method(lengths)
                sync(device)
                if round_ > 0:
                    best[scenario][name] = min(best[scenario][name], time.perf_counter() - start)
    return {s: {m: sum(scenarios[s]) / t for m, t in by.items()} for s, by in best.items()}


def run_all(args: argparse.Namespace, model_dir: Path, runner: ModelRunner,
            scenarios: dict[str, list[int]], prompts: list[list[int]],
            ) -> dict[str, dict[str, float]]:
    """Set up every method, measure, tear down."""
    engine = LocalEngine(runner, seed=0)
    engine.start()
    methods: dict[str, Callable[[list[int]], None]] = {
        "hf_generate": HFGenerate(runner.model, prompts, args.device),
        "engine": InProcessEngine(engine, prompts)}
    server = None
    if not args.no_http and all(importlib.util.find_spec(m) for m in ("fastapi", "uvicorn")):
        from megarl.rollout.local.launch import launch_local_engines

        (server,) = launch_local_engines(
            str(model_dir), 1, device=args.device, num_threads=torch.get_num_threads(),
            extra_args=["--random-seed", "0", "--dtype",
                        str(runner.dtype).removeprefix("torch.")])
        methods["engine_http"] = OverHTTP(server.url, prompts)
    try:
        return measure(methods, scenarios, args.repeats, args.device)
    finally:
        engine.shutdown()
        if server is not None:
            server.stop()


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print one line per scenario and method plus a JSON summary."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny model, few prompts (seconds)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="model dtype (default: fp32 on CPU, bf16 on GPU)")
    p.add_argument("--model", default=None, help="HF model dir (default: a random Qwen3-MoE)")
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--no-http", action="store_true", help="skip the HTTP server measurement")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per method (best kept)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (all methods)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    on_gpu = args.device.startswith("cuda")
    preset = "smoke" if args.smoke else ("gpu" if on_gpu else "cpu")
    num_prompts = args.num_prompts or (16 if args.smoke else 256 if on_gpu else 64)
    new_tokens = args.max_new_tokens or (16 if args.smoke else 256 if on_gpu else 128)
    gen = torch.Generator().manual_seed(1)
    scenarios = {"fixed": [new_tokens] * num_prompts,
                 "varied": torch.randint(max(1, new_tokens // 8), new_tokens + 1, (num_prompts,),
                                         generator=gen).tolist()}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(args.model) if args.model else build_model(Path(tmp), preset)
        runner = ModelRunner(model_dir, device=args.device,
                             dtype=args.dtype or ("bfloat16" if on_gpu else "float32"))
        low, high = (4, 16) if args.smoke else (16, 64)
        prompts = make_prompts(num_prompts, low, high, runner.vocab_size)
        results = run_all(args, model_dir, runner, scenarios, prompts)
    print(f"device={args.device} dtype={runner.dtype} model={args.model or preset} "
          f"prompts={num_prompts} max_new_tokens={new_tokens} "
          f"threads={torch.get_num_threads()} best of {args.repeats}")
    summary: dict[str, object] = {"bench": "rollout_throughput", "device": args.device,
                                  "prompts": num_prompts, "max_new_tokens": new_tokens}
    for name, by_method in results.items():
        base = by_method["hf_generate"]
        for method, tps in by_method.items():
            print(f"{name:>7} {method:>12}: {tps:10.1f} tokens/s   "
                  f"ratio vs hf_generate {tps / base:5.2f}x")
            summary[f"{name}_{method}_tokens_per_s"] = round(tps, 1)
            summary[f"{name}_{method}_ratio"] = round(tps / base, 3)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
