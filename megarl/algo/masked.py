"""Masked reductions shared by the algorithm functions.

A mask marks the valid entries (response tokens) with 1 and padding with 0; it may be bool or
float. Every reduction here is safe on an all-zero mask: it returns 0, never NaN, and entries
outside the mask never reach the result, even when they hold inf or NaN.
"""

from __future__ import annotations

import torch


def as_float_mask(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The mask as 0/1 values in the dtype and device of `like`."""
    return mask.to(device=like.device, dtype=like.dtype)


def masked_fill_invalid(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`values` with every entry outside the mask set to 0 (inf/NaN there do not leak)."""
    return torch.where(mask.bool(), values, values.new_zeros(()))


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of `values` over the valid entries; over `dim`, or over everything when `dim` is None."""
    kept = masked_fill_invalid(values, mask)
    return kept.sum() if dim is None else kept.sum(dim=dim)


def masked_count(mask: torch.Tensor, like: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Number of valid entries, in the dtype of `like`."""
    m = as_float_mask(mask, like)
    return m.sum() if dim is None else m.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `values` over the valid entries; 0 where there are none."""
    return masked_sum(values, mask, dim) / masked_count(mask, values, dim).clamp(min=1)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance over all valid entries (Bessel-corrected when `unbiased`); 0 with fewer than 2."""
    count = masked_count(mask, values)
    centred = masked_fill_invalid(values - masked_mean(values, mask), mask)
    denominator = count - 1 if unbiased else count
    return (centred.square().sum() / denominator.clamp(min=1)) * (count >= 2)


def masked_std(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Standard deviation over all valid entries; 0 with fewer than 2 (or 1 when biased)."""
    return masked_var(values, mask, unbiased=unbiased).sqrt()


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(values - mean) / sqrt(var + eps) over the valid entries; 0 outside the mask.

    Mean and unbiased variance are taken over all valid entries of the whole tensor. With fewer
    than two valid entries the result is 0 everywhere (nothing to normalise against).
    """
    centred = values - masked_mean(values, mask)
    whitened = centred * torch.rsqrt(masked_var(values, mask) + eps)
    return masked_fill_invalid(whitened, mask)
