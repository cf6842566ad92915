"""Rollout correction: importance weights and rejection masks between trainer and rollout engine.

The rollout engine samples from mu (its own numerics, kernels, MoE routing, stale weights); the
trainer's old log-probs give pi_old. The per-token log-ratio is l_t = old_log_probs -
rollout_log_probs, so the ratio rho_t = pi_old / mu is exp(l_t). Shapes: B sequences, T
positions; every input is [B, T] and `response_mask` marks the valid tokens.

  truncated IS, token level     w_t = min(exp(l_t), threshold)
  truncated IS, sequence level  w_i = min(exp(sum_t l_t), threshold), on every token of row i
  IcePop-style band (a lower bound given): w = rho if lower <= rho <= upper, else 0 (masked,
  not truncated)
  batch-normalised: w / mean(w) (over valid tokens, or over non-empty rows at sequence level)

Rejection sampling (verl's criteria, `<aggregation>_<estimator>`) keeps a token (token_*) or a
whole row (seq_*) when its score is inside the bounds; several criteria at once keep what every
one of them keeps. Per-token estimators:
  k1 = l_t                     kept if lower <= exp(score) <= upper   (a ratio bound; verl bounds
                               -l_t instead: its "a_b" is megarl's exp(-b)..exp(-a))
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
# Log-ratios of the max / min metrics and of chi-square are clamped here before exp.
_RATIO_LOG_BOUND = 20.0
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
    lower: float | None = None,
    batch_normalize: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Importance weights pi_old / mu at token or sequence level, [B, T], detached.

    old_log_probs, rollout_log_probs, response_mask [B, T] -> (weights [B, T], metrics).
    lower None: weights truncated at `threshold`; lower given (IcePop): weights whose ratio lies
    outside [lower, threshold] are 0, the others the ratio itself. batch_normalize divides by
    the mean weight (over valid tokens; at sequence level over non-empty rows).
    Metrics (over valid tokens; at sequence level max, min, std and ESS over non-empty rows):
    rollout_is_mean (final weights), rollout_is_max / _min (the untruncated ratio),
    rollout_is_std, rollout_is_eff_sample_size = mean(w)^2 / mean(w^2) (scale-free, so the same
    before and after normalisation; 1 = all weights equal), rollout_is_ratio_fraction_high /
    _low (ratio above threshold / below lower, or 1 / threshold without lower),
    rollout_is_truncated_fraction (= _high), rollout_is_batch_norm_factor (the mean divided by;
    1 without normalisation).
    """
    if level not in IS_LEVELS:
        raise ValueError(
            f"rollout_is: unknown level {level!r}; valid levels: {', '.join(IS_LEVELS)}"
        )
    if threshold <= 0 or (lower is not None and not 0 <= lower < threshold):
        raise ValueError(f"rollout_is_threshold: need upper > 0 and 0 <= lower < upper, got "
                         f"lower={lower}, upper={threshold}")
    log_ratio = _log_ratio(old_log_probs, rollout_log_probs, response_mask)
    valid = response_mask.bool()
    if level == "sequence":
        log_ratio = masked_sum(log_ratio, response_mask, dim=-1).unsqueeze(-1).expand_as(log_ratio)
    log_upper = math.log(threshold)
    log_lower = math.log(lower) if lower else -math.inf
    high = log_ratio > log_upper
    low = log_ratio < (log_lower if lower is not None else -log_upper)
    if lower is None:
        weights = torch.exp(log_ratio.clamp(max=log_upper))
    else:
        inside = (log_ratio >= log_lower) & (log_ratio <= log_upper)
        weights = torch.where(inside, torch.exp(log_ratio.clamp(max=log_upper)), 0.0)
    weights = masked_fill_invalid(weights, response_mask)
    # At sequence level a row is one sample: its statistics are taken over the non-empty rows.
    if level == "sequence":
        unit_mask, unit_weights, unit_log = valid.any(dim=-1), weights.amax(dim=-1), log_ratio[:, 0]
    else:
        unit_mask, unit_weights, unit_log = valid, weights, log_ratio
    any_valid = unit_mask.any()
    mean = masked_mean(unit_weights, unit_mask)
    second = masked_mean(unit_weights.square(), unit_mask)
    bounded = unit_log.clamp(-_RATIO_LOG_BOUND, _RATIO_LOG_BOUND)
    largest = bounded.masked_fill(~unit_mask, -math.inf).max()
    smallest = bounded.masked_fill(~unit_mask, math.inf).min()
    metrics = {
        "rollout_is_max": torch.where(any_valid, torch.exp(largest), 0.0),
        "rollout_is_min": torch.where(any_valid, torch.exp(smallest), 0.0),
        "rollout_is_std": (second - mean.square()).clamp(min=0).sqrt(),
        "rollout_is_eff_sample_size": torch.where(
            second > 0, mean.square() / second.clamp(min=1e-30), 0.0),
        "rollout_is_ratio_fraction_high": masked_mean(high.to(weights.dtype), response_mask),
        "rollout_is_ratio_fraction_low": masked_mean(low.to(weights.dtype), response_mask),
    }
    metrics["rollout_is_truncated_fraction"] = metrics["rollout_is_ratio_fraction_high"]
    factor = mean.new_ones(())
    if batch_normalize:
        factor = torch.where(mean > 0, mean, 1.0)
        weights = weights / factor
    metrics["rollout_is_batch_norm_factor"] = factor * any_valid.to(factor.dtype)
    metrics["rollout_is_mean"] = masked_mean(weights, response_mask)
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
    """How far mu is from pi_old (inputs [B, T]), with verl's names.

    Over valid tokens: kl = mean(-l_t), the k1 estimate of KL(mu || pi_old); k3_kl =
    mean(exp(l_t) - 1 - l_t); chi2_token = mean(rho_t^2) - 1. Over non-empty rows, with
    lp_i = mean_t log-prob of row i: training_log_ppl = mean(-lp_i(pi_old)), training_ppl =
    mean(exp(-lp_i(pi_old))), rollout_log_ppl and rollout_ppl the same under mu; log_ppl_diff
    = mean(d_i) with d_i = lp_i(mu) - lp_i(pi_old), log_ppl_abs_diff = mean|d_i|,
    log_ppl_diff_max / _min, ppl_ratio = mean(exp(d_i)) (training over rollout perplexity);
    chi2_seq = mean((prod_t rho_t)^2) - 1. All 0 for an all-zero mask.
    """
    log_ratio = _log_ratio(old_log_probs, rollout_log_probs, response_mask)
    bounded = log_ratio.clamp(-_RATIO_LOG_BOUND, _RATIO_LOG_BOUND)
    ratio_sq = masked_fill_invalid(torch.exp(2 * bounded), response_mask)
    any_valid = response_mask.bool().any().to(ratio_sq.dtype)
    rows = response_mask.bool().any(dim=-1)
    train_lp = masked_mean(masked_fill_invalid(old_log_probs.detach(), response_mask),
                           response_mask, dim=-1)
    roll_lp = masked_mean(masked_fill_invalid(rollout_log_probs.detach(), response_mask),
                          response_mask, dim=-1)
    diff = roll_lp - train_lp
    seq_log_ratio = masked_sum(log_ratio, response_mask, dim=-1).clamp(-_RATIO_LOG_BOUND,
                                                                       _RATIO_LOG_BOUND)

    def row_mean(values: torch.Tensor) -> torch.Tensor:
        return masked_mean(values, rows)

    def row_extreme(values: torch.Tensor, largest: bool) -> torch.Tensor:
        if not bool(rows.any()):
            return values.new_zeros(())
        return values[rows].max() if largest else values[rows].min()

    return {
        "kl": masked_mean(-log_ratio, response_mask),
        "k3_kl": masked_mean(_token_scores(log_ratio, "k3"), response_mask),
        "chi2_token": masked_mean(ratio_sq, response_mask) - any_valid,
        "chi2_seq": row_mean(torch.exp(2 * seq_log_ratio)) - any_valid,
        "training_log_ppl": row_mean(-train_lp),
        "training_ppl": row_mean(torch.exp(-train_lp)),
        "rollout_log_ppl": row_mean(-roll_lp),
        "rollout_ppl": row_mean(torch.exp(-roll_lp)),
        "log_ppl_diff": row_mean(diff),
        "log_ppl_abs_diff": row_mean(diff.abs()),
        "log_ppl_diff_max": row_extreme(diff, largest=True),
        "log_ppl_diff_min": row_extreme(diff, largest=False),
        "ppl_ratio": row_mean(torch.exp(diff.clamp(-_RATIO_LOG_BOUND, _RATIO_LOG_BOUND))),
    }


RSThreshold = tuple[float | None, float]


def compute_rollout_correction(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    rollout_is: str | None = None,
    rollout_is_threshold: float = 2.0,
    rollout_is_threshold_lower: float | None = None,
    rollout_is_batch_normalize: bool = False,
    rollout_rs: str | Sequence[str] | None = None,
    rollout_rs_threshold: RSThreshold | Sequence[RSThreshold] = (None, 2.0),
) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, torch.Tensor]]:
    """Weights (None when rollout_is is None), the response mask after rejection, and all metrics.

    Inputs [B, T]. rollout_is: None | token | sequence, with `rollout_is_weights`' threshold,
    lower (IcePop band) and batch_normalize. rollout_rs: None, one of :data:`RS_CRITERIA`, or
    several (a sequence or a comma-separated string): a token is kept only if every criterion
    keeps it. rollout_rs_threshold: one (lower, upper) for all criteria or one per criterion;
    lower None means 1 / upper (k1 only). Weights and their metrics are computed on the full
    response mask; rejected tokens then get weight 0. With several criteria each one's
    metrics are also given as rollout_rs_<criterion>_masked_fraction. The metrics always
    include the probability differences and :func:`off_policy_metrics`.
    """
    metrics = rollout_probs_diff_metrics(old_log_probs, rollout_log_probs, response_mask)
    metrics.update(off_policy_metrics(old_log_probs, rollout_log_probs, response_mask))
    mask = response_mask
    criteria = ([c.strip() for c in rollout_rs.split(",") if c.strip()]
                if isinstance(rollout_rs, str) else list(rollout_rs or ()))
    if criteria:
        per_criterion = (list(rollout_rs_threshold) if rollout_rs_threshold
                         and isinstance(rollout_rs_threshold[0], tuple)
                         else [rollout_rs_threshold] * len(criteria))
        if len(per_criterion) != len(criteria):
            raise ValueError(f"rollout_rs_threshold: {len(per_criterion)} thresholds for "
                             f"{len(criteria)} criteria ({', '.join(criteria)}); give one "
                             "for all or one per criterion")
        keep = response_mask.bool()
        for criterion, (lower, upper) in zip(criteria, per_criterion):
            kept, rs_metrics = rollout_rejection_mask(
                old_log_probs, rollout_log_probs, response_mask,
                criterion=criterion, lower=lower, upper=upper,
            )
            keep = keep & kept.bool()
            if len(criteria) > 1:
                metrics[f"rollout_rs_{criterion}_masked_fraction"] = (
                    rs_metrics["rollout_rs_masked_fraction"])
        valid = response_mask.bool()
        removed = (valid & ~keep).to(old_log_probs.dtype)
        metrics["rollout_rs_masked_fraction"] = masked_mean(removed, valid)
        metrics["rollout_rs_seq_masked_fraction"] = masked_mean(
            (removed.sum(dim=-1) > 0).to(removed.dtype), valid.any(dim=-1))
        mask = keep.to(response_mask.dtype)
    weights = None
    if rollout_is is not None:
        weights, is_metrics = rollout_is_weights(
            old_log_probs, rollout_log_probs, response_mask,
            level=rollout_is, threshold=rollout_is_threshold, lower=rollout_is_threshold_lower,
            batch_normalize=rollout_is_batch_normalize,
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
