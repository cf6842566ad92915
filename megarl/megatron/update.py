"""One PPO-family update of the actor on a mini-batch: losses from megarl.algo on the engine's
log-probs, split-invariant aggregation, megatron's pipeline schedule, a guarded optimizer step.

Aggregation: every loss term is ``aggregate_loss(..., global_counts=C)`` with ``C`` the token
and row counts of the whole mini-batch (summed over micro-batches and all-reduced over DP), so
the sum of the micro-batch losses is the mini-batch loss however it was split. megatron divides
each micro-batch loss by the number of micro-batches and DDP averages gradients over DP ranks;
the loss handed to the schedule is multiplied by both, so the applied gradient is the gradient
of the mini-batch loss.

Context parallelism: each CP rank computes the log-probs of its own tokens; they are gathered over
the CP group (:func:`gather_context_parallel`, whose backward keeps the rank's slice), so every
CP rank computes the same mini-batch loss as cp=1 and back-propagates it into its own tokens.
megatron multiplies the loss by cp and DDP averages gradients over dp x cp, which sums the CP
ranks' partial gradients: the applied gradient is again the mini-batch loss's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.pipeline_parallel import get_forward_backward_func

from megarl.algo import (
    aggregate_loss,
    get_policy_loss,
    kl_penalty,
    loss_counts,
    policy_loss_options,
)
from megarl.megatron import cpu_compat
from megarl.megatron.context_parallel import gather_context_parallel
from megarl.megatron.cuda_graphs import GraphedChunk
from megarl.megatron.logprobs import gpt_forward, make_micro_batches, token_log_probs
from megarl.megatron.optimizer import TrainableActor
from megarl.megatron.packing import PackedBatch
from megarl.megatron.settings import LossSettings

_METRICS = ("pg_loss", "entropy", "kl_loss", "pg_clipfrac", "ppo_kl", "tokens")


@dataclass
class TrainSequence:
    """One sequence of a mini-batch; per-token tensors are ``[L]`` and aligned with ``tokens``
    (entry ``j`` concerns token ``j``; entry 0 is never a target and must be masked out)."""

    tokens: torch.Tensor
    """Prompt and response token ids."""
    loss_mask: torch.Tensor
    """1 on the tokens that are trained on (the response), else 0."""
    old_log_probs: torch.Tensor
    """Log-probs under the policy that sampled (or the old-log-prob recompute)."""
    advantages: torch.Tensor
    """Per-token advantages."""
    ref_log_probs: torch.Tensor | None = None
    """Reference-model log-probs (needed when the KL loss is on)."""
    rollout_is_weights: torch.Tensor | None = None
    """Rollout-correction importance weights (detached inside the loss)."""


def _padded(values: Sequence[torch.Tensor | None], width: int) -> torch.Tensor | None:
    """Stack ``[L_i]`` tensors into ``[n, width]`` (zero padded); None if any is missing."""
    if any(v is None for v in values):
        return None
    out = torch.zeros(len(values), width, dtype=torch.float32)
    for i, v in enumerate(values):
        out[i, : len(v)] = v.float()
    return out


@dataclass
class _MicroBatch:
    """A packed batch and its per-sequence training tensors ``[n, L_max]``."""

    packed: PackedBatch
    gather_index: torch.Tensor  # [n, L_max] packed position predicting each token
    tensors: dict[str, torch.Tensor | None]

    @classmethod
    def build(cls, packed: PackedBatch, seqs: list[TrainSequence]) -> _MicroBatch:
        """Pad the sequences' tensors and index each token's predicting position."""
        width = max(len(s.tokens) for s in seqs)
        index = torch.zeros(len(seqs), width, dtype=torch.long)
        for i, start in enumerate(packed.cu_seqlens_padded[:-1].tolist()):
            n = len(seqs[i].tokens)
            # token j (>= 1) is predicted at packed position start + j - 1
            index[i, 1:n] = torch.arange(start, start + n - 1)
        tensors = {
            name: _padded([getattr(s, name) for s in seqs], width)
            for name in (
                "loss_mask",
                "old_log_probs",
                "advantages",
                "ref_log_probs",
                "rollout_is_weights",
            )
        }
        device = packed.input_ids.device
        tensors = {k: None if v is None else v.to(device) for k, v in tensors.items()}
        tensors["loss_mask"][:, 0] = 0
        return cls(packed=packed, gather_index=index.to(device), tensors=tensors)


def _loss_terms(
    mb: _MicroBatch,
    log_probs: torch.Tensor,
    entropy: torch.Tensor,
    settings: LossSettings,
    counts: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The micro-batch's share of the mini-batch loss, and its metric sums."""
    t = mb.tensors
    mask = t["loss_mask"]
    lp, ent = log_probs[mb.gather_index], entropy[mb.gather_index]
    options = {name: getattr(settings, name) for name in policy_loss_options(settings.loss_mode)}
    if settings.loss_mode == "clip_cov":
        # The same draw on every rank of a model replica: seeded by the mini-batch's counts.
        seed = int(counts[0].item()) * 1000003 + int(mask.sum().item())
        options["generator"] = torch.Generator().manual_seed(seed)
    pg_mat, pg_metrics = get_policy_loss(settings.loss_mode)(
        lp,
        t["old_log_probs"],
        t["advantages"],
        mask,
        **options,
        rollout_is_weights=t["rollout_is_weights"],
    )
    agg = partial(
        aggregate_loss, loss_mask=mask, loss_agg_mode=settings.loss_agg_mode, global_counts=counts,
        norm_len=settings.norm_len,
    )
    pg_loss = agg(pg_mat)
    entropy_loss = agg(ent)
    loss = pg_loss - settings.entropy_coeff * entropy_loss
    kl_loss = torch.zeros_like(pg_loss)
    if settings.use_kl_loss:
        if t["ref_log_probs"] is None:
            raise ValueError("actor.use_kl_loss is on but a sequence has no ref_log_probs")
        kl_loss = agg(kl_penalty(lp, t["ref_log_probs"], settings.kl_loss_type))
        loss = loss + settings.kl_loss_coef * kl_loss
    tokens = mask.sum()
    metrics = {
        "pg_loss": pg_loss.detach(),
        "entropy": entropy_loss.detach(),
        "kl_loss": kl_loss.detach(),
        # per-micro-batch means, weighted by tokens here and divided by all tokens later
        "pg_clipfrac": pg_metrics["pg_clipfrac"] * tokens,
        "ppo_kl": pg_metrics["ppo_kl"] * tokens,
        "tokens": tokens,
    }
    return loss, metrics


def train_step(
    actor: TrainableActor,
    sequences: Sequence[TrainSequence],
    settings: LossSettings,
    *,
    max_tokens_per_micro_batch: int | None = None,
    temperature: float = 1.0,
    graphed: GraphedChunk | None = None,
    before_step: Callable[[], object] | None = None,
) -> dict[str, float]:
    """One optimizer step on this DP rank's share of a mini-batch; returns ``actor/*`` metrics
    (identical on every rank). With ``graphed`` (the single chunk's :class:`GraphedChunk`) the
    micro-batches' forward and backward replay CUDA graphs where their bucket allows.
    ``before_step`` runs between the last backward and the optimizer step (the worker brings
    an offloaded optimizer state back there)."""
    cpu_compat.enable()
    model = actor.model
    batches, groups = make_micro_batches(
        model, [s.tokens for s in sequences], max_tokens_per_micro_batch
    )
    micro = [_MicroBatch.build(b, [sequences[i] for i in g]) for b, g in zip(batches, groups)]
    device = batches[0].input_ids.device
    counts = sum(loss_counts(m.tensors["loss_mask"]) for m in micro).to(device)
    dist.all_reduce(counts, group=mpu.get_data_parallel_group())
    scale = len(micro) * mpu.get_data_parallel_world_size()

    def loss_func(mb: _MicroBatch, output: torch.Tensor, hidden: bool):
        log_probs, entropy = token_log_probs(model, output, mb.packed.targets, temperature,
                                             hidden=hidden)
        # under CP: the whole row on every CP rank, the gradient back to this rank's tokens
        log_probs, entropy = gather_context_parallel(
            torch.stack([log_probs, entropy], dim=1), mb.packed
        ).unbind(1)
        loss, metrics = _loss_terms(mb, log_probs, entropy, settings, counts)
        return loss * scale, metrics

    def forward_step(data_iterator, chunk):
        mb = next(data_iterator)
        if graphed is not None and graphed.supports(mb.packed):  # the graphs hold logits
            return graphed(mb.packed), partial(loss_func, mb, hidden=False)
        return gpt_forward(chunk, mb.packed, hidden=True), partial(loss_func, mb, hidden=True)

    for chunk in model.chunks:
        chunk.train()
    actor.zero_grad()
    iterators = [iter(micro) for _ in model.chunks]
    per_micro = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iterators if len(iterators) > 1 else iterators[0],
        model=model.chunks,
        num_microbatches=len(micro),
        seq_length=max(m.packed.num_tokens for m in micro),
        micro_batch_size=1,
        forward_only=False,
    )
    sums = _reduce_metrics(per_micro, device)
    if before_step is not None:
        before_step()
    result = actor.step(loss_is_finite=math.isfinite(sums["pg_loss"] + sums["kl_loss"]))
    tokens = max(sums["tokens"], 1.0)
    metrics = {
        "actor/pg_loss": sums["pg_loss"],
        "actor/entropy": sums["entropy"],
        "actor/pg_clipfrac": sums["pg_clipfrac"] / tokens,
        "actor/ppo_kl": sums["ppo_kl"] / tokens,
        "actor/grad_norm": result.grad_norm,
        "actor/lr": result.lr,
        "actor/update_skipped": float(not result.updated),
    }
    if settings.use_kl_loss:
        metrics["actor/kl_loss"] = sums["kl_loss"]
    return metrics


def _reduce_metrics(per_micro: list[dict], device: torch.device) -> dict[str, float]:
    """Sum the micro-batch metrics, send them from the last pipeline stage to every stage, and
    sum them over data-parallel ranks."""
    values = torch.zeros(len(_METRICS), dtype=torch.float64, device=device)
    if mpu.is_pipeline_last_stage():
        for m in per_micro:
            values += torch.stack([m[k].double() for k in _METRICS])
    if mpu.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(
            values,
            src=mpu.get_pipeline_model_parallel_last_rank(),
            group=mpu.get_pipeline_model_parallel_group(),
        )
    dist.all_reduce(values, group=mpu.get_data_parallel_group())
    return dict(zip(_METRICS, values.tolist()))
