"""DeepSeek-V3 through mbridge 0.15.1 with megatron-core 0.16.1 and transformers 5.

Importing this module registers :class:`DeepseekV3Bridge` for the HF ``model_type``
``deepseek_v3`` in place of mbridge's own, which keeps mbridge's HF <-> megatron name mapping
and changes what does not work with the installed versions:

- the MLA config: megatron-core 0.16.1's ``MLATransformerConfig`` calls YaRN's pretraining
  length ``original_max_position_embeddings`` (mbridge passes ``max_position_embeddings``,
  which it rejects); RoPE settings come from transformers 5's ``rope_parameters``;
- routing as HF computes it: sigmoid scores plus ``e_score_correction_bias`` (megatron's
  ``expert_bias``), group-limited top-k (``n_group`` / ``topk_group``, which mbridge drops),
  renormalised and scaled by ``routed_scaling_factor``; HF settings megatron cannot reproduce
  are refused with the field named;
- no multi-token-prediction block: HF transformers' ``DeepseekV3ForCausalLM`` has none (it
  ignores a checkpoint's MTP layers), so mbridge's MTP provider and its 61-layer special cases
  are not used; the model provider is the generic one (which also pads the vocabulary);
- the weights reader: mbridge's reads only FP8 checkpoints, with a GPU kernel, into bf16;
  megarl's bridges all read through ``megarl.megatron.hf_reader.HFWeightReader`` (set by
  ``make_bridge``), which reads plain safetensors as stored and dequantizes FP8 ones on CPU.
"""

from __future__ import annotations

from typing import Any

from mbridge.core import LLMBridge, register_model
from mbridge.models.deepseek_v3 import DeepseekV3Bridge as MbridgeDeepseekV3Bridge

ROPE_TYPES = ("default", "yarn")
"""HF ``rope_parameters.rope_type`` values the bridge maps onto megatron's MLA RoPE."""
HF_TOPK_PER_GROUP = 2
"""HF scores an expert group by the sum of its top-2 expert scores; megatron by the sum of its
top ``moe_router_topk // moe_router_group_topk``."""


def rope_kwargs(hf_config: Any) -> dict[str, Any]:
    """MLATransformerConfig RoPE fields (plain RoPE or YaRN) for the HF config's rope settings."""
    rope = dict(getattr(hf_config, "rope_parameters", None) or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    theta = rope.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        raise ValueError("config.json: no rope_parameters.rope_theta (nor rope_theta)")
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"config.json: rope_parameters.rope_type={rope_type!r} is not supported "
                         f"for deepseek_v3; supported: {', '.join(ROPE_TYPES)}")
    if rope_type == "default":
        # MLA always applies YaRN's softmax correction; factor 1 makes it 1
        return {"rope_type": "rope", "rotary_base": theta, "rotary_scaling_factor": 1.0,
                "mscale": 1.0, "mscale_all_dim": 0.0}
    if rope.get("attention_factor") is not None or rope.get("truncate", True) is not True:
        raise ValueError("config.json: rope_parameters.attention_factor / truncate=false are not "
                         "supported for deepseek_v3 YaRN; remove them")
    original = rope["original_max_position_embeddings"]
    factor = rope.get("factor") or hf_config.max_position_embeddings / original
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    if not (mscale and mscale_all_dim):
        if mscale_all_dim:
            raise ValueError("config.json: rope_parameters has mscale_all_dim without mscale; "
                             "megatron's YaRN needs both (DeepSeek-V3 sets both to 1.0)")
        mscale, mscale_all_dim = 1.0, 0.0  # HF: attention factor 0.1 ln(factor) + 1
    return {"rope_type": "yarn", "rotary_base": theta, "rotary_scaling_factor": factor,
            "original_max_position_embeddings": original, "mscale": mscale,
            "mscale_all_dim": mscale_all_dim, "beta_fast": rope.get("beta_fast") or 32,
            "beta_slow": rope.get("beta_slow") or 1}


def routing_kwargs(hf_config: Any) -> dict[str, Any]:
    """Megatron router fields that route as HF's ``DeepseekV3TopkRouter`` does."""
    top_k, experts = hf_config.num_experts_per_tok, hf_config.n_routed_experts
    if top_k > 1 and not getattr(hf_config, "norm_topk_prob", True):
        raise ValueError("config.json: norm_topk_prob=false is not supported for deepseek_v3 "
                         "(megatron renormalises sigmoid top-k weights); set it to true")
    groups, chosen = getattr(hf_config, "n_group", None) or 1, getattr(hf_config, "topk_group", 1)
    kwargs: dict[str, Any] = {}
    if groups > 1 and (chosen or groups) < groups:  # otherwise every group is kept
        if top_k // chosen != HF_TOPK_PER_GROUP or experts % groups:
            raise ValueError(
                f"config.json: n_group={groups}, topk_group={chosen}, num_experts_per_tok="
                f"{top_k}: megatron scores a group by its top num_experts_per_tok // topk_group "
                f"= {top_k // chosen} experts, HF by its top {HF_TOPK_PER_GROUP} (and "
                "n_routed_experts must divide by n_group); choose num_experts_per_tok = "
                f"{HF_TOPK_PER_GROUP} * topk_group")
        kwargs.update(moe_router_num_groups=groups, moe_router_group_topk=chosen)
    return {
        **kwargs,
        "moe_router_topk": top_k,
        "num_moe_experts": experts,
        "moe_router_score_function": "sigmoid",
        "moe_router_enable_expert_bias": True,
        "moe_router_bias_update_rate": 0.001,
        "moe_router_pre_softmax": True,
        "moe_router_topk_scaling_factor": hf_config.routed_scaling_factor,
        "moe_router_load_balancing_type": "none",
        "moe_aux_loss_coeff": getattr(hf_config, "aux_loss_alpha", 0.0),
        "moe_router_dtype": "fp32",
    }


def check_attention(hf_config: Any) -> None:
    """Refuse HF attention settings megatron's MLA computes differently."""
    if not getattr(hf_config, "rope_interleave", True):
        raise ValueError("config.json: rope_interleave=false is not supported for deepseek_v3 "
                         "(megatron's MLA de-interleaves the RoPE dimensions as HF does with "
                         "rope_interleave=true)")
    if getattr(hf_config, "attention_bias", False):
        raise ValueError("config.json: attention_bias=true is not supported for deepseek_v3 "
                         "(megatron's MLA projections have no biases)")


def mla_config_kwargs(hf_config: Any) -> dict[str, Any]:
    """Every MLATransformerConfig field of a DeepSeek-V3 model beyond mbridge's base mapping."""
    check_attention(hf_config)
    layers = hf_config.num_hidden_layers
    dense = min(hf_config.first_k_dense_replace or 0, layers)
    return {
        "layernorm_epsilon": hf_config.rms_norm_eps,
        "ffn_hidden_size": hf_config.intermediate_size,
        "qk_layernorm": True,  # q_a_layernorm / kv_a_layernorm, fused into the up projections
        "moe_ffn_hidden_size": hf_config.moe_intermediate_size,
        "moe_shared_expert_intermediate_size": hf_config.moe_intermediate_size
        * hf_config.n_shared_experts,
        "moe_token_dispatcher_type": "alltoall",
        "moe_shared_expert_overlap": True,
        "moe_grouped_gemm": True,
        "moe_layer_freq": [0] * dense + [1] * (layers - dense),
        **routing_kwargs(hf_config),
        "q_lora_rank": hf_config.q_lora_rank,
        "kv_lora_rank": hf_config.kv_lora_rank,
        "qk_head_dim": hf_config.qk_nope_head_dim,
        "qk_pos_emb_head_dim": hf_config.qk_rope_head_dim,
        "v_head_dim": hf_config.v_head_dim,
        **rope_kwargs(hf_config),
        "disable_bf16_reduced_precision_matmul": True,
        "persist_layer_norm": True,
        "bias_activation_fusion": True,
        "bias_dropout_fusion": True,
    }


@register_model("deepseek_v3")
class DeepseekV3Bridge(MbridgeDeepseekV3Bridge):
    """mbridge's DeepSeek-V3 bridge with the config and provider fixed (module doc)."""

    def _build_config(self) -> Any:
        return self._build_base_config(**mla_config_kwargs(self.hf_config))

    def _model_provider(self, post_model_creation_callbacks: list) -> Any:
        return LLMBridge._model_provider(self, post_model_creation_callbacks)

    # mbridge's class reads FP8 checkpoints only, through a GPU kernel; make_bridge sets every
    # instance's reader to megarl's HFWeightReader, and without it the generic one is used
    _get_safetensor_io = LLMBridge._get_safetensor_io
