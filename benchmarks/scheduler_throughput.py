"""Scheduler throughput with long-tailed response lengths: fully_async and one_step_off vs
colocate_sync, measured in the same run on the same stack.

The real stack (Ray pools, a Megatron actor worker on the train pool, an embedded engine on the
rollout pool, SGLang-protocol weight sync, GRPO on the demo task) runs the real schedulers in
turn. Response lengths follow a long-tailed distribution: every sample gets its own cap on new
tokens, drawn from a log-normal distribution (median ``--max-response-length / --median-div``,
``--sigma``) by its sampling seed, and stop tokens are ignored, so every sample is exactly as
long as its cap. In a synchronous step the engines then idle while the longest samples finish; the
overlapping schedulers keep them busy. Each mode first runs ``--warmup`` steps, then the timed
``--steps``; before each mode the step counter and data position are reset, so every mode
trains on the same prompts with the same length caps. The modes run interleaved ``--rounds``
times (the development machines are shared, so their load drifts) and each mode's throughput
is over all its rounds.

Reported per mode: trained response tokens per second of wall time, its ratio to
colocate_sync, the trainer's and the rollout's idle ratios (means over the timed steps), mean
staleness, the distribution of trained response lengths (mean, quantiles, max: a scheduler
that drops or delays long samples trains on shorter ones than colocate_sync), and for
fully_async the partial and dropped counts. A JSON file and a PNG go to
``--out``.

    python benchmarks/scheduler_throughput.py                 # CPU, a few minutes
    python benchmarks/scheduler_throughput.py --smoke         # short lengths, 2 steps
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megarl.config import load_config
from megarl.config.schema import SchedulerConfig
from megarl.demo import DEMO_CONFIG, prepare_demo_assets
from megarl.rollout.interface import RolloutSample, SamplingParams
from megarl.rollout.sglang.client import SGLangClient
from megarl.scheduler import build_scheduler
from megarl.trainer import Trainer

MODES = ("colocate_sync", "one_step_off", "fully_async")


class LongTailClient(SGLangClient):
    """A rollout client whose every sample is as long as a cap drawn from its seed.

    Requests for ``n > 1`` samples are split into one request per sample (seed ``seed + j``,
    the sample the engine would have drawn anyway). A continuation of a partial rollout keeps
    the sample's seed and asks for ``max_new_tokens`` minus its prefix
    (:mod:`megarl.scheduler.partial`), so its cap is what remains of the same draw."""

    def __init__(self, urls: list[str], *, full_length: int, median: float, sigma: float,
                 **kwargs: Any) -> None:
        super().__init__(urls, **kwargs)
        self.full_length = full_length
        self.median = median
        self.sigma = sigma

    def cap(self, seed: int) -> int:
        """The sample's total response length."""
        draw = random.Random(seed).lognormvariate(math.log(self.median), self.sigma)
        return max(1, min(self.full_length, round(draw)))

    async def generate_one(self, prompt_ids: list[int], params: SamplingParams,
                           **kwargs: Any) -> list[RolloutSample]:
        """One prompt's samples, each capped at its own drawn length."""
        if params.seed is None:
            raise ValueError("LongTailClient needs per-prompt seeds")
        if params.n > 1:
            rid = kwargs.pop("rid", None) or uuid.uuid4().hex
            parts = await asyncio.gather(*(
                self.generate_one(prompt_ids, replace(params, n=1, seed=params.seed + j),
                                  rid=f"{rid}-{j}", **kwargs) for j in range(params.n)))
            return [replace(p[0], sample_index=j) for j, p in enumerate(parts)]
        done = self.full_length - params.max_new_tokens
        left = max(1, min(params.max_new_tokens, self.cap(params.seed) - done))
        return await super().generate_one(
            prompt_ids, replace(params, max_new_tokens=left, ignore_eos=True, stop_token_ids=()),
            **kwargs)


def build_trainer(out: Path, args: argparse.Namespace) -> Trainer:
    """The demo stack: one actor worker, one embedded engine, separate pools."""
    model, train, val = prepare_demo_assets(out / "assets")
    overrides = [
        f"model.path={model}", f"data.train_files=[{train}]", f"data.val_files=[{val}]",
        f"trainer.output_dir={out / 'run'}", "trainer.loggers=[jsonl]", "trainer.resume=never",
        f"trainer.total_steps={args.warmup + args.steps}", f"data.train_batch_size={args.prompts}",
        f"rollout.n={args.n}", f"actor.ppo_mini_batch_size={args.prompts}",
        f"actor.ppo_micro_batch_size_per_gpu={args.prompts * args.n}",
        f"data.max_response_length={args.max_response_length}",
        "resources.train_pool.gpus_per_node=1", "actor.parallel.ep=1", "reward.num_workers=0",
        "ray.num_cpus=4", "ray.address=local", "actor.optim.lr=1e-4"]
    cfg, sources = load_config(str(DEMO_CONFIG), overrides)
    return Trainer(cfg, sources)


def run_mode(trainer: Trainer, mode: str, args: argparse.Namespace,
             make_client: Callable[[], SGLangClient],
             lengths: list[int]) -> tuple[float, list[dict[str, float]]]:
    """Warm-up and timed steps of one scheduler: the timed steps' wall time and metrics; the
    response lengths of the samples trained in the timed steps are appended to ``lengths``."""
    cfg = SchedulerConfig(mode=mode, staleness_threshold=args.staleness,
                          trigger_parameter_sync_step=1, partial_rollout=True)
    trainer.steps_done = 0
    trainer.loader.load_state_dict(args.loader_start)
    scheduler = build_scheduler(trainer, cfg, make_client=make_client)
    history: list[dict[str, float]] = []
    train_on = trainer.train_on

    def recording_train_on(batch: Any, metrics: dict[str, float]) -> None:
        if len(history) >= args.warmup:
            lengths.extend(len(s.response_ids) for s in batch.samples)
        train_on(batch, metrics)

    trainer.train_on = recording_train_on  # type: ignore[method-assign]
    try:
        total = args.warmup + args.steps
        for k in range(total):
            if k == args.warmup:
                start = time.perf_counter()
            history.append(scheduler.step(last=k == total - 1))
        wall = time.perf_counter() - start
        scheduler.finish()
    finally:
        del trainer.train_on
        scheduler.close()
    return wall, history[args.warmup:]


def length_distribution(lengths: list[int]) -> dict[str, float]:
    """Mean, quantiles and maximum of trained response lengths."""
    ordered = sorted(lengths)

    def quantile(q: float) -> float:
        return float(ordered[min(len(ordered) - 1, int(q * len(ordered)))])

    return {"trained_length_mean": sum(ordered) / len(ordered), "trained_length_p50":
            quantile(0.5), "trained_length_p90": quantile(0.9), "trained_length_p99":
            quantile(0.99), "trained_length_max": float(ordered[-1]),
            "trained_samples": float(len(ordered))}


def summarize(mode: str, walls: list[float], timed: list[dict[str, float]],
              samples_per_step: int, lengths: list[int]) -> dict[str, float]:
    """Throughput over every round of a mode, the means of its per-step metrics, and its
    trained length distribution."""
    tokens = sum(m["response_length/mean"] * samples_per_step for m in timed)

    def mean(key: str) -> float:
        values = [m[key] for m in timed if key in m]
        return sum(values) / len(values) if values else float("nan")

    result = {"wall_s": sum(walls), "wall_s_per_round": walls, "response_tokens": tokens,
              "tokens_per_s": tokens / sum(walls), "steps_per_s": len(timed) / sum(walls),
              "trainer_idle_ratio": mean(f"{mode}/trainer/idle_ratio"),
              "rollouter_idle_ratio": mean(f"{mode}/rollouter/idle_ratio"),
              "staleness_mean": mean("staleness/mean"),
              "response_length_mean": mean("response_length/mean"),
              "response_length_max": max(m["response_length/max"] for m in timed),
              **length_distribution(lengths)}
    if mode == "fully_async":
        result["partial_samples"] = sum(m["fully_async/partial/count"] for m in timed)
        result["stale_dropped_groups"] = sum(m["fully_async/count/stale_dropped"] for m in timed)
    return result


def plot(results: dict[str, dict[str, float]], path: Path, title: str) -> None:
    """Relative throughput and idle ratios, one bar group per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(results)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    ratios = [results[m]["relative_throughput"] for m in modes]
    bars = left.bar(modes, ratios, color=["#888888", "#4c72b0", "#dd8452"][:len(modes)])
    left.bar_label(bars, fmt="%.2fx")
    left.axhline(1.0, color="black", linewidth=0.8)
    left.set_ylabel("trained tokens/s relative to colocate_sync")
    left.set_title("throughput")
    x = range(len(modes))
    width = 0.38
    right.bar([i - width / 2 for i in x], [results[m]["trainer_idle_ratio"] for m in modes],
              width, label="trainer idle")
    right.bar([i + width / 2 for i in x], [results[m]["rollouter_idle_ratio"] for m in modes],
              width, label="rollout idle")
    right.set_xticks(list(x), modes)
    right.set_ylim(0, 1)
    right.set_ylabel("fraction of step wall time")
    right.set_title("idle ratios")
    right.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("outputs/bench/scheduler"))
    p.add_argument("--steps", type=int, default=6, help="timed steps per mode")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rounds", type=int, default=2,
                   help="times the three modes run, interleaved (throughput sums the rounds)")
    p.add_argument("--prompts", type=int, default=8, help="prompts per step")
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument("--max-response-length", type=int, default=256)
    p.add_argument("--median-div", type=float, default=8.0,
                   help="median length = max-response-length / this")
    p.add_argument("--sigma", type=float, default=1.0, help="log-normal sigma of the lengths")
    p.add_argument("--staleness", type=float, default=1.0,
                   help="fully_async scheduler.staleness_threshold")
    p.add_argument("--smoke", action="store_true", help="short lengths, 2 timed steps")
    args = p.parse_args(argv)
    if args.smoke:
        args.steps, args.max_response_length, args.prompts, args.rounds = 2, 32, 4, 1
    return args


def main(argv: list[str]) -> int:
    args = parse(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args.out.mkdir(parents=True, exist_ok=True)
    trainer = build_trainer(args.out, args)
    results: dict[str, dict[str, float]] = {}
    try:
        trainer.setup()
        args.loader_start = trainer.loader.state_dict()
        urls = trainer.workers.client.urls
        median = args.max_response_length / args.median_div

        def make_client() -> LongTailClient:
            return LongTailClient(urls, full_length=args.max_response_length, median=median,
                                  sigma=args.sigma, timeout_s=trainer.cfg.trainer.phase_timeout_s)

        trainer.run(trainer.workers.client.close())
        trainer.workers.client = make_client()  # colocate_sync generates through this one
        runs: dict[str, tuple[list[float], list[dict[str, float]], list[int]]] = {
            m: ([], [], []) for m in MODES}
        for round_index in range(args.rounds):  # interleaved: load drift hits every mode
            for mode in MODES:
                wall, timed = run_mode(trainer, mode, args, make_client, runs[mode][2])
                runs[mode][0].append(wall)
                runs[mode][1].extend(timed)
                print(f"round {round_index} {mode}: {wall:.2f} s", flush=True)
        for mode, (walls, timed, lengths) in runs.items():
            results[mode] = summarize(mode, walls, timed, args.prompts * args.n, lengths)
    finally:
        trainer.close()
    base = results["colocate_sync"]["tokens_per_s"]
    for mode in MODES:
        results[mode]["relative_throughput"] = results[mode]["tokens_per_s"] / base
    setting = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
               if k != "loader_start"}
    (args.out / "scheduler_throughput.json").write_text(json.dumps(
        {"settings": setting, "results": results}, indent=2))
    title = (f"{args.prompts} prompts x {args.n} samples, lengths log-normal(median "
             f"{args.max_response_length / args.median_div:.0f}, sigma {args.sigma}) capped at "
             f"{args.max_response_length}; fully_async staleness {args.staleness}")
    plot(results, args.out / "scheduler_throughput.png", title)
    print(f"{'mode':<15}{'tokens/s':>10}{'x sync':>8}{'trainer idle':>14}{'rollout idle':>14}"
          f"{'staleness':>11}")
    for mode, r in results.items():
        print(f"{mode:<15}{r['tokens_per_s']:>10.1f}{r['relative_throughput']:>8.2f}"
              f"{r['trainer_idle_ratio']:>14.2f}{r['rollouter_idle_ratio']:>14.2f}"
              f"{r['staleness_mean']:>11.2f}")
    print(f"{'mode':<15}{'trained response length: mean':>30}{'p50':>6}{'p90':>6}{'p99':>6}"
          f"{'max':>6}{'dropped groups':>16}")
    for mode, r in results.items():
        print(f"{mode:<15}{r['trained_length_mean']:>30.1f}{r['trained_length_p50']:>6.0f}"
              f"{r['trained_length_p90']:>6.0f}{r['trained_length_p99']:>6.0f}"
              f"{r['trained_length_max']:>6.0f}{r.get('stale_dropped_groups', 0):>16.0f}")
    print(f"wrote {args.out / 'scheduler_throughput.json'} and "
          f"{args.out / 'scheduler_throughput.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
