"""LoRA adapters on the actor's linear layers: the base model frozen, low-rank updates trained.

:func:`apply_lora` freezes every parameter of an :class:`~megarl.megatron.model.ActorModel`
(``requires_grad=False``: megatron's DDP gives them no gradient buffer and its optimizer no
state) and gives each targeted linear layer a :class:`LoraAdapter` child named ``lora``, whose
``lora_A`` / ``lora_B`` are the only trainable parameters (in the model dtype; megatron's
optimizer keeps their fp32 master copies). A forward hook adds ``scale * B(A(dropout(x)))`` to
the layer's output, ``scale = alpha / rank``; A starts kaiming-uniform(a=sqrt(5)), B at zero,
as PEFT's.

The adapters are *canonical*: a fused layer carries one adapter per HF projection, as PEFT puts
them on the HF model (q, k, v on ``linear_qkv``; gate and up on ``linear_fc1``), so that a
megatron adapter is a PEFT adapter up to sharding. Sharding follows the base layer:

- column-parallel (``linear_qkv``, ``linear_fc1``): A is whole on every TP rank and B holds
  this rank's output rows of each projection; under sequence parallelism the rank-r activations
  ``A x`` are all-gathered over the sequence (their gradient reduce-scattered), else copied into
  the TP region (gradient all-reduced);
- row-parallel (``linear_proj``, ``linear_fc2``): A holds this rank's input columns and the
  partial ``A x`` is reduced over TP where the base layer reduces its output (reduce-scatter
  under sequence parallelism, else all-reduce); B is whole.

A replicated matrix that sees only this rank's sequence shard is marked ``sequence_parallel``,
so megatron all-reduces its gradient over TP as it does the norms'.

In the run checkpoint an adapted layer's ``sharded_state_dict`` adds its adapters as shards
along their own TP axes (each B of a fused layer one tensor), so they reload under any layout.
:func:`merged_weights` lets the bridge export ``W + scale * B @ A`` under the base names (the
weight sync of any engine); :func:`peft_state_dict` / :func:`load_peft_state_dict` read and set
the adapters under PEFT's names, whole (gathered over TP).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state as mpu
from megatron.core.tensor_parallel import (
    get_cuda_rng_tracker,
    set_defaults_if_not_set_tensor_model_parallel_attributes,
    set_tensor_model_parallel_attributes,
)
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.utils import (
    ensure_metadata_has_dp_cp_group,
    make_sharded_tensors_for_checkpoint,
)

from megarl.config.lora_layers import (
    HF_MODULES,
    LAYER_PATHS,
    is_excluded,
    resolve_targets,
    selection_problems,
)
from megarl.megatron.lora_experts import (
    HF_EXPERT_PARAMS,
    ExpertLoraAdapter,
    add_expert_adapter_output,
    gather_shards,
    peft_expert_key,
    sharded_state_dict_with_expert_adapter,
)
from megarl.megatron.model import ActorModel
from megarl.megatron.native_modules import NormColumnParallelLinear
from megarl.megatron.native_spec import moe_layer_pattern
from megarl.megatron.parallel import unwrap_chunk
from megarl.megatron.settings import LoraSettings
from megarl.weights.expert_adapters import PEFT_PREFIX

# How each target's layers are split over TP.
ROW_PARALLEL = {"linear_proj", "linear_fc2", "shared_experts.linear_fc2", "experts.linear_fc2"}

TP_ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "partition_stride")

# Where each HF family keeps its MoE layers' shared expert.
HF_SHARED_EXPERT: dict[str, str] = {"qwen2_moe": "mlp.shared_expert",
                                    "deepseek_v3": "mlp.shared_experts"}


class LoraAdapter(torch.nn.Module):
    """The adapters of one linear layer: ``lora_A`` stacks the parts' A matrices
    (``[parts * r, in]``, input columns of this TP rank for a row-parallel layer) and
    ``lora_B[p]`` is part ``p``'s B matrix (``[out_p, r]``, this TP rank's output rows for a
    column-parallel layer); the layer's output is the parts' outputs laid out as the base
    layer's. Each B of a column-parallel layer is one TP-sharded tensor in checkpoints, so
    they reshard to any TP size."""

    def __init__(self, base: torch.nn.Module, name: str, kind: str, parts: tuple[str, ...],
                 settings: LoraSettings) -> None:
        super().__init__()
        config = base.config
        self.name, self.kind, self.parts = name, kind, parts
        self.rank, self.scale, self.dropout = settings.rank, settings.scale, settings.dropout
        self.sequence_parallel = config.sequence_parallel
        self.tp_group = getattr(base, "tp_group", None) or mpu.get_tensor_model_parallel_group()
        self.tp_size = self.tp_group.size()
        self.tp_rank = self.tp_group.rank()
        self.in_features = base.input_size
        out_local = base.output_size_per_partition if kind == "column" else base.output_size
        self.qkv_groups = 0  # > 0: q, k, v interleaved per query group, as megatron's linear_qkv
        if parts == ("q", "k", "v"):
            groups = config.num_query_groups or config.num_attention_heads
            self.qkv_groups = groups // self.tp_size
            kv = self.qkv_groups * config.kv_channels
            self.out_sizes: tuple[int, ...] = (out_local - 2 * kv, kv, kv)
        else:
            self.out_sizes = (out_local // len(parts),) * len(parts)
        in_local = self.in_features // self.tp_size if kind == "row" else self.in_features
        kw = {"dtype": config.params_dtype, "device": base.weight.device}
        self.lora_A = torch.nn.Parameter(torch.empty(len(parts) * self.rank, in_local, **kw))
        self.lora_B = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.zeros(out, self.rank, **kw)) for out in self.out_sizes])
        whole = torch.empty(len(parts) * self.rank, self.in_features, dtype=torch.float32)
        seeded = torch.Generator().manual_seed(settings.seed + zlib.crc32(name.encode()))
        torch.nn.init.kaiming_uniform_(whole, a=math.sqrt(5), generator=seeded)
        with torch.no_grad():
            self.lora_A.copy_(self._shard_a(whole))
        sharded, replicated = ([*self.lora_B], [self.lora_A]) if kind == "column" else (
            [self.lora_A], [*self.lora_B])
        for param in sharded:
            set_tensor_model_parallel_attributes(param, is_parallel=True,
                                                 dim=0 if kind == "column" else 1, stride=1)
        for param in replicated:
            set_defaults_if_not_set_tensor_model_parallel_attributes(param)
            # fed by this rank's sequence shard only: megatron sums its gradient over TP
            param.sequence_parallel = self.sequence_parallel

    def checkpoint_axes(self) -> dict[str, int]:
        """The TP-sharded tensors by state-dict key under the base layer, and their axis."""
        if self.kind == "row":
            return {"lora.lora_A": 1}
        return {f"lora.lora_B.{i}": 0 for i in range(len(self.parts))}

    def _shard_a(self, whole: torch.Tensor) -> torch.Tensor:
        return whole.chunk(self.tp_size, dim=1)[self.tp_rank] if self.kind == "row" else whole

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.dropout == 0.0:
            return x
        # a TP-replicated input needs one mask on every TP rank (torch's default generator);
        # a sharded one (row-parallel input, sequence-parallel shard) one mask per rank
        if self.kind == "column" and not self.sequence_parallel:
            return F.dropout(x, self.dropout, training=True)
        with get_cuda_rng_tracker().fork():
            return F.dropout(x, self.dropout, training=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The adapters' contribution to the base layer's output for its input ``x``."""
        z = F.linear(self._dropout(x), self.lora_A)
        if self.kind == "column":
            if self.sequence_parallel:
                z = gather_from_sequence_parallel_region(z, group=self.tp_group)
            elif self.tp_size > 1:
                z = copy_to_tensor_model_parallel_region(z, group=self.tp_group)
            zs = z.split(self.rank, dim=-1)
            outs = [F.linear(zp, bp) for zp, bp in zip(zs, self.lora_B)]
            return part_layout(outs, self.qkv_groups) * self.scale
        if self.sequence_parallel:
            z = reduce_scatter_to_sequence_parallel_region(z, group=self.tp_group)
        elif self.tp_size > 1:
            z = reduce_from_tensor_model_parallel_region(z, group=self.tp_group)
        return F.linear(z, self.lora_B[0]) * self.scale

    @torch.no_grad()
    def delta_weight(self) -> torch.Tensor:
        """``scale * B @ A`` of this rank's shard of the base weight (fp32)."""
        return lora_delta(self.lora_A, list(self.lora_B), self.scale, self.qkv_groups)

    def delta_for(self, leaf: str) -> torch.Tensor | None:
        """:meth:`delta_weight` for the base's ``weight``, None for its other tensors."""
        return self.delta_weight() if leaf == "weight" else None

    @torch.no_grad()
    def whole_parts(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(A, B)`` of every part, gathered over TP (collective over the TP group)."""
        a, bs = self.lora_A.detach(), [b.detach() for b in self.lora_B]
        if self.kind == "row":
            return [(gather_shards(a, 1, self.tp_group), bs[0].clone())]
        return [(ap.clone(), gather_shards(bp, 0, self.tp_group))
                for ap, bp in zip(a.split(self.rank), bs)]

    @torch.no_grad()
    def load_whole_parts(self, parts: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Set the adapters from whole ``(A, B)`` per part (this rank keeps its shards)."""
        if len(parts) != len(self.parts):
            raise ValueError(f"{self.name}: {len(parts)} adapters given, {len(self.parts)} held")
        self.lora_A.copy_(self._shard_a(torch.cat([a for a, _ in parts])))
        for mine, (_, b) in zip(self.lora_B, parts):
            mine.copy_(b if self.kind == "row" else b.chunk(self.tp_size)[self.tp_rank])


def part_layout(outs: list[torch.Tensor], qkv_groups: int) -> torch.Tensor:
    """The parts' outputs (last dim) in the base layer's output layout: q, k, v interleaved per
    query group as megatron's ``linear_qkv`` (``qkv_groups`` > 0), else one after the other."""
    if not qkv_groups:
        return torch.cat(outs, dim=-1)
    lead = outs[0].shape[:-1]
    grouped = [o.reshape(*lead, qkv_groups, -1) for o in outs]
    return torch.cat(grouped, dim=-1).reshape(*lead, -1)


def lora_delta(a: torch.Tensor, bs: list[torch.Tensor], scale: float,
               qkv_groups: int = 0) -> torch.Tensor:
    """``scale * B @ A`` in the base weight's layout (fp32) from the stacked A (``[parts * r,
    in]``) and the parts' B (``[out_p, r]``) of one adapted layer (or shard of it)."""
    a = a.detach().float()
    rank = bs[0].shape[1]
    pieces = [(b.detach().float() @ ap).T for ap, b in zip(a.split(rank), bs)]
    return scale * part_layout(pieces, qkv_groups).T


def _add_adapter_output(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any):
    """Forward hook of an adapted layer: its output plus the adapters' contribution."""
    x = args[0] if args else kwargs["input_"]
    if isinstance(module, NormColumnParallelLinear):
        x = module.normalize(x)
    out, bias = output
    return out + module.lora(x), bias


def _sharded_state_dict_with_adapter(module: torch.nn.Module, base: Any, prefix: str = "",
                                     sharded_offsets: tuple = (), metadata: dict | None = None
                                     ) -> dict[str, Any]:
    """The base layer's checkpoint shards, its adapter's with their own TP axes (the base
    layer's method would save them as replicas)."""
    out = base(prefix, sharded_offsets, metadata)
    adapter = module.lora
    tensors = {f"lora.{name}": p for name, p in adapter.named_parameters()}
    out.update(make_sharded_tensors_for_checkpoint(
        tensors, prefix, adapter.checkpoint_axes(), sharded_offsets, tp_group=adapter.tp_group,
        dp_cp_group=ensure_metadata_has_dp_cp_group(metadata)["dp_cp_group"]))
    return out


def _layers(model: ActorModel) -> Iterator[tuple[int, torch.nn.Module]]:
    """(global layer index, transformer layer) of every layer this rank holds."""
    for chunk in model.chunks:
        for layer in unwrap_chunk(chunk).decoder.layers:
            yield layer.layer_number - 1, layer


def _parts(target: str, config: Any) -> tuple[str, ...]:
    if target == "linear_qkv":
        return ("q", "k", "v")
    if target.endswith("linear_fc1"):
        if not config.gated_linear_unit:
            raise ValueError(f"LoRA on {target} is built for gated MLPs (SwiGLU, gate and up "
                             "projections) only; drop it from actor.lora.target_modules")
        return ("gate", "up")
    return ("",)


def apply_lora(model: ActorModel, settings: LoraSettings) -> list[str]:
    """Freeze ``model`` and add adapters to the targeted layers this rank holds; returns their
    names (``layers.{i}.{path}``). Call before wrapping the chunks for training."""
    if not settings.enabled:
        raise ValueError("apply_lora needs LoraSettings.rank > 0")
    if model.spec != "native":
        raise ValueError("LoRA is built on megarl's native layer spec; the TransformerEngine "
                         "spec's fused layers have no adapters yet")
    config = model.config
    moe_layers = moe_layer_pattern(config)
    shared = bool(config.moe_shared_expert_intermediate_size)
    targets = resolve_targets(moe_layers, shared, settings.target_modules)
    experts = sorted(t for t in targets if t.startswith("experts."))
    etp = mpu.get_expert_tensor_parallel_world_size()
    tp = mpu.get_tensor_model_parallel_world_size()
    if experts and etp not in (1, tp):
        raise ValueError(f"LoRA on the routed experts needs parallel.etp = 1 or = parallel.tp "
                         f"(got etp={etp}, tp={tp})")
    problems = selection_problems(moe_layers, shared, targets, settings.exclude_modules)
    if problems:
        raise ValueError(f"actor.lora.{problems[0]}")
    model.lora = settings
    for chunk in model.chunks:
        chunk.requires_grad_(False)
    names = []
    for index, layer in _layers(model):
        for path, module in layer.named_modules():
            target = LAYER_PATHS.get(path)
            name = f"layers.{index}.{path}"
            if target not in targets or is_excluded(name, settings.exclude_modules):
                continue
            kind = "row" if target in ROW_PARALLEL else "column"
            parts = _parts(target, config)
            if target in HF_EXPERT_PARAMS:
                module.lora = ExpertLoraAdapter(module, name, kind, parts, settings)
                module.register_forward_hook(add_expert_adapter_output, with_kwargs=True)
                module.sharded_state_dict = functools.partial(
                    sharded_state_dict_with_expert_adapter, module, module.sharded_state_dict)
            else:
                module.lora = LoraAdapter(module, name, kind, parts, settings)
                module.register_forward_hook(_add_adapter_output, with_kwargs=True)
                module.sharded_state_dict = functools.partial(_sharded_state_dict_with_adapter,
                                                              module, module.sharded_state_dict)
            names.append(name)
    return names


def adapters(model: ActorModel) -> dict[str, LoraAdapter | ExpertLoraAdapter]:
    """This rank's adapters by name (``layers.{i}.{path}``)."""
    return {m.name: m for chunk in model.chunks for m in chunk.modules()
            if isinstance(m, (LoraAdapter, ExpertLoraAdapter))}


def _merged_named_parameters(module: torch.nn.Module, *args: Any, **kwargs: Any):
    """``named_parameters`` of a chunk without the adapters, an adapted layer's weight merged
    (``W + scale * B @ A`` in the weight's dtype), one tensor at a time."""
    for name, param in torch.nn.Module.named_parameters(module, *args, **kwargs):
        if ".lora." in name:
            continue
        owner_path, _, leaf = name.rpartition(".")
        adapter = getattr(module.get_submodule(owner_path), "lora", None)
        delta = (adapter.delta_for(leaf)
                 if isinstance(adapter, (LoraAdapter, ExpertLoraAdapter)) else None)
        if delta is not None:
            merged = (param.detach().float() + delta).to(param.dtype)
            for attr in (*TP_ATTRIBUTES, "allreduce"):  # the bridge gathers shards by these
                if hasattr(param, attr):
                    setattr(merged, attr, getattr(param, attr))
            yield name, merged
        else:
            yield name, param


@contextlib.contextmanager
def merged_weights(model: ActorModel) -> Iterator[None]:
    """Inside the block the chunks' ``named_parameters`` (what mbridge's ``export_weights``
    reads) give the merged weights and no adapters; nothing is written to the model."""
    chunks = [unwrap_chunk(c) for c in model.chunks]
    try:
        for chunk in chunks:
            chunk.named_parameters = _merged_named_parameters.__get__(chunk)
        yield
    finally:
        for chunk in chunks:
            vars(chunk).pop("named_parameters", None)


def export_merged_weights(model: ActorModel) -> Iterator[tuple[str, torch.Tensor]]:
    """The HF-named export (:func:`~megarl.megatron.hf_export.export_hf_weights`: mbridge's,
    or the direct one on a one-rank group; both read ``named_parameters``) with the adapters
    merged into their base weights (collective over the model-parallel groups)."""
    from megarl.megatron.hf_export import export_hf_weights

    with merged_weights(model):
        yield from export_hf_weights(model)


def hf_modules(target: str, model_type: str) -> tuple[str, ...]:
    """HF module paths (under ``model.layers.{i}.``) of a target's adapters, part by part."""
    if target.startswith("shared_experts."):
        if model_type not in HF_SHARED_EXPERT:
            raise ValueError(f"no HF name of the shared expert of {model_type} models")
        fc = HF_MODULES[target.split(".", 1)[1]]
        return tuple(f"{HF_SHARED_EXPERT[model_type]}.{m.split('.', 1)[1]}" for m in fc)
    return HF_MODULES[target]


def _peft_keys(model: ActorModel, adapter: LoraAdapter | ExpertLoraAdapter,
               names: list[str]) -> list[str]:
    """PEFT's module keys of ``adapter``'s parts (``names``: every adapter of this rank)."""
    _, index, path = adapter.name.split(".", 2)
    prefix = f"base_model.model.model.layers.{index}"
    if isinstance(adapter, ExpertLoraAdapter):
        siblings = [n for n in names if n.startswith(f"layers.{index}.mlp.experts.")]
        return [f"{prefix}.{peft_expert_key(siblings, adapter.name)}"]
    target = LAYER_PATHS[path]
    return [f"{prefix}.{m}" for m in hf_modules(target, model.hf_config.model_type)]


def peft_state_dict(model: ActorModel) -> dict[str, torch.Tensor]:
    """This rank's adapters, whole, under PEFT's saved names
    (``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight``); collective over TP."""
    out, found = {}, adapters(model)
    for adapter in found.values():
        for key, (a, b) in zip(_peft_keys(model, adapter, list(found)), adapter.whole_parts()):
            out[f"{key}.lora_A.weight"], out[f"{key}.lora_B.weight"] = a, b
    return out


def load_peft_state_dict(model: ActorModel, state: dict[str, torch.Tensor]) -> None:
    """Set this rank's adapters from whole tensors under PEFT's saved names."""
    found = adapters(model)
    for adapter in found.values():
        keys = _peft_keys(model, adapter, list(found))
        missing = [k for k in keys if f"{k}.lora_A.weight" not in state]
        if missing:
            raise KeyError(f"{adapter.name}: no adapter for {missing[0]} in the state given")
        adapter.load_whole_parts([(state[f"{k}.lora_A.weight"], state[f"{k}.lora_B.weight"])
                                  for k in keys])


def peft_adapter(model: ActorModel, settings: LoraSettings, base_model: str | None = None
                 ) -> tuple[dict[str, Any], dict[str, torch.Tensor]] | None:
    """(``adapter_config.json``, state dict) of the adapters in PEFT's format, whole; collective
    over the model-parallel groups, global rank 0 gets them (the others None). Every adapted HF
    module is named in ``target_modules`` (so exclusions carry over)."""
    stages = [None] * mpu.get_pipeline_model_parallel_world_size()
    dist.all_gather_object(stages, (peft_state_dict(model), sorted(adapters(model))),
                           group=mpu.get_pipeline_model_parallel_group())
    if dist.get_rank() != 0:
        return None
    tensors = {k: v.contiguous() for stage, _ in stages for k, v in stage.items()}
    names = [n for _, stage_names in stages for n in stage_names]
    experts = [n for n in names if ".mlp.experts." in n]
    prefix, suffix = PEFT_PREFIX, ".lora_A.weight"
    modules = sorted(k[len(prefix):-len(suffix)] for k in tensors
                     if k.endswith(suffix) and ".mlp.experts" not in k)
    # PEFT's expert adapters: per 3-D parameter, nested in this order (gate_up innermost)
    parameters = [f"model.layers.{n.split('.')[1]}.mlp.experts.{HF_EXPERT_PARAMS[t]}"
                  for n in sorted(experts, key=lambda n: int(n.split(".")[1]))
                  for t in HF_EXPERT_PARAMS if n.endswith("mlp." + t)]
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": settings.rank,
              "lora_alpha": settings.alpha, "lora_dropout": settings.dropout, "bias": "none",
              "target_modules": modules, "base_model_name_or_path": base_model,
              "fan_in_fan_out": False, "use_rslora": False, "init_lora_weights": True}
    if parameters:
        config["target_parameters"] = parameters
    return config, tensors


def save_peft_adapter(model: ActorModel, settings: LoraSettings, out: str | Path,
                      base_model: str | None = None) -> Path | None:
    """Write :func:`peft_adapter` as a PEFT adapter directory (``adapter_config.json`` +
    ``adapter_model.safetensors``) that ``peft.PeftModel.from_pretrained`` loads on the HF
    model; collective, global rank 0 writes and gets the directory (the others None)."""
    from safetensors.torch import save_file

    adapter = peft_adapter(model, settings, base_model)
    if adapter is None:
        return None
    config, tensors = adapter
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
