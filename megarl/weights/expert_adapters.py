"""Routed-expert LoRA adapters in the layout an engine loads: PEFT's fused layout -> one adapter
per expert and projection, as SGLang reads MoE adapters (issue 33, ``actor.lora.sync: adapter``).

PEFT adapts HF's fused expert parameters through ``target_parameters``
(``model.layers.{i}.mlp.experts.gate_up_proj`` ``[E, 2I, H]``, ``...down_proj`` ``[E, H, I]``):
one module key per parameter, nested (``mlp.experts.base_layer`` is the innermost wrapper,
``mlp.experts`` the outermost), with ``lora_A`` ``[E * r, in]`` (row ``e * r + j``) and ``lora_B``
``[out, r * E]`` (column ``j * E + e``). SGLang (``srt/lora/lora.py``, ``mem_pool.py``) takes an
MoE adapter as 2-D tensors per expert, ``model.layers.{i}.mlp.experts.{e}.gate_proj`` /
``up_proj`` / ``down_proj`` (``w1`` / ``w3`` / ``w2`` renamed to those), stacks gate and up into
``gate_up_proj`` (A ``[2r, H]``, B ``[2I, r]``, gate rows first) and applies each half of A with
its half of B. PEFT's one A for gate and up together is therefore sent twice, once per
projection, with B's gate rows and up rows: ``B_gate A x`` and ``B_up A x`` are exactly the two
halves of ``B A x``. The rank, alpha and the adapters of every other module stay as they are.
"""

from __future__ import annotations

import re
from typing import Any

import torch

PEFT_PREFIX = "base_model.model."
"""What PEFT puts before a module's name in an adapter's state dict."""
_FUSED = re.compile(
    r"^(model\.layers\.(\d+)\.mlp\.experts)((?:\.base_layer)*)\.lora_([AB])\.weight$")
_PROJECTIONS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
"""HF's fused expert parameters in the order HF defines them, and SGLang's projections of each."""


def _parameter_order(config: dict[str, Any]) -> dict[str, list[str]]:
    """Per experts module (``model.layers.{i}.mlp.experts``), its adapted parameters in PEFT's
    nesting order, the innermost first: the order HF defines them (``gate_up_proj``, then
    ``down_proj``), whatever the order of ``target_parameters`` (PEFT saves it sorted)."""
    order: dict[str, list[str]] = {}
    for parameter in config.get("target_parameters") or ():
        module, _, leaf = parameter.rpartition(".")
        if leaf not in _PROJECTIONS:
            raise ValueError(f"target_parameters: {parameter!r} is not an expert parameter "
                             f"({sorted(_PROJECTIONS)})")
        order.setdefault(module, []).append(leaf)
    return {module: [p for p in _PROJECTIONS if p in leaves] for module, leaves in order.items()}


def unfuse(a: torch.Tensor, b: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """PEFT's fused expert adapter (A ``[E * r, in]``, B ``[out, r * E]``) as ``A [E, r, in]``
    and ``B [E, out, r]`` (views)."""
    experts = a.shape[0] // rank
    return (a.reshape(experts, rank, a.shape[1]),
            b.reshape(b.shape[0], rank, experts).permute(2, 0, 1))


def per_expert_adapter(config: dict[str, Any], tensors: dict[str, torch.Tensor]
                       ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``(config, tensors)`` of a PEFT adapter with its fused expert adapters split into SGLang's
    per-expert ones (the others unchanged; an adapter without experts is returned as it is)."""
    order = _parameter_order(config)
    if not order:
        return config, tensors
    rank = int(config["r"])
    out: dict[str, torch.Tensor] = {}
    fused: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _FUSED.match(key.removeprefix(PEFT_PREFIX))
        if match is None:
            out[key] = tensor
            continue
        module, depth, part = match.group(1), match.group(3).count(".base_layer"), match.group(4)
        params = order.get(module)
        if params is None or depth >= len(params):
            raise ValueError(f"{key}: no expert parameter of target_parameters "
                             f"{config.get('target_parameters')} at this nesting depth")
        fused.setdefault((module, params[len(params) - 1 - depth]), {})[part] = tensor
    leaves: list[str] = []
    for (module, parameter), pair in fused.items():
        if set(pair) != {"A", "B"}:
            raise ValueError(f"{module}.{parameter}: lora_{''.join(pair)} only")
        a, b = pair["A"], pair["B"]
        if a.shape[0] % rank or b.shape[1] != a.shape[0]:
            raise ValueError(f"{module}.{parameter}: lora_A {list(a.shape)} / lora_B "
                             f"{list(b.shape)} are not PEFT's fused layout of rank {rank}")
        a_e, b_e = unfuse(a, b, rank)
        projections = _PROJECTIONS[parameter]
        for e in range(a_e.shape[0]):
            rows = b_e[e].chunk(len(projections))  # gate rows, up rows (gate_up_proj)
            for projection, b_rows in zip(projections, rows):
                name = f"{PEFT_PREFIX}{module}.{e}.{projection}"
                out[f"{name}.lora_A.weight"] = a_e[e].contiguous()
                out[f"{name}.lora_B.weight"] = b_rows.contiguous()
        leaves += [p for p in projections if p not in leaves]
    config = {k: v for k, v in config.items() if k != "target_parameters"}
    config["target_modules"] = list(config.get("target_modules") or []) + leaves
    return config, out
