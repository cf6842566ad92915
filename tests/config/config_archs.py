"""HF config.json fields of real architectures (only those the layout depends on)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

QWEN3_30B_A3B: dict[str, Any] = {
    "model_type": "qwen3_moe", "num_hidden_layers": 48, "hidden_size": 2048,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
    "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "max_position_embeddings": 40960, "tie_word_embeddings": False,
}
DEEPSEEK_V3: dict[str, Any] = {
    "model_type": "deepseek_v3", "num_hidden_layers": 61, "hidden_size": 7168,
    "num_attention_heads": 128, "num_key_value_heads": 128, "vocab_size": 129280,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "n_routed_experts": 256,
    "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
    "moe_layer_freq": 1, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
    "v_head_dim": 128, "max_position_embeddings": 163840,
}
QWEN2_1_5B: dict[str, Any] = {
    "model_type": "qwen2", "num_hidden_layers": 28, "hidden_size": 1536,
    "num_attention_heads": 12, "num_key_value_heads": 2, "vocab_size": 151936,
    "intermediate_size": 8960, "max_position_embeddings": 131072, "tie_word_embeddings": True,
}


def base_dict(tmp_path: Path, data_file: Path) -> dict[str, Any]:
    """A valid run on one 8-GPU node: Qwen3-30B-A3B, ep=8, colocated SGLang engines."""
    return {
        "model": {"path": str(tmp_path / "model")},
        "data": {"train_files": [str(data_file)], "train_batch_size": 64,
                 "max_prompt_length": 1024, "max_response_length": 2048},
        "actor": {"ppo_mini_batch_size": 16, "ppo_micro_batch_size_per_gpu": 4,
                  "parallel": {"ep": 8}},
        "rollout": {"n": 8, "backend": "sglang"},
        "resources": {"device": "cuda", "train_pool": {"nnodes": 1, "gpus_per_node": 8}},
        "trainer": {"loggers": ["console"]},
    }
