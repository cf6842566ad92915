"""The native decoder's MoE layer at decode batch sizes where running every expert on every row
costs more than routing (above ``static_kv.ALL_EXPERTS_ROWS``), on CUDA (:mod:`.static_kv`).

:func:`grouped_experts` runs two ``torch._grouped_mm`` over the (row, expert) pairs sorted by
expert. transformers' ``grouped_mm`` experts compute the same in about twice the kernels (masks,
casts, a histogram per call): at 512 rows of the e2e MoE slice on an H100 the decode graph took
7.74 ms against 8.35 (benchmarks/RESULTS.md). :func:`grouped_experts_match` checks the two agree
before the decoder uses it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

logger = logging.getLogger(__name__)

ENABLED = True
"""Use :func:`grouped_experts` (``benchmarks/profile_decode.py --baseline`` turns it off to
time the decoder without it on the same machine)."""


def grouped_experts(experts: nn.Module, x: torch.Tensor, index: torch.Tensor,
                    weights: torch.Tensor, swiglu: Callable[[torch.Tensor], torch.Tensor]
                    ) -> torch.Tensor:
    """transformers' fused SwiGLU expert block (``gate_up_proj [E, 2I, H]``, ``down_proj
    [E, H, I]``) on ``x [n, H]`` with each row's chosen experts ``index [n, k]`` and router
    weights ``[n, k]``. Shapes depend on ``n`` and ``k`` only, so a CUDA graph captures it."""
    n, top_k = index.shape
    flat = index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(experts.num_experts, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    pairs = x.index_select(0, order // top_k)
    gate_up = torch._grouped_mm(pairs, experts.gate_up_proj.transpose(1, 2), offs=offs)
    out = torch._grouped_mm(swiglu(gate_up), experts.down_proj.transpose(1, 2), offs=offs)
    out = out * weights.reshape(-1).index_select(0, order)[:, None].to(out.dtype)
    return torch.empty_like(out).index_copy_(0, order, out).view(n, top_k, -1).sum(dim=1)


def grouped_experts_match(mlp: nn.Module, swiglu: Callable[[torch.Tensor], torch.Tensor],
                          rows: int = 96) -> bool:
    """Whether :func:`grouped_experts` runs on this device and matches ``mlp.experts`` (within
    2% of the largest output) on random rows and routes; eager, before any graph capture."""
    experts = mlp.experts
    weight = experts.gate_up_proj
    if not ENABLED or not hasattr(torch, "_grouped_mm") or weight.device.type != "cuda":
        return False
    gen = torch.Generator(device=weight.device).manual_seed(0)
    top_k = int(getattr(mlp.gate, "top_k", 2))
    x = torch.randn(rows, weight.shape[-1], device=weight.device, dtype=weight.dtype,
                    generator=gen)
    index = torch.rand(rows, experts.num_experts, device=weight.device,
                       generator=gen).topk(top_k, dim=-1).indices
    weights = torch.rand(rows, top_k, device=weight.device, generator=gen).to(weight.dtype)
    try:
        got = grouped_experts(experts, x, index, weights, swiglu).float()
    except (RuntimeError, TypeError) as err:
        logger.warning("grouped expert GEMMs failed (%s); decoding through transformers' "
                       "experts", err)
        return False
    ref = experts(x, index, weights).float()
    error = float((got - ref).abs().max() / ref.abs().max().clamp(min=1e-6))
    logger.info("grouped expert GEMMs vs transformers' experts: relative max error %.2e", error)
    return error < 0.02
