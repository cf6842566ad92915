"""Rollout correction as verl users configure it: IcePop bands, batch-normalised weights,
several rejection criteria at once, and verl's off-policy metrics, against naive loops."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from megarl.algo import (
    compute_rollout_correction,
    off_policy_metrics,
    rollout_is_weights,
    rollout_rejection_mask,
)
from tests.algo.test_rollout_correction import _inputs, _naive_level_ratios, _ratio, _rows


def _units(ratios: dict, mask: torch.Tensor, level: str) -> list[float]:
    """The samples of the IS statistics: one per valid token, or one per non-empty row."""
    if level == "token":
        return list(ratios.values())
    return [ratios[i, positions[0]] for i, positions in enumerate(_rows(mask)) if positions]


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_icepop_band_zeroes_weights_outside_it(make_mask, level: str, normalize: bool) -> None:
    lower, upper = (0.7, 1.4) if level == "token" else (0.2, 3.0)
    old, rollout, mask = _inputs(make_mask, seed=11)
    weights, metrics = rollout_is_weights(old, rollout, mask, level=level, threshold=upper,
                                          lower=lower, batch_normalize=normalize)
    ratios = _naive_level_ratios(old, rollout, mask, level)
    raw = {k: r if lower <= r <= upper else 0.0 for k, r in ratios.items()}
    units = _units(raw, mask, level)
    factor = statistics.fmean(units) if normalize else 1.0
    expected = torch.zeros_like(rollout)
    for k, w in raw.items():
        expected[k] = w / factor
    torch.testing.assert_close(weights, expected, rtol=1e-12, atol=1e-12)
    outside = sum(w == 0.0 for w in raw.values())
    assert 0 < outside < len(raw)
    assert metrics["rollout_is_batch_norm_factor"].item() == pytest.approx(factor)
    assert metrics["rollout_is_mean"].item() == pytest.approx(
        statistics.fmean(w / factor for w in raw.values()))
    assert metrics["rollout_is_ratio_fraction_high"].item() == pytest.approx(
        sum(r > upper for r in ratios.values()) / len(ratios))
    assert metrics["rollout_is_ratio_fraction_low"].item() == pytest.approx(
        sum(r < lower for r in ratios.values()) / len(ratios))
    unit_ratios = _units(ratios, mask, level)
    assert metrics["rollout_is_max"].item() == pytest.approx(max(unit_ratios))
    assert metrics["rollout_is_min"].item() == pytest.approx(min(unit_ratios))
    mean = statistics.fmean(units)
    assert metrics["rollout_is_std"].item() == pytest.approx(statistics.pstdev(units))
    assert metrics["rollout_is_eff_sample_size"].item() == pytest.approx(
        mean ** 2 / statistics.fmean(w * w for w in units))


def test_truncated_weights_normalise_to_mean_one(make_mask) -> None:
    old, rollout, mask = _inputs(make_mask, seed=12)
    weights, metrics = rollout_is_weights(old, rollout, mask, threshold=1.5, batch_normalize=True)
    assert (weights.sum() / mask.sum()).item() == pytest.approx(1.0)
    ratios = _naive_level_ratios(old, rollout, mask, "token")
    assert metrics["rollout_is_batch_norm_factor"].item() == pytest.approx(
        statistics.fmean(min(r, 1.5) for r in ratios.values()))
    assert metrics["rollout_is_ratio_fraction_low"].item() == pytest.approx(
        sum(r < 1 / 1.5 for r in ratios.values()) / len(ratios))


def test_several_criteria_keep_what_every_one_keeps(make_mask) -> None:
    old, rollout, mask = _inputs(make_mask, seed=13)
    criteria = [("token_k1", (0.4, 2.5)), ("seq_max_k2", (None, 0.3)),
                ("seq_mean_k3", (None, 0.1))]
    _, keep, metrics = compute_rollout_correction(
        old, rollout, mask, rollout_rs=",".join(c for c, _ in criteria),
        rollout_rs_threshold=[t for _, t in criteria])
    expected = mask.bool()
    singles = {}
    for criterion, (lower, upper) in criteria:
        kept, _ = rollout_rejection_mask(old, rollout, mask, criterion=criterion, lower=lower,
                                         upper=upper)
        singles[criterion] = kept.bool()
        expected = expected & kept.bool()
    torch.testing.assert_close(keep, expected.to(mask.dtype))
    valid = int(mask.sum())
    for criterion, kept in singles.items():
        assert 0 < int((mask.bool() & ~kept).sum()) < valid, criterion  # each one rejects some
        assert metrics[f"rollout_rs_{criterion}_masked_fraction"].item() == pytest.approx(
            int((mask.bool() & ~kept).sum()) / valid)
    assert metrics["rollout_rs_masked_fraction"].item() == pytest.approx(
        1 - int(expected.sum()) / valid)
    with pytest.raises(ValueError, match="2 thresholds for 3 criteria"):
        compute_rollout_correction(old, rollout, mask, rollout_rs=[c for c, _ in criteria],
                                   rollout_rs_threshold=[(None, 2.0), (None, 0.1)])


def test_off_policy_metrics_follow_verl(make_mask) -> None:
    old, rollout, mask = _inputs(make_mask, seed=14)
    metrics = off_policy_metrics(old, rollout, mask)
    rows = [p for p in _rows(mask) if p]
    idx = [i for i, p in enumerate(_rows(mask)) if p]
    train = [statistics.fmean(float(old[i, t]) for t in p) for i, p in zip(idx, rows)]
    roll = [statistics.fmean(float(rollout[i, t]) for t in p) for i, p in zip(idx, rows)]
    diff = [r - t for r, t in zip(roll, train)]
    seq = [math.prod(_ratio(old, rollout, i, t) for t in p) for i, p in zip(idx, rows)]
    want = {
        "training_log_ppl": statistics.fmean(-x for x in train),
        "training_ppl": statistics.fmean(math.exp(-x) for x in train),
        "rollout_log_ppl": statistics.fmean(-x for x in roll),
        "rollout_ppl": statistics.fmean(math.exp(-x) for x in roll),
        "log_ppl_diff": statistics.fmean(diff),
        "log_ppl_abs_diff": statistics.fmean(abs(d) for d in diff),
        "log_ppl_diff_max": max(diff),
        "log_ppl_diff_min": min(diff),
        "ppl_ratio": statistics.fmean(math.exp(d) for d in diff),
        "chi2_seq": statistics.fmean(s * s for s in seq) - 1,
    }
    for name, value in want.items():
        assert metrics[name].item() == pytest.approx(value), name
    empty = off_policy_metrics(old, rollout, torch.zeros_like(mask))
    assert all(v.item() == 0 for v in empty.values())
