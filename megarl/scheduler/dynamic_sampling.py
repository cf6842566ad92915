"""Dynamic sampling (DAPO, ``algorithm.filter_groups``) for the step-synchronous schedulers.

colocate_sync and one_step_off generate a step's prompts as one batch; with dynamic sampling the
batch is scored, the groups whose responses all got the same reward are dropped (their advantage
would be 0), and more prompts are generated, one batch of ``data.train_batch_size`` at a time,
until the step holds that many groups. The extras of the last round are discarded, as in verl.
``train/num_gen_batches`` is the number of generation rounds the step took.
(fully_async filters the groups it takes from its queue; see :mod:`megarl.scheduler.fully_async`.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from megarl.batch import StepBatch
from megarl.metrics.timing import timer

if TYPE_CHECKING:
    from megarl.scheduler.driver import StepDriver


def zero_variance(scores: torch.Tensor) -> bool:
    """Whether every response of a group got the same reward (nothing to learn from)."""
    return bool((scores.max() - scores.min()).abs() <= 1e-8)


def fill_with_varied_groups(trainer: StepDriver, batch: StepBatch,
                            generate_more: Callable[[], StepBatch],
                            metrics: dict[str, float]) -> StepBatch:
    """``batch`` (generated, not scored) with its zero-variance groups replaced by groups of
    further batches from ``generate_more`` until it holds ``data.train_batch_size`` groups;
    the result is scored. Raises after ``filter_groups.max_num_gen_batches`` rounds (0 = no
    limit) without enough groups."""
    need, n = trainer.cfg.data.train_batch_size, batch.n
    limit = trainer.cfg.algorithm.filter_groups.max_num_gen_batches
    kept_samples, kept_prompts, kept_scores = [], [], []
    rounds = filtered = 0
    while True:
        rounds += 1
        with timer("reward", metrics):
            rewards = trainer.score(batch)
        metrics["reward/timeouts"] = (metrics.get("reward/timeouts", 0.0)
                                      + rewards.pop("reward/timeouts", 0.0))
        metrics.update(rewards)
        assert batch.scores is not None
        for g, prompt in enumerate(batch.prompts):
            scores = batch.scores[g * n:(g + 1) * n]
            if zero_variance(scores):
                filtered += 1
            elif len(kept_prompts) < need:
                kept_prompts.append(prompt)
                kept_samples += batch.samples[g * n:(g + 1) * n]
                kept_scores.append(scores)
        if len(kept_prompts) >= need:
            break
        if limit and rounds >= limit:
            raise RuntimeError(
                f"dynamic sampling generated {rounds} batches (algorithm.filter_groups."
                f"max_num_gen_batches={limit}) and kept only {len(kept_prompts)} of {need} "
                "groups: most groups have identical rewards; raise max_num_gen_batches (0 = no "
                "limit) or check the reward function")
        with timer("gen_more", metrics):
            batch = generate_more()
    kept = StepBatch(samples=kept_samples, prompts=kept_prompts, n=n)
    kept.scores = torch.cat(kept_scores)
    metrics.update({"train/num_gen_batches": float(rounds),
                    "dynamic_sampling/filtered_groups": float(filtered),
                    "critic/score/mean": float(kept.scores.mean()),
                    "critic/score/max": float(kept.scores.max()),
                    "critic/score/min": float(kept.scores.min())})
    return kept
