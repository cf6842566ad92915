"""KL in the reward and its controllers against naive per-element formulas (verl's
``apply_kl_penalty``, ``FixedKLController``, ``AdaptiveKLController``)."""

from __future__ import annotations

import math

import pytest
import torch

from megarl.algo.advantages import outcome_to_token_rewards
from megarl.algo.kl_reward import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_in_reward,
    kl_in_reward,
    make_kl_controller,
)


def _naive_kl(kind: str, lp: float, ref: float) -> float:
    d = lp - ref
    if kind == "kl":
        return d
    if kind == "abs":
        return abs(d)
    if kind == "mse":
        return d * d / 2
    r = max(-20.0, min(20.0, -d))
    return max(-10.0, min(10.0, math.exp(r) - r - 1))


@pytest.mark.parametrize("kind", ["kl", "abs", "mse", "low_var_kl"])
def test_kl_in_reward_matches_the_naive_formula(make_mask, kind: str) -> None:
    gen = torch.Generator().manual_seed(3)
    mask = make_mask(6, 7, seed=1, holes=True)
    scores = torch.randn(6, generator=gen, dtype=torch.float64)
    old = -torch.rand(6, 7, generator=gen, dtype=torch.float64) * 3
    ref = -torch.rand(6, 7, generator=gen, dtype=torch.float64) * 3
    token_scores = outcome_to_token_rewards(scores, mask)
    rewards, current = kl_in_reward(token_scores, old, ref, mask, kl_coef=0.05, kl_type=kind)
    seq_means = []
    for b in range(6):
        valid = [t for t in range(7) if mask[b, t]]
        last = valid[-1] if valid else None
        for t in range(7):
            kl = _naive_kl(kind, float(old[b, t]), float(ref[b, t])) if mask[b, t] else 0.0
            score = float(scores[b]) if t == last else 0.0
            assert rewards[b, t].item() == pytest.approx(score - 0.05 * kl, abs=1e-12)
        if valid:
            seq_means.append(sum(_naive_kl(kind, float(old[b, t]), float(ref[b, t]))
                                 for t in valid) / len(valid))
    assert current == pytest.approx(sum(seq_means) / len(seq_means), abs=1e-12)


def test_fixed_controller_keeps_its_coefficient() -> None:
    ctrl = make_kl_controller("fixed", 0.01, target_kl=0.1, horizon=100)
    assert isinstance(ctrl, FixedKLController)
    ctrl.update(5.0, 64)
    assert ctrl.value == 0.01


@pytest.mark.parametrize(("kl", "error"), [(0.11, 0.1), (0.5, 0.2), (0.0, -0.2), (0.09, -0.1)])
def test_adaptive_controller_is_verls(kl: float, error: float) -> None:
    ctrl = make_kl_controller("adaptive", 0.2, target_kl=0.1, horizon=1000)
    assert isinstance(ctrl, AdaptiveKLController)
    ctrl.update(kl, 64)
    assert ctrl.value == pytest.approx(0.2 * (1 + error * 64 / 1000))
    state = ctrl.state_dict()
    fresh = AdaptiveKLController(0.2, 0.1, 1000)
    fresh.load_state_dict(state)
    assert fresh.value == ctrl.value


def test_apply_uses_beta_before_the_update_and_reports_it(make_mask) -> None:
    mask = make_mask(4, 5, seed=2)
    old, ref = torch.full((4, 5), -1.0, dtype=torch.float64), torch.full((4, 5), -1.5,
                                                                        dtype=torch.float64)
    ctrl = AdaptiveKLController(0.1, target_kl=0.1, horizon=10)
    rewards, metrics = apply_kl_in_reward(torch.zeros(4, 5, dtype=torch.float64), old, ref, mask,
                                          ctrl, kl_type="kl")
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(0.5)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.1
    assert torch.allclose(rewards, -0.1 * 0.5 * mask)
    valid_rows = int((mask.sum(-1) > 0).sum())
    assert ctrl.value == pytest.approx(0.1 * (1 + 0.2 * valid_rows / 10))


def test_unknown_controller_is_refused() -> None:
    with pytest.raises(ValueError, match="algorithm.kl_ctrl.type"):
        make_kl_controller("pid", 0.1, 0.1, 10)
