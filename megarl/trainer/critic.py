"""The critic's part of the RL step (``algorithm.adv_estimator=gae``), driven by the trainer.

The critic runs as its own worker group on the train pool (:class:`CriticWorkers`): with Ray a
second :class:`~megarl.cluster.worker_group.RayWorkerGroup` on the actor's pool (its own
processes, so ``critic.parallel`` may differ from the actor's); under torchrun the same
processes as the actor, which then share one megatron layout. In a step:

1. :func:`compute_values` -- the critic's value of every response token, over its DP ranks;
2. :func:`gae_advantages_of` -- outcome score on the last response token, GAE with
   ``algorithm.gamma`` / ``algorithm.lam``: the actor's advantages, and the critic's targets;
3. :func:`update_critic` -- ``critic.ppo_epochs`` x mini-batches of the clipped value loss.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megarl.algo import gae_advantages, masked_mean, outcome_to_token_rewards
from megarl.batch import StepBatch, even_shares
from megarl.config import RunConfig
from megarl.megatron.offload import OffloadSettings
from megarl.megatron.parallel import ParallelSizes
from megarl.megatron.settings import (
    CriticSpec,
    OptimizerSettings,
    ValueLossSettings,
    recompute_settings,
)
from megarl.metrics.timing import reduce_metrics

CRITIC_WORKER = "megarl.megatron.critic_worker:CriticWorker"
"""Imported by the Ray workers only: the driver does not import megatron-core."""


@dataclass
class CriticWorkers:
    """The critic's worker group and its data-parallel layout."""

    group: Any
    """A RayWorkerGroup or NaiveWorkerGroup of CriticWorker."""
    dp_size: int
    dp_rank: list[int]
    """Data-parallel rank of each critic rank."""
    reports: list[bool]
    """Whether a critic rank returns results for its data-parallel group."""

    @classmethod
    def of(cls, group: Any) -> CriticWorkers:
        """Ask a started group for its layout."""
        layouts = group.execute_all("layout")
        return cls(group=group, dp_size=layouts[0]["dp_size"],
                   dp_rank=[x["dp_rank"] for x in layouts],
                   reports=[bool(x["reports"]) for x in layouts])


@dataclass
class CriticTargets:
    """What the critic is trained on in a step, ``[B, T]`` over response tokens."""

    values: torch.Tensor
    """The values GAE used (the clipping centre of the value loss)."""
    returns: torch.Tensor
    """GAE advantages (before whitening) + values: the regression targets."""


def critic_spec(cfg: RunConfig) -> CriticSpec:
    """The CriticWorker's settings from the config (``critic.*``; the batch-size mode, dtype
    and seed follow the actor's)."""
    c, a = cfg.critic, cfg.actor
    p = c.parallel or a.parallel
    sizes = ParallelSizes(tp=p.tp, pp=p.pp, vpp=p.vpp, ep=p.ep, etp=p.etp, cp=p.cp,
                          sequence_parallel=p.sequence_parallel if p.tp > 1 else None)
    mini_size = c.ppo_mini_batch_size or a.ppo_mini_batch_size
    epochs = c.ppo_epochs or a.ppo_epochs
    mini_batches = -(-cfg.data.train_batch_size // mini_size)
    optim = OptimizerSettings(
        lr=c.optim.lr, weight_decay=c.optim.weight_decay, betas=tuple(c.optim.betas),
        lr_warmup_steps=c.optim.lr_warmup_steps, lr_decay_style=c.optim.lr_decay_style,
        min_lr=c.optim.min_lr, total_steps=cfg.trainer.total_steps * mini_batches * epochs,
        grad_clip=c.grad_clip, use_distributed_optimizer=a.use_distributed_optimizer)
    if a.use_dynamic_bsz:  # per GPU: a packed row is split over the cp ranks
        budget = a.ppo_max_token_len_per_gpu * sizes.cp
    else:
        micro = c.ppo_micro_batch_size_per_gpu or a.ppo_micro_batch_size_per_gpu or 1
        budget = micro * (cfg.data.max_prompt_length + cfg.data.max_response_length)
    return CriticSpec(
        model_path=c.model_path or cfg.model.path, dtype=cfg.model.dtype, sizes=sizes,
        optim=optim,
        loss=ValueLossSettings(cliprange_value=c.cliprange_value, loss_agg_mode=a.loss_agg_mode,
                               norm_len=float(cfg.data.max_response_length)),
        max_tokens_per_micro_batch=budget, seed=cfg.trainer.seed,
        recompute=recompute_settings(a.recompute),
        offload=OffloadSettings(**c.offload.model_dump()),
        trust_remote_code=cfg.model.trust_remote_code)


def start_critic(cfg: RunConfig, *, pool: Any = None, log_dir: Path | None = None,
                 env: Mapping[str, str] | None = None) -> CriticWorkers:
    """Start the critic: a RayWorkerGroup on ``pool`` (the train pool, created with room for
    one more group), or with ``pool=None`` a NaiveWorkerGroup in this torchrun world."""
    spec = critic_spec(cfg)
    timeout = cfg.trainer.phase_timeout_s
    if pool is None:
        from megarl.cluster import NaiveWorkerGroup

        if cfg.critic.parallel is not None and cfg.critic.parallel != cfg.actor.parallel:
            raise ValueError("critic.parallel differs from actor.parallel, but with "
                             "trainer.worker_group=naive the critic shares the actor's processes "
                             "and megatron layout; set critic.parallel=null")
        from megarl.megatron.critic_worker import CriticWorker  # this process is a train rank

        group = NaiveWorkerGroup(CriticWorker, "critic", args=(spec,), call_timeout_s=timeout)
    else:
        from megarl.cluster import RayWorkerGroup

        if log_dir is None:
            raise ValueError("start_critic: a Ray pool needs log_dir for the workers' logs")
        group = RayWorkerGroup(CRITIC_WORKER, pool, "critic", log_dir=log_dir, args=(spec,),
                               env=dict(env or {}), echo_logs=False, call_timeout_s=timeout)
    return CriticWorkers.of(group)


def compute_values(critic: CriticWorkers, batch: StepBatch) -> list[list[float]]:
    """The critic's value of every response token of every sample, over its DP ranks."""
    sequences = batch.sequences()
    shares = even_shares(len(sequences), critic.dp_size)
    group = critic.group
    per_rank = [([sequences[i] for i in shares[critic.dp_rank[r]]],)
                for r in range(group.world_size)]
    results = group.execute_rank_split("compute_values", per_rank)
    full: list[list[float]] = [[] for _ in sequences]
    for rank, result in enumerate(results):
        if critic.reports[rank]:
            for k, i in enumerate(shares[critic.dp_rank[rank]]):
                full[i] = result[k]
    return [batch.response_slice(full[i], i) for i in range(len(full))]


def gae_advantages_of(batch: StepBatch, values: list[list[float]], *, gamma: float,
                      lam: float, token_level_rewards: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, CriticTargets]:
    """GAE on ``token_level_rewards`` ``[B, T]`` (default: the batch's scores, each on its
    sample's last response token) and the critic's ``values``; returns the whitened advantages
    ``[B, T]`` and the critic's targets."""
    mask = batch.response_mask()
    padded = batch.padded(values)
    rewards = token_level_rewards
    if rewards is None:
        if batch.scores is None:
            raise ValueError("gae_advantages_of: the batch has no scores; score it first")
        rewards = outcome_to_token_rewards(batch.scores, mask)
    advantages, returns = gae_advantages(rewards, padded, mask, gamma=gamma, lam=lam)
    return advantages, CriticTargets(values=padded, returns=returns)


def critic_record(batch: StepBatch, targets: CriticTargets, i: int) -> dict[str, list]:
    """Sample ``i`` as CriticWorker.update expects it: per-token lists over prompt + response
    (prompt entries 0 and masked out)."""
    sample = batch.samples[i]
    p, r = len(sample.prompt_ids), len(sample.response_ids)

    def full(row: torch.Tensor) -> list[float]:
        return [0.0] * p + row[:r].tolist()

    return {"tokens": list(sample.prompt_ids) + list(sample.response_ids),
            "loss_mask": [0.0] * p + [float(m) for m in (sample.response_mask or [1] * r)],
            "values": full(targets.values[i]), "returns": full(targets.returns[i])}


def update_critic(critic: CriticWorkers, batch: StepBatch, targets: CriticTargets,
                  cfg: RunConfig) -> dict[str, float]:
    """``critic.ppo_epochs`` passes of mini-batch value updates, each split over the critic's
    DP ranks; returns ``critic/*`` metrics (mean over the optimizer steps)."""
    per_mini = (cfg.critic.ppo_mini_batch_size or cfg.actor.ppo_mini_batch_size) * batch.n
    epochs = cfg.critic.ppo_epochs or cfg.actor.ppo_epochs
    minis = [range(s, min(s + per_mini, len(batch))) for s in range(0, len(batch), per_mini)]
    records = [critic_record(batch, targets, i) for i in range(len(batch))]
    per_dp: list[list[list[dict]]] = [[] for _ in range(critic.dp_size)]
    for _ in range(epochs):
        for mini in minis:
            for d, share in enumerate(even_shares(len(mini), critic.dp_size)):
                per_dp[d].append([records[mini[j]] for j in share])
    group = critic.group
    results = group.execute_rank_split(
        "update", [(per_dp[critic.dp_rank[r]],) for r in range(group.world_size)])
    return reduce_metrics(results[0])


def critic_data_metrics(targets: CriticTargets, response_mask: torch.Tensor) -> dict[str, float]:
    """``critic/values/*``, ``critic/returns/*`` and ``critic/vf_explained_var`` of a step."""
    valid = response_mask.bool()
    out: dict[str, float] = {}
    for name, t in (("values", targets.values), ("returns", targets.returns)):
        picked = t[valid]
        out[f"critic/{name}/mean"] = float(picked.mean()) if picked.numel() else 0.0
        out[f"critic/{name}/max"] = float(picked.max()) if picked.numel() else 0.0
        out[f"critic/{name}/min"] = float(picked.min()) if picked.numel() else 0.0
    residual = targets.returns - targets.values
    var_returns = masked_mean((targets.returns - masked_mean(targets.returns, valid)).square(),
                              valid)
    var_residual = masked_mean((residual - masked_mean(residual, valid)).square(), valid)
    out["critic/vf_explained_var"] = float(1.0 - var_residual / (var_returns + 1e-5))
    return out
