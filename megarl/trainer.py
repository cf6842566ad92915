"""The RL trainer: ``megarl train --config CONFIG [a.b.c=value ...]``.

One step (``colocate_sync``), read top to bottom in :meth:`Trainer.step`:

1. take ``data.train_batch_size`` prompts;
2. generate ``rollout.n`` responses per prompt on the rollout engines (token ids, the engine's
   log-probs, the ``weight_version`` of every sample);
3. score them (batched reward manager);
4. compute advantages on the driver (``megarl.algo``);
5. recompute old log-probs on the actor (and reference log-probs when a KL term needs them);
   compare with the engine's log-probs; rollout correction when configured;
6. update the actor: ``ppo_epochs`` x mini-batches, each split over the data-parallel ranks;
7. stream the new weights to every engine; ``weight_version += 1``;
8. log metrics, run the health monitor.

Workers: one :class:`~megarl.megatron.worker.ActorWorker` per train-pool slot and one
:class:`~megarl.rollout.server_worker.RolloutServerWorker` per engine, in Ray placement groups.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from megarl.algo import compute_advantages, compute_rollout_correction, rollout_probs_diff_metrics
from megarl.batch import StepBatch, even_shares
from megarl.config import RunConfig, load_config, validate_config
from megarl.config.loader import ConfigError
from megarl.config.render import render_config
from megarl.metrics.health import HealthMonitor, HealthThresholds
from megarl.metrics.timing import reduce_metrics, throughput_metrics, timer
from megarl.metrics.trackers import MultiTracker, TrackerSettings
from megarl.rollout.interface import SamplingParams
from megarl.trainer_setup import Workers, build_workers, shutdown_workers

# Config settings whose machinery is not part of this trainer yet: refused, never ignored.
NOT_BUILT = (
    ("trainer.save_every", lambda c: c.trainer.save_every > 0,
     "checkpoint saving is not built into the trainer yet; set trainer.save_every=0"),
    ("scheduler.mode", lambda c: c.scheduler.mode != "colocate_sync",
     "only scheduler.mode=colocate_sync is built yet"),
    ("algorithm.adv_estimator", lambda c: c.algorithm.adv_estimator not in ("grpo", "rloo"),
     "the critic (gae) and token-level-reward estimators are not wired yet; use grpo or rloo"),
    ("actor.router_replay.mode", lambda c: c.actor.router_replay.mode != "disabled",
     "router replay is not wired into the trainer yet; set actor.router_replay.mode=disabled"),
)


class Trainer:
    """Drives the train and rollout pools through RL steps."""

    def __init__(self, cfg: RunConfig, sources: dict[str, str] | None = None) -> None:
        self.cfg = cfg
        self.output_dir = Path(cfg.trainer.output_dir)
        if self.is_driver:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            (self.output_dir / "config.yaml").write_text(render_config(cfg, sources or {}))
        self.loop = asyncio.new_event_loop()
        self.weight_version = 0
        self.steps_done = 0
        self.workers: Workers | None = None

    # ----- setup -----
    def setup(self) -> None:
        """Start pools, workers and engines; load data; open trackers."""
        from megarl.data.dataset import load_prompt_dataset
        from megarl.data.loader import PromptLoader
        from megarl.reward import RewardManager

        cfg = self.cfg
        self.dataset = load_prompt_dataset(cfg.data.train_files, cfg.model.path,
                                           max_prompt_length=cfg.data.max_prompt_length,
                                           prompt_key=cfg.data.prompt_key)
        self.loader = PromptLoader(self.dataset, cfg.data.train_batch_size, seed=cfg.data.seed,
                                   shuffle=cfg.data.shuffle)
        self.tokenizer = self.dataset.tokenizer
        self.val_dataset = None
        if cfg.trainer.val_every:
            self.val_dataset = load_prompt_dataset(
                cfg.data.val_files, cfg.model.path, max_prompt_length=cfg.data.max_prompt_length,
                prompt_key=cfg.data.prompt_key)
        self.rewards = RewardManager(cfg.reward.function, batched=cfg.reward.batched,
                                     num_workers=cfg.reward.num_workers,
                                     timeout_s=cfg.reward.timeout_s,
                                     format_score=cfg.reward.format_score)
        self.workers = build_workers(cfg, self.output_dir)
        loggers = cfg.trainer.loggers if self.is_driver else []
        self.tracker = MultiTracker.from_names(loggers, TrackerSettings(
            output_dir=self.output_dir, total_steps=cfg.trainer.total_steps,
            project_name=cfg.trainer.project_name, experiment_name=cfg.trainer.experiment_name,
            wandb_proxy=cfg.trainer.wandb_proxy, run_config=cfg.model_dump(mode="json")))
        self.health = HealthMonitor(thresholds=HealthThresholds(
            clip_ratio=cfg.actor.clip_ratio_high))

    def close(self) -> None:
        """Stop workers and engines, close trackers."""
        if self.workers is not None:
            shutdown_workers(self.workers, self.loop)
            self.workers = None
        if getattr(self, "rewards", None) is not None:
            self.rewards.close()
        if getattr(self, "tracker", None) is not None:
            self.tracker.close()

    def on_driver(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the driver. In the no-Ray mode every torchrun rank runs the trainer:
        rank 0 runs ``fn`` and the others receive its result, so all ranks see the same data."""
        if self.cfg.trainer.worker_group != "naive":
            return fn()
        import torch.distributed as dist

        box = [fn() if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    @property
    def is_driver(self) -> bool:
        """Whether this process logs and writes outputs (always with Ray; rank 0 under
        torchrun)."""
        if self.cfg.trainer.worker_group != "naive":
            return True
        import torch.distributed as dist

        return dist.get_rank() == 0

    def run(self, coro: Any) -> Any:
        """Run a coroutine of the async rollout client on the trainer's event loop."""
        return self.loop.run_until_complete(coro)

    # ----- the step -----
    def fit(self) -> list[dict[str, float]]:
        """Run ``trainer.total_steps`` steps; returns every step's metrics."""
        history = []
        val_every = self.cfg.trainer.val_every
        for step in range(1, self.cfg.trainer.total_steps + 1):
            metrics = self.step(self.loader.next_batch())
            if val_every and (step % val_every == 0 or step == self.cfg.trainer.total_steps):
                with timer("validate", metrics):
                    metrics.update(self.validate())
            for line in self.health.check(metrics, step):
                self.tracker.warn(line)
            metrics.update(self.health.metrics())
            self.tracker.log(metrics, step)
            history.append(metrics)
        self.finish()
        return history

    def validate(self) -> dict[str, float]:
        """Greedy answers to every validation prompt; mean score overall and per data source."""
        from megarl.data.loader import PromptLoader
        from megarl.reward import RewardSample

        tok, cfg = self.tokenizer, self.cfg
        rows = list(self.val_dataset)
        params = SamplingParams(max_new_tokens=cfg.data.max_response_length, temperature=0.0,
                                n=1, stop_token_ids=[tok.eos_token_id])
        size = cfg.data.val_batch_size or len(rows)
        samples = []
        for batch in PromptLoader(rows, size, shuffle=False, drop_last=False):
            samples += self.on_driver(lambda b=batch: self.run(self.workers.client.generate(
                [p["input_ids"] for p in b], params, return_logprob=False)))
        result = self.on_driver(lambda: self.rewards.score([
            RewardSample(row["data_source"], tok.decode(s.response_ids, skip_special_tokens=True),
                         row["ground_truth"], row.get("extra_info") or {})
            for row, s in zip(rows, samples)]))
        metrics = {"val/score/mean": sum(result.scores) / len(result.scores)}
        for source in sorted({row["data_source"] for row in rows}):
            scores = [x for row, x in zip(rows, result.scores) if row["data_source"] == source]
            metrics[f"val/{source}/score/mean"] = sum(scores) / len(scores)
        return metrics

    def step(self, prompts: list[dict[str, Any]]) -> dict[str, float]:
        """One colocate_sync RL step on a batch of prompt rows; returns its metrics."""
        metrics: dict[str, float] = {}
        start = time.perf_counter()
        with timer("gen", metrics):
            batch = self.generate(prompts)
        with timer("reward", metrics):
            metrics.update(self.score(batch))
        with timer("adv", metrics):
            self.compute_advantages(batch)
        with timer("old_log_prob", metrics):
            metrics.update(self.compute_old_log_probs(batch))
        if self.cfg.ref.enabled:
            with timer("ref", metrics):
                batch.ref_log_probs = self.compute_log_probs(batch, use_ref=True)["log_probs"]
        with timer("update_actor", metrics):
            metrics.update(self.update_actor(batch))
        with timer("sync_weights", metrics):
            metrics.update(self.sync_weights())
        metrics["timing/step"] = time.perf_counter() - start
        metrics.update(self.batch_metrics(batch, metrics))
        self.steps_done += 1
        return metrics

    def generate(self, prompts: list[dict[str, Any]]) -> StepBatch:
        """``rollout.n`` samples per prompt from the engines."""
        cfg, tok = self.cfg, self.tokenizer
        stop = [tok.eos_token_id] if tok.eos_token_id is not None else []
        params = SamplingParams(max_new_tokens=cfg.data.max_response_length,
                                temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                                top_k=cfg.rollout.top_k, n=cfg.rollout.n, stop_token_ids=stop)
        # one seed per prompt, from the run seed and the step: the samples do not depend on
        # how the engines batch the requests, so a run is reproducible
        base = (cfg.trainer.seed * 1_000_003 + self.steps_done * 10_007) % 2**31
        seeds = [base + i * cfg.rollout.n for i in range(len(prompts))]
        samples = self.on_driver(lambda: self.run(self.workers.client.generate(
            [p["input_ids"] for p in prompts], params, return_logprob=True, seeds=seeds)))
        return StepBatch(samples=samples, prompts=prompts, n=cfg.rollout.n)

    def score(self, batch: StepBatch) -> dict[str, float]:
        """Rewards of every sample; returns the reward metrics."""
        from megarl.reward import RewardSample

        items = []
        for i, sample in enumerate(batch.samples):
            row = batch.prompts[i // batch.n]
            text = self.tokenizer.decode(sample.response_ids, skip_special_tokens=True)
            items.append(RewardSample(row["data_source"], text, row["ground_truth"],
                                      row.get("extra_info") or {}))
        result = self.on_driver(lambda: self.rewards.score(items))
        batch.scores = torch.tensor(result.scores, dtype=torch.float32)
        return dict(result.metrics)

    def compute_advantages(self, batch: StepBatch) -> None:
        """Advantages per response token (the estimator of ``algorithm.adv_estimator``)."""
        alg = self.cfg.algorithm
        if alg.adv_estimator not in ("grpo", "rloo"):
            raise ValueError(f"algorithm.adv_estimator={alg.adv_estimator!r} needs a critic or "
                             "token-level rewards, which this trainer does not run yet; use "
                             "grpo or rloo")
        inputs: dict[str, Any] = {"scores": batch.scores, "response_mask": batch.response_mask(),
                                  "index": batch.group_index()}
        if alg.adv_estimator == "grpo":
            inputs["norm_adv_by_std_in_grpo"] = alg.norm_adv_by_std_in_grpo
        batch.advantages, _ = compute_advantages(alg.adv_estimator, **inputs)

    def compute_log_probs(self, batch: StepBatch, use_ref: bool = False) -> dict[str, list]:
        """Trainer log-probs (response part) of every sample, computed over the DP ranks."""
        w = self.workers
        sequences = batch.sequences()
        shares = even_shares(len(sequences), w.dp_size)
        per_rank = [([sequences[i] for i in shares[w.dp_rank[r]]], use_ref)
                    for r in range(w.actor.world_size)]
        results = w.actor.execute_rank_split("compute_log_probs", per_rank)
        full: list[list[float]] = [[] for _ in sequences]
        for rank, result in enumerate(results):
            if w.reports[rank]:
                for i, values in zip(shares[w.dp_rank[rank]], result["log_probs"]):
                    full[i] = values
        return {"log_probs": [batch.response_slice(full[i], i) for i in range(len(full))]}

    def compute_old_log_probs(self, batch: StepBatch) -> dict[str, float]:
        """Old log-probs, the engine/trainer log-prob gap, and rollout correction weights."""
        batch.old_log_probs = self.compute_log_probs(batch)["log_probs"]
        old, mask = batch.padded(batch.old_log_probs), batch.response_mask()
        rollout = batch.rollout_log_probs()
        metrics = {f"training/{k}": float(v)
                   for k, v in rollout_probs_diff_metrics(old, rollout, mask).items()}
        rc = self.cfg.algorithm.rollout_correction
        weights, batch.loss_mask, corr = compute_rollout_correction(
            old, rollout, mask, rollout_is=rc.rollout_is,
            rollout_is_threshold=rc.rollout_is_threshold, rollout_rs=rc.rollout_rs,
            rollout_rs_threshold=(rc.rollout_rs_threshold_lower, rc.rollout_rs_threshold or 2.0))
        batch.rollout_is_weights = weights
        if rc.rollout_is or rc.rollout_rs:
            metrics.update({f"rollout_corr/{k}": float(v) for k, v in corr.items()
                            if not k.startswith("rollout_probs_diff")})
        return metrics

    def update_actor(self, batch: StepBatch) -> dict[str, float]:
        """``ppo_epochs`` passes of mini-batch updates; each mini-batch is split over DP."""
        w, cfg = self.workers, self.cfg
        per_mini = cfg.actor.ppo_mini_batch_size * batch.n
        minis = [list(range(s, min(s + per_mini, len(batch)))) for s in range(0, len(batch),
                                                                              per_mini)]
        records = [batch.train_record(i) for i in range(len(batch))]
        per_dp: list[list[list[dict]]] = [[] for _ in range(w.dp_size)]
        for _ in range(cfg.actor.ppo_epochs):
            for mini in minis:
                for d, share in enumerate(even_shares(len(mini), w.dp_size)):
                    per_dp[d].append([records[mini[j]] for j in share])
        per_rank = [(per_dp[w.dp_rank[r]],) for r in range(w.actor.world_size)]
        results = w.actor.execute_rank_split("update", per_rank)
        return reduce_metrics(results[0])

    def sync_weights(self) -> dict[str, float]:
        """Stream the actor's weights to every engine; bump ``weight_version``."""
        self.weight_version += 1
        sent = self.workers.weight_sync(str(self.weight_version))
        return {"checkpoint_engine/bytes": float(sent),
                "rollout/weight_version": float(self.weight_version)}

    def batch_metrics(self, batch: StepBatch, metrics: dict[str, float]) -> dict[str, float]:
        """Response lengths, score and advantage statistics, throughput."""
        lengths = torch.tensor([len(s.response_ids) for s in batch.samples], dtype=torch.float32)
        max_len = self.cfg.data.max_response_length
        out = {
            "response_length/mean": float(lengths.mean()),
            "response_length/max": float(lengths.max()),
            "response_length/min": float(lengths.min()),
            "response_length/clip_ratio": float((lengths >= max_len).float().mean()),
            "response/aborted_ratio": float(sum(s.finish_reason == "abort"
                                                for s in batch.samples) / len(batch)),
            "critic/advantages/mean": float(batch.advantages[batch.response_mask() > 0].mean()),
        }
        prompt_tokens = sum(len(s.prompt_ids) for s in batch.samples)
        out.update(throughput_metrics(
            metrics, prompt_tokens=prompt_tokens, response_tokens=int(lengths.sum()),
            num_train_gpus=self.workers.actor.world_size,
            num_rollout_gpus=self.workers.num_rollout_gpus, ppo_epochs=self.cfg.actor.ppo_epochs))
        return out

    def finish(self) -> None:
        """End of run: the PNG of the run's metrics and the Ray timeline."""
        if not self.is_driver:
            return
        from megarl.metrics.plot import plot_run

        jsonl = self.output_dir / "metrics.jsonl"
        if jsonl.exists():
            png = plot_run(jsonl, self.output_dir / "run.png")
            print(f"megarl: metrics in {jsonl}, plot in {png}")
        if self.cfg.ray.timeline_file and self.cfg.trainer.worker_group == "ray":
            from megarl.cluster import write_timeline

            write_timeline(self.cfg.ray.timeline_file)


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="megarl train", description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="YAML run config")
    parser.add_argument("overrides", nargs="*", metavar="a.b.c=value")
    return parser.parse_intermixed_args(argv)


def load_run_config(path: str, overrides: list[str],
                    echo: Callable[[str], None] = print) -> tuple[RunConfig, dict] | None:
    """Load and validate; print every problem and return None when the config is invalid."""
    try:
        cfg, sources = load_config(path, overrides)
    except ConfigError as err:
        for line in err.lines:
            echo(f"error: {line}")
        return None
    problems = validate_config(cfg, sources=sources)
    unbuilt = [f"{field}: {fix}" for field, applies, fix in NOT_BUILT if applies(cfg)]
    for problem in problems:
        echo(problem.line() if problem.severity == "error" else f"warning: {problem.line()}")
    for line in unbuilt:
        echo(line)
    if unbuilt or any(p.severity == "error" for p in problems):
        return None
    return cfg, sources


def train_main(argv: list[str]) -> int:
    """``megarl train --config CONFIG [overrides]``; exit 2 on an invalid config."""
    args = _parse(argv)
    loaded = load_run_config(args.config, args.overrides,
                             echo=lambda line: print(line, file=sys.stderr))
    if loaded is None:
        return 2
    cfg, sources = loaded
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if cfg.trainer.worker_group == "naive":
        from megarl.cluster import init_naive

        init_naive(timeout_s=cfg.trainer.phase_timeout_s)
    trainer = Trainer(cfg, sources)
    try:
        trainer.setup()
        trainer.fit()
    finally:
        trainer.close()
    return 0
