"""Policy-gradient losses: PPO clip (clip-higher, dual-clip), GSPO and the recipes after them.

Shapes: B sequences, T response positions; every tensor input is [B, T] and `response_mask`
marks the valid tokens. Each loss returns the per-token loss matrix [B, T] (0 outside the mask;
aggregate it with `megarl.algo.aggregation.aggregate_loss`) and a dict of detached scalar metrics:
  pg_clipfrac        fraction of valid tokens where clipping changed the loss
  pg_clipfrac_lower  PPO: fraction of valid tokens cut by the dual clip (negative advantages);
                     GSPO (no dual clip): fraction clipped with a negative advantage
  ppo_kl             mean over valid tokens of old_log_probs - log_probs
An all-zero mask gives a zero loss matrix and zero metrics, never NaN.

Names follow verl's `actor.policy_loss.loss_mode` values: vanilla (PPO), gspo (GSPO,
arXiv 2507.18071), cispo (MiniMax-M1, 2506.13585), clip_cov and kl_cov (Cui et al., 2505.22617),
geo_mean (GMPO, 2507.20673), sapo (2511.20347), gpg (2504.02546), dppo_tv and dppo_kl (DPPO,
2602.04879). gspo and geo_mean are sequence-level objectives: their loss matrix holds each
sequence's loss on every one of its tokens, so they equal their papers' objectives only when
aggregated with `seq-mean-token-mean` (the config refuses other modes for them).
Clip-Cov and KL-Cov pick tokens by the covariance of advantage and log-prob over the batch they
are given (one micro-batch in the trainer, as in verl).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

from megarl.algo.masked import masked_fill_invalid, masked_mean

# Log-ratios are clamped before exp so that one wild token cannot overflow the loss.
_LOG_RATIO_BOUND = 20.0
# GSPO's sequence log-ratio is clamped above at this value, as in verl.
_GSPO_LOG_RATIO_MAX = 10.0
# DPPO-Binary-KL: keeps log(1 - p) finite when a probability is 1.
_BINARY_KL_EPS = 1e-8
# GMPO: rollout-correction weights enter a geometric mean; a zero weight becomes this one.
_GMPO_MIN_WEIGHT = 1e-10
# Losses whose loss matrix is a sequence-level objective (see the module docstring).
SEQUENCE_LEVEL_LOSSES = ("gspo", "geo_mean")

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


def _masked_log_ratio(
    log_probs: torch.Tensor, old_log_probs: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """log_probs - sg[old_log_probs], 0 outside the mask."""
    return masked_fill_invalid(log_probs - old_log_probs.detach(), response_mask)


def _metrics(
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    clipped: torch.Tensor | None = None,
    clipped_lower: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """The three detached metrics of every loss; a missing clip indicator counts as 0."""
    def frac(flags: torch.Tensor | None) -> torch.Tensor:
        if flags is None:
            return log_ratio.new_zeros(())
        return masked_mean(flags.to(log_ratio.dtype), response_mask)

    metrics = {"pg_clipfrac": frac(clipped), "pg_clipfrac_lower": frac(clipped_lower),
               "ppo_kl": masked_mean(-log_ratio, response_mask)}
    return {name: value.detach() for name, value in metrics.items()}


def cispo_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    rollout_is_weights: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """CISPO (MiniMax-M1): clip the importance weight, keep every token's gradient.

    All inputs [B, T] -> (loss [B, T], metrics). loss = -sg[clip(r, 1 - low, 1 + high)] A log pi;
    its gradient is -clip(r) A grad log pi on every token (no token is dropped).
    clip_ratio_low >= 1 leaves the weight unbounded below (the paper bounds it above only).
    pg_clipfrac: tokens whose weight was clipped; pg_clipfrac_lower: those clipped below.
    """
    _check_inputs(log_probs, old_log_probs, advantages, response_mask)
    if clip_ratio_low < 0 or clip_ratio_high < 0:
        raise ValueError(f"actor.clip_ratio_low/high: CISPO needs both >= 0, got "
                         f"low={clip_ratio_low}, high={clip_ratio_high}")
    log_ratio = _masked_log_ratio(log_probs, old_log_probs, response_mask)
    advantages = masked_fill_invalid(advantages, response_mask)
    ratio = torch.exp(log_ratio.detach().clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND))
    weight = ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    losses = -weight * advantages * masked_fill_invalid(log_probs, response_mask)
    losses = _finish(losses, response_mask, rollout_is_weights)
    return losses, _metrics(log_ratio, response_mask, weight != ratio,
                            ratio < 1.0 - clip_ratio_low)


def _covariance(
    log_probs: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """Per-token (A - mean A)(log pi - mean log pi), means over the valid tokens; detached."""
    lp = masked_fill_invalid(log_probs.detach(), response_mask)
    return ((advantages - masked_mean(advantages, response_mask))
            * (lp - masked_mean(lp, response_mask)))


def clip_cov_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_cov_ratio: float = 2e-4,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    generator: torch.Generator | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """Clip-Cov: PPO clip, plus no gradient for a few random high-covariance tokens.

    All inputs [B, T] -> (loss [B, T], metrics). cov_t = (A_t - mean A)(log pi_t - mean log pi)
    over the valid tokens. Candidates: valid tokens not already clipped by PPO with
    clip_cov_lb < cov_t < clip_cov_ub; max(1, floor(clip_cov_ratio * N)) of them, drawn
    uniformly without replacement (from `generator`, on the CPU), get loss 0; the others the
    PPO clipped loss max(-A r, -A clip(r, 1 - low, 1 + high)). pg_clipfrac: the zeroed tokens.
    """
    _check_inputs(log_probs, old_log_probs, advantages, response_mask)
    _check_clip(clip_ratio_low, clip_ratio_high)
    if clip_cov_ratio <= 0 or clip_cov_lb >= clip_cov_ub:
        raise ValueError("actor.policy_loss.clip_cov_ratio/lb/ub: need ratio > 0 and lb < ub, got "
                         f"{clip_cov_ratio}, {clip_cov_lb}, {clip_cov_ub}")
    log_ratio = _masked_log_ratio(log_probs, old_log_probs, response_mask)
    advantages = masked_fill_invalid(advantages, response_mask)
    ratio = torch.exp(log_ratio.clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND))
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    cov = _covariance(log_probs, advantages, response_mask)
    candidates = (response_mask.bool() & ~(clipped > unclipped)
                  & (cov > clip_cov_lb) & (cov < clip_cov_ub))
    flat = torch.nonzero(candidates.flatten().cpu()).squeeze(-1)
    num_valid = int(response_mask.bool().sum().item())
    take = min(max(int(clip_cov_ratio * num_valid), 1), len(flat))
    chosen = flat[torch.randperm(len(flat), generator=generator)[:take]]
    detached = torch.zeros(candidates.numel(), dtype=torch.bool)
    detached[chosen] = True
    detached = detached.view_as(candidates).to(candidates.device)
    losses = torch.where(detached, unclipped.new_zeros(()), torch.maximum(unclipped, clipped))
    losses = _finish(losses, response_mask, rollout_is_weights)
    return losses, _metrics(log_ratio, response_mask, detached)


def kl_cov_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    kl_cov_ratio: float = 2e-4,
    ppo_kl_coef: float = 1.0,
    rollout_is_weights: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """KL-Cov: unclipped -A r, plus a |log r| penalty on the highest-covariance tokens.

    All inputs [B, T] -> (loss [B, T], metrics). cov as in Clip-Cov; the
    max(1, floor(kl_cov_ratio * N)) valid tokens of largest cov get
    -A r + ppo_kl_coef |log pi - log pi_old|, every other token -A r.
    pg_clipfrac: the penalised tokens.
    """
    _check_inputs(log_probs, old_log_probs, advantages, response_mask)
    if kl_cov_ratio <= 0 or ppo_kl_coef < 0:
        raise ValueError("actor.policy_loss.kl_cov_ratio/ppo_kl_coef: need ratio > 0 and "
                         f"coef >= 0, got {kl_cov_ratio}, {ppo_kl_coef}")
    log_ratio = _masked_log_ratio(log_probs, old_log_probs, response_mask)
    advantages = masked_fill_invalid(advantages, response_mask)
    ratio = torch.exp(log_ratio.clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND))
    valid = response_mask.bool()
    cov = _covariance(log_probs, advantages, response_mask).masked_fill(~valid, -torch.inf)
    num_valid = int(valid.sum().item())
    penalised = torch.zeros(cov.numel(), dtype=torch.bool, device=cov.device)
    if num_valid:
        top = torch.topk(cov.flatten(), max(int(kl_cov_ratio * num_valid), 1)).indices
        penalised[top] = True
    penalised = penalised.view_as(cov)
    losses = -advantages * ratio + penalised * (ppo_kl_coef * log_ratio.abs())
    losses = _finish(losses, response_mask, rollout_is_weights)
    return losses, _metrics(log_ratio, response_mask, penalised)


def geo_mean_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.4,
    clip_ratio_high: float = 0.4,
    rollout_is_weights: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """GMPO: the geometric mean of the token ratios, clipped per token in log space.

    All inputs [B, T] -> (loss [B, T], metrics). Per token, l_t = log r_t and
    c_t = clip(l_t, -low, high); the kept value is min(l_t, c_t) for A_t > 0, max(l_t, c_t) for
    A_t < 0 (0 for A_t = 0). Sequence i: rho_i = exp(mean_t kept_t), Abar_i = mean_t A_t;
    every valid token of row i holds -Abar_i rho_i (times the geometric mean of its rollout
    weights), so `seq-mean-token-mean` gives the paper's mean_i -Abar_i rho_i.
    pg_clipfrac: tokens whose kept value is the clipped one; pg_clipfrac_lower: those with A < 0.
    """
    _check_inputs(log_probs, old_log_probs, advantages, response_mask)
    if clip_ratio_low < 0 or clip_ratio_high < 0:
        raise ValueError(f"actor.clip_ratio_low/high: GMPO needs both >= 0 (log-space bounds), "
                         f"got low={clip_ratio_low}, high={clip_ratio_high}")
    log_ratio = _masked_log_ratio(log_probs, old_log_probs, response_mask)
    advantages = masked_fill_invalid(advantages, response_mask)
    sign = torch.sign(advantages)
    bounded = log_ratio.clamp(-clip_ratio_low, clip_ratio_high)
    kept = sign * torch.minimum(sign * log_ratio, sign * bounded)
    seq_ratio = torch.exp(masked_mean(kept, response_mask, dim=-1).clamp(max=_LOG_RATIO_BOUND))
    seq_loss = -masked_mean(advantages, response_mask, dim=-1) * seq_ratio
    if rollout_is_weights is not None:
        if rollout_is_weights.shape != log_probs.shape:
            raise ValueError(f"rollout_is_weights: shape {tuple(rollout_is_weights.shape)} "
                             f"differs from log_probs {tuple(log_probs.shape)}")
        log_w = rollout_is_weights.detach().clamp(min=_GMPO_MIN_WEIGHT).log()
        seq_loss = seq_loss * torch.exp(masked_mean(log_w, response_mask, dim=-1))
    losses = masked_fill_invalid(seq_loss.unsqueeze(-1).expand_as(log_ratio), response_mask)
    was_clipped = (kept != log_ratio) & (sign != 0)
    return losses, _metrics(log_ratio, response_mask, was_clipped,
                            was_clipped & (advantages < 0))


def sapo_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    rollout_is_weights: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """SAPO: a soft, temperature-controlled gate in place of the hard clip.

    All inputs [B, T] -> (loss [B, T], metrics). tau = tau_pos where A > 0, else tau_neg;
    loss = -A (4 / tau) sigmoid(tau (r - 1)), whose gradient weight 4 s (1 - s) r equals r's at
    r = 1 and fades smoothly away from it. The paper aggregates with seq-mean-token-mean.
    Nothing is clipped: pg_clipfrac and pg_clipfrac_lower are 0.
    """
    _check_inputs(log_probs, old_log_probs, advantages, response_mask)
    if tau_pos <= 0 or tau_neg <= 0:
        raise ValueError(f"actor.tau_pos/tau_neg: SAPO needs both > 0, got {tau_pos}, {tau_neg}")
    log_ratio = _masked_log_ratio(log_probs, old_log_probs, response_mask)
    advantages = masked_fill_invalid(advantages, response_mask)
    ratio = torch.exp(log_ratio.clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND))
    tau = torch.where(advantages > 0, ratio.new_tensor(tau_pos), ratio.new_tensor(tau_neg))
    losses = -advantages * (4.0 / tau) * torch.sigmoid(tau * (ratio - 1.0))
    losses = _finish(losses, response_mask, rollout_is_weights)
    return losses, _metrics(log_ratio, response_mask)


def gpg_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    rollout_is_weights: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """GPG: plain policy gradient, loss = -A log pi (no ratio, no clip).

    All inputs [B, T] -> (loss [B, T], metrics); old_log_probs only feed ppo_kl.
    """
    _check_inputs(log_probs, old_log_probs, advantages, response_mask)
    log_ratio = _masked_log_ratio(log_probs, old_log_probs, response_mask)
    advantages = masked_fill_invalid(advantages, response_mask)
    losses = -advantages * masked_fill_invalid(log_probs, response_mask)
    losses = _finish(losses, response_mask, rollout_is_weights)
    return losses, _metrics(log_ratio, response_mask)


def _dppo_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    divergence: str,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float,
    rollout_is_weights: torch.Tensor | None,
) -> PolicyLossOutput:
    """DPPO with the binary TV or binary KL trust region (see the two public functions)."""
    _check_inputs(log_probs, old_log_probs, advantages, response_mask)
    if clip_ratio_low < 0 or clip_ratio_high < 0 or clip_ratio_c <= 0:
        raise ValueError("actor.clip_ratio_low/high/c: DPPO needs divergence thresholds >= 0 and "
                         f"a truncation > 0, got {clip_ratio_low}, {clip_ratio_high}, "
                         f"{clip_ratio_c}")
    log_ratio = _masked_log_ratio(log_probs, old_log_probs, response_mask)
    advantages = masked_fill_invalid(advantages, response_mask)
    lp = masked_fill_invalid(log_probs, response_mask)
    ratio = torch.exp(log_ratio.detach().clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND))
    prob = torch.exp(lp.detach())
    old_prob = torch.exp(masked_fill_invalid(old_log_probs.detach(), response_mask))
    if divergence == "tv":
        inside_up = prob - old_prob <= clip_ratio_high
        inside_down = prob - old_prob >= -clip_ratio_low
    else:
        binary_kl = (old_prob * (torch.log(old_prob) - torch.log(prob))
                     + (1 - old_prob) * torch.log((1 - old_prob + _BINARY_KL_EPS)
                                                  / (1 - prob + _BINARY_KL_EPS)))
        inside_up = (binary_kl <= clip_ratio_high) | (prob <= old_prob)
        inside_down = (binary_kl <= clip_ratio_low) | (prob >= old_prob)
    inside = torch.where(advantages > 0, inside_up, inside_down)
    truncated = ratio.clamp(max=clip_ratio_c)
    losses = torch.where(inside, -advantages * truncated * lp, lp.new_zeros(()))
    losses = _finish(losses, response_mask, rollout_is_weights)
    return losses, _metrics(log_ratio, response_mask, ~inside, inside & (ratio > clip_ratio_c))


def dppo_tv_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 20.0,
    rollout_is_weights: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """DPPO-Binary-TV: drop the tokens that left a total-variation trust region.

    All inputs [B, T] -> (loss [B, T], metrics). With p = pi(token), p_old = pi_old(token):
    a token stays when A > 0 and p - p_old <= clip_ratio_high, or A <= 0 and
    p - p_old >= -clip_ratio_low (the thresholds are probability differences, not ratio
    bounds). Kept tokens: loss = -A sg[min(r, clip_ratio_c)] log pi (gradient -A min(r, c)
    grad log pi, truncated IS); dropped tokens: 0. pg_clipfrac: dropped tokens;
    pg_clipfrac_lower: kept tokens whose ratio was truncated at clip_ratio_c.
    """
    return _dppo_loss(log_probs, old_log_probs, advantages, response_mask, "tv",
                      clip_ratio_low, clip_ratio_high, clip_ratio_c, rollout_is_weights)


def dppo_kl_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.05,
    clip_ratio_high: float = 0.05,
    clip_ratio_c: float = 20.0,
    rollout_is_weights: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """DPPO-Binary-KL: drop the tokens that left a binary-KL trust region.

    All inputs [B, T] -> (loss [B, T], metrics). D = p_old log(p_old / p)
    + (1 - p_old) log((1 - p_old) / (1 - p)), the KL between the Bernoulli distributions
    "this token or not". A token is dropped when A > 0, p > p_old and D > clip_ratio_high, or
    A <= 0, p < p_old and D > clip_ratio_low; the rest as in `dppo_tv_policy_loss`.
    """
    return _dppo_loss(log_probs, old_log_probs, advantages, response_mask, "kl",
                      clip_ratio_low, clip_ratio_high, clip_ratio_c, rollout_is_weights)


POLICY_LOSSES: dict[str, Callable[..., PolicyLossOutput]] = {
    "vanilla": ppo_policy_loss,
    "gspo": gspo_policy_loss,
    "cispo": cispo_policy_loss,
    "clip_cov": clip_cov_policy_loss,
    "kl_cov": kl_cov_policy_loss,
    "geo_mean": geo_mean_policy_loss,
    "sapo": sapo_policy_loss,
    "gpg": gpg_policy_loss,
    "dppo_tv": dppo_tv_policy_loss,
    "dppo_kl": dppo_kl_policy_loss,
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


def policy_loss_options(loss_mode: str) -> tuple[str, ...]:
    """The keyword options (other than rollout_is_weights and generator) `loss_mode` takes."""
    params = inspect.signature(get_policy_loss(loss_mode)).parameters.values()
    return tuple(p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY
                 and p.name not in ("rollout_is_weights", "generator"))
