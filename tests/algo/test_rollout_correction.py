"""Rollout correction: IS weights, rejection masks and metrics against naive loops."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from megarl.algo import (
    compute_rollout_correction,
    off_policy_metrics,
    rollout_is_weights,
    rollout_probs_diff_metrics,
    rollout_rejection_mask,
    router_agreement,
)


def _inputs(make_mask, seed: int = 0, batch: int = 8, length: int = 10):
    gen = torch.Generator().manual_seed(seed)
    mask = make_mask(batch, length, seed=seed + 1)
    rollout = -torch.rand(batch, length, generator=gen, dtype=torch.float64) * 2
    old = rollout + torch.randn(batch, length, generator=gen, dtype=torch.float64) * 0.6
    old[mask == 0] = float("nan")  # padding must not leak
    return old, rollout, mask


def _rows(mask: torch.Tensor) -> list[list[int]]:
    return [[t for t in range(mask.shape[1]) if mask[i, t] > 0] for i in range(mask.shape[0])]


def _ratio(old, rollout, i, t) -> float:
    return math.exp(float(old[i, t]) - float(rollout[i, t]))


def _naive_level_ratios(old, rollout, mask, level: str) -> dict[tuple[int, int], float]:
    """Ratio used for each valid token at the given level."""
    out = {}
    for i, positions in enumerate(_rows(mask)):
        product = math.prod(_ratio(old, rollout, i, t) for t in positions)
        for t in positions:
            out[i, t] = _ratio(old, rollout, i, t) if level == "token" else product
    return out


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_is_weights_match_naive(make_mask, level: str) -> None:
    old, rollout, mask = _inputs(make_mask)
    old_leaf = old.clone().requires_grad_()
    weights, metrics = rollout_is_weights(old_leaf, rollout, mask, level=level, threshold=1.5)
    assert not weights.requires_grad
    ratios = _naive_level_ratios(old, rollout, mask, level)
    expected = torch.zeros_like(rollout)
    for (i, t), ratio in ratios.items():
        expected[i, t] = min(ratio, 1.5)
    torch.testing.assert_close(weights, expected, rtol=1e-12, atol=1e-12)
    truncated = sum(ratio > 1.5 for ratio in ratios.values())
    assert 0 < truncated < len(ratios)
    assert metrics["rollout_is_mean"].item() == pytest.approx(statistics.fmean(
        min(ratio, 1.5) for ratio in ratios.values()))
    assert metrics["rollout_is_truncated_fraction"].item() == pytest.approx(truncated / len(ratios))


def test_sequence_weights_do_not_overflow_in_fp32() -> None:
    mask = torch.ones(2, 64)
    rollout = torch.full((2, 64), -3.0)
    old = rollout + torch.tensor([[2.0], [-2.0]])  # sequence log-ratio +-128: exp overflows fp32
    weights, _ = rollout_is_weights(old, rollout, mask, level="sequence", threshold=2.0)
    assert torch.equal(weights[0], torch.full((64,), 2.0))
    assert torch.isfinite(weights).all() and weights[1].max() < 1e-30
    keep, _ = rollout_rejection_mask(old, rollout, mask, criterion="seq_sum_k1", upper=1e30,
                                     lower=1e-30)
    assert keep.sum() == 0


def _naive_scores(old, rollout, mask, criterion: str) -> dict[tuple[int, int], float]:
    """The score each valid token is judged by, written out per verl's definitions."""
    aggregation, estimator = criterion.rsplit("_", 1)
    per_token = {
        "k1": lambda l: l,
        "k2": lambda l: 0.5 * l * l,
        "k3": lambda l: math.exp(l) - 1 - l,
    }[estimator]
    out = {}
    for i, positions in enumerate(_rows(mask)):
        values = [per_token(math.log(_ratio(old, rollout, i, t))) for t in positions]
        for t, value in zip(positions, values):
            out[i, t] = {"token": value, "seq_sum": sum(values) if values else 0.0,
                         "seq_mean": statistics.fmean(values) if values else 0.0,
                         "seq_max": max(values, default=0.0)}[aggregation]
    return out


RS_BOUNDS = {"token_k1": 1.6, "seq_sum_k1": 4.0, "seq_mean_k1": 1.15, "token_k2": 0.1,
             "token_k3": 0.1, "seq_sum_k2": 0.8, "seq_sum_k3": 0.9, "seq_mean_k2": 0.15,
             "seq_mean_k3": 0.2, "seq_max_k2": 0.4, "seq_max_k3": 0.5}


@pytest.mark.parametrize("criterion", sorted(RS_BOUNDS))
def test_rejection_mask_matches_naive(make_mask, criterion: str) -> None:
    old, rollout, mask = _inputs(make_mask, seed=3)
    upper = RS_BOUNDS[criterion]
    keep, metrics = rollout_rejection_mask(old, rollout, mask, criterion=criterion, upper=upper)
    scores = _naive_scores(old, rollout, mask, criterion)
    expected = torch.zeros_like(mask)
    for (i, t), score in scores.items():
        if criterion.endswith("k1"):
            expected[i, t] = float(1 / upper <= math.exp(score) <= upper)
        else:
            expected[i, t] = float(score <= upper)
    assert keep.dtype == mask.dtype
    torch.testing.assert_close(keep, expected)
    removed = sum(1 for key in scores if expected[key] == 0)
    assert 0 < removed < len(scores)
    rows = [positions for positions in _rows(mask) if positions]
    hit = sum(any(expected[i, t] == 0 for t in positions)
              for i, positions in enumerate(_rows(mask)) if positions)
    assert metrics["rollout_rs_masked_fraction"].item() == pytest.approx(removed / len(scores))
    assert metrics["rollout_rs_seq_masked_fraction"].item() == pytest.approx(hit / len(rows))


def test_off_policy_metrics_match_naive(make_mask) -> None:
    old, rollout, mask = _inputs(make_mask, seed=4)
    metrics = off_policy_metrics(old, rollout, mask)
    logs = [math.log(_ratio(old, rollout, i, t))
            for i, positions in enumerate(_rows(mask)) for t in positions]
    assert metrics["kl"].item() == pytest.approx(statistics.fmean(-x for x in logs))
    assert metrics["k3_kl"].item() == pytest.approx(
        statistics.fmean(math.exp(x) - 1 - x for x in logs))
    assert metrics["chi2_token"].item() == pytest.approx(
        statistics.fmean(math.exp(2 * x) for x in logs) - 1)


def test_router_agreement_counts_equal_top_k_sets() -> None:
    engine = [torch.tensor([[[0, 1], [2, 3]], [[1, 2], [0, 3]], [[-1, -1], [-1, -1]]]),
              torch.tensor([[[3, 0], [1, 2]]])]
    trainer = [torch.tensor([[[1, 0], [2, 3]], [[1, 3], [0, 3]], [[0, 1], [0, 1]],
                             [[0, 2], [0, 2]]]),  # the last row has no engine row: skipped
               torch.tensor([[[0, 3], [1, 2]]])]
    # compared pairs: 2 x 2 rows of sequence 0 (its -1 row is skipped) + 2 of sequence 1;
    # all but (token 1, layer 0) of sequence 0 match, whatever the order inside a set
    assert router_agreement(engine, trainer).item() == pytest.approx(5 / 6)
    assert router_agreement([torch.full((2, 2, 2), -1)], [torch.zeros(2, 2, 2)]).item() == 0.0
    with pytest.raises(ValueError, match="routes: per-token shape"):
        router_agreement(engine[:1], [torch.zeros(4, 3, 2)])


def test_probs_diff_metrics_match_naive(make_mask) -> None:
    old, rollout, mask = _inputs(make_mask, seed=5)
    metrics = rollout_probs_diff_metrics(old, rollout, mask)
    diffs = [abs(math.exp(float(old[i, t])) - math.exp(float(rollout[i, t])))
             for i, positions in enumerate(_rows(mask)) for t in positions]
    assert metrics["rollout_probs_diff_mean"].item() == pytest.approx(statistics.fmean(diffs))
    assert metrics["rollout_probs_diff_max"].item() == pytest.approx(max(diffs))
    assert metrics["rollout_probs_diff_std"].item() == pytest.approx(statistics.stdev(diffs))


def test_combined_correction_zeroes_weights_of_rejected_tokens(make_mask) -> None:
    old, rollout, mask = _inputs(make_mask, seed=7)
    weights, keep, metrics = compute_rollout_correction(
        old, rollout, mask, rollout_is="token", rollout_is_threshold=2.0,
        rollout_rs="token_k1", rollout_rs_threshold=(0.5, 1.8))
    plain, _ = rollout_is_weights(old, rollout, mask, level="token", threshold=2.0)
    expected_keep, _ = rollout_rejection_mask(old, rollout, mask, criterion="token_k1",
                                              lower=0.5, upper=1.8)
    torch.testing.assert_close(keep, expected_keep)
    torch.testing.assert_close(weights, plain * expected_keep)
    expected_keys = {"rollout_is_mean", "rollout_rs_masked_fraction", "rollout_probs_diff_mean",
                     "kl", "k3_kl", "chi2_token"}
    assert expected_keys <= set(metrics)
    none_weights, same_mask, _ = compute_rollout_correction(old, rollout, mask)
    assert none_weights is None and same_mask is mask


def test_empty_mask_gives_zeros_not_nan(make_mask) -> None:
    old, rollout, _ = _inputs(make_mask)
    empty = torch.zeros_like(rollout)
    weights, keep, metrics = compute_rollout_correction(
        old, rollout, empty, rollout_is="sequence", rollout_rs="seq_mean_k1")
    assert weights.abs().sum() == 0 and keep.sum() == 0
    assert all(value.item() == 0 for value in metrics.values())


def test_errors_name_the_field(make_mask) -> None:
    old, rollout, mask = _inputs(make_mask)
    with pytest.raises(ValueError, match="rollout_is: unknown level 'geometric'"):
        rollout_is_weights(old, rollout, mask, level="geometric")
    with pytest.raises(ValueError, match="rollout_rs_threshold: need 0 <= lower <= upper"):
        rollout_rejection_mask(old, rollout, mask, lower=3.0, upper=2.0)
    with pytest.raises(ValueError, match="rollout_rs: unknown criterion 'geometric'"):
        rollout_rejection_mask(old, rollout, mask, criterion="geometric")
    with pytest.raises(ValueError, match="seq_max_k2 bounds a divergence"):
        rollout_rejection_mask(old, rollout, mask, criterion="seq_max_k2", upper=0.0)
    with pytest.raises(ValueError, match="rollout_log_probs: shape"):
        rollout_probs_diff_metrics(old, rollout[:, :4], mask)
