"""Rollout correction: importance weights and rejection masks between trainer and rollout engine.

The rollout engine samples from mu (its own numerics, kernels, MoE routing, stale weights); the
trainer's old log-probs give pi_old. The per-token log-ratio is l_t = old_log_probs -
rollout_log_probs, so the ratio pi_old / mu is exp(l_t). Shapes: B sequences, T positions;
every input is [B, T] and `response_mask` marks the valid tokens.

  truncated IS, token level     w_t = min(exp(l_t), threshold)
  truncated IS, sequence level  w_i = min(exp(sum_t l_t), threshold), on every token of row i
  rejection, token level        keep token t if lower <= exp(l_t) <= upper
  rejection, sequence level     keep row i if lower <= exp(sum_t l_t) <= upper
  rejection, geometric level    keep row i if lower <= exp(mean_t l_t) <= upper
Ratios are compared in log space, so long sequences never overflow. Weights are detached and 0
outside the mask. Metric fractions are over valid tokens, except `rollout_rs_seq_masked_fraction`
(over non-empty rows). Metric names follow verl's (log them under `rollout_corr/`, and the
probability differences under `training/`).
"""

from __future__ import annotations

import math

import torch

from megarl.algo.masked import masked_fill_invalid, masked_mean, masked_std, masked_sum

IS_LEVELS = ("token", "sequence")
RS_LEVELS = ("token", "sequence", "geometric")


def _check_shapes(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
                  response_mask: torch.Tensor) -> None:
    """The three inputs must share one [B, T] shape."""
    if old_log_probs.dim() != 2:
        raise ValueError(f"old_log_probs: expected [B, T], got {tuple(old_log_probs.shape)}")
    for name, tensor in (("rollout_log_probs", rollout_log_probs),
                         ("response_mask", response_mask)):
        if tensor.shape != old_log_probs.shape:
            raise ValueError(
                f"{name}: shape {tuple(tensor.shape)} differs from old_log_probs "
                f"{tuple(old_log_probs.shape)}; the rollout engine must return one log-prob per "
                "response token"
            )


def _level_log_ratio(
    log_ratio: torch.Tensor, response_mask: torch.Tensor, level: str
) -> torch.Tensor:
    """Log-ratio at the requested level, broadcast to [B, T]."""
    if level == "token":
        return log_ratio
    reduce = masked_sum if level == "sequence" else masked_mean
    return reduce(log_ratio, response_mask, dim=-1).unsqueeze(-1).expand_as(log_ratio)


def rollout_is_weights(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    level: str = "token",
    threshold: float = 2.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Truncated importance weights pi_old / mu at token or sequence level, [B, T], detached.

    old_log_probs, rollout_log_probs, response_mask [B, T] -> (weights [B, T], metrics):
    rollout_is_mean (mean weight over valid tokens), rollout_is_truncated_fraction (valid tokens
    whose weight was capped at `threshold`).
    """
    _check_shapes(old_log_probs, rollout_log_probs, response_mask)
    if level not in IS_LEVELS:
        raise ValueError(
            f"rollout_is: unknown level {level!r}; valid levels: {', '.join(IS_LEVELS)}"
        )
    if threshold <= 0:
        raise ValueError(f"rollout_is_threshold: must be > 0, got {threshold}")
    log_ratio = masked_fill_invalid((old_log_probs - rollout_log_probs).detach(), response_mask)
    level_log_ratio = _level_log_ratio(log_ratio, response_mask, level)
    log_threshold = math.log(threshold)
    weights = torch.exp(level_log_ratio.clamp(max=log_threshold))
    weights = masked_fill_invalid(weights, response_mask)
    truncated = (level_log_ratio > log_threshold).to(weights.dtype)
    metrics = {
        "rollout_is_mean": masked_mean(weights, response_mask),
        "rollout_is_truncated_fraction": masked_mean(truncated, response_mask),
    }
    return weights, metrics


def rollout_rejection_mask(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    level: str = "token",
    upper: float = 2.0,
    lower: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The response mask less the tokens (or rows) whose pi_old / mu is outside [lower, upper].

    old_log_probs, rollout_log_probs, response_mask [B, T] -> (mask [B, T] in response_mask's
    dtype, metrics): rollout_rs_masked_fraction (valid tokens removed),
    rollout_rs_seq_masked_fraction (non-empty rows that lost at least one token).
    `lower` defaults to 1 / upper.
    """
    _check_shapes(old_log_probs, rollout_log_probs, response_mask)
    if level not in RS_LEVELS:
        raise ValueError(
            f"rollout_rs: unknown level {level!r}; valid levels: {', '.join(RS_LEVELS)}"
        )
    lower = 1.0 / upper if lower is None and upper > 0 else lower
    if upper <= 0 or lower is None or not 0 <= lower <= upper:
        raise ValueError(f"rollout_rs_threshold: need 0 <= lower <= upper and upper > 0, got "
                         f"lower={lower}, upper={upper}")
    log_ratio = masked_fill_invalid((old_log_probs - rollout_log_probs).detach(), response_mask)
    level_log_ratio = _level_log_ratio(log_ratio, response_mask, level)
    log_lower = math.log(lower) if lower > 0 else -math.inf
    inside = (level_log_ratio >= log_lower) & (level_log_ratio <= math.log(upper))
    valid = response_mask.bool()
    kept = valid & inside
    removed = (valid & ~inside).to(log_ratio.dtype)
    non_empty = valid.any(dim=-1)
    rows_hit = (removed.sum(dim=-1) > 0).to(log_ratio.dtype)
    metrics = {
        "rollout_rs_masked_fraction": masked_mean(removed, valid),
        "rollout_rs_seq_masked_fraction": masked_mean(rows_hit, non_empty),
    }
    return kept.to(response_mask.dtype), metrics


def rollout_probs_diff_metrics(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """|exp(old_log_probs) - exp(rollout_log_probs)| over valid tokens: mean, max, std (unbiased).

    Inputs [B, T]; all 0 for an all-zero mask. Normal mean < 0.005; above 0.01 the engine and
    the trainer disagree (precision, kernels, routing).
    """
    _check_shapes(old_log_probs, rollout_log_probs, response_mask)
    diff = (old_log_probs.detach().exp() - rollout_log_probs.detach().exp()).abs()
    diff = masked_fill_invalid(diff, response_mask)
    return {
        "rollout_probs_diff_mean": masked_mean(diff, response_mask),
        "rollout_probs_diff_max": diff.max() if diff.numel() else diff.new_zeros(()),
        "rollout_probs_diff_std": masked_std(diff, response_mask),
    }


def compute_rollout_correction(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    rollout_is: str | None = None,
    rollout_is_threshold: float = 2.0,
    rollout_rs: str | None = None,
    rollout_rs_threshold: tuple[float | None, float] = (None, 2.0),
) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, torch.Tensor]]:
    """Weights (None when rollout_is is None), the response mask after rejection, and all metrics.

    Inputs [B, T]. rollout_is: None | token | sequence; rollout_rs: None | token | sequence |
    geometric; rollout_rs_threshold: (lower, upper), lower None meaning 1 / upper. Weights and
    their metrics are computed on the full response mask; rejected tokens then get weight 0.
    """
    metrics = rollout_probs_diff_metrics(old_log_probs, rollout_log_probs, response_mask)
    mask = response_mask
    if rollout_rs is not None:
        lower, upper = rollout_rs_threshold
        mask, rs_metrics = rollout_rejection_mask(
            old_log_probs, rollout_log_probs, response_mask,
            level=rollout_rs, lower=lower, upper=upper,
        )
        metrics.update(rs_metrics)
    weights = None
    if rollout_is is not None:
        weights, is_metrics = rollout_is_weights(
            old_log_probs, rollout_log_probs, response_mask,
            level=rollout_is, threshold=rollout_is_threshold,
        )
        weights = masked_fill_invalid(weights, mask)
        metrics.update(is_metrics)
    return weights, mask, metrics
