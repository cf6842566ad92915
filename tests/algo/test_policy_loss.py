"""Policy losses against naive per-token formulas (values, metrics and gradients)."""

from __future__ import annotations

import math

import pytest
import torch

from megarl.algo import aggregate_loss, get_policy_loss, gspo_policy_loss, ppo_policy_loss

LOW, HIGH, DUAL = 0.2, 0.28, 3.0


def _inputs(make_mask, batch: int = 8, length: int = 12, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    mask = make_mask(batch, length, seed=seed + 1)
    old = -torch.rand(batch, length, generator=gen, dtype=torch.float64) * 3
    # Log-ratios spread over [-1.5, 1.5] so that both clips and the dual clip are exercised.
    log_probs = (old + (torch.rand(batch, length, generator=gen, dtype=torch.float64) - 0.5) * 3)
    advantages = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    return log_probs.requires_grad_(), old, advantages, mask


def _naive_ppo_token(log_prob: float, old: float, adv: float) -> tuple[float, float, bool, bool]:
    """(loss, d loss / d log_prob, clipped, dual-clipped) for one token, written case by case."""
    r = math.exp(log_prob - old)
    if adv > 0:
        if r > 1 + HIGH:
            return -adv * (1 + HIGH), 0.0, True, False
        return -adv * r, -adv * r, False, False
    if adv < 0:
        if r > DUAL:
            return -adv * DUAL, 0.0, False, True
        if r < 1 - LOW:
            return -adv * (1 - LOW), 0.0, True, False
        return -adv * r, -adv * r, False, False
    return 0.0, 0.0, False, False


def test_ppo_matches_naive(make_mask) -> None:
    log_probs, old, adv, mask = _inputs(make_mask)
    losses, metrics = ppo_policy_loss(log_probs, old, adv, mask, clip_ratio_low=LOW,
                                      clip_ratio_high=HIGH, clip_ratio_c=DUAL)
    losses.sum().backward()
    exp_loss, exp_grad = torch.zeros_like(old), torch.zeros_like(old)
    clipped, dual, kl, count = 0, 0, 0.0, 0
    lp = log_probs.detach()
    for i in range(old.shape[0]):
        for t in range(old.shape[1]):
            if mask[i, t] == 0:
                continue
            loss, grad, was_clipped, was_dual = _naive_ppo_token(
                float(lp[i, t]), float(old[i, t]), float(adv[i, t]))
            exp_loss[i, t], exp_grad[i, t] = loss, grad
            clipped, dual = clipped + was_clipped, dual + was_dual
            kl += float(old[i, t]) - float(lp[i, t])
            count += 1
    torch.testing.assert_close(losses, exp_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(log_probs.grad, exp_grad, rtol=1e-12, atol=1e-12)
    assert 0 < clipped and 0 < dual  # the inputs exercise every branch
    assert metrics["pg_clipfrac"].item() == pytest.approx(clipped / count)
    assert metrics["pg_clipfrac_lower"].item() == pytest.approx(dual / count)
    assert metrics["ppo_kl"].item() == pytest.approx(kl / count)
    assert all(not value.requires_grad for value in metrics.values())


def test_ppo_rollout_weights_scale_loss_and_gradient(make_mask) -> None:
    log_probs, old, adv, mask = _inputs(make_mask, seed=3)
    weights = torch.rand(old.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    plain, _ = ppo_policy_loss(log_probs, old, adv, mask)
    (grad_plain,) = torch.autograd.grad(plain.sum(), log_probs)
    weighted, _ = ppo_policy_loss(log_probs, old, adv, mask, rollout_is_weights=weights)
    (grad_weighted,) = torch.autograd.grad(weighted.sum(), log_probs)
    torch.testing.assert_close(weighted, plain * weights)
    torch.testing.assert_close(grad_weighted, grad_plain * weights * mask)


@pytest.mark.parametrize("loss_fn", [ppo_policy_loss, gspo_policy_loss])
def test_padding_garbage_and_empty_rows_do_not_leak(make_mask, loss_fn) -> None:
    log_probs, old, adv, mask = _inputs(make_mask, seed=5)
    garbage = log_probs.detach().clone()
    garbage[mask == 0] = float("nan")
    garbage.requires_grad_()
    bad_old, bad_adv = old.clone(), adv.clone()
    bad_old[mask == 0], bad_adv[mask == 0] = float("inf"), float("nan")
    losses, metrics = loss_fn(garbage, bad_old, bad_adv, mask)
    aggregate_loss(losses, mask, "token-mean").backward()
    assert torch.isfinite(losses).all() and losses[0].abs().sum() == 0  # row 0 is empty
    assert torch.isfinite(garbage.grad).all() and garbage.grad[mask == 0].abs().sum() == 0
    assert all(torch.isfinite(value) for value in metrics.values())
    empty_losses, empty_metrics = loss_fn(garbage, bad_old, bad_adv, torch.zeros_like(mask))
    assert empty_losses.abs().sum() == 0
    assert all(value.item() == 0 for value in empty_metrics.values())


def test_gspo_matches_sequence_level_objective(make_mask) -> None:
    gen = torch.Generator().manual_seed(11)
    batch, length, low, high = 10, 9, 0.05, 0.08
    mask = make_mask(batch, length, seed=12)
    old = -torch.rand(batch, length, generator=gen, dtype=torch.float64) * 2
    log_probs = (old + (torch.rand(batch, length, generator=gen, dtype=torch.float64) - 0.5) * 0.4)
    log_probs.requires_grad_()
    seq_adv = torch.randn(batch, generator=gen, dtype=torch.float64)
    adv = seq_adv.unsqueeze(-1).expand(batch, length)
    losses, metrics = gspo_policy_loss(log_probs, old, adv, mask, clip_ratio_low=low,
                                       clip_ratio_high=high)
    aggregate_loss(losses, mask, "seq-mean-token-mean").backward()
    rows = [i for i in range(batch) if mask[i].sum() > 0]
    lp = log_probs.detach()
    exp_loss, exp_grad = torch.zeros_like(old), torch.zeros_like(old)
    clipped_tokens = lower_tokens = tokens = 0
    for i in rows:
        positions = [t for t in range(length) if mask[i, t] > 0]
        s = math.exp(sum(float(lp[i, t] - old[i, t]) for t in positions) / len(positions))
        a = float(seq_adv[i])
        clipped = (a > 0 and s > 1 + high) or (a < 0 and s < 1 - low)
        value = -a * min(max(s, 1 - low), 1 + high) if clipped else -a * s
        for t in positions:
            exp_loss[i, t] = value
            # d/d log_prob_t of the sequence objective -A s_i, averaged over rows
            exp_grad[i, t] = 0.0 if clipped else -a * s / len(positions) / len(rows)
        tokens += len(positions)
        clipped_tokens += len(positions) * clipped
        lower_tokens += len(positions) * (clipped and a < 0)
    torch.testing.assert_close(losses, exp_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(log_probs.grad, exp_grad, rtol=1e-12, atol=1e-14)
    assert 0 < clipped_tokens < tokens
    assert metrics["pg_clipfrac"].item() == pytest.approx(clipped_tokens / tokens)
    assert metrics["pg_clipfrac_lower"].item() == pytest.approx(lower_tokens / tokens)


def test_registry_and_argument_errors(make_mask) -> None:
    assert get_policy_loss("vanilla") is ppo_policy_loss
    assert get_policy_loss("gspo") is gspo_policy_loss
    with pytest.raises(ValueError, match="valid names: cispo, clip_cov, .*, vanilla"):
        get_policy_loss("grpo")
    log_probs, old, adv, mask = _inputs(make_mask)
    with pytest.raises(ValueError, match="clip_ratio_c: must be > 1"):
        ppo_policy_loss(log_probs, old, adv, mask, clip_ratio_c=0.5)
    with pytest.raises(ValueError, match="advantages: shape"):
        ppo_policy_loss(log_probs, old, adv[:, :3], mask)
