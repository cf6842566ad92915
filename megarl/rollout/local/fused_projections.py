"""One GEMM for several of an HF layer's projections, over the live weights.

The native decode path (:mod:`megarl.rollout.local.static_kv`) computes q/k/v (and a dense
MLP's gate/up) with one GEMM each instead of three (two): :func:`alias_concat` concatenates the
weights once and turns the HF parameters into views of the concatenation, so the model, its
checkpoint names and in-place weight updates (:class:`~megarl.rollout.local.weights.WeightMap`)
are unchanged. Moving the model (offload to host memory) re-allocates each parameter; the
decoder then fuses again.

Block-FP8 projections (:class:`~megarl.rollout.local.fp8_layers.Fp8Linear`, ``--quantization
fp8``) fuse the same way when each one's output rows are whole 128-row blocks, as SGLang's
fused qkv and gate_up FP8 layers need: their FP8 weights and their ``weight_scale_inv`` block
rows are concatenated, and the activations are quantized once for the fused GEMM instead of
once per projection.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from megarl.rollout.local.fp8_layers import Fp8Linear, fp8_linear
from megarl.weights.fp8 import GROUP


@dataclass
class Projection:
    """The fused weight (and bias, and for block FP8 the weight's scales) of several
    projections; calling it computes them all with one GEMM."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    scale_inv: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.scale_inv is None:
            return F.linear(x, self.weight, self.bias)
        return fp8_linear(x, self.weight, self.scale_inv, self.bias)


def _parts(linears: list[nn.Module]) -> tuple[str, ...] | None:
    """The parameters to concatenate: a plain ``nn.Linear``'s weight; an FP8 one's weight and
    scales when each output is whole 128-row blocks. None for anything else (a LoRA-wrapped
    layer, a mix, FP8 layers whose block rows would straddle two projections)."""
    kinds = {type(m) for m in linears}
    if kinds == {nn.Linear}:
        return ("weight",)
    if kinds == {Fp8Linear} and all(m.out_features % GROUP == 0 for m in linears):
        return ("weight", "weight_scale_inv")
    return None


def alias_concat(linears: list[nn.Module]) -> Projection | None:
    """Concatenate the weights (and biases; an FP8 layer's scales) of ``linears`` along the
    output features into one tensor each and make each module's parameters views of it: one GEMM
    then computes all of them, and weights written into the modules in place (weight updates)
    land in the fused tensors. None when the modules differ in having a bias, or are not all
    plain ``nn.Linear`` or all block-FP8 layers of whole output blocks (:func:`_parts`)."""
    names = _parts(linears)
    biases = [m.bias for m in linears]
    if names is None or len({b is None for b in biases}) > 1:
        return None
    fused: dict[str, torch.Tensor | None] = {}
    for name in (*names, "bias"):
        params = [getattr(m, name) for m in linears]
        if params[0] is None:
            fused[name] = None
            continue
        joined = torch.cat([p.data for p in params])
        offset = 0
        for p in params:
            p.data = joined[offset: offset + p.shape[0]]
            offset += p.shape[0]
        fused[name] = joined
    return Projection(fused["weight"], fused["bias"], fused.get("weight_scale_inv"))


@dataclass
class FusedLayer:
    """One layer's projections that a single GEMM computes (see :func:`alias_concat`)."""

    qkv: Projection | None
    qkv_sizes: tuple[int, int, int]
    gate_up: Projection | None

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
