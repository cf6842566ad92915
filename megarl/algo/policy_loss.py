"""Policy-gradient losses: PPO clip (clip-higher, dual-clip) and GSPO.

Shapes: B sequences, T response positions; every tensor input is [B, T] and `response_mask`
marks the valid tokens. Each loss returns the per-token loss matrix [B, T] (0 outside the mask;
aggregate it with `megarl.algo.aggregation.aggregate_loss`) and a dict of detached scalar metrics:
  pg_clipfrac        fraction of valid tokens where clipping changed the loss
  pg_clipfrac_lower  PPO: fraction of valid tokens cut by the dual clip (negative advantages);
                     GSPO (no dual clip): fraction clipped with a negative advantage
  ppo_kl             mean over valid tokens of old_log_probs - log_probs
An all-zero mask gives a zero loss matrix and zero metrics, never NaN.

Names follow verl's `actor.policy_loss.loss_mode` values (vanilla, gspo).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megarl.algo.masked import masked_fill_invalid, masked_mean

# Log-ratios are clamped before exp so that one wild token cannot overflow the loss.
_LOG_RATIO_BOUND = 20.0
# GSPO's sequence log-ratio is clamped above at this value, as in verl.
_GSPO_LOG_RATIO_MAX = 10.0

PolicyLossOutput = tuple[torch.Tensor, dict[str, torch.Tensor]]


def _check_inputs(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
) -> None:
    """All four inputs must share one [B, T] shape."""
    for name, tensor in (("old_log_probs", old_log_probs), ("advantages", advantages),
                         ("response_mask", response_mask)):
        if tensor.shape != log_probs.shape:
            raise ValueError(
                f"{name}: shape {tuple(tensor.shape)} differs from log_probs "
                f"{tuple(log_probs.shape)}; every input is [B, T]"
            )


def _check_clip(clip_ratio_low: float, clip_ratio_high: float) -> None:
    """Clip ratios must be non-negative and the lower one below 1."""
    if not 0.0 <= clip_ratio_low < 1.0 or clip_ratio_high < 0.0:
        raise ValueError(
            f"actor.clip_ratio_low/high: need 0 <= low < 1 and high >= 0, "
            f"got low={clip_ratio_low}, high={clip_ratio_high}"
        )


def _finish(
    losses: torch.Tensor, response_mask: torch.Tensor, rollout_is_weights: torch.Tensor | None
) -> torch.Tensor:
    """Multiply by detached rollout-correction weights, if given, and zero the invalid tokens."""
    if rollout_is_weights is not None:
        if rollout_is_weights.shape != losses.shape:
            raise ValueError(
                f"rollout_is_weights: shape {tuple(rollout_is_weights.shape)} differs from the "
                f"loss {tuple(losses.shape)}; pass the [B, T] weights of the same micro-batch"
            )
        losses = losses * masked_fill_invalid(rollout_is_weights.detach(), response_mask)
    return masked_fill_invalid(losses, response_mask)


def ppo_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    rollout_is_weights: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """PPO clipped surrogate with clip-higher and dual-clip ("vanilla"), per token.

    log_probs, old_log_probs, advantages, response_mask [, rollout_is_weights]: [B, T]
    -> (loss [B, T], metrics). ratio r = exp(log_probs - old_log_probs);
    loss = max(-A r, -A clip(r, 1 - low, 1 + high)); for A < 0 the loss is further capped at
    -A clip_ratio_c (dual clip). Rollout-correction weights multiply the loss, detached.
    """
    _check_inputs(log_probs, old_log_probs, advantages, response_mask)
    _check_clip(clip_ratio_low, clip_ratio_high)
    if clip_ratio_c <= 1.0:
        raise ValueError(f"actor.clip_ratio_c: must be > 1 for dual-clip, got {clip_ratio_c}")
    log_ratio = masked_fill_invalid(log_probs - old_log_probs.detach(), response_mask)
    advantages = masked_fill_invalid(advantages, response_mask)
    ratio = torch.exp(log_ratio.clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND))
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    clip_loss = torch.maximum(unclipped, clipped)
    dual_cap = -advantages * clip_ratio_c
    negative = advantages < 0
    losses = torch.where(negative, torch.minimum(clip_loss, dual_cap), clip_loss)
    losses = _finish(losses, response_mask, rollout_is_weights)
    metrics = {
        "pg_clipfrac": masked_mean((clipped > unclipped).to(log_ratio.dtype), response_mask),
        "pg_clipfrac_lower": masked_mean(
            ((clip_loss > dual_cap) & negative).to(log_ratio.dtype), response_mask
        ),
        "ppo_kl": masked_mean(-log_ratio, response_mask),
    }
    return losses, {name: value.detach() for name, value in metrics.items()}


def gspo_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 3e-4,
    clip_ratio_high: float = 4e-4,
    rollout_is_weights: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """GSPO: clip the sequence-level ratio s_i = exp(mean_t (log_probs - old_log_probs)), per token.

    log_probs, old_log_probs, advantages, response_mask [, rollout_is_weights]: [B, T]
    -> (loss [B, T], metrics). Token form of the GSPO paper (straight-through):
    s_it = sg[s_i] * pi_t / sg[pi_t], whose value is s_i and whose gradient is s_i grad log pi_t;
    loss = max(-A s_it, -A clip(s_it, 1 - low, 1 + high)). Aggregated with
    `seq-mean-token-mean`, its gradient equals that of the sequence-level GSPO objective.
    pg_clipfrac_lower counts clipped tokens with negative advantage.
    """
    _check_inputs(log_probs, old_log_probs, advantages, response_mask)
    _check_clip(clip_ratio_low, clip_ratio_high)
    log_ratio = masked_fill_invalid(log_probs - old_log_probs.detach(), response_mask)
    advantages = masked_fill_invalid(advantages, response_mask)
    seq_log_ratio = masked_mean(log_ratio, response_mask, dim=-1)
    token_log_ratio = log_ratio - log_ratio.detach() + seq_log_ratio.detach().unsqueeze(-1)
    ratio = torch.exp(token_log_ratio.clamp(max=_GSPO_LOG_RATIO_MAX))
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    losses = torch.maximum(unclipped, clipped)
    losses = _finish(losses, response_mask, rollout_is_weights)
    was_clipped = clipped > unclipped
    metrics = {
        "pg_clipfrac": masked_mean(was_clipped.to(ratio.dtype), response_mask),
        "pg_clipfrac_lower": masked_mean(
            (was_clipped & (advantages < 0)).to(ratio.dtype), response_mask
        ),
        "ppo_kl": masked_mean(-log_ratio, response_mask),
    }
    return losses, {name: value.detach() for name, value in metrics.items()}


POLICY_LOSSES: dict[str, Callable[..., PolicyLossOutput]] = {
    "vanilla": ppo_policy_loss,
    "gspo": gspo_policy_loss,
}


def get_policy_loss(loss_mode: str) -> Callable[..., PolicyLossOutput]:
    """The policy loss registered under `loss_mode` (actor.policy_loss.loss_mode)."""
    try:
        return POLICY_LOSSES[loss_mode]
    except KeyError:
        valid = ", ".join(sorted(POLICY_LOSSES))
        raise ValueError(
            f"actor.policy_loss.loss_mode: unknown loss {loss_mode!r}; valid names: {valid}"
        ) from None
