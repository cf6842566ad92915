"""One GEMM for several of an HF layer's projections, over the live weights.

The native decode path (:mod:`megarl.rollout.local.static_kv`) computes q/k/v (and a dense
MLP's gate/up) with one GEMM each instead of three (two): :func:`alias_concat` concatenates the
weights once and turns the HF parameters into views of the concatenation, so the model, its
checkpoint names and in-place weight updates (:class:`~megarl.rollout.local.weights.WeightMap`)
are unchanged. Moving the model (offload to host memory) re-allocates each parameter; the
decoder then fuses again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


def alias_concat(linears: list[nn.Module]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """Concatenate the weights (and biases) of ``linears`` along the output features into one
    tensor and make each module's parameters views of it: one GEMM then computes all of them,
    and weights written into the modules in place (weight updates) land in the fused tensor.
    None when the modules differ in having a bias, or are not plain ``nn.Linear`` (an FP8
    layer's weight is not a GEMM operand of its own)."""
    if not all(type(m) is nn.Linear for m in linears):
        return None
    biases = [m.bias for m in linears]
    if len({b is None for b in biases}) > 1:
        return None
    fused = []
    for params in ([m.weight for m in linears], biases):
        if params[0] is None:
            fused.append(None)
            continue
        joined = torch.cat([p.data for p in params])
        offset = 0
        for p in params:
            p.data = joined[offset: offset + p.shape[0]]
            offset += p.shape[0]
        fused.append(joined)
    return fused[0], fused[1]


@dataclass
class FusedLayer:
    """One layer's projections that a single GEMM computes (see :func:`alias_concat`)."""

    qkv: tuple[torch.Tensor, torch.Tensor | None] | None
    qkv_sizes: tuple[int, int, int]
    gate_up: tuple[torch.Tensor, torch.Tensor | None] | None

    @classmethod
    def of(cls, layer: nn.Module) -> FusedLayer:
        """Fuse ``layer``'s q/k/v projections and, for a dense MLP, its gate/up projections."""
        attn, mlp = layer.self_attn, layer.mlp
        projections = [attn.q_proj, attn.k_proj, attn.v_proj]
        gate_up = None
        if hasattr(mlp, "gate_proj") and hasattr(mlp, "up_proj"):
            gate_up = alias_concat([mlp.gate_proj, mlp.up_proj])
        return cls(qkv=alias_concat(projections),
                   qkv_sizes=tuple(p.weight.shape[0] for p in projections), gate_up=gate_up)
