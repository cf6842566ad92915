"""Reading the model's architecture from config.json, under every naming convention."""

from __future__ import annotations

import json

import pytest
from config_archs import DEEPSEEK_V3, QWEN2_1_5B, QWEN3_30B_A3B

from megarl.config import ModelInfoError, load_model_info
from megarl.config.model_info import model_info_from_dict, tokenizer_size


def test_tiny_qwen3_moe_written_by_transformers(tiny_moe_dir):
    # transformers 5 writes num_local_experts (not num_experts) for Qwen3-MoE
    assert "num_local_experts" in json.loads((tiny_moe_dir / "config.json").read_text())
    info = load_model_info(tiny_moe_dir)
    assert (info.model_type, info.num_layers, info.hidden_size) == ("qwen3_moe", 2, 64)
    assert (info.num_attention_heads, info.num_kv_heads, info.head_dim) == (4, 2, 16)
    assert (info.num_experts, info.top_k, info.moe_ffn_hidden_size) == (4, 2, 32)
    assert info.vocab_size == 128 and info.max_position_embeddings == 512
    assert info.is_moe and info.dense_layers == () and info.first_dense_layers == 0


def test_deepseek_names():
    info = model_info_from_dict(DEEPSEEK_V3)
    assert (info.num_experts, info.top_k, info.num_shared_experts) == (256, 8, 1)
    assert info.shared_expert_ffn_hidden_size == 2048
    assert info.dense_layers == (0, 1, 2) and info.first_dense_layers == 3
    assert info.kv_lora_rank == 512 and info.head_dim == 7168 // 128


def test_mixtral_and_qwen2_moe_names():
    mixtral = model_info_from_dict({"model_type": "mixtral", "num_hidden_layers": 32,
                                        "hidden_size": 4096, "num_attention_heads": 32,
                                        "num_key_value_heads": 8, "vocab_size": 32000,
                                        "intermediate_size": 14336, "num_local_experts": 8,
                                        "num_experts_per_tok": 2})
    assert (mixtral.num_experts, mixtral.moe_ffn_hidden_size, mixtral.head_dim) == (8, 14336, 128)
    qwen2_moe = model_info_from_dict(dict(QWEN3_30B_A3B, model_type="qwen2_moe",
                                          shared_expert_intermediate_size=5632,
                                          decoder_sparse_step=2, mlp_only_layers=[47]))
    assert qwen2_moe.num_shared_experts == 1 and qwen2_moe.shared_expert_ffn_hidden_size == 5632
    assert qwen2_moe.dense_layers == tuple(range(0, 47, 2)) + (47,)


def test_dense_and_multimodal_text_config():
    dense = model_info_from_dict(QWEN2_1_5B)
    assert not dense.is_moe and dense.top_k == 0 and len(dense.dense_layers) == 28
    assert dense.tie_word_embeddings
    vl = model_info_from_dict({"model_type": "qwen2_5_vl", "text_config": QWEN2_1_5B})
    assert vl.num_layers == 28 and vl.num_kv_heads == 2


def test_missing_and_broken_model_dirs_give_one_line(tmp_path):
    with pytest.raises(ModelInfoError, match="does not exist"):
        load_model_info(tmp_path / "nope")
    with pytest.raises(ModelInfoError, match="has no config.json — is it an HF model directory"):
        load_model_info(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelInfoError, match="cannot be read"):
        load_model_info(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "x", "hidden_size": 8}))
    with pytest.raises(ModelInfoError) as info:
        load_model_info(tmp_path)
    assert "has no num_hidden_layers, num_attention_heads, vocab_size" in str(info.value)
    assert "\n" not in str(info.value)


def test_tokenizer_size_is_largest_id_plus_one(tiny_moe_dir, tmp_path):
    from megarl.data.tiny_model import tokenizer_vocab

    assert tokenizer_size(tiny_moe_dir) == len(tokenizer_vocab())
    assert tokenizer_size(tmp_path) is None
