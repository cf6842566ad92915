"""Tiny random HF model directories (Qwen2/3, their MoE variants, Mixtral, Llama, DeepSeek-V3)
with a locally built tokenizer.

Tests and the demo cannot download anything, so they write their own model: an HF
``config.json``, random ``model.safetensors`` and a character-level tokenizer (built with the
``tokenizers`` library) with a chat template. ``make_tiny_model(path)`` is the one entry point.
"""

from __future__ import annotations

import gc
import json
import string
from pathlib import Path
from typing import Any, Literal

import torch

# Character alphabet of the tokenizer: enough for the synthetic tasks and chat-formatted prompts.
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
ALPHABET = list(string.digits + string.ascii_letters + " +-*/=()[],.:;?!'\"<>|_\n#{}")
# Qwen3's tool-call markers, one token each and not special (decoding keeps them), as in Qwen3,
# and the pieces of a calculator call's JSON that a BPE tokenizer would merge (so a call is 10
# tokens, not 60 characters): `<tool_call>{"name": "calculator", "arguments": {"expression": "`
# `2*3"}}</tool_call>`.
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
               '{"name": ', '"calculator"', ', "arguments": ', '{"expression": "', '"}}']

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

Arch = Literal["qwen3_moe", "qwen3", "qwen2", "qwen2_moe", "mixtral", "llama", "deepseek_v3"]


def tokenizer_vocab() -> list[str]:
    """The token strings in id order: special tokens first, then single characters, then the
    tool-call markers."""
    return SPECIAL_TOKENS + ALPHABET + TOOL_TOKENS


def build_tokenizer(vocab_size: int):
    """A character-level ``PreTrainedTokenizerFast`` whose ids are all < ``vocab_size``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens = tokenizer_vocab()
    if len(tokens) > vocab_size:
        raise ValueError(f"vocab_size must be >= {len(tokens)} for the tiny tokenizer")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.add_tokens(TOOL_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="?",
        chat_template=CHAT_TEMPLATE,
    )
    return fast


# DeepSeek-V3 in small: MLA (low-rank q and kv, a separate RoPE part), a dense first layer, then
# sigmoid-routed experts with a score-correction bias, group-limited routing (4 groups of 2,
# 2 groups chosen, top-4 experts: megatron's top-(k / groups) per group is HF's top-2) and one
# shared expert; no multi-token-prediction layers.
_DEEPSEEK_V3: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "num_hidden_layers": 3, "first_k_dense_replace": 1, "moe_intermediate_size": 32,
    "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 4,
    "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
    "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
    "v_head_dim": 16, "rope_interleave": True, "num_nextn_predict_layers": 0,
}


def tiny_config_dict(arch: Arch = "qwen3_moe", **overrides: Any) -> dict[str, Any]:
    """HF config fields of a tiny model of the given architecture (random init, fp32)."""
    common: dict[str, Any] = {
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "bos_token_id": 0,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "torch_dtype": "float32",
    }
    if arch == "qwen3_moe":
        common.update(
            architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
            router_aux_loss_coef=0.0,
        )
    elif arch == "qwen3":
        common.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3")
    elif arch == "qwen2":
        common.update(architectures=["Qwen2ForCausalLM"], model_type="qwen2")
        common.pop("head_dim")
    elif arch == "qwen2_moe":
        common.update(
            architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe",
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=64, norm_topk_prob=False, decoder_sparse_step=1,
            mlp_only_layers=[], router_aux_loss_coef=0.0,
        )
        common.pop("head_dim")
    elif arch == "mixtral":
        common.update(
            architectures=["MixtralForCausalLM"], model_type="mixtral",
            num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.0,
        )
        common.pop("head_dim")
    elif arch == "llama":
        common.update(architectures=["LlamaForCausalLM"], model_type="llama")
        common.pop("head_dim")
    elif arch == "deepseek_v3":
        common.update(_DEEPSEEK_V3)
        common.pop("head_dim")
        common["num_key_value_heads"] = common["num_attention_heads"]
    else:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose one of {Arch.__args__}")
    common.update(overrides)
    return common


def make_tiny_model(
    path: str | Path,
    arch: Arch = "qwen3_moe",
    seed: int = 0,
    with_tokenizer: bool = True,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    **overrides: Any,
) -> Path:
    """Write a random HF model (config, safetensors weights, tokenizer) to ``path``.

    ``overrides`` replace fields of :func:`tiny_config_dict` (e.g. ``num_hidden_layers=4``).
    ``dtype`` is the weights' (and config.json's ``torch_dtype``); ``device`` is where they are
    drawn: a model of billions of parameters is drawn on a GPU in seconds, not on the host in
    fp32. Returns the directory. The same ``seed`` and arguments on the same device give
    bit-identical weights.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg_dict = tiny_config_dict(arch, **overrides)
    cfg_dict["torch_dtype"] = str(dtype).removeprefix("torch.")
    model_type = cfg_dict.pop("model_type")
    config = AutoConfig.for_model(model_type, **cfg_dict)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    _randomize_buffers(model)
    model.save_pretrained(path, safe_serialization=True)
    del model
    if torch.device(device).type == "cuda":  # whatever runs next on the GPU sees it free
        gc.collect()
        torch.cuda.empty_cache()
    if with_tokenizer:
        build_tokenizer(config.vocab_size).save_pretrained(path)
    # generation_config defaults would otherwise differ between transformers versions
    gen_cfg = {"eos_token_id": config.eos_token_id, "pad_token_id": config.pad_token_id}
    (path / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2))
    return path


def _randomize_buffers(model: torch.nn.Module) -> None:
    """Give DeepSeek-V3's routing score-correction biases (zero at init) random values, so that
    a conversion or an engine that ignores them routes differently from the model."""
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.05)
