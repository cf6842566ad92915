"""Rollout correction: importance weights and rejection masks between trainer and rollout engine.

The rollout engine samples from mu (its own numerics, kernels, MoE routing, stale weights); the
trainer's old log-probs give pi_old. The per-token log-ratio is l_t = old_log_probs -
rollout_log_probs, so the ratio rho_t = pi_old / mu is exp(l_t). Shapes: B sequences, T
positions; every input is [B, T] and `response_mask` marks the valid tokens.

  truncated IS, token level     w_t = min(exp(l_t), threshold)
  truncated IS, sequence level  w_i = min(exp(sum_t l_t), threshold), on every token of row i

Rejection sampling (verl's criteria, `<aggregation>_<estimator>`) keeps a token (token_*) or a
whole row (seq_*) when its score is inside the bounds. Per-token estimators:
  k1 = l_t                     kept if lower <= exp(score) <= upper   (a ratio bound)
  k2 = l_t^2 / 2               kept if score <= upper                 (a divergence bound)
  k3 = exp(l_t) - 1 - l_t      kept if score <= upper (its mean over mu estimates KL(mu||pi_old))
aggregated per row by sum (seq_sum_*), mean (seq_mean_*; seq_mean_k1 is the geometric-mean
ratio) or max (seq_max_*). Ratios are compared in log space, so long sequences never overflow.
Weights are detached and 0 outside the mask. Metric fractions are over valid tokens, except
`rollout_rs_seq_masked_fraction` (over non-empty rows). Metric names follow verl's (log them
under `rollout_corr/`, and the probability differences under `training/`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from megarl.algo.masked import masked_fill_invalid, masked_mean, masked_std, masked_sum

IS_LEVELS = ("token", "sequence")
RS_CRITERIA = (
    "token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
    "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3",
)


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


def _log_ratio(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
               response_mask: torch.Tensor) -> torch.Tensor:
    """Detached l_t = old - rollout, 0 outside the mask."""
    _check_shapes(old_log_probs, rollout_log_probs, response_mask)
    return masked_fill_invalid((old_log_probs - rollout_log_probs).detach(), response_mask)


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
    if level not in IS_LEVELS:
        raise ValueError(
            f"rollout_is: unknown level {level!r}; valid levels: {', '.join(IS_LEVELS)}"
        )
    if threshold <= 0:
        raise ValueError(f"rollout_is_threshold: must be > 0, got {threshold}")
    log_ratio = _log_ratio(old_log_probs, rollout_log_probs, response_mask)
    if level == "sequence":
        log_ratio = masked_sum(log_ratio, response_mask, dim=-1).unsqueeze(-1).expand_as(log_ratio)
    log_threshold = math.log(threshold)
    weights = masked_fill_invalid(torch.exp(log_ratio.clamp(max=log_threshold)), response_mask)
    truncated = (log_ratio > log_threshold).to(weights.dtype)
    metrics = {
        "rollout_is_mean": masked_mean(weights, response_mask),
        "rollout_is_truncated_fraction": masked_mean(truncated, response_mask),
    }
    return weights, metrics


def _token_scores(log_ratio: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token k1 / k2 / k3 of the log-ratio."""
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    return torch.expm1(log_ratio) - log_ratio


def rejection_scores(log_ratio: torch.Tensor, response_mask: torch.Tensor,
                     criterion: str) -> torch.Tensor:
    """The score each valid token is judged by under `criterion` (see the module docstring),
    [B, T]; a row-level score is broadcast to every position of its row."""
    if criterion not in RS_CRITERIA:
        raise ValueError(f"rollout_rs: unknown criterion {criterion!r}; valid criteria: "
                         f"{', '.join(RS_CRITERIA)}")
    aggregation, estimator = criterion.rsplit("_", 1)
    scores = masked_fill_invalid(_token_scores(log_ratio, estimator), response_mask)
    if aggregation == "token":
        return scores
    if aggregation == "seq_sum":
        row = masked_sum(scores, response_mask, dim=-1)
    elif aggregation == "seq_mean":
        row = masked_mean(scores, response_mask, dim=-1)
    else:  # seq_max; k2 and k3 are >= 0, so the zeros outside the mask never win
        row = scores.max(dim=-1).values if scores.shape[-1] else scores.sum(dim=-1)
    return row.unsqueeze(-1).expand_as(scores)


def rollout_rejection_mask(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    criterion: str = "token_k1",
    upper: float = 2.0,
    lower: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The response mask less the tokens (or rows) whose score under `criterion` is out of
    bounds: for *_k1 the ratio exp(score) must lie in [lower, upper] (`lower` defaults to
    1 / upper); for k2 / k3 the score must be <= upper (`lower` is ignored).

    old_log_probs, rollout_log_probs, response_mask [B, T] -> (mask [B, T] in response_mask's
    dtype, metrics): rollout_rs_masked_fraction (valid tokens removed),
    rollout_rs_seq_masked_fraction (non-empty rows that lost at least one token).
    """
    log_ratio = _log_ratio(old_log_probs, rollout_log_probs, response_mask)
    scores = rejection_scores(log_ratio, response_mask, criterion)
    if criterion.endswith("k1"):
        lower = 1.0 / upper if lower is None and upper > 0 else lower
        if upper <= 0 or lower is None or not 0 <= lower <= upper:
            raise ValueError(f"rollout_rs_threshold: need 0 <= lower <= upper and upper > 0, "
                             f"got lower={lower}, upper={upper}")
        log_lower = math.log(lower) if lower > 0 else -math.inf
        inside = (scores >= log_lower) & (scores <= math.log(upper))
    else:
        if upper <= 0:
            raise ValueError(f"rollout_rs_threshold: {criterion} bounds a divergence, which "
                             f"needs an upper bound > 0, got {upper}")
        inside = scores <= upper
    valid = response_mask.bool()
    removed = (valid & ~inside).to(log_ratio.dtype)
    rows_hit = (removed.sum(dim=-1) > 0).to(log_ratio.dtype)
    metrics = {
        "rollout_rs_masked_fraction": masked_mean(removed, valid),
        "rollout_rs_seq_masked_fraction": masked_mean(rows_hit, valid.any(dim=-1)),
    }
    return (valid & inside).to(response_mask.dtype), metrics


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


def off_policy_metrics(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """How far mu is from pi_old over valid tokens (inputs [B, T]): kl = mean(-l_t), the k1
    estimate of KL(mu || pi_old); k3_kl = mean(exp(l_t) - 1 - l_t), its non-negative k3
    estimate; chi2_token = mean(rho_t^2) - 1."""
    log_ratio = _log_ratio(old_log_probs, rollout_log_probs, response_mask)
    ratio_sq = masked_fill_invalid(torch.exp(2 * log_ratio.clamp(max=20.0)), response_mask)
    return {
        "kl": masked_mean(-log_ratio, response_mask),
        "k3_kl": masked_mean(_token_scores(log_ratio, "k3"), response_mask),
        "chi2_token": masked_mean(ratio_sq, response_mask) - response_mask.any().to(ratio_sq),
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

    Inputs [B, T]. rollout_is: None | token | sequence; rollout_rs: None | one of
    :data:`RS_CRITERIA`; rollout_rs_threshold: (lower, upper), lower None meaning 1 / upper (k1
    only). Weights and their metrics are computed on the full response mask; rejected tokens
    then get weight 0. The metrics always include the probability differences and
    :func:`off_policy_metrics`.
    """
    metrics = rollout_probs_diff_metrics(old_log_probs, rollout_log_probs, response_mask)
    metrics.update(off_policy_metrics(old_log_probs, rollout_log_probs, response_mask))
    mask = response_mask
    if rollout_rs is not None:
        lower, upper = rollout_rs_threshold
        mask, rs_metrics = rollout_rejection_mask(
            old_log_probs, rollout_log_probs, response_mask,
            criterion=rollout_rs, lower=lower, upper=upper,
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


def router_agreement(
    reference: Sequence[torch.Tensor], routes: Sequence[torch.Tensor]
) -> torch.Tensor:
    """Fraction of (token, MoE layer) pairs whose top-k expert sets are equal.

    Per sequence, `reference[i]` ``[N_i, layers, top_k]`` and `routes[i]` ``[M_i, layers,
    top_k]`` are expert ids whose row j concerns token j; rows past the shorter one and rows of
    `reference` that are -1 (no route known) are not compared. Order within a top-k set does
    not matter. Returns a 0-dim float64 tensor (0 when nothing is compared).
    """
    if len(reference) != len(routes):
        raise ValueError(f"routes: {len(routes)} sequences, reference has {len(reference)}")
    same, total = 0, 0
    for ref, got in zip(reference, routes):
        rows = min(len(ref), len(got))
        ref, got = ref[:rows].long(), got[:rows].long()
        if ref.shape[1:] != got.shape[1:]:
            raise ValueError(f"routes: per-token shape {tuple(got.shape[1:])} differs from the "
                             f"reference's {tuple(ref.shape[1:])} (MoE layers, top_k)")
        known = (ref >= 0).all(-1)
        equal = (ref.sort(-1).values == got.sort(-1).values).all(-1)
        same += int((equal & known).sum())
        total += int(known.sum())
    return torch.tensor(same / total if total else 0.0, dtype=torch.float64)
