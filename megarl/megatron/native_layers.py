"""megatron layers with the native spec's fast paths: RoPE, SwiGLU and MoE token permutation
without host synchronisation and with fewer kernels.

Each class subclasses the megatron layer it replaces in the spec and keeps its parameters,
submodules and checkpoint layout; its fast path covers the configurations megarl trains
(non-interleaved RoPE over the whole head, SwiGLU without bias, dropless top-k routing) and
anything else goes through the megatron code unchanged:

- :class:`NativeSelfAttention` applies RoPE with :func:`~megarl.megatron.native_ops.rotary` from
  per-micro-batch tables (megatron's unfused THD RoPE calls ``.tolist()`` twice per layer);
  under context parallelism the tables follow the CP rank's chunks of each sequence;
- :class:`NativeMLP` / :class:`NativeGroupedMLP` run SwiGLU through
  :func:`~megarl.megatron.native_ops.swiglu` (the grouped one feeds ``torch._grouped_mm`` with
  per-expert token counts that stay on the device);
- :class:`NativeMoELayer` permutes tokens with :class:`LocalTokenDispatcher` when all experts of
  the layer are on this rank (expert parallel and expert tensor parallel sizes 1).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.moe.experts import TEGroupedMLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.transformer_config import TransformerConfig

from megarl.megatron.context_parallel import sequence_positions
from megarl.megatron.native_ops import RotaryTables, rotary, swiglu

_ROTARY_TABLES = RotaryTables()


def clear_rotary_tables() -> None:
    """Forget the cached RoPE tables (around a CUDA graph capture: a table cached by an eager
    forward would be read by the graph instead of recomputed from its static offsets)."""
    _ROTARY_TABLES.clear()


def _plain_swiglu(config: TransformerConfig) -> bool:
    """Whether the MLP activation is exactly ``silu(gate) * up`` in megatron's torch path."""
    return (
        config.gated_linear_unit
        and config.activation_func is F.silu
        and not config.bias_activation_fusion
        and not getattr(config, "use_te_activation_func", False)
        and getattr(config, "activation_func_clamp_value", None) is None
        and not getattr(config, "glu_linear_offset", 0.0)
    )


class NativeSelfAttention(SelfAttention):
    """megatron's SelfAttention with RoPE applied by :func:`native_ops.rotary` (training and
    scoring forwards; inference contexts use megatron's path)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        cfg = self.config
        self._fast_rope = (
            not cfg.rotary_interleaved
            and not cfg.multi_latent_attention
            and not cfg.apply_rope_fusion
            and not hasattr(cfg, "yarn_rotary_scaling_factor")
        )
        self._pending_rope: tuple[Any, Any] | None = None

    def _rope_disabled_here(self) -> bool:
        no_rope = getattr(self.config, "no_rope_freq", None)
        return bool(no_rope[self.layer_number - 1]) if no_rope else False

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any):
        """megatron's forward; RoPE moves into :meth:`get_query_key_value_tensors`."""
        rotary_pos_emb = kwargs.get("rotary_pos_emb")
        inference = kwargs.get("inference_context") or kwargs.get("inference_params")
        if (args or rotary_pos_emb is None or inference is not None or not self._fast_rope
                or self._rope_disabled_here()):
            return super().forward(hidden_states, *args, **kwargs)
        self._pending_rope = (rotary_pos_emb, kwargs.get("packed_seq_params"))
        try:
            return super().forward(hidden_states, **{**kwargs, "rotary_pos_emb": None})
        finally:
            self._pending_rope = None

    def get_query_key_value_tensors(self, *args: Any, **kwargs: Any):
        """megatron's q/k/v (after q/k layernorm), then RoPE on q and k when pending."""
        out = super().get_query_key_value_tensors(*args, **kwargs)
        if self._pending_rope is None:
            return out
        rotary_pos_emb, params = self._pending_rope
        freqs = rotary_pos_emb if isinstance(rotary_pos_emb, tuple) else (rotary_pos_emb,) * 2
        cu = None
        if params is not None and params.qkv_format == "thd":
            cu = params.cu_seqlens_q_padded
            if cu is None:
                cu = params.cu_seqlens_q
        query, key = out[:2]
        if freqs[0] is not freqs[1] or freqs[0].shape[-1] != query.shape[-1]:
            # separate or partial rotary frequencies: megatron's own function
            query, key = (apply_rotary_pos_emb(t, f, config=self.config, cu_seqlens=cu)
                          for t, f in zip((query, key), freqs))
        elif cu is not None and self.config.context_parallel_size > 1:
            # this CP rank's chunks: rotate by their positions inside each sequence
            positions = sequence_positions(cu, getattr(self.pg_collection, "cp", None))
            tables = _ROTARY_TABLES.get(freqs[0], query.dtype, query.shape[0],
                                        positions=positions)
            query, key = rotary(query, key, tables)
        else:
            tables = _ROTARY_TABLES.get(freqs[0], query.dtype, query.shape[0], cu)
            query, key = rotary(query, key, tables)
        return (query, key, *out[2:])


class NativeMLP(MLP):
    """megatron's dense MLP with SwiGLU through :func:`native_ops.swiglu`."""

    def forward(self, hidden_states: torch.Tensor, per_token_scale: torch.Tensor | None = None,
                **kwargs: Any):
        """fc1 -> SwiGLU (optionally scaled per token) -> fc2; returns (output, bias)."""
        if not _plain_swiglu(self.config):
            return super().forward(hidden_states, per_token_scale, **kwargs)
        intermediate, bias = self.linear_fc1(hidden_states)
        if bias is not None:
            intermediate = intermediate + bias
        scale = None if per_token_scale is None else per_token_scale.unsqueeze(-1)
        output, output_bias = self.linear_fc2(swiglu(intermediate, scale))
        if per_token_scale is not None and output_bias is not None:
            output = output + output_bias.unsqueeze(0) * per_token_scale.unsqueeze(-1)
            output_bias = None
        return output, output_bias


class NativeGroupedMLP(TEGroupedMLP):
    """The routed experts: grouped GEMMs around a probability-weighted SwiGLU; the per-expert
    token counts may stay on the device (from :class:`LocalTokenDispatcher`)."""

    def _fast_path(self) -> bool:
        cfg = self.config
        return (
            _plain_swiglu(cfg)
            and not (cfg.fp8 or getattr(cfg, "fp4", None))
            and not cfg.add_bias_linear
            and not cfg.moe_apply_probs_on_input
            and not getattr(self, "activation_recompute", False)
            and not getattr(self, "offload_expert_fc1", False)
            and not getattr(self, "offload_moe_act", False)
            and not getattr(self, "_with_fused_impl", False)
        )

    def forward(self, permuted_local_hidden_states: torch.Tensor,
                tokens_per_expert: torch.Tensor, permuted_probs: torch.Tensor, **kwargs: Any):
        """fc1 -> SwiGLU * router probability -> fc2 per expert; returns (output, None)."""
        if kwargs or not self._fast_path():
            return super().forward(permuted_local_hidden_states, tokens_per_expert,
                                   permuted_probs, **kwargs)
        fc1, _ = self.linear_fc1(permuted_local_hidden_states, tokens_per_expert)
        hidden = swiglu(fc1, permuted_probs.unsqueeze(-1))
        output, _ = self.linear_fc2(hidden, tokens_per_expert)
        return output, None


def _gather_sum(rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``out[t] = sum_j rows[positions[t, j]]`` for ``positions [N, k]``: a gather and a sum
    over ``k`` (accumulated in fp32 for bf16 rows), no atomic adds."""
    tokens, top_k = positions.shape
    return rows.index_select(0, positions.reshape(-1)).view(tokens, top_k, -1).sum(1)


class _Permute(torch.autograd.Function):
    """``x[token_index]``; the backward sums each token's ``k`` row gradients by gathering them
    at ``positions`` (autograd's ``index_select`` backward scatters them with atomic adds, which
    took ~2.3 ms a call on the e2e MoE slice's 131k x 2048 rows on an H100)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, token_index: torch.Tensor,
                positions: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(positions)
        return x.index_select(0, token_index)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (positions,) = ctx.saved_tensors
        return _gather_sum(grad, positions), None, None


class _Unpermute(torch.autograd.Function):
    """Each token's ``k`` expert outputs summed back into token order (:func:`_gather_sum`);
    the backward hands each row its token's gradient (a gather)."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, token_index: torch.Tensor,
                positions: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(token_index)
        return _gather_sum(rows, positions)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (token_index,) = ctx.saved_tensors
        return grad.index_select(0, token_index), None, None


class LocalTokenDispatcher:
    """MoE token permutation when every expert of the layer is on this rank: tokens are sorted
    by expert (expert-major, token order within an expert, as megatron's ``permute``) with a
    stable sort on the device, and the per-expert counts stay on the device. Both directions
    are gathers (:class:`_Permute`, :class:`_Unpermute`): each token's ``k`` rows are found by
    a second stable sort, by token.

    Dropless top-k routing is assumed: every token goes to exactly ``top_k`` experts.
    """

    def __init__(self, top_k: int) -> None:
        self.top_k = top_k
        self._shape: torch.Size | None = None
        self._routing_map: torch.Tensor | None = None
        self._token_index: torch.Tensor | None = None
        self._positions: torch.Tensor | None = None

    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor,
                            probs: torch.Tensor):
        """Flatten tokens to ``[N, H]`` and keep the routing map."""
        self._shape = hidden_states.shape
        self._routing_map = routing_map
        return hidden_states.view(-1, hidden_states.shape[-1]), probs

    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """No communication: the experts are local."""
        return hidden_states, probs

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """Rows sorted by expert, per-expert counts (device tensor) and the rows' probs."""
        routing_map, self._routing_map = self._routing_map, None
        tokens = routing_map.shape[0]
        by_expert = routing_map.T.reshape(-1).to(torch.uint8)
        order = torch.argsort(by_expert, descending=True, stable=True)[: tokens * self.top_k]
        self._token_index = order % tokens
        # row j of token t in the permuted order: [tokens, top_k]
        self._positions = torch.argsort(self._token_index, stable=True).view(tokens, self.top_k)
        permuted = _Permute.apply(hidden_states, self._token_index, self._positions)
        permuted_probs = probs.T.reshape(-1).index_select(0, order)
        return permuted, routing_map.sum(dim=0), permuted_probs

    def get_expert_zero_copy_buffers(self) -> tuple[None, None]:
        """No communication buffers for the experts to write into (megatron-core >= 0.19)."""
        return None, None

    def combine_preprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Sum each token's expert outputs back into token order."""
        index, positions = self._token_index, self._positions
        self._token_index = self._positions = None
        return _Unpermute.apply(hidden_states, index, positions)

    def token_combine(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """No communication: the experts are local."""
        return hidden_states

    def combine_postprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Restore the input's shape."""
        return hidden_states.view(self._shape)


class NativeMoELayer(MoELayer):
    """megatron's MoE layer (its router, shared experts and checkpoint layout); when all experts
    are local and routing is dropless, tokens are permuted by :class:`LocalTokenDispatcher`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        cfg = self.config
        dispatcher = self.token_dispatcher
        local = (
            getattr(dispatcher, "ep_size", 0) == 1
            and getattr(dispatcher, "tp_size", 0) == 1
            and cfg.moe_expert_capacity_factor is None
            and not cfg.moe_pad_expert_input_to_capacity
            and not getattr(cfg, "moe_router_padding_for_fp8", False)
            and not getattr(cfg, "moe_router_padding_for_quantization", False)
            and not getattr(cfg, "moe_latent_size", None)
            and not getattr(self, "shared_expert_overlap", False)
        )
        self._megatron_dispatcher = dispatcher
        self._local_dispatcher = LocalTokenDispatcher(cfg.moe_router_topk) if local else None

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any):
        """megatron's MoE forward with the local dispatcher when it applies."""
        padding_mask = kwargs.get("padding_mask", args[1] if len(args) > 1 else None)
        use_local = self._local_dispatcher is not None and padding_mask is None
        self.token_dispatcher = self._local_dispatcher if use_local else self._megatron_dispatcher
        return super().forward(hidden_states, *args, **kwargs)
