"""Every validation rule: the base config is clean; breaking one thing makes the rule report a
line that names the field(s) and a fix with a valid nearby value (PITFALLS S3, B2-B5, T7)."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
from config_archs import DEEPSEEK_V3, QWEN2_1_5B, QWEN3_30B_A3B, base_dict

from megarl.config import load_config_dict, validate_config
from megarl.config.model_info import load_model_info
from megarl.config.validate import RULES

DENSE_4K = dict(QWEN2_1_5B, max_position_embeddings=4096)
KV6 = dict(QWEN2_1_5B, num_attention_heads=24, num_key_value_heads=6)
QWEN_60E = dict(QWEN3_30B_A3B, num_experts=60)
QWEN_30L = dict(QWEN3_30B_A3B, num_hidden_layers=30)

# (rule, overrides, architecture, fields the line must name, text of the fix, severity)
CASES = [
    # B2: batch sizes
    ("check_mini_batch_divides_train_batch", ["data.train_batch_size=8"], None,
     ["data.train_batch_size", "actor.ppo_mini_batch_size"], "actor.ppo_mini_batch_size=8",
     "error"),
    ("check_mini_batch_divides_train_batch", ["data.train_batch_size=60"], None,
     ["data.train_batch_size", "actor.ppo_mini_batch_size"],
     "actor.ppo_mini_batch_size=15 or data.train_batch_size=64", "error"),
    ("check_micro_batch_sizes_exclusive", ["actor.ppo_micro_batch_size=32"], None,
     ["actor.ppo_micro_batch_size", "actor.ppo_micro_batch_size_per_gpu"],
     "remove actor.ppo_micro_batch_size", "error"),
    ("check_micro_batch_sizes_exclusive", ["actor.ppo_micro_batch_size_per_gpu=null"], None,
     ["actor.ppo_micro_batch_size_per_gpu"], "actor.ppo_micro_batch_size_per_gpu=4", "error"),
    ("check_global_micro_batch_splits_over_dp",
     ["actor.ppo_micro_batch_size_per_gpu=null", "actor.ppo_micro_batch_size=12"], None,
     ["actor.ppo_micro_batch_size"], "actor.ppo_micro_batch_size=16", "error"),
    ("check_mini_batch_splits_over_dp", ["rollout.n=3", "actor.ppo_mini_batch_size=4"], None,
     ["actor.ppo_mini_batch_size", "rollout.n"], "actor.ppo_mini_batch_size=8", "error"),
    ("check_micro_batch_divides_mini_batch", ["actor.ppo_micro_batch_size_per_gpu=5"], None,
     ["actor.ppo_micro_batch_size_per_gpu", "actor.ppo_mini_batch_size"],
     "actor.ppo_micro_batch_size_per_gpu=4", "error"),
    ("check_dynamic_bsz_token_budget",
     ["actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=2048"], None,
     ["actor.ppo_max_token_len_per_gpu", "data.max_response_length"],
     "actor.ppo_max_token_len_per_gpu=3072", "error"),
    ("check_dynamic_bsz_token_budget", ["actor.use_dynamic_bsz=true",
     "actor.ppo_max_token_len_per_gpu=1024", "actor.parallel.cp=2"], None,
     ["actor.ppo_max_token_len_per_gpu"], "actor.ppo_max_token_len_per_gpu=1536", "error"),
    ("check_dynamic_bsz_token_budget", ["actor.use_dynamic_bsz=true",
     "actor.log_prob_max_token_len_per_gpu=1024"], None,
     ["actor.log_prob_max_token_len_per_gpu"], "actor.log_prob_max_token_len_per_gpu=3072",
     "error"),
    ("check_dynamic_bsz_token_budget", ["actor.use_dynamic_bsz=true", "ref.enabled=true",
     "ref.log_prob_max_token_len_per_gpu=1024"], None,
     ["ref.log_prob_max_token_len_per_gpu"], "ref.log_prob_max_token_len_per_gpu=3072", "error"),
    ("check_critic_batch_split", ["algorithm.adv_estimator=gae",
     "critic.ppo_micro_batch_size_per_gpu=5"], None,
     ["critic.ppo_micro_batch_size_per_gpu"], "critic.ppo_micro_batch_size_per_gpu=4", "error"),
    # B3: layout against the pool and the model
    ("check_layout_fills_train_pool", ["actor.parallel.tp=3"], None,
     ["actor.parallel.tp", "resources.train_pool"], "actor.parallel.tp=2", "error"),
    ("check_expert_layout", ["actor.parallel.ep=16"], None,
     ["actor.parallel.ep", "actor.parallel.etp"], "actor.parallel.ep=8", "error"),
    ("check_expert_layout", ["actor.parallel.etp=2"], None,
     ["actor.parallel.ep", "actor.parallel.etp"], "actor.parallel.ep=4", "error"),
    ("check_experts_divisible_by_ep", [], QWEN_60E, ["actor.parallel.ep"],
     "actor.parallel.ep=4", "error"),
    ("check_experts_divisible_by_ep", ["actor.parallel.ep=2"], QWEN2_1_5B, ["actor.parallel.ep"],
     "actor.parallel.ep=1", "error"),
    ("check_heads_divisible_by_tp", ["actor.parallel.tp=8", "actor.parallel.ep=1"], QWEN2_1_5B,
     ["actor.parallel.tp"], "actor.parallel.tp=4", "error"),
    ("check_kv_heads_vs_tp", ["actor.parallel.tp=4", "actor.parallel.ep=1"], KV6,
     ["actor.parallel.tp"], "actor.parallel.tp=2", "error"),
    ("check_ffn_divisible", ["actor.parallel.etp=5"], None, ["actor.parallel.etp"],
     "actor.parallel.etp=4", "error"),
    ("check_layers_divisible_by_pp", ["actor.parallel.pp=4", "actor.parallel.ep=2"], QWEN_30L,
     ["actor.parallel.pp"], "actor.parallel.pp=2", "error"),
    ("check_layers_divisible_by_pp", ["actor.parallel.pp=2", "actor.parallel.vpp=5",
     "actor.parallel.ep=4"], None, ["actor.parallel.vpp"], "actor.parallel.vpp=4", "error"),
    ("check_layers_divisible_by_pp", ["actor.parallel.vpp=2"], None,
     ["actor.parallel.vpp", "actor.parallel.pp"], "remove actor.parallel.vpp", "error"),
    ("check_moe_tp_sequence_parallel", ["actor.parallel.tp=2", "actor.parallel.ep=4",
     "actor.parallel.sequence_parallel=false"], None, ["actor.parallel.sequence_parallel"],
     "actor.parallel.sequence_parallel=true", "error"),
    ("check_recompute_layers", ["actor.recompute.granularity=full",
     "actor.recompute.num_layers=30", "actor.parallel.pp=2", "actor.parallel.ep=4"], None,
     ["actor.recompute.num_layers"], "actor.recompute.num_layers=24", "error"),
    ("check_recompute_layers", ["actor.recompute.granularity=full",
     "actor.recompute.method=block", "actor.recompute.num_layers=30", "actor.parallel.pp=2",
     "actor.parallel.ep=4"], None, ["actor.recompute.num_layers", "actor.parallel.pp"],
     "actor.recompute.num_layers=24", "error"),
    ("check_recompute_layers", ["actor.recompute.granularity=full",
     "actor.recompute.num_layers=5", "actor.parallel.pp=2", "actor.parallel.ep=4"], None,
     ["actor.recompute.num_layers", "actor.parallel.pp"], "actor.recompute.num_layers=4",
     "error"),
    ("check_recompute_layers", ["actor.recompute.granularity=full",
     "actor.recompute.num_layers=4", "algorithm.adv_estimator=gae",
     "critic.parallel={tp: 1, pp: 8}"], None,
     ["actor.recompute.num_layers", "critic.parallel.pp"], "actor.recompute.num_layers=3", "error"),
    ("check_recompute_modules", ["actor.recompute.granularity=selective",
     "actor.recompute.modules=[core_attn, mlp]"], None, ["actor.recompute.modules"],
     "use moe in actor.recompute.modules", "error"),
    ("check_recompute_modules", ["actor.recompute.granularity=selective",
     "actor.recompute.modules=[moe]", "actor.parallel.ep=1"], QWEN2_1_5B,
     ["actor.recompute.modules"], "remove moe from actor.recompute.modules", "error"),
    ("check_recompute_modules", ["actor.recompute.granularity=selective",
     "actor.recompute.modules=[]"], None, ["actor.recompute.modules"],
     "actor.recompute.granularity=none", "error"),
    ("check_sequence_fits_positions", ["data.max_prompt_length=4096"], DENSE_4K,
     ["data.max_prompt_length", "data.max_response_length"], "<= 4096", "warning"),
    # B5: context parallelism
    ("check_context_parallel_sequence_length", ["actor.parallel.cp=2",
     "data.max_prompt_length=1000", "data.max_response_length=2047", "actor.parallel.ep=4"], None,
     ["actor.parallel.cp", "data.max_response_length"], "data.max_response_length=2048", "error"),
    ("check_layout_fills_train_pool", ["actor.parallel.cp=3"], None, ["actor.parallel.cp"],
     "use actor.parallel.cp=2", "error"),
    ("check_context_parallel_combinations", ["actor.parallel.cp=2", "actor.parallel.ep=4",
     "resources.train_pool.nnodes=2", "actor.parallel.tp=1"], DEEPSEEK_V3,
     ["actor.parallel.cp"], "actor.parallel.cp=1", "error"),
    ("check_context_parallel_combinations", ["actor.parallel.cp=2", "actor.parallel.ep=4",
     "actor.cuda_graphs=true"], None, ["actor.cuda_graphs", "actor.parallel.cp"],
     "set actor.cuda_graphs=false", "error"),
    # B4: rollout engines
    ("check_engines_fill_rollout_pool", ["rollout.gpus_per_engine=3"], None,
     ["rollout.gpus_per_engine", "resources.train_pool"], "rollout.gpus_per_engine=2", "error"),
    ("check_engines_fill_rollout_pool", ["rollout.gpus_per_engine=16",
     "resources.train_pool.nnodes=2"], None, ["rollout.gpus_per_engine"],
     "rollout.gpus_per_engine <= 8", "warning"),
    ("check_engine_heads", ["rollout.gpus_per_engine=8", "actor.parallel.ep=1"], QWEN2_1_5B,
     ["rollout.gpus_per_engine"], "rollout.gpus_per_engine=4", "error"),
    ("check_engine_memory", ["resources.gpu_memory_gb=16"], None,
     ["rollout.gpus_per_engine"], "rollout.gpus_per_engine=8", "error"),
    ("check_engine_concurrency", ["rollout.max_num_seqs=32"], None, ["rollout.max_num_seqs"],
     "rollout.max_num_seqs=64", "warning"),
    ("check_engine_fp8_blocks", ["rollout.quantization=fp8", "rollout.gpus_per_engine=4"], None,
     ["rollout.quantization", "rollout.gpus_per_engine"], "rollout.gpus_per_engine=2", "error"),
    # S3: files
    ("check_data_files", ["data.val_files=[/nonexistent/val.parquet]"], None, ["data.val_files"],
     "check the path", "error"),
    ("check_other_paths", ["trainer.resume=/nonexistent/ckpt"], None, ["trainer.resume"],
     "check the path", "error"),
    ("check_other_paths", ["model.mcore_checkpoint=/nonexistent/mcore"], None,
     ["model.mcore_checkpoint"], "check the path", "error"),
    # pools, schedulers, transports, devices
    ("check_pools_and_colocation", ["resources.rollout_pool.gpus_per_node=8"], None,
     ["rollout.colocate", "resources.rollout_pool"], "rollout.colocate=false", "error"),
    ("check_pools_and_colocation", ["rollout.colocate=false"], None,
     ["rollout.colocate", "resources.rollout_pool"], "add resources.rollout_pool", "error"),
    ("check_scheduler_needs_separate_pools", ["scheduler.mode=fully_async"], None,
     ["scheduler.mode", "rollout.colocate"], "rollout.colocate=false", "error"),
    ("check_weight_sync_backend", ["checkpoint_engine.backend=ipc", "rollout.colocate=false",
     "resources.rollout_pool.gpus_per_node=8"], None,
     ["checkpoint_engine.backend", "rollout.colocate"], "checkpoint_engine.backend=nccl", "error"),
    ("check_weight_sync_backend", ["checkpoint_engine.backend=nccl", "rollout.colocate=true",
     "resources.device=cuda"], None,
     ["checkpoint_engine.backend", "rollout.colocate"], "checkpoint_engine.backend=ipc", "error"),
    ("check_device_settings", ["resources.device=cpu"], None,
     ["rollout.backend", "resources.device"], "rollout.backend=local", "error"),
    ("check_device_settings", ["resources.device=cpu", "rollout.backend=local",
     "ray.num_cpus=2"], None, ["ray.num_cpus"], "ray.num_cpus=8", "warning"),
    # T7 and algorithm options
    ("check_offload_param_and_optimizer", ["actor.offload.param_offload=true",
     "actor.offload.optimizer_offload=true"], None,
     ["actor.offload.param_offload", "actor.offload.optimizer_offload"],
     "actor.offload.optimizer_offload=true alone", "warning"),
    ("check_offload_param_and_optimizer", ["actor.offload.param_offload=true"], None,
     ["actor.offload.param_offload", "actor.offload.optimizer_offload"],
     "drop actor.offload.param_offload, or set actor.offload.optimizer_offload=false",
     "warning"),
    ("check_not_built", ["checkpoint_engine.backend=disk"], None,
     ["checkpoint_engine.backend"], "set checkpoint_engine.backend=auto", "error"),
    ("check_group_size", ["rollout.n=1"], None, ["rollout.n", "algorithm.adv_estimator"],
     "rollout.n=8", "error"),
    ("check_group_size", ["rollout.n=1", "algorithm.adv_estimator=opo"], None,
     ["rollout.n", "algorithm.adv_estimator"], "rollout.n=8", "error"),
    ("check_estimator_is_built", ["algorithm.adv_estimator=remax"], None,
     ["algorithm.adv_estimator"], "algorithm.adv_estimator=grpo", "error"),
    ("check_critic_for_gae", ["algorithm.adv_estimator=gae", "critic.enabled=false"], None,
     ["algorithm.adv_estimator", "critic.enabled"], "critic.enabled=true", "error"),
    ("check_critic_for_gae", ["critic.enabled=true"], None, ["critic.enabled"],
     "leave critic.enabled unset", "warning"),
    ("check_reference_layout", ["actor.use_kl_loss=true", "ref.parallel.tp=2"], None,
     ["ref.parallel.tp"], "remove ref.parallel or set it equal to actor.parallel", "error"),
    ("check_reference_for_kl", ["actor.use_kl_loss=true", "ref.enabled=false"], None,
     ["actor.use_kl_loss", "ref.enabled"], "ref.enabled=true", "error"),
    ("check_reference_for_kl", ["actor.use_kl_loss=true", "algorithm.use_kl_in_reward=true"],
     None, ["actor.use_kl_loss", "algorithm.use_kl_in_reward"], "keep one", "warning"),
    ("check_policy_loss_settings", ["actor.policy_loss.loss_mode=gspo"], None,
     ["actor.loss_agg_mode"], "actor.loss_agg_mode=seq-mean-token-mean", "error"),
    ("check_policy_loss_settings", ["actor.policy_loss.loss_mode=geo_mean"], None,
     ["actor.loss_agg_mode"], "actor.loss_agg_mode=seq-mean-token-mean", "error"),
    ("check_policy_loss_settings", ["actor.policy_loss.loss_mode=clip_cov",
     "actor.policy_loss.clip_cov_lb=5"], None, ["actor.policy_loss.clip_cov_lb"],
     "clip_cov_lb < clip_cov_ub", "error"),
    ("check_rollout_correction", ["algorithm.rollout_correction.rollout_rs=seq_mean_k3"], None,
     ["algorithm.rollout_correction.rollout_rs_threshold"],
     "algorithm.rollout_correction.rollout_rs_threshold (e.g. 0.01)", "error"),
    ("check_rollout_correction", ["algorithm.rollout_correction.rollout_rs=token_k1",
     "algorithm.rollout_correction.rollout_rs_threshold='0.1_0.4'"], None,
     ["algorithm.rollout_correction.rollout_rs_threshold"], "'0.67_0.905'", "warning"),
    ("check_rollout_correction", ["algorithm.rollout_correction.rollout_rs=token_k1",
     "algorithm.rollout_correction.rollout_rs_threshold='-0.2_0.4'"], None,
     ["algorithm.rollout_correction.rollout_rs_threshold"], "'0.67_1.22'", "error"),
    ("check_rollout_correction", ["algorithm.rollout_correction.rollout_rs=token_k1,seq_max_k2",
     "algorithm.rollout_correction.rollout_rs_threshold='2.0,0.1,0.3'"], None,
     ["algorithm.rollout_correction.rollout_rs_threshold"], "one per criterion", "error"),
    ("check_rollout_correction", ["algorithm.rollout_correction.rollout_is=token",
     "algorithm.rollout_correction.rollout_is_threshold=0.9"], None,
     ["algorithm.rollout_correction.rollout_is_threshold"], "rollout_is_threshold=2.0", "warning"),
    ("check_fp8_attention", ["rollout.fp8_attention=false"], None,
     ["rollout.fp8_attention", "rollout.quantization"], "set rollout.quantization=fp8", "error"),
    ("check_router_replay", ["actor.router_replay.mode=R3", "actor.parallel.ep=1"], QWEN2_1_5B,
     ["actor.router_replay.mode"], "actor.router_replay.mode=disabled", "error"),
    ("check_router_replay", ["actor.router_replay.mode=R3",
     "rollout.enable_return_routed_experts=false"], None,
     ["actor.router_replay.mode", "rollout.enable_return_routed_experts"],
     "rollout.enable_return_routed_experts=true", "error"),
    ("check_cuda_graphs", ["actor.cuda_graphs=true", "actor.offload.param_offload=true"], None,
     ["actor.cuda_graphs", "actor.offload.param_offload"], "actor.offload.param_offload=false",
     "error"),
    ("check_cuda_graphs", ["actor.cuda_graphs=true", "actor.parallel.pp=2"], None,
     ["actor.cuda_graphs", "actor.parallel.pp"], "actor.parallel.pp=1", "error"),
    ("check_cuda_graphs", ["actor.cuda_graphs=true", "actor.router_replay.mode=R2"], None,
     ["actor.cuda_graphs", "actor.router_replay.mode"], "set actor.cuda_graphs=false", "error"),
    ("check_cuda_graphs", ["actor.cuda_graphs=true", "actor.recompute.granularity=selective"],
     None, ["actor.cuda_graphs", "actor.recompute.granularity"],
     "actor.recompute.granularity=none", "error"),
    ("check_training_safety", ["actor.grad_clip=0"], None, ["actor.grad_clip"],
     "actor.grad_clip=1.0", "warning"),
    ("check_validation_data", ["trainer.val_every=5"], None,
     ["trainer.val_every", "data.val_files"], "add data.val_files", "error"),
    ("check_optional_packages", ["reward.function=no_such_module_42:score"], None,
     ["reward.function"], "PYTHONPATH", "error"),
    ("check_settings_without_effect", ["actor.ppo_max_token_len_per_gpu=8192"], None,
     ["actor.ppo_max_token_len_per_gpu"], "set actor.use_dynamic_bsz=true to use it", "warning"),
    ("check_settings_without_effect", ["actor.log_prob_max_token_len_per_gpu=65536"], None,
     ["actor.log_prob_max_token_len_per_gpu"], "set actor.use_dynamic_bsz=true to use it",
     "warning"),
    ("check_settings_without_effect", ["scheduler.staleness_threshold=0.5"], None,
     ["scheduler.staleness_threshold"], "scheduler.mode=fully_async", "warning"),
    ("check_settings_without_effect", ["actor.offload.optimizer_offload=false",
                                       "actor.offload.optimizer_step_chunk_mb=256"], None,
     ["actor.offload.optimizer_step_chunk_mb"], "actor.offload.optimizer_offload=true", "warning"),
    ("check_settings_without_effect", ["trainer.worker_group=naive",
                                       "ray.timeline_file=/tmp/megarl_timeline.json"], None,
     ["ray.timeline_file"], "set trainer.worker_group=ray", "warning"),
    ("check_sglang_only_settings", ["rollout.backend=local", "rollout.chunked_prefill_size=4096"],
     None, ["rollout.chunked_prefill_size", "rollout.backend"], "rollout.max_prefill_tokens",
     "error"),
    ("check_sglang_only_settings", ["rollout.backend=local",
                                    "rollout.sglang_args=[--cuda-graph-max-bs,'256']"], None,
     ["rollout.sglang_args", "rollout.backend"], "set rollout.backend=sglang", "error"),
    # multi-turn episodes (rollout.multi_turn)
    ("check_multi_turn", ["rollout.multi_turn.enable=true"], None,
     ["rollout.multi_turn.tools", "rollout.multi_turn.env"],
     "rollout.multi_turn.tools=[megarl.rollout.agent:calculator]", "error"),
    ("check_multi_turn", ["rollout.multi_turn.enable=true",
     "rollout.multi_turn.tools=[megarl.rollout.agent:calculator]",
     "rollout.multi_turn.env=megarl.rollout.agent:ToolEnvironment"], None,
     ["rollout.multi_turn.tools", "rollout.multi_turn.env"], "set one of them", "error"),
    ("check_multi_turn", ["rollout.multi_turn.enable=true",
     "rollout.multi_turn.tools=[no_such_module_42:tool]"], None,
     ["rollout.multi_turn.tools[0]"], "'package.module:name'", "error"),
    ("check_multi_turn", ["rollout.multi_turn.enable=true",
     "rollout.multi_turn.env=no_such_module_42.make_env"], None,
     ["rollout.multi_turn.env"], "PYTHONPATH", "error"),
    ("check_multi_turn", ["rollout.multi_turn.enable=true",
     "rollout.multi_turn.tools=[megarl.rollout.agent:calculator]",
     "rollout.multi_turn.max_tokens_per_turn=100000"], None,
     ["rollout.multi_turn.max_tokens_per_turn", "data.max_response_length"],
     "rollout.multi_turn.max_tokens_per_turn <=", "error"),
    ("check_settings_without_effect", ["rollout.multi_turn.max_assistant_turns=3"], None,
     ["rollout.multi_turn.max_assistant_turns"], "set rollout.multi_turn.enable=true",
     "warning"),
    # LoRA (actor.lora): what it cannot run with, and targets / exclusions naming real layers
    ("check_lora", ["actor.lora.rank=8", "actor.cuda_graphs=true"], None,
     ["actor.lora.rank", "actor.cuda_graphs"], "set actor.cuda_graphs=false", "error"),
    ("check_lora", ["actor.lora.rank=8", "actor.lora.target_modules=[linear_qkv,linear_fc1]"],
     None, ["actor.lora.target_modules"], "choose targets and patterns", "error"),
    ("check_lora", ["actor.lora.rank=8", "actor.lora.exclude_modules=[layers.99.*]"], None,
     ["actor.lora.exclude_modules"], "choose targets and patterns", "error"),
    ("check_lora", ["actor.lora.rank=8", "actor.lora.exclude_modules=['layers.*']"], None,
     ["actor.lora.exclude_modules"], "choose targets and patterns", "error"),
    ("check_lora", ["actor.lora.rank=8"], DEEPSEEK_V3, ["actor.lora.rank", "model.path"],
     "set actor.lora.rank=0", "error"),
    ("check_lora", ["actor.lora.rank=8", "actor.lora.dropout=0.1",
                    "actor.lora.target_modules=[experts.linear_fc1]"], None,
     ["actor.lora.dropout", "actor.lora.target_modules"], "set actor.lora.dropout=0", "error"),
    ("check_lora", ["actor.lora.rank=8", "actor.lora.target_modules=[experts.linear_fc2]",
                    "actor.parallel.tp=1", "actor.parallel.etp=2", "actor.parallel.ep=1"], None,
     ["actor.lora.target_modules", "actor.parallel.etp"], "set actor.parallel.etp=1", "error"),
    ("check_settings_without_effect", ["actor.lora.alpha=32"], None, ["actor.lora.alpha"],
     "set actor.lora.rank > 0", "warning"),
    # security: engines reachable from the network need an API key
    ("check_rollout_bind_needs_api_key", ["rollout.host=0.0.0.0"], None,
     ["rollout.host", "rollout.api_key"], "set rollout.api_key", "error"),
    # T1: memory per GPU (estimates.py; numbers in test_config_estimates.py)
    ("check_memory_fits", ["resources.gpu_memory_gb=16"], None,
     ["resources.gpu_memory_gb", "actor.parallel.ep"], "add GPUs to the train pool", "warning"),
]


def test_base_config_is_clean(checker):
    assert [p.line() for p in checker.problems()] == []


@pytest.mark.parametrize("rule,overrides,arch,fields,fix,severity", CASES,
                         ids=[f"{c[0]}-{'+'.join(c[1]) or 'model'}" for c in CASES])
def test_rule_names_fields_and_fix(checker, rule, overrides, arch, fields, fix, severity):
    problem = checker.find(rule, *overrides, model=arch, field=fields[0])
    line = problem.line()
    for field in fields:
        assert field in problem.fields, line
    assert " — " in line and fix in line.split(" — ", 1)[1], line
    assert problem.severity == severity, line


def test_every_rule_has_a_case():
    covered = {case[0] for case in CASES} | {"check_model_dir", "check_vocab_and_tokenizer",
                                              "check_model_weights"}  # test_config_shipped.py
    assert {rule.__name__ for rule in RULES} <= covered


def test_suggested_fixes_are_valid(checker):
    """Applying the suggested value removes the problem (the fix is not just any number)."""
    for overrides, fix in ((["data.train_batch_size=60"], ["actor.ppo_mini_batch_size=15",
                                                            "actor.ppo_micro_batch_size_per_gpu=5"]),
                           (["actor.parallel.tp=3"], ["actor.parallel.tp=2",
                                                       "actor.parallel.ep=4"]),
                           (["actor.ppo_micro_batch_size_per_gpu=5"],
                            ["actor.ppo_micro_batch_size_per_gpu=4"])):
        assert checker.problems(*overrides), overrides
        assert checker.problems(*overrides, *fix) == [], (overrides, fix)


def test_b3_example_tp3_on_6_gpus_is_rejected_against_the_model(checker):
    """PITFALLS B3: tp=3 on 6 GPUs with a batch of 60 over 2 engines."""
    problems = checker.problems(
        "resources.train_pool.gpus_per_node=6", "actor.parallel.tp=3", "actor.parallel.ep=1",
        "data.train_batch_size=60", "rollout.n=12", "actor.ppo_mini_batch_size=15",
        "actor.ppo_micro_batch_size_per_gpu=3", "rollout.gpus_per_engine=3")
    rules = {p.rule for p in problems if p.is_error}
    assert rules == {"check_heads_divisible_by_tp", "check_kv_heads_vs_tp", "check_engine_heads"}
    heads = next(p for p in problems if p.rule == "check_heads_divisible_by_tp")
    assert "32 attention heads" in heads.line() and "actor.parallel.tp=2" in heads.line()


def test_missing_model_dir_is_an_error_or_with_allow_a_warning(tmp_path, data_file):

    cfg, sources = load_config_dict(base_dict(tmp_path, data_file))
    problems = validate_config(cfg, sources=sources)
    assert [p.rule for p in problems] == ["check_model_dir"]
    assert problems[0].is_error and "model.path" in problems[0].fields
    assert f"{tmp_path / 'model'} does not exist" in problems[0].line()
    relaxed = validate_config(cfg, sources=sources, allow_missing_files=True)
    assert [p.severity for p in relaxed] == ["warning"]
    assert "architecture were skipped" in relaxed[0].line()


def test_model_dir_without_config_json_is_always_an_error(tmp_path, data_file):

    (tmp_path / "model").mkdir()
    cfg, _ = load_config_dict(base_dict(tmp_path, data_file))
    problems = validate_config(cfg, allow_missing_files=True)
    assert [(p.rule, p.severity) for p in problems] == [("check_model_dir", "error")]
    assert "has no config.json" in problems[0].line()


def test_missing_data_file_errors_and_allow_demotes(checker):
    strict = checker.find("check_data_files", "data.train_files=/nope/train.parquet")
    assert strict.is_error and "/nope/train.parquet does not exist" in strict.line()
    relaxed = checker.find("check_data_files", "data.train_files=/nope/train.parquet",
                           allow_missing_files=True)
    assert relaxed.severity == "warning"


def test_tokenizer_larger_than_vocab_is_rejected(checker, tiny_moe_dir, tmp_path):
    model_dir = tmp_path / "small_vocab"
    model_dir.mkdir()
    shutil.copy(tiny_moe_dir / "tokenizer.json", model_dir / "tokenizer.json")
    config = json.loads((tiny_moe_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps(dict(config, vocab_size=64)))
    problem = checker.find("check_vocab_and_tokenizer", f"model.path={model_dir}",
                           "actor.parallel.ep=4", model=load_model_info(model_dir))
    assert problem.fields == ("model.tokenizer_path", "model.path")
    assert "token ids up to 101" in problem.line() and "vocab_size is 64" in problem.line()


def test_context_parallel_layouts_that_are_built_pass(checker):
    """cp=2 with TP + SP, EP, a critic and router replay is built (tests/megatron): no error."""
    assert checker.problems("actor.parallel.cp=2", "actor.parallel.ep=4") == []
    assert checker.problems("actor.parallel.cp=2", "actor.parallel.ep=2", "actor.parallel.tp=2",
                            "actor.router_replay.mode=R2") == []


def test_r3_turns_on_routed_experts_by_itself(checker):
    assert checker.problems("actor.router_replay.mode=R3") == []


def test_deepseek_v3_layout(checker):
    """61 layers (3 dense) and 256 experts on 2 x 8 GPUs: pp must divide 61, so pp=1 only."""
    assert checker.problems("resources.train_pool.nnodes=2", "actor.parallel.ep=16",
                            "actor.parallel.tp=1", model=DEEPSEEK_V3) == []
    problem = checker.find("check_layers_divisible_by_pp", "actor.parallel.pp=2",
                           model=DEEPSEEK_V3)
    assert "61 layers" in problem.line() and "actor.parallel.pp=1" in problem.line()


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed")
def test_wandb_logger_without_wandb_is_rejected(checker):
    problem = checker.find("check_optional_packages", "trainer.loggers=[console, wandb]")
    assert "pip install wandb" in problem.line()


def test_errors_come_before_warnings(checker):
    problems = checker.problems("actor.grad_clip=0", "data.train_batch_size=60")
    assert [p.severity for p in problems] == ["error", "warning"]


def test_problem_line_format(checker):
    line = checker.find("check_group_size", "rollout.n=1").line()
    fields, rest = line.split(": ", 1)
    assert fields == "rollout.n, algorithm.adv_estimator"
    what, fix = rest.split(" — ")
    assert "advantage 0" in what and fix.startswith("set rollout.n=8")


def test_files_are_read_from_real_paths(checker, tmp_path: Path):
    val = tmp_path / "val.jsonl"
    val.write_text("{}\n")
    assert checker.problems(f"data.val_files=[{val}]") == []


def test_file_problems_checks_only_files(tmp_path, data_file):

    from megarl.config.validate import file_problems

    cfg, _ = load_config_dict(base_dict(tmp_path, data_file), ["data.train_batch_size=60",
                                                               "data.val_files=[/nope.parquet]"])
    assert [p.rule for p in file_problems(cfg)] == ["check_model_dir", "check_data_files"]


@pytest.mark.parametrize("mode", ["one_step_off", "fully_async"])
def test_overlapping_schedules_on_one_colocated_gpu_are_refused_with_the_reason(checker, mode):
    """Issue 18 item 6: on one GPU the engine and the actor take turns, so a schedule that
    overlaps them is refused at validation, naming both fields and the way out."""
    problem = checker.find("check_scheduler_needs_separate_pools", f"scheduler.mode={mode}",
                           "resources.device=cuda", "resources.train_pool.gpus_per_node=1",
                           "rollout.colocate=true", "actor.parallel.ep=1")
    assert problem.severity == "error"
    assert problem.fields == ("scheduler.mode", "rollout.colocate")
    assert "gives its weights and KV cache back while the actor trains" in problem.message
    assert "scheduler.mode=colocate_sync" in problem.fix


def test_lora_on_the_default_targets_is_clean(checker):
    """LoRA with the default targets (every attention layer of the all-MoE Qwen3-30B-A3B: the
    dense-MLP targets are left out where no layer has them) validates; so does an exclusion
    that names a real layer. Here the merged sync (the default) is in bf16: clean with rollout
    correction on or with the adapter sync, otherwise warned about (the next test)."""
    corrected = "algorithm.rollout_correction.rollout_is=token"
    assert [p.line() for p in checker.problems("actor.lora.rank=8", corrected)] == []
    assert [p.line() for p in checker.problems(
        "actor.lora.rank=8", "actor.lora.exclude_modules=[layers.0.*]", corrected)] == []
    assert [p.line() for p in checker.problems("actor.lora.rank=8", "actor.lora.sync=adapter")
            ] == []


def test_the_merged_sync_in_bf16_without_rollout_correction_is_warned_about(checker):
    """W + alpha/r * B A rounded to bf16 loses the adapters' early change (docs/lora.md): a
    warning naming the three fields, not an error."""
    problems = checker.problems("actor.lora.rank=8")
    assert [p.rule for p in problems] == ["check_lora"]
    assert not problems[0].is_error
    line = problems[0].line()
    for field in ("actor.lora.sync", "rollout.dtype", "algorithm.rollout_correction.rollout_is"):
        assert field in line
    assert "rounded to bfloat16" in line
    fp16 = checker.find("check_lora", "actor.lora.rank=8", "rollout.dtype=float16")
    assert "rounded to float16" in fp16.line()
    assert checker.problems("actor.lora.rank=8", "model.dtype=float32") == []


def test_fp8_engines_that_fit_sglangs_blocks_pass(checker):
    """Qwen3-30B-A3B in block FP8 on SGLang: 1 or 2 GPUs per engine keep q, k/v and the experts'
    768 intermediate features whole 128-blocks per GPU (4 GPUs leave 192: refused above); the
    embedded engine and bf16 engines have no such rule."""
    for overrides in (["rollout.quantization=fp8", "rollout.gpus_per_engine=2"],
                      ["rollout.quantization=fp8", "rollout.gpus_per_engine=1"],
                      ["rollout.quantization=fp8", "rollout.gpus_per_engine=4",
                       "rollout.backend=local"],
                      ["rollout.gpus_per_engine=4"]):
        assert not [p for p in checker.problems(*overrides)
                    if p.rule == "check_engine_fp8_blocks"], overrides
    problem = checker.find("check_engine_fp8_blocks", "rollout.quantization=fp8",
                           "rollout.gpus_per_engine=4")
    assert "moe_intermediate_size 192" in problem.line()


def test_the_adapter_sync_refuses_a_base_the_engines_do_not_have(checker):
    """actor.lora.sync=adapter sends only the adapters, so the engines' base is model.path: an
    actor whose first weights come from model.mcore_checkpoint would not match it, and engines
    started from dummy weights would never get one."""
    lora = ("actor.lora.rank=8", "actor.lora.sync=adapter")
    problem = checker.find("check_lora", *lora, "model.mcore_checkpoint=/ckpt/run",
                           field="actor.lora.sync", allow_missing_files=True)
    assert "model.mcore_checkpoint" in problem.fields and "actor.lora.sync=merged" in problem.line()
    assert not [p for p in checker.problems(*lora, allow_missing_files=True)
                if p.rule == "check_lora"]
    corrected = "algorithm.rollout_correction.rollout_is=token"  # else the bf16 merge warns
    assert not [p for p in checker.problems("actor.lora.rank=8",
                                            "model.mcore_checkpoint=/ckpt/run", corrected,
                                            allow_missing_files=True)
                if p.rule == "check_lora"]
    # nor engines that start from dummy weights: the adapter sync never sends them a base
    for dummy in (["rollout.load_format=dummy"],
                  ["rollout.backend=sglang", "rollout.quantization=fp8"]):
        problem = checker.find("check_lora", *lora, *dummy, field="actor.lora.sync",
                               allow_missing_files=True)
        assert "rollout.load_format" in problem.fields and "never sends" in problem.line()
    assert not [p for p in checker.problems("actor.lora.rank=8", "rollout.load_format=dummy",
                                            corrected, allow_missing_files=True)
                if p.rule == "check_lora"]
