"""The names of the linear layers LoRA adapters can go on (``actor.lora``), shared by validation
and the actor: ``layers.{i}.{path}`` with the global layer index ``i`` and the layer's path in a
megatron transformer layer, e.g. ``layers.0.self_attention.linear_qkv``."""

from __future__ import annotations

import fnmatch
import typing
from collections.abc import Sequence
from typing import Literal

LoraTarget = Literal[
    "linear_qkv", "linear_proj", "linear_fc1", "linear_fc2",
    "shared_experts.linear_fc1", "shared_experts.linear_fc2",
    "experts.linear_fc1", "experts.linear_fc2",
]
LORA_TARGETS: tuple[str, ...] = typing.get_args(LoraTarget)

# A megatron transformer layer's linear layers (path in the layer) -> the target selecting them.
ATTENTION_PATHS = {"self_attention.linear_qkv": "linear_qkv",
                   "self_attention.linear_proj": "linear_proj"}
DENSE_MLP_PATHS = {"mlp.linear_fc1": "linear_fc1", "mlp.linear_fc2": "linear_fc2"}
SHARED_EXPERT_PATHS = {"mlp.shared_experts.linear_fc1": "shared_experts.linear_fc1",
                       "mlp.shared_experts.linear_fc2": "shared_experts.linear_fc2"}
EXPERT_PATHS = {"mlp.experts.linear_fc1": "experts.linear_fc1",
                "mlp.experts.linear_fc2": "experts.linear_fc2"}
LAYER_PATHS = {**ATTENTION_PATHS, **DENSE_MLP_PATHS, **SHARED_EXPERT_PATHS, **EXPERT_PATHS}


DEFAULT_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2",
                   "shared_experts.linear_fc1", "shared_experts.linear_fc2")
"""What ``target_modules: null`` stands for: those of these the model has (every linear layer
but the routed experts')."""


HF_MODULES: dict[str, tuple[str, ...]] = {
    "linear_qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "linear_proj": ("self_attn.o_proj",),
    "linear_fc1": ("mlp.gate_proj", "mlp.up_proj"),
    "linear_fc2": ("mlp.down_proj",),
}
"""The HF modules (under ``model.layers.{i}.``) of each target's adapters, in adapter-part
order (a shared expert's are the same projections under its own module)."""


def hf_leaf_modules(targets: Sequence[str] | None) -> tuple[str, ...]:
    """The HF projection names (``q_proj``, ``down_proj``...) adapters of ``targets`` sit on
    (None: :data:`DEFAULT_TARGETS`): what SGLang's ``--lora-target-modules`` lists."""
    names: list[str] = []
    for target in targets if targets is not None else DEFAULT_TARGETS:
        # a routed expert's projections have the dense MLP's names (SGLang: experts.{e}.gate_proj)
        for module in HF_MODULES[target.removeprefix("shared_experts.").removeprefix("experts.")]:
            leaf = module.rsplit(".", 1)[-1]
            if leaf not in names:
                names.append(leaf)
    return tuple(names)


def resolve_targets(moe_layers: Sequence[bool], shared_experts: bool,
                    targets: Sequence[str] | None) -> tuple[str, ...]:
    """``targets``, or for None the :data:`DEFAULT_TARGETS` that select a layer of the model."""
    if targets is not None:
        return tuple(targets)
    return tuple(t for t in DEFAULT_TARGETS if lora_layer_names(moe_layers, shared_experts, [t]))


def lora_layer_names(moe_layers: Sequence[bool], shared_experts: bool,
                     targets: Sequence[str]) -> list[str]:
    """Every targeted layer of a model whose layer ``i`` is MoE when ``moe_layers[i]``."""
    names = []
    for index, moe in enumerate(moe_layers):
        paths = {**ATTENTION_PATHS, **(EXPERT_PATHS if moe else DENSE_MLP_PATHS)}
        if moe and shared_experts:
            paths.update(SHARED_EXPERT_PATHS)
        names += [f"layers.{index}.{p}" for p, t in paths.items() if t in targets]
    return names


def is_excluded(name: str, patterns: Sequence[str]) -> bool:
    """Whether an ``exclude_modules`` pattern (fnmatch, case-sensitive) matches ``name``."""
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def selection_problems(moe_layers: Sequence[bool], shared_experts: bool,
                       targets: Sequence[str], excludes: Sequence[str]) -> list[str]:
    """What is wrong with a choice of targets and exclusions for this model: a target that
    selects no layer, an exclude pattern that matches no targeted layer, nothing left."""
    names = lora_layer_names(moe_layers, shared_experts, targets)
    problems = [f"target_modules: {t} selects no layer of this model" for t in targets
                if not lora_layer_names(moe_layers, shared_experts, [t])]
    problems += [f"exclude_modules: {p!r} matches no targeted layer (names look like "
                 f"{names[0]!r})" for p in excludes
                 if names and not any(is_excluded(n, [p]) for n in names)]
    if names and all(is_excluded(n, excludes) for n in names):
        problems.append("exclude_modules: every targeted layer is excluded")
    return problems


def adapter_params(name: str, rank: int, sizes: dict[str, int], tp: int) -> int:
    """Adapter parameters of layer ``name`` on one of ``tp`` ranks: per HF projection
    ``rank x (in + out)``, the output side split over TP for a column-parallel layer (B), the
    input side for a row-parallel one (A). ``sizes``: hidden, q, kv, ffn, shared_ffn widths;
    for the routed experts (``tp``: expert-TP) expert_ffn and local_experts, each local expert
    ``rank x (hidden + 2 expert_ffn / tp)`` on fc1 (one A for gate and up, as PEFT's) and
    ``rank x (expert_ffn / tp + hidden)`` on fc2."""
    h, q, kv = sizes["hidden"], sizes["q"], sizes["kv"]
    if ".mlp.experts." in name:
        ffn = -(-sizes["expert_ffn"] // tp)
        per_expert = rank * (h + 2 * ffn) if name.endswith("linear_fc1") else rank * (ffn + h)
        return sizes["local_experts"] * per_expert
    ffn = sizes["shared_ffn"] if ".shared_experts." in name else sizes["ffn"]
    target = LAYER_PATHS[name.split(".", 2)[2]]
    column = {"linear_qkv": (h, (q, kv, kv)), "linear_fc1": (h, (ffn, ffn)),
              "shared_experts.linear_fc1": (h, (ffn, ffn))}
    row = {"linear_proj": (q, h), "linear_fc2": (ffn, h), "shared_experts.linear_fc2": (ffn, h)}
    if target in column:
        width, outs = column[target]
        return sum(rank * (width + -(-out // tp)) for out in outs)
    width, out = row[target]
    return rank * (-(-width // tp) + out)


def adapter_counts(names: Sequence[str], rank: int, sizes: dict[str, int], tp: int,
                   etp: int) -> tuple[int, int]:
    """(non-expert, routed-expert) adapter parameters of layers ``names`` on one rank."""
    counts = [0, 0]
    for name in names:
        expert = ".mlp.experts." in name
        counts[expert] += adapter_params(name, rank, sizes, etp if expert else tp)
    return counts[0], counts[1]
