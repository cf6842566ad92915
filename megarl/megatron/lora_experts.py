"""LoRA adapters on the routed experts (``experts.linear_fc1``, ``experts.linear_fc2``): one
adapter per expert, in the layout PEFT gives HF's fused expert tensors.

HF keeps an MoE layer's experts as two 3-D parameters (``mlp.experts.gate_up_proj``
``[E, 2I, H]``, ``mlp.experts.down_proj`` ``[E, H, I]``) and PEFT adapts them through
``target_parameters``: expert ``e`` gets ``A_e`` ``[r, in]`` and ``B_e`` ``[out, r]``, one A for
gate and up together. :class:`ExpertLoraAdapter` holds the same matrices for the experts of this
rank, on the grouped linear layer of megatron's native spec
(:mod:`megarl.megatron.native_modules`), and adds ``scale * B_e A_e x`` to each expert's rows
through the same grouped GEMM as the base.

Sharding follows the base layer: the token dispatcher gives every expert-TP (ETP) rank the same
rows and sums the ranks' outputs (fc2) and input gradients, so

- fc1 (output split over ETP): ``A_e`` is whole on every ETP rank, B keeps this rank's gate rows
  and up rows (two tensors: they reshard over any ETP size in checkpoints);
- fc2 (input split over ETP): ``A_e`` keeps this rank's input columns, ``B_e`` is whole;

and the whole (ETP-replicated) matrix sees only this rank's partial gradient, so its gradient is
summed over ETP inside autograd. All adapters are expert parameters (``allreduce=False``):
megatron's DDP reduces them over the expert-data-parallel group, as the experts' weights.
"""

from __future__ import annotations

import math
import zlib
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
from megatron.core.transformer.utils import (
    ensure_metadata_has_dp_cp_group,
    make_sharded_tensors_for_checkpoint,
)

from megarl.megatron.native_modules import grouped_linear
from megarl.megatron.settings import LoraSettings
from megarl.weights.expert_adapters import unfuse

# HF's expert parameters, in the order PEFT nests their adapters (the first is innermost).
HF_EXPERT_PARAMS = {"experts.linear_fc1": "gate_up_proj", "experts.linear_fc2": "down_proj"}


class ExpertLoraAdapter(torch.nn.Module):
    """The adapters of one grouped expert linear layer: ``lora_A[k]`` (``[r, in]``, this ETP
    rank's input columns for fc2) and ``lora_B[p][k]`` (part ``p``'s ``[out_p, r]``, this ETP
    rank's rows of gate and of up for fc1) of local expert ``k``."""

    def __init__(self, base: torch.nn.Module, name: str, kind: str, parts: tuple[str, ...],
                 settings: LoraSettings) -> None:
        super().__init__()
        self.name, self.kind, self.parts = name, kind, parts
        self.rank, self.scale = settings.rank, settings.scale
        if settings.dropout:
            raise ValueError(f"{name}: LoRA dropout on the routed experts is not built (PEFT's "
                             "expert adapters have none either); set actor.lora.dropout=0")
        self.ep_group, self.etp_group, self.edp_group = base._expert_groups()
        self.etp, self.etp_rank = self.etp_group.size(), self.etp_group.rank()
        self.num_local = base.num_gemms
        self.first_expert = self.ep_group.rank() * self.num_local
        out_local, in_local = base.weight0.shape
        self.in_features = in_local * (self.etp if kind == "row" else 1)
        kw = {"dtype": base.weight0.dtype, "device": base.weight0.device}
        a_in = in_local if kind == "row" else self.in_features
        self.lora_A = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.empty(self.rank, a_in, **kw))
             for _ in range(self.num_local)])
        part_out = out_local // len(parts)
        self.lora_B = torch.nn.ModuleList([torch.nn.ParameterList(
            [torch.nn.Parameter(torch.zeros(part_out, self.rank, **kw))
             for _ in range(self.num_local)]) for _ in parts])
        with torch.no_grad():
            for k, a in enumerate(self.lora_A):  # seeded by the global expert: any EP agrees
                whole = torch.empty(self.rank, self.in_features, dtype=torch.float32)
                seed = settings.seed + zlib.crc32(f"{name}.{self.first_expert + k}".encode())
                torch.nn.init.kaiming_uniform_(whole, a=math.sqrt(5),
                                               generator=torch.Generator().manual_seed(seed))
                a.copy_(self._shard_a(whole))
        sharded = ([b for part in self.lora_B for b in part] if kind == "column"
                   else list(self.lora_A))
        for param in self.parameters():
            param.allreduce = False  # expert parameters: reduced over expert-data-parallel
            is_sharded = any(param is s for s in sharded)
            # every rank counts what it holds in the grad norm, as with the experts' weights,
            # but a matrix repeated on the ETP ranks counts once (ETP = TP is checked upstream)
            set_tensor_model_parallel_attributes(
                param, is_parallel=is_sharded or self.etp == 1,
                dim=(0 if kind == "column" else 1) if is_sharded else 0, stride=1)

    def _shard_a(self, whole: torch.Tensor) -> torch.Tensor:
        return whole.chunk(self.etp, dim=1)[self.etp_rank] if self.kind == "row" else whole

    def _local_b(self, k: int) -> torch.Tensor:
        """Expert ``k``'s B in the base weight's local row layout (gate rows, then up rows)."""
        return torch.cat([part[k] for part in self.lora_B]) if len(self.parts) > 1 \
            else self.lora_B[0][k]

    def forward(self, x: torch.Tensor, m_splits: Any) -> torch.Tensor:
        """The adapters' contribution to the rows ``x`` (``m_splits`` rows per local expert)."""
        a = torch.stack(list(self.lora_A))
        b = torch.stack([self._local_b(k) for k in range(self.num_local)])
        if self.etp > 1:  # the ETP-replicated matrix: its partial gradients summed over ETP
            if self.kind == "column":
                a = copy_to_tensor_model_parallel_region(a, group=self.etp_group)
            else:
                b = copy_to_tensor_model_parallel_region(b, group=self.etp_group)
        z = grouped_linear(x, a, m_splits)
        return grouped_linear(z, b, m_splits) * self.scale

    @torch.no_grad()
    def delta_for(self, leaf: str) -> torch.Tensor | None:
        """``scale * B_k @ A_k`` (fp32, this rank's shard) for the base's ``weight{k}``."""
        if not leaf.startswith("weight") or not leaf[len("weight"):].isdigit():
            return None
        k = int(leaf[len("weight"):])
        return self.scale * (self._local_b(k).float() @ self.lora_A[k].float())

    @torch.no_grad()
    def whole_parts(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``[(A, B)]`` of every expert of the layer in PEFT's fused layout (``A`` ``[E * r,
        in]``, row ``e * r + j``; ``B`` ``[out, r * E]``, column ``j * E + e``), gathered over
        ETP and EP (collective over both groups)."""
        a = torch.stack([gather_shards(p.detach(), 1, self.etp_group) if self.kind == "row"
                         else p.detach().clone() for p in self.lora_A])
        if self.kind == "column":
            b = torch.stack([torch.cat([gather_shards(part[k].detach(), 0, self.etp_group)
                                        for part in self.lora_B])
                             for k in range(self.num_local)])
        else:
            b = torch.stack([self.lora_B[0][k].detach().clone() for k in range(self.num_local)])
        # every expert of the layer: [E, r, in], [E, out, r]
        a, b = gather_shards(a, 0, self.ep_group), gather_shards(b, 0, self.ep_group)
        experts = a.shape[0]
        return [(a.reshape(experts * self.rank, -1), b.permute(1, 2, 0).reshape(b.shape[1], -1))]

    @torch.no_grad()
    def load_whole_parts(self, parts: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Set this rank's experts from :meth:`whole_parts`' layout."""
        (a_fused, b_fused), = parts
        a, b = unfuse(a_fused, b_fused, self.rank)
        for k in range(self.num_local):
            e = self.first_expert + k
            self.lora_A[k].copy_(self._shard_a(a[e]))
            rows = b[e].chunk(len(self.parts))  # gate rows, up rows (fc1); all rows (fc2)
            for part, whole in zip(self.lora_B, rows):
                part[k].copy_(whole.chunk(self.etp)[self.etp_rank] if self.kind == "column"
                              else whole)

    def sharded_state_dict(self, prefix: str, sharded_offsets: tuple, metadata: dict | None
                           ) -> dict[str, Any]:
        """The adapters as shards of ``[experts, ...]`` tensors (global expert axis, ETP axis of
        the split matrices), replicated over expert-DP, as the base layer's ``weight{k}``."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        num_global = self.ep_group.size() * self.num_local
        expert_axis = len(sharded_offsets)
        out: dict[str, Any] = {}
        for k in range(self.num_local):
            tensors = {"lora.lora_A": self.lora_A[k],
                       **{f"lora.lora_B.{p}": part[k] for p, part in enumerate(self.lora_B)}}
            axes = ({"lora.lora_A": 1} if self.kind == "row" else
                    {f"lora.lora_B.{p}": 0 for p in range(len(self.parts))})
            offsets = (*sharded_offsets, (expert_axis, self.first_expert + k, num_global))
            shards = make_sharded_tensors_for_checkpoint(
                tensors, prefix, axes, offsets, tp_group=self.etp_group,
                dp_cp_group=metadata["dp_cp_group"])
            for key in tensors:
                sharded = shards[f"{prefix}{key}"]
                sharded.replica_id = (*sharded.replica_id[:2], self.edp_group.rank())
                out[f"{prefix}{key}.{k}"] = sharded
        return out


def gather_shards(shard: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """The shards of ``group``'s ranks concatenated along ``dim`` (a copy; collective)."""
    if group.size() == 1:
        return shard.clone()
    pieces = [torch.empty_like(shard) for _ in range(group.size())]
    dist.all_gather(pieces, shard.contiguous(), group=group)
    return torch.cat(pieces, dim=dim)


def add_expert_adapter_output(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any):
    """Forward hook of an adapted grouped expert layer: its output plus the adapters'."""
    x = args[0] if args else kwargs["x"]
    m_splits = args[1] if len(args) > 1 else kwargs["m_splits"]
    out, bias = output
    return out + module.lora(x, m_splits), bias


def sharded_state_dict_with_expert_adapter(module: torch.nn.Module, base: Any, prefix: str = "",
                                           sharded_offsets: tuple = (),
                                           metadata: dict | None = None) -> dict[str, Any]:
    """The grouped layer's checkpoint shards and its adapters'."""
    out = base(prefix, sharded_offsets, metadata)
    out.update(module.lora.sharded_state_dict(prefix, sharded_offsets, metadata))
    return out


def peft_expert_key(layer_names: list[str], name: str) -> str:
    """The PEFT module key (under ``model.layers.{i}.``) of expert adapter ``name`` when the
    adapted expert layers of its layer are ``layer_names``: PEFT nests one wrapper per adapted
    parameter in :data:`HF_EXPERT_PARAMS` order, the first innermost (``experts.base_layer``)."""
    path = name.split(".", 2)[2].removeprefix("mlp.")
    order = [t for t in HF_EXPERT_PARAMS
             if any(n.endswith("mlp." + t) for n in layer_names)]
    depth = len(order) - 1 - order.index(path)
    return "mlp.experts" + ".base_layer" * depth
