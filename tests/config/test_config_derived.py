"""Derived sizes (PITFALLS B1) against numbers worked out by hand, and the model-based estimates
(parameter count, KV cache) against the real tiny model's tensors."""

from __future__ import annotations

import math

from config_archs import QWEN3_30B_A3B

from megarl.config import derive_sizes, load_config_dict, load_model_info
from megarl.config.derived import format_sizes, nearest_divisor, nearest_multiple, ratio
from megarl.config.model_info import model_info_from_dict

B1 = {  # PITFALLS B1: 60 prompts x 12 samples over 6 GPUs
    "model": {"path": "/m"},
    "data": {"train_files": ["/t.parquet"], "train_batch_size": 60, "max_prompt_length": 512,
             "max_response_length": 1536},
    "actor": {"ppo_mini_batch_size": 15, "ppo_micro_batch_size_per_gpu": 5, "ppo_epochs": 2},
    "rollout": {"n": 12, "gpus_per_engine": 3},
    "resources": {"train_pool": {"nnodes": 1, "gpus_per_node": 6}},
}


def test_b1_example_sizes():
    cfg, _ = load_config_dict(B1)
    s = derive_sizes(cfg)
    assert s.sequences_per_step == 720
    assert s.actor.dp == 6 and s.sequences_per_dp_rank == 120
    assert s.num_engines == 2 and s.sequences_per_engine == 360
    assert s.mini_batches_per_step == 4 and s.sequences_per_mini_batch == 180
    assert s.sequences_per_mini_batch_per_dp_rank == 30
    assert s.micro_batches_per_mini_batch == 6
    assert s.optimizer_steps_per_step == 8
    assert s.max_num_seqs == 360  # auto, memory unknown: every sequence an engine receives
    assert s.max_sequence_length == 2048 and s.weight_sync_backend == "ipc"


def test_b1_sizes_are_printed():
    cfg, _ = load_config_dict(B1)
    text = "\n".join(format_sizes(derive_sizes(cfg)))
    assert "60 prompts x 12 samples = 720" in text
    assert "sequences per DP rank     120" in text
    assert "sequences per engine      360" in text
    assert "4 of 180 sequences (30 per DP rank)" in text
    assert "6 per DP rank of 5 sequences" in text


def test_non_dividing_sizes_show_as_fractions():
    cfg, _ = load_config_dict(B1, ["actor.parallel.tp=4"])
    s = derive_sizes(cfg)
    assert s.actor.dp == 1.5 and s.sequences_per_dp_rank is None
    assert "dp 1.50 (not whole)" in "\n".join(format_sizes(s))


def test_layout_with_tp_pp_ep_and_global_micro_batch():
    cfg, _ = load_config_dict(B1, [
        "resources.train_pool.nnodes=2", "resources.train_pool.gpus_per_node=8",
        "actor.parallel.tp=2", "actor.parallel.pp=2", "actor.parallel.ep=4",
        "actor.parallel.etp=1", "actor.ppo_micro_batch_size_per_gpu=null",
        "actor.ppo_micro_batch_size=12", "data.train_batch_size=64", "actor.ppo_mini_batch_size=16",
        "rollout.n=8", "rollout.colocate=false", "resources.rollout_pool.gpus_per_node=8",
        "rollout.gpus_per_engine=2", "actor.use_kl_loss=true"])
    s = derive_sizes(cfg)
    assert s.actor.dp == 4 and s.actor.expert_dp == 2  # 16 / (2 x 2), 16 / (2 x 4 x 1)
    assert s.micro_batch_size_per_gpu == 3  # global 12 over dp 4
    assert s.sequences_per_mini_batch_per_dp_rank == 32 and s.micro_batches_per_mini_batch == 32 / 3
    assert s.rollout_pool_gpus == 8 and s.num_engines == 4 and s.sequences_per_engine == 128
    assert s.ref is not None and s.ref.dp == 4 and s.critic is None
    assert s.weight_sync_backend == "nccl"


def test_dynamic_batch_token_budget_scales_with_cp():
    cfg, _ = load_config_dict(B1, ["actor.use_dynamic_bsz=true", "actor.parallel.cp=2",
                                   "actor.ppo_max_token_len_per_gpu=4096"])
    s = derive_sizes(cfg)
    assert s.token_budget_per_micro_batch == 8192 and s.micro_batch_size_per_gpu is None


def test_param_count_matches_the_tiny_models_tensors(tiny_moe_dir):
    """Every non-norm tensor of the real checkpoint is counted, nothing else."""
    from safetensors import safe_open

    with safe_open(tiny_moe_dir / "model.safetensors", framework="pt") as f:
        names = f.keys()  # safe_open is not iterable
        total = sum(math.prod(f.get_slice(k).get_shape()) for k in names if "norm" not in k)
    assert load_model_info(tiny_moe_dir).param_count() == total


def test_kv_cache_fit_against_hand_arithmetic(tiny_moe_dir):
    cfg, _ = load_config_dict({
        "model": {"path": str(tiny_moe_dir), "dtype": "float32"},
        "data": {"train_files": ["/t"], "max_prompt_length": 64, "max_response_length": 32,
                 "train_batch_size": 8},
        "actor": {"ppo_mini_batch_size": 4, "ppo_micro_batch_size_per_gpu": 4},
        "rollout": {"n": 4}, "resources": {"train_pool": {"gpus_per_node": 1},
                                           "gpu_memory_gb": 0.001}})
    s = derive_sizes(cfg, load_model_info(tiny_moe_dir))
    params = 128 * 64 * 2 + 2 * (64 * 16 * (2 * 4 + 2 * 2) + 3 * 64 * 32 * 4 + 64 * 4)
    kv_per_seq = 2 * 2 * 2 * 16 * 4 * (64 + 32)  # K and V x layers x kv heads x head_dim x fp32
    expected = int((0.001 * 2**30 * 0.8 - params * 4) // kv_per_seq)
    assert s.kv_cache_sequences_per_engine == expected == 10
    assert s.sequences_per_engine == 32 and s.max_num_seqs == 10  # auto, capped by the KV cache
    assert s.padded_vocab_size == 128


def test_mla_kv_cache_and_padded_vocab():
    info = model_info_from_dict(dict(QWEN3_30B_A3B, kv_lora_rank=512, qk_rope_head_dim=64))
    assert info.kv_bytes_per_token("bfloat16", tp=8) == 48 * (512 + 64) * 2
    plain = model_info_from_dict(QWEN3_30B_A3B)
    assert plain.kv_bytes_per_token("bfloat16", tp=8) == 2 * 48 * 1 * 128 * 2  # 4 kv heads < 8
    cfg, _ = load_config_dict(B1, ["actor.parallel.tp=3"])
    assert derive_sizes(cfg, plain).padded_vocab_size == 152064  # ceil(151936 / 384) x 384


def test_number_helpers():
    assert ratio(7, 2) == 3.5 and ratio(8, 2) == 4 and ratio(None, 2) is None
    assert ratio(3, 0) is None
    assert nearest_divisor(60, 16) == 15 and nearest_divisor(90, 4) == 3
    assert nearest_multiple(16, 60) == 64 and nearest_multiple(8, 12) == 16
    assert nearest_multiple(8, 3) == 8
