"""Build megatron-core GPT model chunks from an HF model directory through mbridge.

``build_actor_model`` creates the megatron parallel groups if needed, asks mbridge's
``AutoBridge`` for the TransformerConfig of the HF architecture, builds this rank's model chunks
(one per virtual pipeline stage) with the TE spec or megarl's native spec, and loads the HF
safetensors directly (no conversion step).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from megatron.core import parallel_state as mpu
from megatron.core import tensor_parallel
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import ModelType

from megarl.megatron import (
    cpu_compat,
    deepseek_bridge,  # registers megarl's DeepSeek-V3 bridge with mbridge
)
from megarl.megatron.hf_reader import HFWeightReader
from megarl.megatron.mla_spec import mla_decoder_block_spec
from megarl.megatron.native_spec import (
    NATIVE_CONFIG_OVERRIDES,
    bind_missing_te_names,
    has_transformer_engine,
    native_decoder_block_spec,
)
from megarl.megatron.parallel import ParallelSizes, init_parallel
from megarl.megatron.settings import RecomputeSettings  # noqa: F401 (re-exported)

SpecChoice = Literal["auto", "te", "native"]

# HF rope_parameters.rope_type values each family's bridge maps (others: plain RoPE only).
ROPE_TYPES: dict[str, tuple[str, ...]] = {"deepseek_v3": deepseek_bridge.ROPE_TYPES}

# Per-family TransformerConfig corrections on top of mbridge 0.15.1's bridges, by HF model_type.
FAMILY_OVERRIDES: dict[str, dict[str, Any]] = {
    # mbridge maps shared_expert_gate.weight but never turns the gate on
    "qwen2_moe": {"moe_shared_expert_gate": True},
    # HF Mixtral renormalises the top-k softmax weights (= softmax over the top-k logits);
    # mbridge's pre-softmax routing does not
    "mixtral": {"moe_router_pre_softmax": False},
}


@dataclass
class ActorModel:
    """This rank's model chunks plus what is needed to feed and export them."""

    chunks: list[torch.nn.Module]
    """One GPTModel per virtual pipeline stage held by this rank (a single one without VPP)."""
    bridge: Any
    """The mbridge Bridge (HF <-> megatron names; ``export_weights`` for weight sync)."""
    hf_config: Any
    """The HF config the model was built from."""
    spec: Literal["te", "native"]
    """Which layer spec built the chunks."""
    lora: Any = None
    """The ``LoraSettings`` of the chunks' LoRA adapters (``megatron.lora.apply_lora``); None
    without adapters."""

    @property
    def config(self) -> TransformerConfig:
        """The megatron TransformerConfig shared by the chunks."""
        return self.bridge.config

    @property
    def vocab_size(self) -> int:
        """The tokenizer's vocabulary size (the output layer may be padded beyond it)."""
        return self.hf_config.vocab_size


def load_hf_config(hf_path: str | Path, trust_remote_code: bool = False) -> Any:
    """Load an HF config and fill the fields mbridge 0.15.1 reads as transformers 4 had them:
    transformers 5 moved ``rope_theta`` into ``rope_parameters`` and sets ``head_dim=None``
    where it used to be absent (mbridge then multiplies None)."""
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(str(hf_path), trust_remote_code=trust_remote_code)
    for cfg in (hf_config, getattr(hf_config, "text_config", None)):
        if cfg is not None:
            _fill_rope_theta(cfg, hf_path)
            if getattr(cfg, "head_dim", 0) is None:
                cfg.head_dim = cfg.hidden_size // cfg.num_attention_heads
    return hf_config


def _fill_rope_theta(cfg: Any, hf_path: str | Path) -> None:
    if getattr(cfg, "rope_theta", None) is not None:
        return
    rope = getattr(cfg, "rope_parameters", None) or {}
    if "rope_theta" not in rope:
        raise ValueError(f"{hf_path}/config.json: no rope_theta nor rope_parameters.rope_theta")
    rope_type = rope.get("rope_type", "default")
    supported = ROPE_TYPES.get(cfg.model_type, ("default",))
    if rope_type not in supported:
        raise ValueError(
            f"{hf_path}/config.json: rope_parameters.rope_type={rope_type!r} is not supported "
            f"by megarl's bridge for {cfg.model_type}; supported: {', '.join(supported)}"
        )
    cfg.rope_theta = rope["rope_theta"]


def make_bridge(hf_config: Any, **kwargs: Any) -> Any:
    """``mbridge.AutoBridge.from_config(hf_config, **kwargs)`` without its side effect on later
    bridges: for tied embeddings mbridge's Qwen2 bridge (also Qwen3's) rewrites its *class's*
    ``_DIRECT_MAPPING`` in place, so every later Qwen2/Qwen3 bridge of the process would map
    ``output_layer.weight`` to the embedding. The adjusted mapping stays on this instance and
    the classes get theirs back. The bridge reads HF weights through :class:`HFWeightReader`
    (FP8 block-quantized checkpoints are dequantized on load)."""
    from mbridge import AutoBridge
    from mbridge.core.bridge import _MODEL_REGISTRY

    owners = [cls for cls in getattr(_MODEL_REGISTRY.get(hf_config.model_type), "__mro__", ())
              if "_DIRECT_MAPPING" in vars(cls)]
    saved = {cls: dict(vars(cls)["_DIRECT_MAPPING"]) for cls in owners}
    try:
        bridge = AutoBridge.from_config(hf_config, **kwargs)
        bridge._get_safetensor_io = lambda path: HFWeightReader(bridge._get_actual_hf_path(path))
        if owners:
            bridge._DIRECT_MAPPING = dict(vars(owners[0])["_DIRECT_MAPPING"])
    finally:
        for cls, mapping in saved.items():
            vars(cls)["_DIRECT_MAPPING"].clear()
            vars(cls)["_DIRECT_MAPPING"].update(mapping)
    return bridge


def resolve_spec(spec: SpecChoice) -> Literal["te", "native"]:
    """``auto`` -> ``te`` when TransformerEngine imports, else ``native``."""
    if spec == "auto":
        return "te" if has_transformer_engine() else "native"
    if spec == "te" and not has_transformer_engine():
        raise ValueError("spec='te' but transformer_engine is not importable; use 'native'")
    if spec not in ("te", "native"):
        raise ValueError(f"spec={spec!r}: choose 'auto', 'te' or 'native'")
    return spec


def _config_overrides(
    hf_config: Any, sizes: ParallelSizes, dtype: torch.dtype, spec: str
) -> dict[str, Any]:
    overrides: dict[str, Any] = {
        "sequence_parallel": sizes.use_sequence_parallel,
        "use_cpu_initialization": not torch.cuda.is_available(),
        # kept on even when the checkpoint overwrites the weights: megatron's Column/Row
        # parallel linears and vocab embedding set their tensor-parallel attributes (which
        # grad-norm, optimizer and export rely on) only inside their init functions
        "perform_initialization": True,
        "bf16": dtype is torch.bfloat16,
        "fp16": dtype is torch.float16,
    }
    if spec == "native":
        overrides.update(NATIVE_CONFIG_OVERRIDES)
    overrides.update(FAMILY_OVERRIDES.get(hf_config.model_type, {}))
    return overrides


def _check_layout(sizes: ParallelSizes) -> None:
    actual = {
        "tp": mpu.get_tensor_model_parallel_world_size(),
        "pp": mpu.get_pipeline_model_parallel_world_size(),
        "vpp": mpu.get_virtual_pipeline_model_parallel_world_size(),
        "ep": mpu.get_expert_model_parallel_world_size(),
        "etp": mpu.get_expert_tensor_parallel_world_size(),
        "cp": mpu.get_context_parallel_world_size(),
    }
    wanted = {
        "tp": sizes.tp,
        "pp": sizes.pp,
        "vpp": sizes.vpp,
        "ep": sizes.ep,
        "etp": sizes.expert_tp,
        "cp": sizes.cp,
    }
    if actual != wanted:
        raise ValueError(
            f"megatron parallel state {actual} differs from the requested sizes {wanted}; "
            "call destroy_parallel() first or pass the sizes it was initialised with"
        )


def build_actor_model(
    hf_path: str | Path,
    sizes: ParallelSizes,
    dtype: torch.dtype = torch.bfloat16,
    *,
    spec: SpecChoice = "auto",
    load_weights: bool = True,
    config_overrides: dict[str, Any] | None = None,
    seed: int = 1234,
    trust_remote_code: bool = False,
) -> ActorModel:
    """Build this rank's GPT model chunks for the HF model at ``hf_path`` and load its weights.

    Creates the megatron parallel groups for ``sizes`` if none exist (``torch.distributed`` must
    be initialised). ``config_overrides`` are TransformerConfig fields applied last;
    ``trust_remote_code`` lets the HF config load custom code shipped with the model.
    """
    cpu_compat.enable()
    if not mpu.model_parallel_is_initialized():
        init_parallel(sizes, seed=seed)
    _check_layout(sizes)
    chosen = resolve_spec(spec)
    hf_config = load_hf_config(hf_path, trust_remote_code)
    vocab_multiple = sizes.tp if hf_config.vocab_size % sizes.tp else None
    bridge = make_bridge(hf_config, dtype=dtype, make_vocab_size_divisible_by=vocab_multiple)
    overrides = _config_overrides(hf_config, sizes, dtype, chosen)
    overrides.update(config_overrides or {})
    bridge.set_extra_args(**overrides)
    _fix_replicated_expert_export(bridge)
    if chosen == "native":
        _use_native_spec(bridge)
    chunks = _build_chunks(bridge, sizes)
    if load_weights:
        bridge.load_weights(chunks, str(hf_path))
    return ActorModel(chunks=chunks, bridge=bridge, hf_config=hf_config, spec=chosen)


def _fix_replicated_expert_export(bridge: Any) -> None:
    """mbridge 0.15.1's ``export_weights`` gathers tensor-parallel expert weights over the TP
    group and then asserts one piece per *expert*-TP rank; with EP = 1 and ETP = 1 < TP the
    pieces are identical copies of the replicated expert, and one of them is the weight."""
    merge = bridge._weight_merge_across_tp

    def merge_replicated_experts(name: str, weights: list, param: torch.Tensor):
        if ".mlp.experts.linear_fc" in name and bridge.mpu.etp_size == 1 and len(weights) > 1:
            return weights[0]
        return merge(name, weights, param)

    bridge._weight_merge_across_tp = merge_replicated_experts


def _use_native_spec(bridge: Any) -> None:
    """Make mbridge's model provider build the native spec instead of its hard-wired TE spec
    (the MLA variant for multi-latent attention models).

    mbridge's ``LLMBridge._model_provider`` asks ``self._get_transformer_layer_spec(vp_stage)``
    for the block spec and reads ``self.has_vp_stage``; both are set on the instance.
    """
    bind_missing_te_names()
    bridge.has_vp_stage = True
    block_spec = (
        mla_decoder_block_spec if bridge.config.multi_latent_attention
        else native_decoder_block_spec
    )
    bridge._get_transformer_layer_spec = lambda vp_stage=None: block_spec(
        bridge.config, vp_stage=vp_stage
    )


def _build_chunks(bridge: Any, sizes: ParallelSizes) -> list[torch.nn.Module]:
    """Instantiate one GPTModel per virtual stage on this rank (mbridge's ``get_model`` without
    DDP wrapping, and without its unconditional ``.cuda()``)."""
    provider = bridge._model_provider([])
    stages = [None] if sizes.vpp is None else list(range(sizes.vpp))
    chunks = []
    for vp_stage in stages:
        model = provider(
            pre_process=mpu.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=mpu.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            vp_stage=vp_stage,
        )
        model.model_type = ModelType.encoder_or_decoder
        if vp_stage is not None:
            model.vp_stage = vp_stage
        for param in model.parameters():
            tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
        if torch.cuda.is_available():
            model.cuda(torch.cuda.current_device())
        chunks.append(model)
    return chunks
