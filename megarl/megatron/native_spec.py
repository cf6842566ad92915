"""megarl's native layer spec for the megatron GPT decoder, used when TransformerEngine is absent
(with TE, mbridge's own TE spec is used unchanged).

The native spec mirrors ``get_gpt_layer_with_transformer_engine_spec`` slot for slot with the
modules of :mod:`megarl.megatron.native_modules`, so the model has TE's parameter names (fused
``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``, ``q_layernorm``,
``experts.linear_fc1.weight{k}``, ...). Unlike megatron's "local" spec it supports sequence
parallelism, attends through SDPA / FlashAttention varlen and runs the experts as a grouped GEMM;
the attention, MLP and MoE layers are the subclasses of :mod:`megarl.megatron.native_layers`
(fused RoPE and SwiGLU, MoE permutation without host synchronisation).
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from typing import Any

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe.moe_layer import MoESubmodules
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
    get_transformer_layer_offset,
)

from megarl.megatron.native_layers import (
    NativeGroupedMLP,
    NativeMLP,
    NativeMoELayer,
    NativeSelfAttention,
)
from megarl.megatron.native_modules import (
    ColumnGroupedLinear,
    NativeNorm,
    NormColumnParallelLinear,
    RowGroupedLinear,
    SDPAttention,
)

# TransformerConfig fields that mbridge's bridges turn on and that need TE, apex or a compiled
# fusion; the native spec runs the plain torch path of each.
NATIVE_CONFIG_OVERRIDES: dict[str, Any] = {
    "persist_layer_norm": False,
    "bias_activation_fusion": False,
    "bias_dropout_fusion": False,
    "masked_softmax_fusion": False,
    "apply_rope_fusion": False,
    "gradient_accumulation_fusion": False,
    "moe_shared_expert_overlap": False,
    "moe_permute_fusion": False,
}


def bind_missing_te_names() -> None:
    """Bind names megatron-core only defines when TransformerEngine imports.

    ``moe_utils.RouterGatingLinearFunction`` tests ``te_general_gemm is not None``, but the name
    is bound inside a ``try: from ...transformer_engine import ...`` block: without TE every MoE
    router forward raises NameError (on GPUs as on the CPU). ``None`` selects the torch path.
    """
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def has_transformer_engine() -> bool:
    """True when ``transformer_engine`` is importable (then the TE spec is used)."""
    return importlib.util.find_spec("transformer_engine") is not None


def native_layer_spec(config: TransformerConfig, moe: bool) -> ModuleSpec:
    """One decoder layer with native modules in TE's slots (dense MLP or MoE)."""
    if config.multi_latent_attention:
        raise ValueError(
            "multi_latent_attention (DeepSeek-V3 style MLA) is not supported by the native spec; "
            "install TransformerEngine to use the TE spec"
        )
    qk_norm = NativeNorm if config.qk_layernorm else IdentityOp
    attention = ModuleSpec(
        module=NativeSelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=SelfAttentionSubmodules(
            linear_qkv=NormColumnParallelLinear,
            core_attention=SDPAttention,
            linear_proj=RowParallelLinear,
            q_layernorm=qk_norm,
            k_layernorm=qk_norm,
        ),
    )
    if moe:
        mlp = ModuleSpec(
            module=NativeMoELayer,
            submodules=MoESubmodules(
                experts=ModuleSpec(
                    module=NativeGroupedMLP,
                    submodules=MLPSubmodules(
                        linear_fc1=ColumnGroupedLinear, linear_fc2=RowGroupedLinear
                    ),
                ),
                shared_experts=ModuleSpec(
                    module=SharedExpertMLP,
                    submodules=MLPSubmodules(
                        linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear
                    ),
                ),
            ),
            metainfo={"fuse_pre_mlp_layernorm": False},
        )
    else:
        mlp = _dense_mlp(
            MLPSubmodules(linear_fc1=NormColumnParallelLinear, linear_fc2=RowParallelLinear)
        )
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            self_attention=attention,
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=NativeNorm if moe else IdentityOp,
            mlp=mlp,
            mlp_bda=get_bias_dropout_add,
        ),
    )


def _dense_mlp(submodules: MLPSubmodules) -> ModuleSpec | Callable[..., NativeMLP]:
    """The dense MLP slot. megatron-core >= 0.19 hands a TransformerLayer's ``mlp`` the process
    groups and re-wraps only its own ``MLP`` class into ``MLP.as_mlp_submodule``, which takes
    them; subclasses are given that builder directly."""
    if hasattr(NativeMLP, "as_mlp_submodule"):
        return functools.partial(NativeMLP.as_mlp_submodule, submodules=submodules)
    return ModuleSpec(module=NativeMLP, submodules=submodules)


def moe_layer_pattern(config: TransformerConfig) -> list[bool]:
    """For each global layer, whether it is an MoE layer (from ``config.moe_layer_freq``)."""
    if not config.num_moe_experts:
        return [False] * config.num_layers
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        return [i % freq == 0 for i in range(config.num_layers)]
    if len(freq) != config.num_layers:
        raise ValueError(
            f"moe_layer_freq has {len(freq)} entries but num_layers is {config.num_layers}"
        )
    return [bool(x) for x in freq]


def native_decoder_block_spec(
    config: TransformerConfig, vp_stage: int | None = None, pp_rank: int | None = None
) -> TransformerBlockSubmodules:
    """The layers of this pipeline stage (and virtual stage) built with the native spec."""
    if config.pipeline_model_parallel_layout is not None:
        raise ValueError(
            "pipeline_model_parallel_layout is not supported by the native spec; "
            "leave it unset (layers are split evenly over pipeline stages)"
        )
    specs = {moe: native_layer_spec(config, moe) for moe in (False, True)}
    pattern = moe_layer_pattern(config)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return TransformerBlockSubmodules(
        layer_specs=[specs[moe] for moe in pattern[offset : offset + count]],
        layer_norm=NativeNorm,
    )
