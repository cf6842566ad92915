"""The recipe policy losses (CISPO, Clip-Cov, KL-Cov, GMPO, SAPO, GPG, DPPO) against naive
per-element formulas from their papers, through every loss_agg_mode each accepts."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from megarl.algo import (
    LOSS_AGG_MODES,
    SEQUENCE_LEVEL_LOSSES,
    aggregate_loss,
    clip_cov_policy_loss,
    get_policy_loss,
    policy_loss_options,
)

LOW, HIGH = 0.2, 0.28
NORM_LEN = 16.0
TOKEN_LEVEL_MODES = LOSS_AGG_MODES


def _inputs(make_mask, batch: int = 10, length: int = 12, seed: int = 0):
    """Random log-probs in [-3, 0) with log-ratios over [-1.5, 1.5]; holes in the masks."""
    gen = torch.Generator().manual_seed(seed)
    mask = make_mask(batch, length, seed=seed + 1, holes=True)
    old = -torch.rand(batch, length, generator=gen, dtype=torch.float64) * 3 - 0.01
    shift = (torch.rand(batch, length, generator=gen, dtype=torch.float64) - 0.5) * 3
    log_probs = (old + shift).clamp(max=-0.01)
    advantages = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    return log_probs.requires_grad_(), old, advantages, mask


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


# Naive per-token formulas: (loss, d loss / d log_prob, clipped?) for one token.
def _cispo(lp: float, old: float, a: float) -> tuple[float, float, bool]:
    r = math.exp(lp - old)
    w = min(max(r, 1 - LOW), 1 + HIGH)
    return -w * a * lp, -w * a, w != r


def _sapo(lp: float, old: float, a: float, tau_pos: float = 1.0,
          tau_neg: float = 1.05) -> tuple[float, float, bool]:
    r = math.exp(lp - old)
    tau = tau_pos if a > 0 else tau_neg
    s = _sigmoid(tau * (r - 1))
    return -a * 4 / tau * s, -a * 4 * s * (1 - s) * r, False


def _gpg(lp: float, old: float, a: float) -> tuple[float, float, bool]:
    return -a * lp, -a, False


def _dppo(divergence: str, low: float, high: float, cap: float):
    def token(lp: float, old: float, a: float) -> tuple[float, float, bool]:
        p, q, r = math.exp(lp), math.exp(old), math.exp(lp - old)
        if divergence == "tv":
            keep = p - q <= high if a > 0 else p - q >= -low
        else:
            d = q * math.log(q / p) + (1 - q) * math.log((1 - q + 1e-8) / (1 - p + 1e-8))
            keep = (d <= high or p <= q) if a > 0 else (d <= low or p >= q)
        if not keep:
            return 0.0, 0.0, True
        return -a * min(r, cap) * lp, -a * min(r, cap), False
    return token


TOKEN_CASES: dict[str, tuple[dict, Callable]] = {
    "cispo": ({"clip_ratio_low": LOW, "clip_ratio_high": HIGH}, _cispo),
    "sapo": ({"tau_pos": 1.0, "tau_neg": 1.05}, _sapo),
    "gpg": ({}, _gpg),
    "dppo_tv": ({"clip_ratio_low": 0.05, "clip_ratio_high": 0.08, "clip_ratio_c": 2.0},
                _dppo("tv", 0.05, 0.08, 2.0)),
    "dppo_kl": ({"clip_ratio_low": 0.01, "clip_ratio_high": 0.02, "clip_ratio_c": 2.0},
                _dppo("kl", 0.01, 0.02, 2.0)),
}


def _agg_weights(mask: torch.Tensor, mode: str) -> torch.Tensor:
    """Naive d(aggregate)/d(loss_it) of each mode, written per mode."""
    rows = [i for i in range(mask.shape[0]) if mask[i].sum() > 0]
    n_tokens, n_rows = float(mask.sum()), len(rows)
    weights = torch.zeros_like(mask)
    for i in rows:
        for t in range(mask.shape[1]):
            if mask[i, t] == 0:
                continue
            weights[i, t] = {
                "token-mean": 1 / n_tokens,
                "token-sum": 1.0,
                "seq-mean-token-sum": 1 / n_rows,
                "seq-mean-token-mean": 1 / (float(mask[i].sum()) * n_rows),
                "seq-mean-token-sum-norm": 1 / (NORM_LEN * n_rows),
            }[mode]
    return weights


@pytest.mark.parametrize("mode", TOKEN_LEVEL_MODES)
@pytest.mark.parametrize("name", sorted(TOKEN_CASES))
def test_token_losses_match_naive(make_mask, name: str, mode: str) -> None:
    kwargs, naive = TOKEN_CASES[name]
    log_probs, old, adv, mask = _inputs(make_mask, seed=len(name))
    losses, metrics = get_policy_loss(name)(log_probs, old, adv, mask, **kwargs)
    aggregate_loss(losses, mask, mode, norm_len=NORM_LEN).backward()
    exp_loss, exp_grad = torch.zeros_like(old), torch.zeros_like(old)
    clipped = count = 0
    kl = 0.0
    lp = log_probs.detach()
    for i in range(old.shape[0]):
        for t in range(old.shape[1]):
            if mask[i, t] == 0:
                continue
            loss, grad, was_clipped = naive(float(lp[i, t]), float(old[i, t]), float(adv[i, t]))
            exp_loss[i, t], exp_grad[i, t] = loss, grad
            clipped, count = clipped + was_clipped, count + 1
            kl += float(old[i, t] - lp[i, t])
    torch.testing.assert_close(losses, exp_loss, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(log_probs.grad, exp_grad * _agg_weights(mask, mode),
                               rtol=1e-10, atol=1e-12)
    assert metrics["pg_clipfrac"].item() == pytest.approx(clipped / count)
    assert metrics["ppo_kl"].item() == pytest.approx(kl / count)
    if name in ("cispo", "dppo_tv", "dppo_kl"):
        assert 0 < clipped < count  # the inputs exercise both branches


def _covariances(lp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor) -> dict:
    """{(i, t): (A - mean A)(log pi - mean log pi)} over the valid tokens, by loops."""
    valid = [(i, t) for i in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[i, t]]
    mean_a = sum(float(adv[k]) for k in valid) / len(valid)
    mean_lp = sum(float(lp[k]) for k in valid) / len(valid)
    return {k: (float(adv[k]) - mean_a) * (float(lp[k]) - mean_lp) for k in valid}


@pytest.mark.parametrize("mode", TOKEN_LEVEL_MODES)
def test_kl_cov_matches_naive(make_mask, mode: str) -> None:
    ratio, coef = 0.1, 0.7
    log_probs, old, adv, mask = _inputs(make_mask, seed=21)
    losses, metrics = get_policy_loss("kl_cov")(log_probs, old, adv, mask, kl_cov_ratio=ratio,
                                                ppo_kl_coef=coef)
    aggregate_loss(losses, mask, mode, norm_len=NORM_LEN).backward()
    lp = log_probs.detach()
    cov = _covariances(lp, adv, mask)
    top = sorted(cov, key=cov.get, reverse=True)[:max(int(ratio * len(cov)), 1)]
    exp_loss, exp_grad = torch.zeros_like(old), torch.zeros_like(old)
    for k in cov:
        d = float(lp[k] - old[k])
        r, a = math.exp(d), float(adv[k])
        exp_loss[k], exp_grad[k] = -a * r, -a * r
        if k in top:
            exp_loss[k] += coef * abs(d)
            exp_grad[k] += coef * math.copysign(1.0, d)
    torch.testing.assert_close(losses, exp_loss, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(log_probs.grad, exp_grad * _agg_weights(mask, mode),
                               rtol=1e-10, atol=1e-12)
    assert metrics["pg_clipfrac"].item() == pytest.approx(len(top) / len(cov))


@pytest.mark.parametrize("mode", TOKEN_LEVEL_MODES)
def test_clip_cov_matches_naive(make_mask, mode: str) -> None:
    ratio, lb, ub = 0.1, 0.05, 1.5
    log_probs, old, adv, mask = _inputs(make_mask, seed=31)
    gen = torch.Generator().manual_seed(5)
    losses, metrics = clip_cov_policy_loss(log_probs, old, adv, mask, clip_ratio_low=LOW,
                                           clip_ratio_high=HIGH, clip_cov_ratio=ratio,
                                           clip_cov_lb=lb, clip_cov_ub=ub, generator=gen)
    aggregate_loss(losses, mask, mode, norm_len=NORM_LEN).backward()
    lp = log_probs.detach()
    cov = _covariances(lp, adv, mask)
    candidates, ppo = set(), {}
    for k in cov:
        r, a = math.exp(float(lp[k] - old[k])), float(adv[k])
        clipped = (a > 0 and r > 1 + HIGH) or (a < 0 and r < 1 - LOW)
        ppo[k] = (-a * min(max(r, 1 - LOW), 1 + HIGH), 0.0) if clipped else (-a * r, -a * r)
        if not clipped and lb < cov[k] < ub:
            candidates.add(k)
    dropped = {k for k in cov if losses[k].item() == 0.0 and ppo[k][0] != 0.0}
    assert len(dropped) == min(max(int(ratio * len(cov)), 1), len(candidates)) > 0
    assert dropped <= candidates
    exp_loss, exp_grad = torch.zeros_like(old), torch.zeros_like(old)
    for k in cov:
        exp_loss[k], exp_grad[k] = (0.0, 0.0) if k in dropped else ppo[k]
    torch.testing.assert_close(losses, exp_loss, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(log_probs.grad, exp_grad * _agg_weights(mask, mode),
                               rtol=1e-10, atol=1e-12)
    assert metrics["pg_clipfrac"].item() == pytest.approx(len(dropped) / len(cov))
    again, _ = clip_cov_policy_loss(log_probs, old, adv, mask, clip_ratio_low=LOW,
                                    clip_ratio_high=HIGH, clip_cov_ratio=ratio, clip_cov_lb=lb,
                                    clip_cov_ub=ub, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(again, losses)  # the draw follows the generator


def test_geo_mean_matches_sequence_objective(make_mask) -> None:
    low, high = 0.3, 0.4
    log_probs, old, adv, mask = _inputs(make_mask, seed=41)
    weights = torch.rand(old.shape, generator=torch.Generator().manual_seed(3),
                         dtype=torch.float64) + 0.5
    losses, metrics = get_policy_loss("geo_mean")(log_probs, old, adv, mask, clip_ratio_low=low,
                                                  clip_ratio_high=high,
                                                  rollout_is_weights=weights)
    aggregate_loss(losses, mask, "seq-mean-token-mean").backward()
    lp = log_probs.detach()
    rows = [i for i in range(mask.shape[0]) if mask[i].sum() > 0]
    exp_loss, exp_grad = torch.zeros_like(old), torch.zeros_like(old)
    clipped = lower = count = 0
    for i in rows:
        pos = [t for t in range(mask.shape[1]) if mask[i, t]]
        kept, free = [], []
        for t in pos:
            d, a = float(lp[i, t] - old[i, t]), float(adv[i, t])
            c = min(max(d, -low), high)
            k = (min(d, c) if a > 0 else max(d, c)) if a != 0 else 0.0
            kept.append(k)
            free.append(a != 0 and k == d)
            clipped += a != 0 and k != d
            lower += a < 0 and k != d
        rho = math.exp(sum(kept) / len(pos))
        abar = sum(float(adv[i, t]) for t in pos) / len(pos)
        w = math.exp(sum(math.log(float(weights[i, t])) for t in pos) / len(pos))
        for t, is_free in zip(pos, free):
            exp_loss[i, t] = -abar * rho * w
            exp_grad[i, t] = -abar * rho * w / len(pos) / len(rows) if is_free else 0.0
        count += len(pos)
    torch.testing.assert_close(losses, exp_loss, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(log_probs.grad, exp_grad, rtol=1e-10, atol=1e-12)
    assert 0 < clipped < count
    assert metrics["pg_clipfrac"].item() == pytest.approx(clipped / count)
    assert metrics["pg_clipfrac_lower"].item() == pytest.approx(lower / count)


@pytest.mark.parametrize("name", ["cispo", "clip_cov", "kl_cov", "geo_mean", "sapo", "gpg",
                                  "dppo_tv", "dppo_kl"])
def test_padding_garbage_and_empty_rows_do_not_leak(make_mask, name: str) -> None:
    log_probs, old, adv, mask = _inputs(make_mask, seed=5)
    garbage = log_probs.detach().clone()
    garbage[mask == 0] = float("nan")
    garbage.requires_grad_()
    bad_old, bad_adv = old.clone(), adv.clone()
    bad_old[mask == 0], bad_adv[mask == 0] = float("inf"), float("nan")
    losses, metrics = get_policy_loss(name)(garbage, bad_old, bad_adv, mask)
    mode = "seq-mean-token-mean" if name in SEQUENCE_LEVEL_LOSSES else "token-mean"
    aggregate_loss(losses, mask, mode).backward()
    assert torch.isfinite(losses).all() and losses[0].abs().sum() == 0  # row 0 is empty
    assert torch.isfinite(garbage.grad).all() and garbage.grad[mask == 0].abs().sum() == 0
    assert set(metrics) == {"pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"}
    assert all(torch.isfinite(value) and not value.requires_grad for value in metrics.values())
    empty, empty_metrics = get_policy_loss(name)(garbage, bad_old, bad_adv, torch.zeros_like(mask))
    assert empty.abs().sum() == 0 and all(v.item() == 0 for v in empty_metrics.values())


def test_options_name_what_each_loss_takes() -> None:
    assert policy_loss_options("vanilla") == ("clip_ratio_low", "clip_ratio_high", "clip_ratio_c")
    assert policy_loss_options("gpg") == ()
    assert policy_loss_options("sapo") == ("tau_pos", "tau_neg")
    assert policy_loss_options("kl_cov") == ("kl_cov_ratio", "ppo_kl_coef")
    assert set(SEQUENCE_LEVEL_LOSSES) == {"gspo", "geo_mean"}
