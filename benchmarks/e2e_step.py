"""A whole colocated GRPO step, phase by phase against each phase's floor measured in the same run,
and the same step in TRL's ``GRPOTrainer`` on the same model, prompts and lengths (issue 19).

Models: random weights, bf16, of two shapes: ``dense`` (Qwen3-1.7B's layer dimensions, untied
output layer) and ``moe`` (a slice of Qwen3-30B-A3B: its real layer dimensions, 128 experts top-8,
expert ffn 768, 151,936 vocabulary, ``--moe-layers`` layers). Prompts are random token ids of
``--prompt-len`` lengths (the same ids in both systems: drawn from characters of the benchmark
tokenizer, so TRL's text prompts tokenize back to them). Every sample's response length is forced:
a long-tailed (log-normal, ``--median``, ``--sigma``, capped at ``--max-response``) draw keyed by
the prompt's ids and the sample's index in its group; megarl asks the engine for exactly that many
tokens with EOS ignored, TRL's ``generate`` gets a logits processor that forbids EOS before the
length and forces it at the length. Both systems therefore generate the same tokens counts.

Per phase (megarl, means over the timed steps): gen (tokens/s, fraction of the decode bandwidth
floor: the bf16 weights plus every running row's KV cache read once per decode step at the
measured copy bandwidth), old_log_prob and update_actor (tokens/s, MFU against the measured bf16
matmul rate), weight sync (seconds, GB/s of bf16 weights, fraction of the measured copy rate),
release / resume (seconds) and the whole step (seconds, tokens/s); TRL: step seconds and tokens/s,
and the ratio megarl / TRL; each phase's memory estimate against its measured peak
(``benchmarks/e2e_memory.py``). A JSON file and a PNG of the breakdown go to ``--out``.

``--router-replay R3`` runs megarl's side with ``actor.router_replay.mode=R3`` (the engine returns
each token's routes, the actor replays them) and reports it as the shape ``moe_r3``; once the same
``--out`` holds ``moe`` too (the default run, on the same machine), ``moe_r3`` gains the step
throughput against it (``r3_throughput_ratio``, ``r3_cost``).

    python benchmarks/e2e_step.py --shape both               # the H200 run (issue 19)
    python benchmarks/e2e_step.py --shape moe --router-replay R3 --trl off   # R3's cost
    python benchmarks/e2e_step.py --smoke                    # tiny shapes on CPU (CI)
    megarl bench step --smoke
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import os
import random
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.e2e_memory import compare_estimates, write_estimates
from benchmarks.e2e_plot import plot
from benchmarks.e2e_trl import run_trl
from megarl.data.tiny_model import ALPHABET, SPECIAL_TOKENS, build_tokenizer
from megarl.rollout.interface import RolloutSample, SamplingParams
from megarl.rollout.local.step_profile import profile_delta, profile_summary
from megarl.rollout.sglang.client import SGLangClient

REPO = Path(__file__).resolve().parents[1]
QWEN3_VOCAB = 151936
QWEN3_CONTEXT = 40960  # max_position_embeddings of Qwen3-1.7B and Qwen3-30B-A3B
SHAPES: dict[str, dict[str, Any]] = {
    "dense": {"arch": "qwen3", "hidden_size": 2048, "num_hidden_layers": 28,
              "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
              "intermediate_size": 6144, "vocab_size": QWEN3_VOCAB, "tie_word_embeddings": False,
              "max_position_embeddings": QWEN3_CONTEXT},
    "moe": {"arch": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 8,
            "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
            "intermediate_size": 6144, "num_experts": 128, "num_experts_per_tok": 8,
            "moe_intermediate_size": 768, "vocab_size": QWEN3_VOCAB,
            "max_position_embeddings": QWEN3_CONTEXT},
}
SMOKE_SHAPES: dict[str, dict[str, Any]] = {
    "dense": {"arch": "qwen3", "hidden_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "intermediate_size": 128, "vocab_size": 512, "tie_word_embeddings": False},
    "moe": {"arch": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "intermediate_size": 128, "num_experts": 8, "num_experts_per_tok": 2,
            "moe_intermediate_size": 32, "vocab_size": 512},
}
# prompt ids are characters of the benchmark tokenizer, so a decoded prompt encodes back to them
PROMPT_IDS = list(range(len(SPECIAL_TOKENS), len(SPECIAL_TOKENS) + len(ALPHABET)))


# ---------------------------------------------------------------------------------------------
# the shared workload: model, prompts, forced lengths, reward
# ---------------------------------------------------------------------------------------------

def response_length(prompt_ids: list[int], index: int, median: float, sigma: float,
                    cap: int) -> int:
    """Sample ``index`` of the group of ``prompt_ids``: its forced response length (both
    systems draw it from the same key)."""
    key = hashlib.sha256(f"{','.join(map(str, prompt_ids))}:{index}".encode()).hexdigest()
    draw = random.Random(key).lognormvariate(math.log(median), sigma)
    return max(1, min(cap, round(draw)))


def score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    """A deterministic pseudo-random 0/1 reward of the response text (so GRPO groups have
    non-zero advantages); used by both systems."""
    return float(hashlib.sha256(solution_str.encode()).digest()[0] & 1)


def write_model(root: Path, shape: dict[str, Any], device: str) -> Path:
    """The random bf16 HF checkpoint, the benchmark tokenizer and a generation config."""
    if (root / "config.json").exists():
        return root
    from benchmarks.actor_throughput import write_hf_model

    write_hf_model(root, shape, device, torch.bfloat16)
    tok = build_tokenizer(shape["vocab_size"])
    tok.save_pretrained(root)
    cfg = json.loads((root / "config.json").read_text())
    (root / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": cfg.get("eos_token_id"), "pad_token_id": cfg.get("pad_token_id")}))
    return root


def write_prompts(path: Path, count: int, low: int, high: int, seed: int = 0) -> list[list[int]]:
    """``count`` prompts of random lengths in [low, high], as ids and as their text."""
    tok_text = {i: ALPHABET[i - len(SPECIAL_TOKENS)] for i in PROMPT_IDS}
    rng = random.Random(seed)
    rows, prompts = [], []
    for index in range(count):
        ids = [rng.choice(PROMPT_IDS) for _ in range(rng.randint(low, high))]
        prompts.append(ids)
        rows.append({"data_source": "e2e_bench", "input_ids": ids,
                     "prompt": [{"role": "user", "content": "".join(tok_text[i] for i in ids)}],
                     "text": "".join(tok_text[i] for i in ids),
                     "reward_model": {"style": "rule", "ground_truth": ""},
                     "extra_info": {"index": index}})
    from megarl.data.synthetic import write_rows

    write_rows(path, rows)
    return prompts


class ForcedLengthClient(SGLangClient):
    """Every sample is exactly :func:`response_length` tokens long (EOS ignored); a request for
    ``n`` samples goes as one request per sample, seed ``seed + j`` as the engine would use."""

    def __init__(self, urls: list[str], *, median: float, sigma: float, cap: int,
                 **kwargs: Any) -> None:
        super().__init__(urls, **kwargs)
        self.median, self.sigma, self.cap = median, sigma, cap

    async def generate_one(self, prompt_ids: list[int], params: SamplingParams,
                           **kwargs: Any) -> list[RolloutSample]:
        rid = kwargs.pop("rid", None) or uuid.uuid4().hex
        seed = params.seed if params.seed is not None else 0

        async def one(j: int) -> RolloutSample:
            length = response_length(prompt_ids, j, self.median, self.sigma, self.cap)
            out = await super(ForcedLengthClient, self).generate_one(
                prompt_ids, replace(params, n=1, seed=seed + j, max_new_tokens=length,
                                    ignore_eos=True, stop_token_ids=()),
                rid=f"{rid}-{j}", **kwargs)
            return replace(out[0], sample_index=j)

        return list(await asyncio.gather(*(one(j) for j in range(params.n))))


# ---------------------------------------------------------------------------------------------
# floors measured in the same run
# ---------------------------------------------------------------------------------------------

def _timed(fn: Any, device: str, warmup: int = 2, repeats: int = 5) -> float:
    """Median seconds of ``fn()``."""
    times = []
    for i in range(warmup + repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def measure_floors(device: str, smoke: bool) -> dict[str, float]:
    """The dtype's matmul rate (FLOP/s) and the copy rate (bytes copied per second; a copy of B
    bytes reads B and writes B) of this device, measured now; the 4.3 GiB of buffers go back
    to the device (this process would keep them cached through megarl's phases)."""
    floors = _measure_floors(device, smoke)
    if device == "cuda":
        torch.cuda.empty_cache()
    return floors


def _measure_floors(device: str, smoke: bool) -> dict[str, float]:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    n = 1024 if smoke else 8192
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    matmul_s = _timed(lambda: a @ b, device)
    src = torch.randn((1 << 22) if smoke else (1 << 30), device=device, dtype=dtype)
    dst = torch.empty_like(src)
    copy_s = _timed(lambda: dst.copy_(src), device)
    copied = src.numel() * src.element_size()
    return {"matmul_flops": 2 * n**3 / matmul_s, "copy_bytes_per_s": copied / copy_s}


def weight_bytes(model_dir: Path, dtype_bytes: int = 2) -> tuple[int, int]:
    """(all weights, weights a decode step reads: all but an untied input embedding) in bytes."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    total = sum(p.numel() for p in model.parameters())
    embed = model.get_input_embeddings().weight
    tied = embed is model.get_output_embeddings().weight
    return total * dtype_bytes, (total - (0 if tied else embed.numel())) * dtype_bytes


def decode_floor_s(model_dir: Path, prompts: list[list[int]], lengths: list[int],
                   copy_bytes_per_s: float, dtype_bytes: int = 2) -> float:
    """Seconds of generating ``lengths`` tokens for ``prompts`` (all at once) if every decode step
    only read the weights and each running row's KV cache once (reads at the copy rate x 2: a
    copy reads and writes)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    _, read = weight_bytes(model_dir, dtype_bytes)
    kv_per_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * dtype_bytes
    total = 0.0
    for step in range(max(lengths)):
        cached = sum(len(p) + step for p, n in zip(prompts, lengths) if step < n)
        total += read + cached * kv_per_token
    return total / (2 * copy_bytes_per_s)


def flops_per_token(model_dir: Path, seq_len: float, train: bool) -> float:
    from transformers import AutoConfig

    from benchmarks.actor_throughput import train_flops_per_token

    flops = train_flops_per_token(AutoConfig.from_pretrained(model_dir), int(seq_len))
    return flops if train else flops / 3


# ---------------------------------------------------------------------------------------------
# megarl
# ---------------------------------------------------------------------------------------------

def side(args: argparse.Namespace) -> str:
    """The folder of megarl's side under ``<out>/<shape>/``: ``megarl``, or ``megarl_r3``."""
    return "megarl" if args.router_replay == "disabled" else "megarl_r3"


def result_key(args: argparse.Namespace, shape: str) -> str:
    """The shape's name in the report: ``moe``, or ``moe_r3`` for the R3 run."""
    return shape if args.router_replay == "disabled" else f"{shape}_r3"


def micro_batch_overrides(args: argparse.Namespace, samples: int, recompute: str) -> list[str]:
    """megarl's micro-batching and recompute: token budgets (``--micro-batch-tokens``, what a
    colocated run at these sizes needs: 32 sequences of up to 2.5k tokens hold 24 GB of bf16
    logits alone) or ``--micro-batches`` equal splits."""
    knobs = [f"actor.recompute.granularity={recompute}"]
    if args.micro_batch_tokens:
        return [*knobs, "actor.use_dynamic_bsz=true",
                f"actor.ppo_max_token_len_per_gpu={args.micro_batch_tokens}"]
    return [*knobs, f"actor.ppo_micro_batch_size_per_gpu={max(1, samples // args.micro_batches)}"]


AUTO_RECOMPUTE_FRACTION = 0.7
"""``--recompute auto`` keeps every activation (``none``) when megarl's estimate of the update's
peak without recompute is at most this fraction of the device's memory, else recomputes whole
layers (``full``): the estimates are within 25% of the measured peaks (issue 29's bound), and
the colocated engine's weights stay on the device through the update."""


def resolve_recompute(args: argparse.Namespace, config: Path, overrides: list[str],
                      samples: int, device_bytes: int | None) -> str:
    """``--recompute``, with ``auto`` decided from megarl's memory estimate of the update
    (``megarl config show``'s) against ``device_bytes`` (None, off CUDA: ``full``)."""
    if args.recompute != "auto":
        return args.recompute
    if device_bytes is None:
        return "full"
    from megarl.config import derive_sizes, estimate, load_config
    from megarl.config.estimates import phase_estimates
    from megarl.config.model_info import load_model_info

    cfg, _ = load_config(str(config), [*overrides, *micro_batch_overrides(args, samples, "none"),
                                       *args.set])
    model = load_model_info(cfg.model.path)
    need = phase_estimates(estimate(cfg, model, derive_sizes(cfg, model)))["update_actor"]
    choice = "none" if need <= AUTO_RECOMPUTE_FRACTION * device_bytes else "full"
    print(f"--recompute auto: the update without recompute is estimated at {need / 2**30:.1f} "
          f"GiB of the device's {device_bytes / 2**30:.1f} GiB (none up to "
          f"{AUTO_RECOMPUTE_FRACTION:.0%}): {choice}", flush=True)
    return choice


STEP_PHASES = ("gen", "old_log_prob", "update_actor", "offload_actor", "sync_weights")
"""The phases each step's progress line shows (seconds)."""


def engine_profiles(urls: list[str]) -> list[dict[str, Any] | None]:
    """Each engine's step profile (``/get_server_info``; None where it has none, e.g. a real
    SGLang server or an engine that did not answer)."""
    out = []
    for url in urls:
        try:
            with urllib.request.urlopen(f"{url}/get_server_info", timeout=30) as reply:
                states = json.load(reply).get("internal_states") or [{}]
            out.append(states[0].get("step_profile"))
        except (OSError, ValueError):
            out.append(None)
    return out


def engine_metrics(after: list[dict[str, Any] | None],
                   before: list[dict[str, Any] | None]) -> dict[str, float]:
    """``engine/*`` metrics of one step: the engines' step profiles between two snapshots,
    summed over the engines (rows per step and the finished fraction: of the first engine)."""
    out: dict[str, float] = {}
    for now, old in zip(after, before):
        if now is None:
            continue
        for key, value in profile_summary(profile_delta(now, old)).items():
            summed = key not in ("decode_ms_per_step", "decode_rows_per_step",
                                 "decode_finished_fraction")
            out[f"engine/{key}"] = out.get(f"engine/{key}", 0.0) + value if summed else \
                out.get(f"engine/{key}", value)
    return out


def run_megarl(args: argparse.Namespace, shape: str, model: Path, data: Path,
               prompts: list[list[int]],
               measured: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Warm-up and timed colocated GRPO steps through the real trainer; per-step metrics.
    ``measured`` gets them as soon as the last step ended, before the teardown (which can be
    long at these sizes: engines, Ray, pinned host memory)."""
    from megarl.cluster.preflight import NodeMemoryError
    from megarl.config import load_config
    from megarl.config.schema import SchedulerConfig
    from megarl.demo import DEMOS
    from megarl.scheduler import build_scheduler
    from megarl.trainer import Trainer, preflight_refuses

    device = args.device
    spec = DEMOS["cuda" if device == "cuda" else "cpu"]
    samples = len(prompts) * args.n
    overrides = [
        f"model.path={model}", f"data.train_files=[{data}]", f"data.val_files=[{data}]",
        f"trainer.output_dir={args.out / shape / side(args)}", "trainer.loggers=[jsonl]",
        "trainer.resume=never", f"trainer.total_steps={args.warmup + args.steps}",
        f"data.train_batch_size={len(prompts)}", f"rollout.n={args.n}",
        f"actor.ppo_mini_batch_size={len(prompts)}",
        f"data.max_prompt_length={args.prompt_len[1]}",
        f"data.max_response_length={args.max_response}",
        f"reward.function={Path(__file__).resolve()}:score", "reward.num_workers=0",
        "actor.parallel.ep=1", "resources.train_pool.gpus_per_node=1", "ray.address=local",
        f"model.dtype={'bfloat16' if device == 'cuda' else 'float32'}",
        f"actor.router_replay.mode={args.router_replay}"]
    device_bytes = torch.cuda.get_device_properties(0).total_memory if device == "cuda" else None
    recompute = resolve_recompute(args, spec.config, overrides, samples, device_bytes)
    overrides += [*micro_batch_overrides(args, samples, recompute), *args.set]
    cfg, sources = load_config(str(spec.config), overrides)
    write_estimates(args.out / shape / side(args) / "estimates.json", cfg)
    if device == "cuda" and preflight_refuses(cfg, first=True):  # as `megarl train` does
        return {"refused": "the device preflight refused these settings (its lines above)"}
    if device == "cuda":  # what this driver keeps on the device is not megarl's: say it
        torch.cuda.empty_cache()
        print(f"[megarl {shape}] the benchmark's own process holds "
              f"{torch.cuda.memory_reserved() / 2**30:.2f} GiB reserved on the device",
              flush=True)
    trainer = Trainer(cfg, sources)
    history: list[dict[str, float]] = []
    walls: list[float] = []
    steps_log = args.out / shape / side(args) / "steps.jsonl"  # each step as it ends: a cut
    steps_log.parent.mkdir(parents=True, exist_ok=True)       # run keeps what it measured
    steps_log.write_text("")
    started = time.perf_counter()
    try:
        try:
            trainer.setup()
        except NodeMemoryError as err:  # a node's GPU or host memory: refused, as train does
            print(err, flush=True)
            return {"refused": "the preflight on the nodes refused these settings (above)"}
        print(f"[megarl {shape}] setup: {time.perf_counter() - started:.1f} s", flush=True)
        urls, limit = trainer.workers.client.urls, trainer.workers.client.max_concurrency_per_engine
        trainer.run(trainer.workers.client.close())
        trainer.workers.client = ForcedLengthClient(
            urls, median=args.median, sigma=args.sigma, cap=args.max_response,
            timeout_s=trainer.cfg.trainer.phase_timeout_s, max_concurrency_per_engine=limit)
        scheduler = build_scheduler(trainer, SchedulerConfig(mode="colocate_sync"))
        try:
            total = args.warmup + args.steps
            profiles = engine_profiles(urls)
            for k in range(total):
                start = time.perf_counter()
                metrics = scheduler.step(last=k == total - 1)
                walls.append(time.perf_counter() - start)
                profiles, before = engine_profiles(urls), profiles
                metrics.update(engine_metrics(profiles, before))
                if "engine/decode_steps" in metrics:
                    print(f"[megarl {shape}] engine: prefill {metrics['engine/prefill_s']:.1f} s "
                          f"({metrics['engine/prefill_tokens']:.0f} tokens), decode "
                          f"{metrics['engine/decode_s']:.1f} s ({metrics['engine/decode_steps']:.0f}"
                          f" steps, {metrics['engine/decode_rows_per_step']:.0f} rows, "
                          f"{metrics['engine/decode_ms_per_step']:.2f} ms each), scheduling "
                          f"{metrics['engine/schedule_s']:.1f} s", flush=True)
                history.append(metrics)
                with steps_log.open("a") as f:
                    f.write(json.dumps({"step": k + 1, "wall_s": walls[-1], **metrics}) + "\n")
                print(f"[megarl {shape}] step {k + 1}/{total}: {walls[-1]:.2f} s ("
                      + ", ".join(f"{name} {metrics.get('timing/' + name, float('nan')):.1f}"
                                  for name in STEP_PHASES)
                      + f"; peak {metrics.get('perf/max_memory_allocated_gb', float('nan')):.1f}"
                        " GB)", flush=True)
            if measured is not None:
                measured({"walls": walls[args.warmup:], "metrics": history[args.warmup:],
                          "recompute": recompute})
            scheduler.finish()
        finally:
            scheduler.close()
    finally:
        closing = time.perf_counter()
        trainer.close()
        print(f"[megarl {shape}] close: {time.perf_counter() - closing:.1f} s", flush=True)
    return {"walls": walls[args.warmup:], "metrics": history[args.warmup:],
            "recompute": recompute}


def load_megarl_steps(args: argparse.Namespace, shape: str) -> dict[str, Any]:
    """megarl's timed steps of an earlier run into the same ``--out`` (its ``steps.jsonl``),
    for a TRL-only run (``--megarl off``) that merges both into one report."""
    path = args.out / shape / side(args) / "steps.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    if len(rows) < args.warmup + args.steps:
        return {"refused": f"--megarl off needs megarl's {args.warmup + args.steps} steps in "
                           f"{path} (found {len(rows)}): run the same command with --trl off "
                           "first"}
    rows = rows[args.warmup:args.warmup + args.steps]
    return {"walls": [r.pop("wall_s") for r in rows],
            "metrics": [{k: v for k, v in r.items() if k != "step"} for r in rows]}


# ---------------------------------------------------------------------------------------------
# the report
# ---------------------------------------------------------------------------------------------

def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def summarize(args: argparse.Namespace, model: Path, prompts: list[list[int]],
              floors: dict[str, float], megarl: dict[str, Any],
              trl: dict[str, Any]) -> dict[str, Any]:
    """Per-phase figures and their floors."""
    lengths = [response_length(p, j, args.median, args.sigma, args.max_response)
               for p in prompts for j in range(args.n)]
    prompt_rows = [p for p in prompts for _ in range(args.n)]
    response_tokens = sum(lengths)
    all_tokens = response_tokens + sum(len(p) for p in prompt_rows)
    seq_len = all_tokens / len(lengths)
    m = megarl["metrics"]

    missing: list[str] = []

    def t(key: str) -> float:
        values = [row[key] for row in m if key in row]
        if not values:  # e.g. release/resume on separate pools: 0 s, and said so
            missing.append(key)
        return mean(values) if values else 0.0

    dtype_bytes = 2 if args.device == "cuda" else 4
    total_bytes, _ = weight_bytes(model, dtype_bytes)
    gen_floor = decode_floor_s(model, prompt_rows, lengths, floors["copy_bytes_per_s"],
                               dtype_bytes)
    step_s = mean(megarl["walls"])
    out: dict[str, Any] = {
        "response_tokens": response_tokens, "tokens": all_tokens,
        "mean_response_length": response_tokens / len(lengths),
        "trained_response_length": t("response_length/mean"),
        "gen_s": t("timing/gen"), "gen_tokens_per_s": response_tokens / t("timing/gen"),
        "gen_floor_s": gen_floor, "gen_floor_fraction": gen_floor / t("timing/gen"),
        "old_log_prob_s": t("timing/old_log_prob"),
        "update_actor_s": t("timing/update_actor"),
        "sync_s": t("timing/sync_weights"), "weight_bytes": total_bytes,
        "release_s": t("timing/release_rollout"),
        "resume_s": t("timing/resume_rollout") + t("timing/resume_rollout_kv"),
        "reward_s": t("timing/reward"), "step_s": step_s, "step_tokens_per_s": all_tokens / step_s,
    }
    for phase, train in (("old_log_prob", False), ("update_actor", True)):
        tps = all_tokens / out[f"{phase}_s"]
        out[f"{phase}_tokens_per_s"] = tps
        out[f"{phase}_mfu"] = tps * flops_per_token(model, seq_len, train) / floors["matmul_flops"]
    out["sync_gb_per_s"] = total_bytes / out["sync_s"] / 1e9
    out["sync_copy_fraction"] = total_bytes / out["sync_s"] / floors["copy_bytes_per_s"]
    out["other_s"] = step_s - sum(out[k] for k in ("gen_s", "old_log_prob_s", "update_actor_s",
                                                    "sync_s", "release_s", "resume_s", "reward_s"))
    out["phases_not_run"] = missing
    out["gen_profile"] = gen_profile(m, out["gen_s"])
    out["recompute"] = megarl.get("recompute")  # the actor's (--recompute auto decides it)
    out["memory_gb"] = {k.removeprefix("perf/"): max(row[k] for row in m if k in row)
                        for k in sorted({k for row in m for k in row}) if k.startswith("perf/")}
    out["memory_estimates"] = compare_estimates(model.parent / side(args) / "estimates.json",
                                                out["memory_gb"], total_bytes)
    trained = out["trained_response_length"]
    if abs(trained - out["mean_response_length"]) > 1e-6 * out["mean_response_length"]:
        out["error"] = (f"megarl trained on responses of mean {trained:.1f} tokens, but the "
                        f"forced mean is {out['mean_response_length']:.1f}: the engine cut them "
                        "(context length?); every per-token figure of this run is wrong")
    if "walls" in trl:
        # TRL's step may cover the first --trl-prompts prompts only: the ratio is of tokens/s
        rows = len(lengths) if trl.get("prompts") is None else trl["prompts"] * args.n
        trl_tokens = sum(lengths[:rows]) + sum(len(p) for p in prompt_rows[:rows])
        out["trl_prompts"] = rows // args.n
        out["trl_micro_batch"] = trl.get("micro_batch")
        out["trl_generation_batch"] = trl.get("generation_batch")
        out["trl_mean_completion_length"] = mean(trl["mean_completion_length"])
        out["trl_expected_completion_length"] = sum(lengths[:rows]) / rows + 1  # + its EOS
        out["trl_step_s"] = mean(trl["walls"])
        out["trl_tokens_per_s"] = trl_tokens / out["trl_step_s"]
        out["trl_step_s_all_prompts"] = all_tokens / out["trl_tokens_per_s"]
        out["megarl_over_trl"] = out["step_tokens_per_s"] / out["trl_tokens_per_s"]
    else:
        out["trl"] = trl
    return out


def gen_profile(metrics: list[dict[str, Any]], gen_s: float) -> dict[str, float]:
    """Where the generation phase's seconds went (the engines' step profiles, means over the
    timed steps): prefill, decode (and its steps by row bucket), scheduling, and the rest
    (``outside_steps_s``: requests arriving, results leaving, the client's own work)."""
    keys = sorted({k for row in metrics for k in row if k.startswith("engine/")})
    if not keys:
        return {}
    rows = [row for row in metrics if any(k.startswith("engine/") for k in row)]
    prof = {k.removeprefix("engine/"): mean([row.get(k, 0.0) for row in rows]) for k in keys}
    prof.pop("idle_s", None)  # the engine waits through the training phases too
    prof["outside_steps_s"] = gen_s - sum(prof.get(k, 0.0)
                                          for k in ("prefill_s", "decode_s", "schedule_s"))
    return prof


def write_json(args: argparse.Namespace, floors: dict[str, float],
               results: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``<out>/e2e_step.json``: the settings, the floors and each shape's results so far, updated
    in place: the shapes of an earlier run into the same ``--out`` (one shape per command on a
    device whose call limit fits one) stay, each with the settings and floors it ran under
    (``by_shape``); a shape run again replaces its entry. Returns every shape's results."""
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    path = args.out / "e2e_step.json"
    earlier = json.loads(path.read_text()) if path.exists() else {}
    merged = {k: v for k, v in earlier.get("results", {}).items() if k not in results}
    by_shape = {k: v for k, v in earlier.get("by_shape", {}).items() if k in merged}
    merged.update(results)
    by_shape.update({shape: {"settings": settings, "floors": floors} for shape in results})
    compare_router_replay(merged)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"settings": settings, "floors": floors, "results": merged,
                               "by_shape": by_shape}, indent=2))
    tmp.replace(path)
    return merged


def compare_router_replay(results: dict[str, dict[str, Any]]) -> None:
    """Where the report holds a shape run with R3 (``<shape>_r3``) and without it (``<shape>``),
    the R3 entry gets its step throughput as a fraction of the other's (``r3_throughput_ratio``)
    and the throughput R3 costs (``r3_cost`` = 1 - ratio; issue 30's bound is 5%). The tokens
    are the same forced lengths in both runs, so the ratio is one of step seconds."""
    for key, r3 in results.items():
        base = results.get(key.removesuffix("_r3")) if key.endswith("_r3") else None
        if base is None or "step_tokens_per_s" not in base or "step_tokens_per_s" not in r3:
            continue
        ratio = r3["step_tokens_per_s"] / base["step_tokens_per_s"]
        r3["r3_throughput_ratio"] = ratio
        r3["r3_cost"] = 1.0 - ratio
        r3["r3_phase_ratios"] = {k: r3[k] / base[k] for k in (
            "gen_s", "old_log_prob_s", "update_actor_s", "sync_s") if base.get(k)}


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("outputs/bench/e2e_step"))
    p.add_argument("--shape", choices=["dense", "moe", "both"], default="both")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--prompts", type=int, default=64, help="prompts per step")
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--prompt-len", type=int, nargs=2, default=[256, 512])
    p.add_argument("--max-response", type=int, default=2048)
    p.add_argument("--median", type=float, default=512.0, help="median forced response length")
    p.add_argument("--sigma", type=float, default=0.8, help="log-normal sigma of the lengths")
    p.add_argument("--moe-layers", type=int, default=8)
    p.add_argument("--micro-batches", type=int, default=16,
                   help="megarl's micro-batches per step with --micro-batch-tokens 0")
    p.add_argument("--micro-batch-tokens", type=int, default=16384,
                   help="megarl's token budget per micro-batch (actor.use_dynamic_bsz); 0: equal "
                        "splits of --micro-batches")
    p.add_argument("--recompute", choices=["auto", "none", "selective", "full"], default="auto",
                   help="megarl's actor.recompute.granularity; auto: none where megarl's "
                        "estimate of the update without it fits 70%% of the device, else full")
    p.add_argument("--steps", type=int, default=2, help="timed steps")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--trl", choices=["on", "off"], default="on")
    p.add_argument("--megarl", choices=["on", "off"], default="on",
                   help="off: TRL's side only, reported next to the megarl steps an earlier run "
                        "with --trl off left in the same --out (the two sides as two commands)")
    p.add_argument("--trl-vllm", action="store_true", help="TRL with vLLM colocated generation")
    p.add_argument("--trl-prompts", type=int, default=0,
                   help="TRL's step on the first K of the prompts (same ids, same forced lengths; "
                        "0: all); the ratio is then one of step tokens/s")
    p.add_argument("--trl-micro-batch", type=int, default=8,
                   help="TRL's per_device_train_batch_size (its default, 8)")
    p.add_argument("--trl-generation-batch", type=int, default=0,
                   help="rows per HF generate call in TRL (0: the most whose KV cache fits)")
    p.add_argument("--trl-warmup", type=int, default=None, help="TRL's untimed steps (--warmup)")
    p.add_argument("--trl-steps", type=int, default=None, help="TRL's timed steps (--steps)")
    p.add_argument("--router-replay", choices=["disabled", "R3"], default="disabled",
                   help="R3: megarl's side with actor.router_replay.mode=R3 (the MoE shape), "
                        "reported as moe_r3 next to an R3-less moe run in the same --out")
    p.add_argument("--smoke", action="store_true", help="tiny shapes and lengths (CPU, CI)")
    p.add_argument("--set", nargs="*", default=[], metavar="a.b.c=value",
                   help="megarl config overrides, after the benchmark's own (e.g. the memory "
                        "knobs: actor.recompute.granularity=full)")
    args = p.parse_args(argv)
    if args.router_replay != "disabled" and args.shape != "moe":
        p.error(f"--router-replay {args.router_replay} replays MoE routes: it needs --shape moe "
                f"(got --shape {args.shape})")
    if args.router_replay != "disabled" and args.trl == "on":
        p.error("--router-replay R3 times megarl's side only: add --trl off (TRL's side is the "
                "same as in the run without R3)")
    if args.smoke:
        args.prompts, args.n, args.prompt_len, args.max_response = 4, 2, [8, 16], 16
        args.median, args.steps, args.micro_batches = 6.0, 1, 2
        args.micro_batch_tokens, args.recompute = 0, "none"
        args.trl_micro_batch = min(args.trl_micro_batch, args.n)
    args.trl_warmup = args.warmup if args.trl_warmup is None else args.trl_warmup
    args.trl_steps = args.steps if args.trl_steps is None else args.trl_steps
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args.out.mkdir(parents=True, exist_ok=True)
    shapes = ["dense", "moe"] if args.shape == "both" else [args.shape]
    floors = measure_floors(args.device, args.smoke)
    print(f"floors: matmul {floors['matmul_flops'] / 1e12:.1f} TFLOP/s, copy "
          f"{floors['copy_bytes_per_s'] / 1e9:.0f} GB/s", flush=True)
    results: dict[str, dict[str, Any]] = {}
    for shape in shapes:
        dims = dict((SMOKE_SHAPES if args.smoke else SHAPES)[shape])
        if shape == "moe" and not args.smoke:
            dims["num_hidden_layers"] = args.moe_layers
        model = write_model(args.out / shape / "model", dims,
                            "cuda" if args.device == "cuda" else "cpu")
        rows_path = args.out / shape / "prompts.jsonl"
        prompts = write_prompts(rows_path, args.prompts, *args.prompt_len)

        def measured(partial: dict[str, Any], shape: str = shape, model: Path = model,
                     prompts: list[list[int]] = prompts) -> None:
            """The figures so far on disk before the teardown (TRL's side still to come)."""
            results[result_key(args, shape)] = summarize(args, model, prompts, floors, partial,
                                                         {"skipped": "not run yet"})
            write_json(args, floors, results)

        if args.megarl == "off":  # TRL's side only, next to a megarl run in the same --out
            megarl = load_megarl_steps(args, shape)
        else:
            megarl = run_megarl(args, shape, model, rows_path, prompts, measured)
        key = result_key(args, shape)
        if "refused" in megarl:
            results[key] = {"error": megarl["refused"]}
            print(f"error: {key}: {megarl['refused']}", file=sys.stderr, flush=True)
            continue
        trl = run_trl(args, shape, model, rows_path) if args.trl == "on" else {"skipped": "--trl off"}
        results[key] = summarize(args, model, prompts, floors, megarl, trl)
        print(json.dumps({key: results[key]}, indent=1), flush=True)
        if "error" in results[key]:
            print(f"error: {key}: {results[key]['error']}", file=sys.stderr, flush=True)
    every = write_json(args, floors, results)
    title = (f"{args.prompts} prompts x {args.n}, prompts {args.prompt_len[0]}-"
             f"{args.prompt_len[1]} tokens, responses log-normal(median {args.median:.0f}, sigma "
             f"{args.sigma}) <= {args.max_response}, {args.device}")
    ran = {shape: r for shape, r in every.items() if "step_s" in r}
    if ran:
        plot(ran, args.out / "e2e_step.png", title)
    print(f"{'shape':<6}{'step s':>8}{'tok/s':>10}{'gen/floor':>10}{'oldlp MFU':>10}"
          f"{'upd MFU':>9}{'sync/copy':>10}{'TRL s':>8}{'x TRL':>7}")
    for shape, r in ran.items():
        print(f"{shape:<6}{r['step_s']:>8.2f}{r['step_tokens_per_s']:>10.0f}"
              f"{r['gen_floor_fraction']:>10.1%}{r['old_log_prob_mfu']:>10.1%}"
              f"{r['update_actor_mfu']:>9.1%}{r['sync_copy_fraction']:>10.1%}"
              f"{r.get('trl_step_s', float('nan')):>8.2f}{r.get('megarl_over_trl', float('nan')):>7.1f}")
    for shape, r in ran.items():
        print(f"{shape} memory, estimate / measured peak: " + ", ".join(
            f"{phase} {e['estimate_gb']:.1f} / {e['measured_gb']:.1f} GiB ({e['ratio']:.2f})"
            for phase, e in r.get("memory_estimates", {}).items() if e["measured_gb"]))
        if "r3_cost" in r:
            print(f"{shape}: step throughput {r['r3_throughput_ratio']:.3f}x the run without "
                  f"R3 (R3 costs {r['r3_cost']:.1%})")
    print(f"wrote {args.out / 'e2e_step.json'} and {args.out / 'e2e_step.png'}")
    return 1 if any("error" in r for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
