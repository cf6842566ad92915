"""Random masks shared by the algorithm tests: right padding, empty rows, optional holes."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

MaskFactory = Callable[..., torch.Tensor]


def _make_mask(
    batch: int, length: int, *, seed: int, holes: bool = False, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """[batch, length] 0/1 mask: random right-padded lengths, row 0 empty, row 1 full."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, length + 1, (batch,), generator=gen)
    lengths[0] = 0
    lengths[1] = length
    mask = (torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)).to(dtype)
    if holes:
        # Zero a few interior positions (tool output inside a multi-turn response).
        interior = torch.rand(batch, length, generator=gen) < 0.2
        interior[:, 0] = False
        mask = mask * (~interior).to(dtype)
    return mask


@pytest.fixture
def make_mask() -> MaskFactory:
    """Factory for test masks (see _make_mask)."""
    return _make_mask
