"""Torch-native modules with TransformerEngine's parameter names, for running without TE.

Each module here takes the slot of a TE module in the megatron layer spec and keeps its state
dict keys and tensor layout, so that mbridge's HF name mappings and megatron checkpoints are the
same with or without TE:

| TE module                          | here                         | parameters                      |
|------------------------------------|------------------------------|---------------------------------|
| ``TENorm`` (RMSNorm / LayerNorm)   | :class:`NativeNorm`          | ``weight`` (``bias``)           |
| ``TELayerNormColumnParallelLinear``| :class:`NormColumnParallelLinear` | ``weight``, ``bias``, ``layer_norm_weight`` (``layer_norm_bias``) |
| ``TEDotProductAttention``          | :class:`SDPAttention`        | none                            |
| ``TEColumnParallelGroupedLinear``  | :class:`ColumnGroupedLinear` | ``weight{k}`` (``bias{k}``)     |
| ``TERowParallelGroupedLinear``     | :class:`RowGroupedLinear`    | ``weight{k}`` (``bias{k}``)     |

Norm parameters carry ``sequence_parallel`` like TE's, so megatron all-reduces their gradients
over the TP group under sequence parallelism. The grouped linears' ``sharded_state_dict`` lays
the local experts into global expert tensors like TE's, so dist-checkpoints reshard over EP/ETP.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as mpu
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    get_cuda_rng_tracker,
    set_tensor_model_parallel_attributes,
)
from megatron.core.tensor_parallel.random import get_expert_parallel_rng_tracker_name
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import (
    ensure_metadata_has_dp_cp_group,
    make_sharded_tensors_for_checkpoint,
)
from megatron.core.utils import divide

from megarl.megatron.context_parallel import context_parallel_attention
from megarl.megatron.native_ops import flash_varlen_attention, flash_varlen_supported, rms_norm
from megarl.megatron.wgrad_fusion import add_expert_grads, stacked_view


def param_device(config: TransformerConfig) -> torch.device | str:
    """Where megatron would allocate this config's parameters."""
    return "cpu" if config.use_cpu_initialization else torch.cuda.current_device()


def _norm_params(
    module: torch.nn.Module, config: TransformerConfig, hidden_size: int, prefix: str
) -> None:
    """Register ``{prefix}weight`` (and ``{prefix}bias`` for LayerNorm) on ``module``."""
    if config.normalization not in ("RMSNorm", "LayerNorm"):
        raise ValueError(
            f"normalization={config.normalization!r} is not supported by the native spec; "
            "use RMSNorm or LayerNorm"
        )
    kw = {"dtype": config.params_dtype, "device": param_device(config)}
    init = torch.zeros if config.layernorm_zero_centered_gamma else torch.ones
    weight = torch.nn.Parameter(init(hidden_size, **kw))
    weight.sequence_parallel = config.sequence_parallel
    module.register_parameter(f"{prefix}weight", weight)
    if config.normalization == "LayerNorm":
        bias = torch.nn.Parameter(torch.zeros(hidden_size, **kw))
        bias.sequence_parallel = config.sequence_parallel
        module.register_parameter(f"{prefix}bias", bias)
    else:
        module.register_parameter(f"{prefix}bias", None)


def _normalize(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    config: TransformerConfig,
) -> torch.Tensor:
    """RMSNorm (fused on CUDA; on the CPU computed in fp32 and scaled in the input dtype, as HF
    does), or LayerNorm."""
    gamma = weight + 1 if config.layernorm_zero_centered_gamma else weight
    if config.normalization == "LayerNorm":
        return F.layer_norm(x, (x.shape[-1],), gamma, bias, eps)
    return rms_norm(x, gamma, eps)


class NativeNorm(MegatronModule):
    """RMSNorm or LayerNorm (per ``config.normalization``) with TENorm's parameter names."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__(config=config)
        self.eps = eps
        _norm_params(self, config, hidden_size, prefix="")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise over the last dimension."""
        return _normalize(x, self.weight, self.bias, self.eps, self.config)


class NormColumnParallelLinear(ColumnParallelLinear):
    """A norm fused in front of a column-parallel linear, laid out like TE's module.

    With sequence parallelism the norm runs on this rank's sequence shard and the linear
    all-gathers the normalised activations, as TE does.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config: TransformerConfig,
        init_method: Callable,
        gather_output: bool = False,
        bias: bool = True,
        skip_bias_add: bool = False,
        is_expert: bool = False,
        stride: int = 1,
        skip_weight_param_allocation: bool = False,
        tp_comm_buffer_name: str | None = None,
        tp_group: torch.distributed.ProcessGroup | None = None,
        name: str | None = None,
    ) -> None:
        # megatron-core >= 0.19 names every module (``name``); older versions take no name
        named = {} if name is None else {"name": name}
        super().__init__(
            input_size,
            output_size,
            config=config,
            init_method=init_method,
            bias=bias,
            gather_output=gather_output,
            stride=stride,
            skip_bias_add=skip_bias_add,
            skip_weight_param_allocation=skip_weight_param_allocation,
            is_expert=is_expert,
            tp_comm_buffer_name=tp_comm_buffer_name,
            tp_group=tp_group,
            **named,
        )
        self.eps = config.layernorm_epsilon
        _norm_params(self, config, input_size, prefix="layer_norm_")

    def normalize(self, input_: torch.Tensor) -> torch.Tensor:
        """The fused norm alone (what the linear sees)."""
        return _normalize(input_, self.layer_norm_weight, self.layer_norm_bias, self.eps,
                          self.config)

    def forward(self, input_: torch.Tensor, *args: Any, **kwargs: Any):
        """Normalise, then apply the column-parallel linear; returns (output, bias)."""
        return super().forward(self.normalize(input_), *args, **kwargs)


class SDPAttention(MegatronModule):
    """Core attention through ``torch.nn.functional.scaled_dot_product_attention``.

    Inputs are megatron's: ``[s, b, heads, dim]`` (sbhd) or ``[t, heads, dim]`` with
    ``packed_seq_params`` (thd, one causal segment per ``cu_seqlens`` entry). Grouped-query
    attention is native to SDPA. Under context parallelism (thd only) the keys and values come
    from every CP rank (:func:`~megarl.megatron.context_parallel.context_parallel_attention`:
    one FlashAttention varlen call per layer on CUDA, else SDPA with a mask per sequence).
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str = "self",
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
    ) -> None:
        super().__init__(config=config)
        self.cp_group = getattr(pg_collection, "cp", None)
        self.attn_mask_type = attn_mask_type
        self.softmax_scale = softmax_scale
        self.dropout_p = (
            config.attention_dropout if attention_dropout is None else attention_dropout
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        """Attention output, ``[s, b, heads*dim]`` (sbhd) or ``[t, heads, dim]`` (thd)."""
        if attention_bias is not None:
            raise ValueError("SDPAttention: attention_bias is not supported")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        causal = mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal)
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            return self._forward_thd(query, key, value, packed_seq_params, causal)
        if self.config.context_parallel_size > 1:
            raise ValueError("SDPAttention: context parallelism needs packed (thd) batches")
        # [s, b, h, d] -> [b, h, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        mask = None
        if attention_mask is not None:
            # megatron's masks are True where attention is NOT allowed; SDPA's the opposite
            mask = ~attention_mask
            if causal:
                sq, sk = q.shape[2], k.shape[2]
                mask = mask & torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
        out = self._sdpa(q, k, v, mask, causal and mask is None)
        s, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)

    def _forward_thd(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        params: PackedSeqParams,
        causal: bool,
    ) -> torch.Tensor:
        """Attention inside each packed sequence. With megarl's padded offsets (which end at the
        last token) it runs without host synchronisation: one SDPA call for a single sequence, one
        FlashAttention varlen call for several on CUDA; otherwise one SDPA call per sequence."""
        cu = params.cu_seqlens_q_padded
        dropout = self.dropout_p if self.training else 0.0
        if self.config.context_parallel_size > 1:
            if cu is None or not causal:
                raise ValueError(
                    "SDPAttention: context parallelism needs causal attention over packed "
                    "sequences with cu_seqlens_q_padded (megarl's packed micro-batches)"
                )
            return context_parallel_attention(
                query, key, value, cu, scale=self.softmax_scale, dropout_p=dropout,
                group=self.cp_group,
            )
        if cu is not None and causal:
            if cu.numel() == 2:
                # [t, h, d] -> [1, h, t, d]
                q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (query, key, value))
                return self._sdpa(q, k, v, None, True)[0].transpose(0, 1)
            if flash_varlen_supported(query, dropout):
                max_len = params.max_seqlen_q
                if max_len is None:
                    max_len = int((cu[1:] - cu[:-1]).max())
                return flash_varlen_attention(query, key, value, cu, max_len, self.softmax_scale)
        if cu is None:
            cu = params.cu_seqlens_q
        bounds = cu.tolist()
        outs = []
        for start, end in itertools.pairwise(bounds):
            # [t, h, d] -> [1, h, t, d]
            q, k, v = (t[start:end].transpose(0, 1).unsqueeze(0) for t in (query, key, value))
            outs.append(self._sdpa(q, k, v, None, causal)[0].transpose(0, 1))
        tail = query.shape[0] - bounds[-1]
        if tail > 0:
            outs.append(query.new_zeros(tail, query.shape[1], value.shape[-1]))
        return torch.cat(outs, dim=0)

    def _sdpa(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        causal: bool,
    ) -> torch.Tensor:
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=self.dropout_p if self.training else 0.0,
            is_causal=causal,
            scale=self.softmax_scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )


def _grouped_mm_supported(x: torch.Tensor, weight_t: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` runs for these operands (dtype, device, 16-byte strides)."""
    if not hasattr(torch, "_grouped_mm") or x.shape[0] == 0:
        return False
    if x.is_cuda:
        if x.dtype != torch.bfloat16 or torch.cuda.get_device_capability(x.device)[0] < 9:
            return False
    elif x.dtype not in (torch.float32, torch.bfloat16):
        return False
    itemsize = x.element_size()
    return all((n * itemsize) % 16 == 0 for n in (x.shape[1], weight_t.shape[-1]))


def grouped_linear(
    x: torch.Tensor, weights: Sequence[torch.Tensor] | torch.Tensor,
    m_splits: Sequence[int] | torch.Tensor, fuse_wgrad: bool = False
) -> torch.Tensor:
    """``cat([x_k @ W_k^T])`` for row blocks ``x_k`` of sizes ``m_splits`` (``weights``: a list,
    or stacked ``[E, out, in]``); one grouped GEMM when ``torch._grouped_mm`` supports the
    operands, a loop of ``F.linear`` otherwise. ``m_splits`` may be a tensor on ``x``'s device:
    the grouped GEMM then runs without host synchronisation. ``fuse_wgrad`` (a list of weights
    under megatron's DDP): the backward adds the weight gradients into their ``main_grad``
    (:func:`~megarl.megatron.wgrad_fusion.add_expert_grads`)."""
    first = weights if isinstance(weights, torch.Tensor) else weights[0]
    if _grouped_mm_supported(x, first.transpose(-2, -1)):
        sizes = torch.as_tensor(m_splits, device=x.device)
        offs = sizes.cumsum(0).to(torch.int32)
        if not isinstance(weights, torch.Tensor):
            return _GroupedMM.apply(x, offs, fuse_wgrad, *weights)
        out = torch._grouped_mm(x, weights.transpose(1, 2), offs=offs)
        if out.requires_grad:
            # the grouped GEMM backward needs a dense gradient (e.g. not one from expand())
            out.register_hook(lambda grad: grad.contiguous())
        return out
    if isinstance(m_splits, torch.Tensor):
        m_splits = m_splits.tolist()
    chunks = x.split(list(m_splits))
    return torch.cat([F.linear(c, w) for c, w in zip(chunks, weights)], dim=0)


def _stacked(weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """The experts' weights as ``[E, out, in]``: a view where they lie back to back in expert
    order (megatron DDP's parameter buffer), else a stacked copy."""
    view = stacked_view(weights)
    return view[0] if view is not None and not view[1] else torch.stack(weights)


_EMPTY_GROUPS_ZEROED: dict[str, bool] = {}


def _empty_groups_zeroed(device: torch.device, may_check: bool = True) -> bool:
    """Whether the weight-gradient grouped GEMM (groups along the rows it sums over) writes
    zeros for a group of no rows on ``device``: on the CPU it multiplies group by group; Hopper's
    kernel does, and torch issue #172439 reports Blackwell's leaving garbage. Checked once per
    device type on an output block the allocator held NaNs in just before; unknown (False)
    where not checked yet and ``may_check`` is false."""
    key = "cpu" if device.type == "cpu" else torch.cuda.get_device_name(device)
    if key not in _EMPTY_GROUPS_ZEROED:
        if not may_check:
            return False
        g = torch.Generator(device=device).manual_seed(0)
        x, grad = (torch.randn(48, n, device=device, generator=g).to(torch.bfloat16)
                   for n in (64, 32))
        offs = torch.tensor([16, 16, 48, 48], device=device, dtype=torch.int32)
        ok = True
        for fill in (float("nan"), 1.0):
            torch.full((4, 32, 64), fill, device=device, dtype=torch.bfloat16)  # freed at once
            out = torch._grouped_mm(grad.t(), x, offs=offs)
            ok = ok and bool((out[1] == 0).all()) and bool((out[3] == 0).all())
        _EMPTY_GROUPS_ZEROED[key] = ok
    return _EMPTY_GROUPS_ZEROED[key]


def _zero_unused(per_expert: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``per_expert`` with zeros for every expert no row chose (a pass over it only on devices
    whose kernel may leave garbage there, :func:`_empty_groups_zeroed`; inside a CUDA graph
    capture, which the check's host read would break, unless checked before)."""
    capturing = per_expert.is_cuda and torch.cuda.is_current_stream_capturing()
    if _empty_groups_zeroed(per_expert.device, may_check=not capturing):
        return per_expert
    unused = torch.diff(offs, prepend=offs.new_zeros(1)) == 0
    return per_expert.masked_fill_(unused[:, None, None], 0)


def _in_backward() -> bool:
    """Whether autograd is running a backward pass on this thread right now (as when a
    reentrant activation checkpoint recomputes its forward)."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


class _GroupedMM(torch.autograd.Function):
    """``torch._grouped_mm`` over the experts' own weight tensors as ``[E, out, in]``: a view
    where they lie back to back in expert order (:func:`_stacked`), else stacked only while a
    GEMM runs. Through autograd the stacked copy (every local expert's weights) was
    kept from each layer's forward to its backward: without recompute, a second copy of all the
    expert weights in the update (the GPU LoRA demo's update peak fell from 44.7 to 30.3 GB
    without it; benchmarks/RESULTS.md). Its backward stacks
    again, one layer at a time, and returns each expert's gradient as a view of one grouped
    GEMM's output, as torch's own backward of ``_grouped_mm`` computes them. A forward that a
    full recompute re-runs inside the backward keeps its stacked copy: this layer's backward
    follows at once, so the copy lives no longer and the second stack is saved. With
    ``fuse_wgrad`` the weight gradients go straight into DDP's ``main_grad`` buffers."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, offs: torch.Tensor, fuse_wgrad: bool,
                *weights: torch.Tensor) -> torch.Tensor:
        ctx.fuse_wgrad = fuse_wgrad
        stacked = _stacked(weights)
        keep = _in_backward()  # a recompute's forward (megatron's checkpoint is reentrant)
        # the parameters themselves (no copy), and the stacked copy only where it dies soon
        ctx.save_for_backward(x, offs, stacked if keep else None, *weights)
        return torch._grouped_mm(x, stacked.transpose(1, 2), offs=offs)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, offs, stacked, *weights = ctx.saved_tensors
        grad = grad.contiguous()  # the grouped GEMM needs a dense gradient (not an expand())
        grad_x = None
        if ctx.needs_input_grad[0]:  # [M, out] x [E, out, in] -> [M, in]
            if stacked is None:
                stacked = _stacked(weights)
            grad_x = torch._grouped_mm(grad, stacked, offs=offs)
        del stacked
        grad_weights: list[torch.Tensor | None] = [None] * len(weights)
        needs = ctx.needs_input_grad[3:]
        # (a graphed bucket's backward differentiates leaf copies: no main_grad there)
        if ctx.fuse_wgrad and all(needs) and all(hasattr(w, "main_grad") for w in weights):
            # g_e^T x_e in the weights' layout: [E, out, in]
            per_expert = _zero_unused(torch._grouped_mm(grad.t(), x, offs=offs), offs)
            add_expert_grads(weights, per_expert)
            # none for autograd: no per-expert AccumulateGrad copy and DDP hook (which, without
            # overlap_grad_reduce, only adds a gradient it is handed)
        elif any(needs):  # x_e^T g_e for each expert's rows: [E, in, out]
            per_expert = _zero_unused(torch._grouped_mm(x.t(), grad, offs=offs), offs)
            grad_weights = [g.t() if need else None
                            for g, need in zip(per_expert.unbind(0), needs)]
        return grad_x, None, None, *grad_weights


class _GroupedLinear(MegatronModule):
    """Local experts' linear layers as ``weight{k}`` tensors, with no communication (the MoE
    token dispatcher moves tokens across EP/ETP ranks, as with TE's grouped linear)."""

    parallel_mode: str = ""
    fuse_wgrad: bool = False
    """Add the weight gradients into DDP's ``main_grad`` in the backward (set by
    :func:`~megarl.megatron.wgrad_fusion.fuse_weight_gradients`)."""

    def __init__(
        self,
        num_gemms: int,
        input_size: int,
        output_size: int,
        *,
        config: TransformerConfig,
        init_method: Callable,
        bias: bool,
        skip_bias_add: bool,
        is_expert: bool = True,
        tp_comm_buffer_name: str | None = None,
        pg_collection: Any = None,
        name: str | None = None,
    ) -> None:
        super().__init__(config=config)
        if not is_expert:
            raise ValueError("grouped linear layers are for MoE experts only (is_expert=True)")
        etp = (
            pg_collection.expt_tp.size()
            if pg_collection is not None
            else mpu.get_expert_tensor_parallel_world_size()
        )
        if self.parallel_mode == "column":
            output_size = divide(output_size, etp)
        else:
            input_size = divide(input_size, etp)
        self.num_gemms = num_gemms
        self.skip_bias_add = skip_bias_add
        self.use_bias = bias
        self.pg_collection = pg_collection
        kw = {"dtype": config.params_dtype, "device": param_device(config)}
        weights = []
        for _ in range(num_gemms):
            weight = torch.nn.Parameter(torch.empty(output_size, input_size, **kw))
            if config.perform_initialization:
                with get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name()):
                    init_method(weight)
            weights.append(weight)
        # registered last expert first: megatron's DDP lays its parameter and gradient buffers
        # out in reverse registration order, so expert k's weight and main_grad sit at [k] of
        # one [E, out, in] view of each buffer (the grouped GEMMs need no stacked copy, the
        # fused weight gradients no reversed one)
        for k in reversed(range(num_gemms)):
            self.register_parameter(f"weight{k}", weights[k])
            if bias:
                self.register_parameter(
                    f"bias{k}", torch.nn.Parameter(torch.zeros(output_size, **kw))
                )
        for param in self.parameters():
            # always reduced over the expert-data-parallel group (the ranks holding the same
            # expert shard). TE uses `not expert_parallel`, which with EP = 1 and ETP < TP
            # reduces over the dense DP group only and drops the other TP ranks' tokens
            param.allreduce = False
        # as TE does: every rank counts its expert weights in the grad norm (the expert
        # optimizer treats the dense TP group as the duplicate group, which is wrong for ETP < TP)
        for k in range(num_gemms):
            set_tensor_model_parallel_attributes(
                getattr(self, f"weight{k}"),
                is_parallel=True,
                dim=0 if self.parallel_mode == "column" else 1,
                stride=1,
            )

    def _weights(self) -> list[torch.Tensor]:
        return [getattr(self, f"weight{k}") for k in range(self.num_gemms)]

    def _expert_groups(self) -> tuple[Any, Any, Any]:
        """(expert-parallel, expert-TP, expert-DP) groups of this layer."""
        pgs = self.pg_collection
        if pgs is not None:
            return pgs.ep, pgs.expt_tp, pgs.expt_dp
        return (
            mpu.get_expert_model_parallel_group(),
            mpu.get_expert_tensor_parallel_group(),
            mpu.get_expert_data_parallel_group(),
        )

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict[str, Any]:
        """``weight{k}`` (``bias{k}``) as shards of one global ``[experts, ...]`` tensor per name,
        keyed ``{prefix}weight`` like TE's grouped linear: an expert axis at the *global* expert
        index (EP rank * local experts + k), then the expert-TP axis, replicated over expert-DP.
        Checkpoints therefore reshard across EP/ETP and match the TE spec's expert tensors
        (TE's fp8 ``_extra_state`` objects aside)."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        ep_group, etp_group, edp_group = self._expert_groups()
        num_global = ep_group.size() * self.num_gemms
        first_global = ep_group.rank() * self.num_gemms
        column = self.parallel_mode == "column"
        axis_map = {"weight": 0, "bias": 0} if column else {"weight": 1}
        expert_axis = len(sharded_offsets)
        out: dict[str, Any] = {}
        for k in range(self.num_gemms):
            tensors = {"weight": getattr(self, f"weight{k}")}
            if self.use_bias:
                tensors["bias"] = getattr(self, f"bias{k}")
            offsets = (*sharded_offsets, (expert_axis, first_global + k, num_global))
            shards = make_sharded_tensors_for_checkpoint(
                tensors,
                prefix,
                axis_map,
                offsets,
                tp_group=etp_group,
                dp_cp_group=metadata["dp_cp_group"],
            )
            for name in tensors:
                sharded = shards[f"{prefix}{name}"]
                sharded.replica_id = (*sharded.replica_id[:2], edp_group.rank())
                out[f"{prefix}{name}{k}"] = sharded
        return out

    def _biases(self) -> list[torch.Tensor]:
        return [getattr(self, f"bias{k}") for k in range(self.num_gemms)]

    def forward(self, x: torch.Tensor, m_splits: Sequence[int] | torch.Tensor):
        """Apply expert ``k``'s weight to the ``k``-th block of rows (``m_splits``: a list, or a
        tensor on the device); returns (output, bias)."""
        out = grouped_linear(x, self._weights(), m_splits, self.fuse_wgrad)
        if not self.use_bias:
            return out, None
        if self.skip_bias_add:
            return out, self._biases()
        sizes = torch.as_tensor(m_splits, device=x.device)
        return out + torch.stack(self._biases()).repeat_interleave(sizes, dim=0), None


class ColumnGroupedLinear(_GroupedLinear):
    """Experts' fc1: output features split over the expert-TP group."""

    parallel_mode = "column"


class RowGroupedLinear(_GroupedLinear):
    """Experts' fc2: input features split over the expert-TP group."""

    parallel_mode = "row"
