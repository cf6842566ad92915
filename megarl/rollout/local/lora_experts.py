"""Routed-expert LoRA adapters served by the embedded engine, in SGLang's per-expert names
(``model.layers.{i}.mlp.experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj``, or ``w1`` / ``w3``
/ ``w2``; ``megarl/weights/expert_adapters.py`` makes them from PEFT's fused layout).

HF keeps a layer's experts as two 3-D parameters (``gate_up_proj`` ``[E, 2I, H]``, gate rows
first, and ``down_proj`` ``[E, H, I]``), so there is no linear module per expert to hook. An
adapted experts module runs :func:`experts_forward` instead of its own: HF's eager loop over the
hit experts, where each projection adds ``scale * B_e (A_e x)`` for the tokens of the rows that
use the adapter, which is what the merged weights ``W_e + scale * B_e A_e`` compute. An expert
an adapter does not name has zero adapters (as in SGLang's buffers).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

EXPERT_KEY = re.compile(r"^(?P<module>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)$")
"""A per-expert adapter module name: the experts module, the expert, the projection."""
PROJECTIONS = {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj",
               "w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
"""SGLang's accepted projection names (``w1``/``w3``/``w2`` renamed as its loader does)."""


@dataclass
class ExpertWeights:
    """One adapter's matrices on one experts module: per projection ``(A [E, r, in],
    B [E, out, r])``, zero for the experts it does not name."""

    projections: dict[str, tuple[torch.Tensor, torch.Tensor]]


def fused_shapes(module: nn.Module) -> tuple[int, int, int] | None:
    """``(experts, hidden, intermediate)`` of an HF experts module with the fused, untransposed
    parameters :func:`experts_forward` runs, or None."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if (not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor)
            or gate_up.dim() != 3 or down.dim() != 3 or getattr(module, "is_transposed", False)
            or getattr(module, "has_bias", False) or not hasattr(module, "act_fn")):
        return None
    experts, two_i, hidden = gate_up.shape
    if two_i % 2 or tuple(down.shape) != (experts, hidden, two_i // 2):
        return None
    return experts, hidden, two_i // 2


def expert_weights(adapter: str, module_name: str, module: nn.Module,
                   pairs: Mapping[tuple[int, str], Mapping[str, torch.Tensor]], rank: int,
                   device: torch.device, dtype: torch.dtype,
                   error: Callable[[str], Exception]) -> ExpertWeights:
    """The stacked matrices of ``pairs`` (``(expert, projection) -> {"A", "B"}``) for
    ``module``; raises ``error(message)`` naming what does not fit."""
    shapes = fused_shapes(module)
    if shapes is None:
        raise error(f"{adapter}: {module_name} is not an experts module with fused gate_up_proj "
                    "[E, 2I, H] and down_proj [E, H, I] parameters (per-expert adapters need "
                    "them; an FP8-quantized model has none)")
    experts, hidden, inter = shapes
    dims = {"gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    stacked: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for (expert, projection), pair in sorted(pairs.items()):
        where = f"{module_name}.{expert}.{projection}"
        if expert >= experts:
            raise error(f"{adapter}: {where}: the layer has {experts} experts")
        if set(pair) != {"A", "B"}:
            raise error(f"{adapter}: {where} has lora_{next(iter(pair))} only")
        a, b = pair["A"], pair["B"]
        fan_in, fan_out = dims[projection]
        if (a.dim() != 2 or b.dim() != 2 or tuple(a.shape) != (rank, fan_in)
                or tuple(b.shape) != (fan_out, rank)):
            raise error(f"{adapter}: {where} lora_A {list(a.shape)} / lora_B {list(b.shape)} do "
                        f"not fit an expert projection of {fan_in} -> {fan_out} at rank {rank}")
        if projection not in stacked:
            stacked[projection] = (torch.zeros(experts, rank, fan_in, device=device, dtype=dtype),
                                   torch.zeros(experts, fan_out, rank, device=device, dtype=dtype))
        stacked[projection][0][expert].copy_(a)
        stacked[projection][1][expert].copy_(b)
    return ExpertWeights(stacked)


def _plus_adapters(y: torch.Tensor, x: torch.Tensor, expert: int, projection: str,
                   applied: list[tuple[ExpertWeights, torch.Tensor]]) -> torch.Tensor:
    """``y`` (``projection`` of expert ``expert`` on its tokens ``x``) plus each applied
    adapter's ``B_e (A_e x)``, times the adapter's per-token factor (scale, or 0 off its rows)."""
    for weights, factor in applied:
        pair = weights.projections.get(projection)
        if pair is not None:
            delta = F.linear(F.linear(x.to(pair[0].dtype), pair[0][expert]), pair[1][expert])
            y = y + (delta * factor).to(y.dtype)
    return y


def experts_forward(module: nn.Module,
                    adapters: Callable[[], list[tuple[ExpertWeights, float, torch.Tensor]]]
                    ) -> Callable[..., torch.Tensor]:
    """The forward of an adapted experts module: HF's eager expert loop with each adapter's
    ``scale * B_e (A_e x)`` added to the tokens whose row uses it. ``adapters()`` gives, for
    the coming forward, ``(weights, scale, per-row mask)`` of each adapter that applies."""

    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        experts = module.gate_up_proj.shape[0]
        applied = adapters()
        tokens = hidden_states.shape[0]
        token_masks = []
        for weights, scale, rows in applied:
            if tokens % rows.shape[0]:
                raise RuntimeError(f"LoRA: {tokens} expert tokens for {rows.shape[0]} rows")
            token_masks.append((weights, scale, rows.repeat_interleave(tokens // rows.shape[0])))
        out = torch.zeros_like(hidden_states)
        with torch.no_grad():
            hit = torch.bincount(top_k_index.flatten(), minlength=experts).nonzero().flatten()
        for expert in hit.tolist():
            if expert >= experts:  # HF's index of a slot routed nowhere
                continue
            token_idx, top_k_pos = torch.where(top_k_index == expert)
            x = hidden_states[token_idx]
            extra = [(w, scale * mask[token_idx].unsqueeze(-1)) for w, scale, mask in token_masks]
            gate, up = F.linear(x, module.gate_up_proj[expert]).chunk(2, dim=-1)
            gate = _plus_adapters(gate, x, expert, "gate_proj", extra)
            up = _plus_adapters(up, x, expert, "up_proj", extra)
            h = module.act_fn(gate) * up
            y = _plus_adapters(F.linear(h, module.down_proj[expert]), h, expert, "down_proj", extra)
            y = y * top_k_weights[token_idx, top_k_pos, None]
            out.index_add_(0, token_idx, y.to(out.dtype))
        return out

    return forward
