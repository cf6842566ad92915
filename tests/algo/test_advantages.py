"""Advantage estimators against naive per-sequence Python references."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from megarl.algo import (
    compute_advantages,
    gae_advantages,
    grpo_advantages,
    outcome_to_token_rewards,
    reinforce_plus_plus_advantages,
    rloo_advantages,
)


def _valid_rows(mask: torch.Tensor) -> list[bool]:
    return [bool(mask[i].sum() > 0) for i in range(mask.shape[0])]


def _broadcast_reference(per_row: list[float], mask: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(mask, dtype=torch.float64)
    for i, value in enumerate(per_row):
        for t in range(mask.shape[1]):
            if mask[i, t] > 0:
                out[i, t] = value
    return out


def _naive_grpo(
    scores: list[float], labels: list, valid: list[bool], norm: bool, eps: float
) -> list[float]:
    out = []
    for i, label in enumerate(labels):
        members = [scores[j] for j in range(len(labels)) if labels[j] == label and valid[j]]
        if not valid[i] or len(members) < 2:
            out.append(0.0)
            continue
        centred = scores[i] - statistics.fmean(members)
        out.append(centred / (statistics.stdev(members) + eps) if norm else centred)
    return out


def _naive_rloo(scores: list[float], labels: list, valid: list[bool]) -> list[float]:
    out = []
    for i, label in enumerate(labels):
        others = [scores[j] for j in range(len(labels))
                  if labels[j] == label and valid[j] and j != i]
        out.append(scores[i] - statistics.fmean(others) if valid[i] and others else 0.0)
    return out


def _grouped_batch(make_mask):
    """12 rows in groups a (5), b (4), c (1, a singleton), d (2, equal scores)."""
    labels = ["a"] * 5 + ["b"] * 4 + ["c"] + ["d"] * 2
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(len(labels), generator=gen, dtype=torch.float64)
    scores[-2:] = 0.5
    mask = make_mask(len(labels), 7, seed=1)  # row 0 (group a) is empty
    return scores, labels, mask


@pytest.mark.parametrize("norm", [True, False])
def test_grpo_matches_naive(make_mask, norm: bool) -> None:
    scores, labels, mask = _grouped_batch(make_mask)
    adv, returns = grpo_advantages(scores, mask, labels, norm_adv_by_std_in_grpo=norm, epsilon=1e-6)
    expected = _naive_grpo(scores.tolist(), labels, _valid_rows(mask), norm, 1e-6)
    torch.testing.assert_close(adv, _broadcast_reference(expected, mask), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(returns, adv)
    assert adv[9].abs().sum() == 0  # singleton group
    assert adv[10:].abs().sum() == 0  # equal scores
    assert adv[0].abs().sum() == 0  # empty row
    # The empty row is not part of group a's statistics.
    assert expected[1] != _naive_grpo(scores.tolist(), labels, [True] * 12, norm, 1e-6)[1]


def test_grpo_accepts_tensor_index_and_int_scores(make_mask) -> None:
    scores, labels, mask = _grouped_batch(make_mask)
    ids = torch.tensor([ord(label) for label in labels])
    by_tensor, _ = grpo_advantages(scores, mask, ids)
    by_strings, _ = grpo_advantages(scores, mask, labels)
    torch.testing.assert_close(by_tensor, by_strings)
    binary = torch.tensor([1, 0, 1, 1, 0, 0, 0, 1, 1, 1, 0, 0])
    adv, _ = grpo_advantages(binary, mask, labels)
    expected = _naive_grpo([float(x) for x in binary], labels, _valid_rows(mask), True, 1e-6)
    torch.testing.assert_close(adv, _broadcast_reference(expected, mask).float())


def test_rloo_matches_naive(make_mask) -> None:
    scores, labels, mask = _grouped_batch(make_mask)
    adv, returns = rloo_advantages(scores, mask, labels)
    expected = _naive_rloo(scores.tolist(), labels, _valid_rows(mask))
    torch.testing.assert_close(adv, _broadcast_reference(expected, mask), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(returns, adv)
    assert adv[9].abs().sum() == 0


def _naive_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    out = torch.zeros_like(rewards)
    for i in range(rewards.shape[0]):
        positions = [t for t in range(rewards.shape[1]) if mask[i, t] > 0]
        for k, t in enumerate(positions):
            out[i, t] = sum(gamma**j * float(rewards[i, u]) for j, u in enumerate(positions[k:]))
    return out


def _naive_whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    flat = [float(values[i, t]) for i in range(values.shape[0]) for t in range(values.shape[1])
            if mask[i, t] > 0]
    mean, var = statistics.fmean(flat), statistics.variance(flat)
    out = torch.zeros_like(values)
    for i in range(values.shape[0]):
        for t in range(values.shape[1]):
            if mask[i, t] > 0:
                out[i, t] = (float(values[i, t]) - mean) / math.sqrt(var + 1e-8)
    return out


def test_reinforce_plus_plus_matches_naive(make_mask) -> None:
    mask = make_mask(6, 9, seed=2, holes=True)
    rewards = torch.randn(6, 9, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    rewards[mask == 0] = float("nan")  # rewards outside the mask are ignored
    adv, returns = reinforce_plus_plus_advantages(rewards, mask, gamma=0.9)
    expected_returns = _naive_returns(torch.nan_to_num(rewards), mask, 0.9)
    torch.testing.assert_close(returns, expected_returns, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(adv, _naive_whiten(expected_returns, mask), rtol=1e-8, atol=1e-10)


def test_outcome_rewards_give_broadcast_returns(make_mask) -> None:
    mask = make_mask(5, 6, seed=4)
    scores = torch.tensor([3.0, -1.0, 2.0, 0.5, 1.5], dtype=torch.float64)
    rewards = outcome_to_token_rewards(scores, mask)
    assert rewards[0].abs().sum() == 0  # empty row
    for i in range(1, 5):
        last = max(t for t in range(6) if mask[i, t] > 0)
        assert rewards[i, last] == scores[i] and rewards[i].sum() == scores[i]
    _, returns = reinforce_plus_plus_advantages(rewards, mask, gamma=1.0)
    torch.testing.assert_close(returns, scores.unsqueeze(-1) * mask)


def _naive_gae(rewards, values, mask, gamma, lam):
    advantages, returns = torch.zeros_like(rewards), torch.zeros_like(rewards)
    for i in range(rewards.shape[0]):
        positions = [t for t in range(rewards.shape[1]) if mask[i, t] > 0]
        running = 0.0
        for k in reversed(range(len(positions))):
            t = positions[k]
            next_value = float(values[i, positions[k + 1]]) if k + 1 < len(positions) else 0.0
            delta = float(rewards[i, t]) + gamma * next_value - float(values[i, t])
            running = delta + gamma * lam * running
            advantages[i, t] = running
            returns[i, t] = running + float(values[i, t])
    return _naive_whiten(advantages, mask), returns


def test_gae_matches_naive(make_mask) -> None:
    mask = make_mask(6, 10, seed=5, holes=True)
    gen = torch.Generator().manual_seed(6)
    rewards = torch.randn(6, 10, generator=gen, dtype=torch.float64)
    values = torch.randn(6, 10, generator=gen, dtype=torch.float64)
    values[mask == 0] = float("inf")  # garbage values outside the mask must not leak
    adv, returns = gae_advantages(rewards, values, mask, gamma=0.95, lam=0.8)
    exp_adv, exp_returns = _naive_gae(rewards, values, mask, 0.95, 0.8)
    torch.testing.assert_close(returns, exp_returns, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(adv, exp_adv, rtol=1e-8, atol=1e-10)


def test_all_empty_mask_gives_zeros_not_nan() -> None:
    mask = torch.zeros(4, 5)
    scores = torch.randn(4)
    rewards, values = torch.randn(4, 5), torch.randn(4, 5)
    outputs = [
        grpo_advantages(scores, mask, [0, 0, 1, 1]),
        rloo_advantages(scores, mask, [0, 0, 1, 1]),
        reinforce_plus_plus_advantages(rewards, mask),
        gae_advantages(rewards, values, mask),
    ]
    for adv, returns in outputs:
        assert torch.equal(adv, torch.zeros(4, 5)) and torch.equal(returns, torch.zeros(4, 5))


def test_registry_dispatches_and_names_valid_estimators(make_mask) -> None:
    scores, labels, mask = _grouped_batch(make_mask)
    via_registry = compute_advantages("grpo", scores=scores, response_mask=mask, index=labels)
    torch.testing.assert_close(via_registry, grpo_advantages(scores, mask, labels))
    with pytest.raises(ValueError, match="gae, gpg, grpo, grpo_passk, opo, .*, rloo"):
        compute_advantages("ppo", scores=scores)


def test_shape_errors_name_the_input(make_mask) -> None:
    mask = make_mask(4, 3, seed=7)
    with pytest.raises(ValueError, match="scores: expected one outcome reward per sequence"):
        grpo_advantages(torch.zeros(4, 3), mask, [0, 0, 1, 1])
    with pytest.raises(ValueError, match="index: has 3 labels for 4 sequences"):
        grpo_advantages(torch.zeros(4), mask, [0, 0, 1])
    with pytest.raises(ValueError, match="values: expected shape"):
        gae_advantages(torch.zeros(4, 3), torch.zeros(4, 2), mask)
