"""megarl's native layer spec for decoders with multi-latent attention (DeepSeek-V3 style MLA),
used when TransformerEngine is absent.

It mirrors the MLA branch of ``get_gpt_layer_with_transformer_engine_spec`` slot for slot with
the torch-native modules of :mod:`megarl.megatron.native_modules`, so the parameter names are
TE's (and mbridge's DeepSeek-V3 mapping applies unchanged):

| slot                   | TE spec                              | here                          |
|------------------------|--------------------------------------|-------------------------------|
| ``input_layernorm``    | ``TENorm``                           | ``NativeNorm``                |
| ``linear_q_proj``      | ``TEColumnParallelLinear``           | ``ColumnParallelLinear``      |
| ``linear_q_down_proj`` | ``TELinear`` (replicated over TP)    | megatron's local ``Linear``   |
| ``linear_q_up_proj``   | ``TELayerNormColumnParallelLinear``  | ``NormColumnParallelLinear``  |
| ``linear_kv_down_proj``| ``TELinear`` (replicated over TP)    | megatron's local ``Linear``   |
| ``linear_kv_up_proj``  | ``TELayerNormColumnParallelLinear``  | ``NormColumnParallelLinear``  |
| ``core_attention``     | ``TEDotProductAttention``            | :class:`MLASDPAttention`      |
| ``linear_proj``        | ``TERowParallelLinear``              | ``RowParallelLinear``         |

The down projections are replicated over TP as with TE: megatron's local spec splits them
(``ColumnParallelLinear``), and then ``MLASelfAttention``'s backward keeps only this rank's
heads' share of the gradient of the shared RoPE key (its column slice of the gathered output),
so the gradients of ``linear_kv_down_proj`` and of the layer input are wrong for TP > 1. The
replicated ``Linear`` (``megatron.core.post_training.modelopt.layers``, one of the classes
``MLASelfAttention`` accepts there) runs on this rank's sequence shard; the RoPE key is
all-gathered over the sequence (its gradient reduce-scattered, summing every rank's heads)
and the weights' gradients are summed over TP as sequence-parallel parameters. Tensor parallel
therefore needs sequence parallelism (megatron requires it for MoE anyway). Everything but the
attention (norm-fused dense MLP, or router, grouped-GEMM experts and shared experts behind
``pre_mlp_layernorm``) is taken from :func:`~megarl.megatron.native_spec.native_layer_spec`.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from megatron.core.post_training.modelopt.layers import Linear
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.multi_latent_attention import (
    MLASelfAttention,
    MLASelfAttentionSubmodules,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import (
    get_transformer_layer_offset,
)

from megarl.megatron.native_modules import (
    NativeNorm,
    NormColumnParallelLinear,
    SDPAttention,
)
from megarl.megatron.native_spec import (
    has_transformer_engine,
    moe_layer_pattern,
    native_layer_spec,
)


def mark_mla_without_te() -> None:
    """Tell megatron's MLA module that TransformerEngine is absent.

    Without TE, megatron-core 0.16.1's ``extensions.transformer_engine`` still imports (its TE
    classes subclass a ``MagicMock``), so ``multi_latent_attention`` sets ``HAVE_TE = True``
    and its ``isinstance(self.linear_proj, TELinear)`` check raises TypeError in every
    ``MLASelfAttention.__init__``. ``HAVE_TE = False`` skips that TE-only (fp8) branch.
    """
    from megatron.core.transformer import multi_latent_attention

    if not has_transformer_engine():
        multi_latent_attention.HAVE_TE = False


class MLASDPAttention(SDPAttention):
    """:class:`SDPAttention` built as MLA builds its core attention: with the query/key and
    value head sizes (``k_channels``, ``v_channels``), which SDPA reads off the tensors."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str = "self",
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
    ) -> None:
        super().__init__(
            config,
            layer_number,
            attn_mask_type,
            attention_type=attention_type,
            attention_dropout=attention_dropout,
            softmax_scale=softmax_scale,
            cp_comm_type=cp_comm_type,
            pg_collection=pg_collection,
        )


def check_mla_layout(config: TransformerConfig) -> None:
    """Raise a one-line error for tensor parallelism without sequence parallelism (the
    replicated down projections need the sequence-parallel gradient reductions)."""
    if config.tensor_model_parallel_size > 1 and not config.sequence_parallel:
        raise ValueError(
            "the native MLA spec needs sequence_parallel with tensor parallel size "
            f"{config.tensor_model_parallel_size}; leave sequence parallelism on"
        )


def mla_attention_spec() -> ModuleSpec:
    """MLA self-attention with native modules in the TE spec's slots (q/kv norms fused)."""
    return ModuleSpec(
        module=MLASelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=MLASelfAttentionSubmodules(
            linear_q_proj=ColumnParallelLinear,
            linear_q_down_proj=Linear,
            linear_q_up_proj=NormColumnParallelLinear,
            linear_kv_down_proj=Linear,
            linear_kv_up_proj=NormColumnParallelLinear,
            core_attention=MLASDPAttention,
            linear_proj=RowParallelLinear,
            q_layernorm=IdentityOp,
            kv_layernorm=IdentityOp,
        ),
    )


def mla_layer_spec(config: TransformerConfig, moe: bool) -> ModuleSpec:
    """One MLA decoder layer: the native spec's layer (its MLP or MoE, ``pre_mlp_layernorm``)
    with MLA self-attention behind a separate ``input_layernorm``, as in TE's MLA spec."""
    without_mla = copy.copy(config)
    without_mla.multi_latent_attention = False  # the native spec refuses MLA attention itself
    layer = native_layer_spec(without_mla, moe)
    submodules = dataclasses.replace(
        layer.submodules, input_layernorm=NativeNorm, self_attention=mla_attention_spec()
    )
    return dataclasses.replace(layer, submodules=submodules)


def mla_decoder_block_spec(
    config: TransformerConfig, vp_stage: int | None = None, pp_rank: int | None = None
) -> TransformerBlockSubmodules:
    """The MLA layers of this pipeline stage (and virtual stage) with the native spec."""
    if not config.multi_latent_attention:
        raise ValueError("mla_decoder_block_spec needs a config with multi_latent_attention")
    if config.pipeline_model_parallel_layout is not None:
        raise ValueError(
            "pipeline_model_parallel_layout is not supported by the native spec; "
            "leave it unset (layers are split evenly over pipeline stages)"
        )
    check_mla_layout(config)
    mark_mla_without_te()
    specs = {moe: mla_layer_spec(config, moe) for moe in (False, True)}
    pattern = moe_layer_pattern(config)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return TransformerBlockSubmodules(
        layer_specs=[specs[moe] for moe in pattern[offset : offset + count]],
        layer_norm=NativeNorm,
    )
