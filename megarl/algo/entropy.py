"""Entropy of categorical distributions given by logits, numerically stable and chunkable."""

from __future__ import annotations

import torch


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    """H = -sum_v p_v log p_v over the last dim, with log p from log_softmax; -inf logits add 0."""
    log_p = torch.log_softmax(logits, dim=-1)
    finite_log_p = torch.where(torch.isfinite(log_p), log_p, 0.0)
    return -(log_p.exp() * finite_log_p).sum(dim=-1)


def entropy_from_logits(logits: torch.Tensor, chunk_size: int | None = None) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim: logits [..., V] -> [...].

    Computed as -sum p log p with log p = logits - logsumexp(logits), so large logits do not
    overflow; logits of -inf (masked vocabulary entries) contribute 0. With `chunk_size`, the
    leading dims are flattened and processed `chunk_size` rows at a time, so that the [rows, V]
    temporaries are bounded by one chunk (under no_grad; with autograd each chunk's are kept).
    """
    if chunk_size is None or logits.dim() == 1:
        return _entropy(logits)
    if chunk_size <= 0:
        raise ValueError(f"chunk_size: must be a positive number of rows, got {chunk_size}")
    rows = logits.reshape(-1, logits.shape[-1])
    parts = [_entropy(chunk) for chunk in rows.split(chunk_size, dim=0)]
    return torch.cat(parts).reshape(logits.shape[:-1])
