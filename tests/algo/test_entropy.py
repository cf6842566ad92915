"""Entropy from logits against torch.distributions.Categorical."""

from __future__ import annotations

import pytest
import torch
from torch.distributions import Categorical

from megarl.algo import entropy_from_logits


def _logits(*shape: int, scale: float = 3.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).requires_grad_()


@pytest.mark.parametrize("chunk_size", [None, 1, 4, 7, 100])
def test_matches_categorical_value_and_gradient(chunk_size: int | None) -> None:
    logits = _logits(3, 5, 37)
    reference = Categorical(logits=logits).entropy()
    (ref_grad,) = torch.autograd.grad(reference.sum(), logits)
    value = entropy_from_logits(logits, chunk_size=chunk_size)
    (grad,) = torch.autograd.grad(value.sum(), logits)
    assert value.shape == (3, 5)
    torch.testing.assert_close(value, reference, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-12)


def test_large_logits_in_fp32_do_not_overflow() -> None:
    logits = (_logits(4, 50).detach() * 1e4).float()
    logits[0] = 0.0  # uniform row: entropy log(50)
    value = entropy_from_logits(logits)
    assert torch.isfinite(value).all()
    torch.testing.assert_close(value, Categorical(logits=logits.double()).entropy().float(),
                               rtol=1e-5, atol=1e-5)
    assert value[0].item() == pytest.approx(torch.log(torch.tensor(50.0)).item(), rel=1e-6)


def test_minus_inf_logits_are_excluded_without_nan_gradients() -> None:
    base = _logits(6, 20).detach()
    banned = torch.zeros(6, 20, dtype=torch.bool)
    banned[:, 15:] = True
    logits = base.masked_fill(banned, float("-inf")).requires_grad_()
    value = entropy_from_logits(logits, chunk_size=4)
    value.sum().backward()
    finite_only = base[:, :15].clone().requires_grad_()
    reference = Categorical(logits=finite_only).entropy()
    reference.sum().backward()
    torch.testing.assert_close(value, reference.detach(), rtol=1e-12, atol=1e-12)
    assert torch.isfinite(logits.grad).all() and logits.grad[banned].abs().sum() == 0
    torch.testing.assert_close(logits.grad[:, :15], finite_only.grad, rtol=1e-10, atol=1e-12)


def test_bad_chunk_size() -> None:
    with pytest.raises(ValueError, match="chunk_size: must be a positive"):
        entropy_from_logits(_logits(2, 3, 4), chunk_size=0)
