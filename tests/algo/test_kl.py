"""KL estimators: values and gradients against the naive per-element formulas."""

from __future__ import annotations

import math

import pytest
import torch

from megarl.algo import kl_penalty


def _value(kind: str, lp: float, ref: float) -> float:
    d = lp - ref
    if kind in ("kl", "k1"):
        return d
    if kind == "abs":
        return abs(d)
    if kind in ("mse", "k2"):
        return d * d / 2
    r = min(max(ref - lp, -20.0), 20.0)
    return min(max(math.exp(r) - r - 1, -10.0), 10.0)


def _grad(kind: str, lp: float, ref: float) -> float:
    """d value / d log_prob (0 where a k3 clamp is active)."""
    d = lp - ref
    if kind in ("kl", "k1"):
        return 1.0
    if kind == "abs":
        return math.copysign(1.0, d)
    if kind in ("mse", "k2"):
        return d
    if abs(d) > 20 or abs(math.exp(-d) + d - 1) > 10:
        return 0.0
    return 1.0 - math.exp(-d)


def _inputs():
    gen = torch.Generator().manual_seed(0)
    ref = -torch.rand(6, 7, generator=gen, dtype=torch.float64) * 4
    log_probs = ref + torch.randn(6, 7, generator=gen, dtype=torch.float64)
    return log_probs.requires_grad_(), ref.requires_grad_()


@pytest.mark.parametrize("kind", ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"])
@pytest.mark.parametrize("plus", [False, True])
def test_values_and_gradients(kind: str, plus: bool) -> None:
    log_probs, ref = _inputs()
    value = kl_penalty(log_probs, ref, kind + ("+" if plus else ""))
    value.sum().backward()
    lp, rf = log_probs.detach(), ref.detach()
    expected = torch.tensor([[_value(kind, float(lp[i, t]), float(rf[i, t])) for t in range(7)]
                             for i in range(6)], dtype=torch.float64)
    grad_kind = "k2" if plus else kind
    expected_grad = torch.tensor([[_grad(grad_kind, float(lp[i, t]), float(rf[i, t]))
                                   for t in range(7)] for i in range(6)], dtype=torch.float64)
    torch.testing.assert_close(value, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(log_probs.grad, expected_grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ref.grad, -expected_grad, rtol=1e-12, atol=1e-12)


def test_k3_is_clamped_and_finite() -> None:
    log_probs = torch.tensor([0.0, -50.0, 50.0, -1.0], requires_grad=True)
    ref = torch.tensor([-50.0, 0.0, 0.0, 0.0])
    value = kl_penalty(log_probs, ref, "low_var_kl")
    value.sum().backward()
    # ref - log_prob is clamped to [-20, 20]: 19, exp(20) - 21 and 19 are then clamped to 10.
    assert value[:3].tolist() == [10.0, 10.0, 10.0]
    assert value[3].item() == pytest.approx(math.e - 2)
    assert torch.isfinite(log_probs.grad).all()
    assert log_probs.grad[:3].abs().sum() == 0  # no gradient through an active clamp


def test_unknown_name_lists_valid_ones() -> None:
    log_probs, ref = _inputs()
    with pytest.raises(ValueError, match="abs, k1, k2, k3, kl, low_var_kl, mse"):
        kl_penalty(log_probs, ref, "k4")
    with pytest.raises(ValueError, match="ref_log_probs: shape"):
        kl_penalty(log_probs, ref[:, :2], "k1")
