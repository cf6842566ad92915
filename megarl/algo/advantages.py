"""Advantage estimators: GRPO (and pass@k), RLOO, OPO, GPG, REINFORCE++ (and with a group
baseline), ReMax and GAE, as pure tensor functions.

Shapes: B sequences, T response positions. `response_mask` [B, T] marks response tokens (bool or
0/1). Outcome rewards (`scores`) are one number per sequence, [B]; token-level rewards are
[B, T]. Every estimator returns `(advantages, returns)`, both [B, T] and 0 outside the mask.

A row whose response mask is all zeros (an aborted sample, a padding row) is not a sample: it gets
zero advantage and return, and it is left out of group statistics and of whitening.

Names follow verl's `algorithm.adv_estimator` values so that configs carry over.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from megarl.algo.masked import masked_fill_invalid, masked_whiten

GroupIndex = torch.Tensor | Sequence[Hashable]


def _group_ids(index: GroupIndex, batch_size: int, device: torch.device) -> torch.Tensor:
    """Map a per-sequence group label (uid strings, ints, a tensor) to dense ids 0..G-1, [B]."""
    if isinstance(index, torch.Tensor):
        if index.dim() != 1:
            raise ValueError(f"index: expected shape [B], got {tuple(index.shape)}")
        ids = torch.unique(index, return_inverse=True)[1]
    else:
        dense: dict[Hashable, int] = {}
        labels = [dense.setdefault(label, len(dense)) for label in index]
        ids = torch.tensor(labels, dtype=torch.long)
    if ids.numel() != batch_size:
        raise ValueError(
            f"index: has {ids.numel()} labels for {batch_size} sequences; give one per row"
        )
    return ids.to(device)


def _check_scores(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Validate [B] scores against a [B, T] mask; return them as floating point."""
    if response_mask.dim() != 2:
        raise ValueError(f"response_mask: expected shape [B, T], got {tuple(response_mask.shape)}")
    if scores.shape != response_mask.shape[:1]:
        raise ValueError(
            f"scores: expected one outcome reward per sequence, shape [{response_mask.shape[0]}], "
            f"got {tuple(scores.shape)}; sum token-level rewards over the response first"
        )
    return scores if scores.is_floating_point() else scores.float()


def _group_sums(values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Per-group sum of a [B] tensor, [G]."""
    num_groups = int(ids.max()) + 1 if ids.numel() else 0
    sums = torch.zeros(num_groups, dtype=values.dtype, device=values.device)
    return sums.index_add_(0, ids, values)


def _broadcast(per_sequence: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Spread a [B] value over the valid tokens of each row, [B, T]."""
    expanded = per_sequence.unsqueeze(-1).expand(response_mask.shape)
    return masked_fill_invalid(expanded, response_mask)


def outcome_to_token_rewards(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Place each sequence's outcome reward [B] on its last valid token, [B, T]; 0 elsewhere."""
    scores = _check_scores(scores, response_mask)
    valid = response_mask.bool()
    positions = torch.arange(valid.shape[-1], device=valid.device).expand(valid.shape)
    last = torch.where(valid, positions, -1).amax(dim=-1)
    rewards = torch.zeros(valid.shape, dtype=scores.dtype, device=scores.device)
    has_tokens = last >= 0
    rows = torch.arange(valid.shape[0], device=valid.device)[has_tokens]
    rewards[rows, last[has_tokens]] = scores[has_tokens]
    return rewards


def grpo_advantages(
    scores: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
    *,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-relative advantage (score - group mean) [/ (group std + epsilon)], on every token.

    scores [B], response_mask [B, T], index: B group labels (uids) -> advantages, returns [B, T].
    The std is the unbiased (Bessel-corrected) one over the group's samples. A group with a
    single sample has no baseline and gets advantage 0. Returns equal advantages.
    """
    scores = _check_scores(scores, response_mask)
    ids = _group_ids(index, scores.shape[0], scores.device)
    valid = (response_mask.sum(dim=-1) > 0).to(scores.dtype)
    counts = _group_sums(valid, ids)
    means = _group_sums(scores * valid, ids) / counts.clamp(min=1)
    centred = scores - means[ids]
    squares = _group_sums(centred.square() * valid, ids)
    stds = (squares / (counts - 1).clamp(min=1)).sqrt()
    if norm_adv_by_std_in_grpo:
        centred = centred / (stds[ids] + epsilon)
    per_sequence = centred * valid * (counts[ids] >= 2)
    advantages = _broadcast(per_sequence, response_mask)
    return advantages, advantages


def rloo_advantages(
    scores: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE leave-one-out: score minus the mean score of the other samples of its group.

    scores [B], response_mask [B, T], index: B group labels -> advantages, returns [B, T].
    A group with a single sample gets advantage 0. Returns equal advantages.
    """
    scores = _check_scores(scores, response_mask)
    ids = _group_ids(index, scores.shape[0], scores.device)
    valid = (response_mask.sum(dim=-1) > 0).to(scores.dtype)
    counts = _group_sums(valid, ids)[ids]
    totals = _group_sums(scores * valid, ids)[ids]
    baseline = (totals - scores) / (counts - 1).clamp(min=1)
    per_sequence = (scores - baseline) * valid * (counts >= 2)
    advantages = _broadcast(per_sequence, response_mask)
    return advantages, advantages


def _group_stats(
    scores: torch.Tensor, response_mask: torch.Tensor, index: GroupIndex
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dense group ids [B], 1/0 validity of each row [B], valid rows per group [G])."""
    ids = _group_ids(index, scores.shape[0], scores.device)
    valid = (response_mask.sum(dim=-1) > 0).to(scores.dtype)
    return ids, valid, _group_sums(valid, ids)


def grpo_passk_advantages(
    scores: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
    *,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k GRPO (arXiv 2503.19595): only the best sample of each group is credited.

    scores [B], response_mask [B, T], index: B group labels -> advantages, returns [B, T].
    The group's best sample (the first one on a tie) gets r_max - r_second_max [/ (group std +
    epsilon), unbiased std], every other sample 0; a group of one valid sample gets 0.
    """
    scores = _check_scores(scores, response_mask)
    ids, valid, counts = _group_stats(scores, response_mask, index)
    per_sequence = torch.zeros_like(scores)
    for group in range(counts.numel()):
        rows = torch.nonzero((ids == group) & (valid > 0)).squeeze(-1)
        if rows.numel() < 2:
            continue
        top = torch.topk(scores[rows], 2)
        advantage = top.values[0] - top.values[1]
        if norm_adv_by_std_in_grpo:
            advantage = advantage / (scores[rows].std() + epsilon)
        per_sequence[rows[top.indices[0]]] = advantage
    advantages = _broadcast(per_sequence, response_mask)
    return advantages, advantages


def opo_advantages(
    scores: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO (arXiv 2505.23585): score minus the length-weighted mean score of its group.

    scores [B], response_mask [B, T], index: B group labels -> advantages, returns [B, T].
    b = sum_j l_j r_j / sum_j l_j over the group's samples (l_j their response lengths), the
    optimal baseline of the paper; a group of one valid sample gets 0.
    """
    scores = _check_scores(scores, response_mask)
    ids, valid, counts = _group_stats(scores, response_mask, index)
    lengths = response_mask.to(scores.dtype).sum(dim=-1) * valid
    baseline = _group_sums(lengths * scores, ids) / _group_sums(lengths, ids).clamp(min=1)
    per_sequence = (scores - baseline[ids]) * valid * (counts[ids] >= 2)
    advantages = _broadcast(per_sequence, response_mask)
    return advantages, advantages


def gpg_advantages(
    scores: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG (arXiv 2504.02546): group-centred score, scaled up for the groups that carry none.

    scores [B], response_mask [B, T], index: B group labels -> advantages, returns [B, T].
    A = alpha (r - group mean) with alpha = B / (B - M), B the valid samples and M those in
    groups whose rewards are all equal (their advantage is 0); this keeps the gradient's scale
    when a loss averages over all B samples. (verl counts the samples with a non-zero reward as
    B - M instead.) A group of one valid sample gets 0.
    """
    scores = _check_scores(scores, response_mask)
    ids, valid, counts = _group_stats(scores, response_mask, index)
    means = _group_sums(scores * valid, ids) / counts.clamp(min=1)
    centred = (scores - means[ids]) * valid * (counts[ids] >= 2)
    spread = _group_sums(centred.abs(), ids)[ids] > 0
    informative = (spread.to(scores.dtype) * valid).sum()
    alpha = valid.sum() / informative.clamp(min=1)
    advantages = _broadcast(alpha * centred, response_mask)
    return advantages, advantages


def reinforce_plus_plus_baseline_advantages(
    scores: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with a group baseline (arXiv 2501.03262): score minus group mean, on every
    token, then whitened over all valid tokens of the batch.

    scores [B], response_mask [B, T], index: B group labels -> advantages, returns [B, T]
    (returns equal advantages). A group of one valid sample has no baseline: its score is kept
    as is (as in verl) before the whitening.
    """
    scores = _check_scores(scores, response_mask)
    ids, valid, counts = _group_stats(scores, response_mask, index)
    means = _group_sums(scores * valid, ids) / counts.clamp(min=1)
    centred = (scores - means[ids] * (counts[ids] >= 2)) * valid
    advantages = masked_whiten(_broadcast(centred, response_mask), response_mask)
    return advantages, advantages


def remax_advantages(
    token_level_rewards: torch.Tensor,
    reward_baselines: torch.Tensor,
    response_mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (arXiv 2310.10505): undiscounted return-to-go minus the reward of the greedy
    response to the same prompt.

    token_level_rewards [B, T], reward_baselines [B] (the greedy response's score),
    response_mask [B, T] -> advantages, returns [B, T].
    """
    returns = discounted_returns(token_level_rewards, response_mask, 1.0)
    if reward_baselines.shape != returns.shape[:1]:
        raise ValueError(f"reward_baselines: expected shape [{returns.shape[0]}], got "
                         f"{tuple(reward_baselines.shape)}; one greedy score per sequence")
    advantages = masked_fill_invalid(returns - reward_baselines.unsqueeze(-1), response_mask)
    return advantages, returns


def _check_token_level(rewards: torch.Tensor, response_mask: torch.Tensor, name: str) -> None:
    """Validate that a token-level tensor matches the [B, T] response mask."""
    if rewards.shape != response_mask.shape or rewards.dim() != 2:
        raise ValueError(
            f"{name}: expected shape [B, T] = {tuple(response_mask.shape)} like response_mask, "
            f"got {tuple(rewards.shape)}; use outcome_to_token_rewards for per-sequence scores"
        )


def discounted_returns(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float
) -> torch.Tensor:
    """Return-to-go sum_k gamma^k r_{t+k} over the valid tokens of each row, [B, T].

    Positions outside the mask are skipped: their rewards are ignored and the return flows across
    them (a tool-output span inside a multi-turn response), and they get 0.
    """
    _check_token_level(token_level_rewards, response_mask, "token_level_rewards")
    valid = response_mask.bool()
    running = torch.zeros_like(token_level_rewards[:, 0])
    returns = torch.zeros_like(token_level_rewards)
    for t in reversed(range(token_level_rewards.shape[-1])):
        running = torch.where(valid[:, t], token_level_rewards[:, t] + gamma * running, running)
        returns[:, t] = running
    return masked_fill_invalid(returns, valid)


def reinforce_plus_plus_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    gamma: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: discounted returns, whitened over all valid tokens of the batch.

    token_level_rewards [B, T], response_mask [B, T] -> advantages (whitened), returns [B, T].
    """
    returns = discounted_returns(token_level_rewards, response_mask, gamma)
    return masked_whiten(returns, response_mask), returns


def gae_advantages(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation with a critic; advantages whitened over valid tokens.

    token_level_rewards [B, T], values [B, T], response_mask [B, T] -> advantages, returns [B, T].
    delta_t = r_t + gamma V_{t+1} - V_t, A_t = delta_t + gamma lam A_{t+1}, over the valid tokens
    of each row (masked positions are skipped, V after the last valid token is 0); returns are
    the un-whitened A_t + V_t, the critic's regression target.
    """
    _check_token_level(token_level_rewards, response_mask, "token_level_rewards")
    _check_token_level(values, response_mask, "values")
    valid = response_mask.bool()
    next_value = torch.zeros_like(values[:, 0])
    next_advantage = torch.zeros_like(values[:, 0])
    advantages = torch.zeros_like(values)
    for t in reversed(range(values.shape[-1])):
        delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        next_advantage = torch.where(valid[:, t], advantage, next_advantage)
        next_value = torch.where(valid[:, t], values[:, t], next_value)
        advantages[:, t] = advantage
    returns = masked_fill_invalid(advantages + values, valid)
    return masked_whiten(advantages, valid), returns


ADVANTAGE_ESTIMATORS: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {
    "grpo": grpo_advantages,
    "grpo_passk": grpo_passk_advantages,
    "rloo": rloo_advantages,
    "opo": opo_advantages,
    "gpg": gpg_advantages,
    "reinforce_plus_plus": reinforce_plus_plus_advantages,
    "reinforce_plus_plus_baseline": reinforce_plus_plus_baseline_advantages,
    "remax": remax_advantages,
    "gae": gae_advantages,
}


def get_advantage_estimator(name: str) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The estimator registered under `name` (algorithm.adv_estimator)."""
    try:
        return ADVANTAGE_ESTIMATORS[name]
    except KeyError:
        valid = ", ".join(sorted(ADVANTAGE_ESTIMATORS))
        raise ValueError(
            f"algorithm.adv_estimator: unknown estimator {name!r}; valid names: {valid}"
        ) from None


def compute_advantages(name: str, **inputs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the estimator `name` on keyword inputs; returns (advantages, returns), each [B, T]."""
    return get_advantage_estimator(name)(**inputs)
