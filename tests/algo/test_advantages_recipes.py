"""Pass@k GRPO, OPO, GPG, REINFORCE++ with a group baseline and ReMax against naive
per-group Python formulas from their papers (ragged masks, empty rows, groups of one)."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from megarl.algo import (
    compute_advantages,
    gpg_advantages,
    grpo_passk_advantages,
    opo_advantages,
    reinforce_plus_plus_baseline_advantages,
    remax_advantages,
)


def _batch(make_mask, seed: int = 0, groups: int = 5, n: int = 4, length: int = 10):
    """Scores with ties (0/1 plus a few fractions), uid labels, a ragged mask with an empty row,
    one group of all-equal scores and a trailing group of one sample."""
    gen = torch.Generator().manual_seed(seed)
    batch = groups * n + 1
    scores = torch.randint(0, 2, (batch,), generator=gen).double()
    scores[::3] += torch.rand(len(scores[::3]), generator=gen, dtype=torch.float64)
    scores[n:2 * n] = 1.0  # group 1: no spread
    labels = [f"uid{i // n}" for i in range(batch - 1)] + ["alone"]
    mask = make_mask(batch, length, seed=seed + 7)
    return scores, labels, mask


def _members(labels: list, mask: torch.Tensor, i: int) -> list[int]:
    valid = [bool(mask[j].sum() > 0) for j in range(len(labels))]
    return [j for j in range(len(labels)) if labels[j] == labels[i] and valid[j]]


def _spread(values: list[float], mask: torch.Tensor) -> torch.Tensor:
    """[B, T]: each row's value on its valid tokens."""
    return torch.tensor(values, dtype=torch.float64).unsqueeze(-1) * mask


@pytest.mark.parametrize("norm", [True, False])
def test_grpo_passk_credits_the_best_sample_only(make_mask, norm: bool) -> None:
    scores, labels, mask = _batch(make_mask)
    adv, returns = grpo_passk_advantages(scores, mask, labels, norm_adv_by_std_in_grpo=norm)
    want = [0.0] * len(labels)
    for label in dict.fromkeys(labels):
        rows = [j for j in range(len(labels)) if labels[j] == label and mask[j].sum() > 0]
        if len(rows) < 2:
            continue
        values = [float(scores[j]) for j in rows]
        best = rows[values.index(max(values))]  # the first best on a tie
        second = sorted(values, reverse=True)[1]
        value = max(values) - second
        want[best] = value / (statistics.stdev(values) + 1e-6) if norm else value
    torch.testing.assert_close(adv, _spread(want, mask))
    torch.testing.assert_close(returns, adv)
    assert sum(v != 0 for v in want) >= 2


def test_opo_subtracts_the_length_weighted_group_mean(make_mask) -> None:
    scores, labels, mask = _batch(make_mask, seed=1)
    adv, _ = opo_advantages(scores, mask, labels)
    want = []
    for i in range(len(labels)):
        rows = _members(labels, mask, i)
        if mask[i].sum() == 0 or len(rows) < 2:
            want.append(0.0)
            continue
        lengths = [float(mask[j].sum()) for j in rows]
        baseline = sum(lengths[k] * float(scores[j]) for k, j in enumerate(rows)) / sum(lengths)
        want.append(float(scores[i]) - baseline)
    torch.testing.assert_close(adv, _spread(want, mask))


def test_gpg_scales_the_centred_score_by_b_over_b_minus_m(make_mask) -> None:
    scores, labels, mask = _batch(make_mask, seed=2)
    adv, _ = gpg_advantages(scores, mask, labels)
    valid = [i for i in range(len(labels)) if mask[i].sum() > 0]
    centred, flat = {}, 0
    for i in valid:
        rows = _members(labels, mask, i)
        values = [float(scores[j]) for j in rows]
        centred[i] = float(scores[i]) - sum(values) / len(values) if len(rows) >= 2 else 0.0
        flat += len(rows) < 2 or max(values) == min(values)  # M: groups without a signal
    alpha = len(valid) / (len(valid) - flat)
    assert flat >= 2 and alpha > 1
    want = [alpha * centred.get(i, 0.0) for i in range(len(labels))]
    torch.testing.assert_close(adv, _spread(want, mask))


def test_reinforce_plus_plus_baseline_whitens_the_centred_scores(make_mask) -> None:
    scores, labels, mask = _batch(make_mask, seed=3)
    adv, _ = reinforce_plus_plus_baseline_advantages(scores, mask, labels)
    per_row = []
    for i in range(len(labels)):
        rows = _members(labels, mask, i)
        mean = sum(float(scores[j]) for j in rows) / len(rows) if len(rows) >= 2 else 0.0
        per_row.append(float(scores[i]) - mean)
    tokens = [per_row[i] for i in range(len(labels)) for t in range(mask.shape[1]) if mask[i, t]]
    mu, var = statistics.fmean(tokens), statistics.variance(tokens)
    want = [(v - mu) / math.sqrt(var + 1e-8) for v in per_row]
    torch.testing.assert_close(adv, _spread(want, mask))


def test_remax_subtracts_the_greedy_reward_from_the_return(make_mask) -> None:
    gen = torch.Generator().manual_seed(4)
    mask = make_mask(6, 8, seed=5, holes=True)
    rewards = torch.randn(6, 8, generator=gen, dtype=torch.float64) * mask
    greedy = torch.randn(6, generator=gen, dtype=torch.float64)
    adv, returns = remax_advantages(rewards, greedy, mask)
    want_adv, want_ret = torch.zeros_like(rewards), torch.zeros_like(rewards)
    for i in range(6):
        for t in range(8):
            if mask[i, t]:
                ret = sum(float(rewards[i, k]) for k in range(t, 8) if mask[i, k])
                want_ret[i, t], want_adv[i, t] = ret, ret - float(greedy[i])
    torch.testing.assert_close(returns, want_ret)
    torch.testing.assert_close(adv, want_adv)
    with pytest.raises(ValueError, match="reward_baselines"):
        remax_advantages(rewards, greedy[:3], mask)


@pytest.mark.parametrize("name", ["grpo_passk", "opo", "gpg", "reinforce_plus_plus_baseline"])
def test_registered_and_zero_outside_the_mask(make_mask, name: str) -> None:
    scores, labels, mask = _batch(make_mask, seed=6)
    adv, _ = compute_advantages(name, scores=scores, response_mask=mask, index=labels)
    assert adv[mask == 0].abs().sum() == 0 and torch.isfinite(adv).all()
