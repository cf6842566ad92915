"""Parameter counts and per-GPU memory estimates (megarl/config/estimates.py, PITFALLS T1):
published totals of the model cards, hand arithmetic on the real tiny model, and the warning when
a phase does not fit ``resources.gpu_memory_gb``."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from megarl.config import (
    derive_sizes,
    load_config,
    load_config_dict,
    load_model_info,
    resolve_sizes,
)
from megarl.config.estimates import (
    BUCKETS_IN_FLIGHT,
    GB,
    estimate,
    micro_batches_in_flight,
    stage_layers,
)
from megarl.config.estimates_report import _step_optimizer, format_estimates
from megarl.config.schema import ParallelConfig
from megarl.config.validate import validate_config
from megarl.weights.buckets import BufferPool

REPO = Path(__file__).resolve().parents[2]
CARDS = REPO / "configs" / "models"

# Published (total, activated) parameters: Qwen3 model cards and technical report; DeepSeek-V3
# technical report (671B main model without the 14B MTP module, 37B activated per token).
PUBLISHED = {
    "qwen3-0.6b": (0.6e9, 0.6e9),
    "qwen3-8b": (8.2e9, 8.2e9),
    "qwen3-30b-a3b": (30.5e9, 3.3e9),
    "qwen3-235b-a22b": (235e9, 22e9),
    "deepseek-v3-671b": (671e9, 37e9),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_param_counts_match_the_published_totals_within_2_percent(name):
    info = load_model_info(CARDS / name)
    total, active = PUBLISHED[name]
    assert info.param_count() == pytest.approx(total, rel=0.02)
    assert info.active_param_count() == pytest.approx(active, rel=0.02)


def test_mla_attention_and_kv_cache_by_hand():
    """DeepSeek-V3's MLA: low-rank q and kv projections, one 576-wide latent cached per layer."""
    info = load_model_info(CARDS / "deepseek-v3-671b")
    h, heads = 7168, 128
    q = h * 1536 + 1536 * heads * (128 + 64)
    kv = h * (512 + 64) + 512 * heads * (128 + 128)
    out = heads * 128 * h
    assert info.attention_params() == q + kv + out == 187_105_280
    assert info.kv_bytes_per_token("bfloat16", tp=16) == 61 * 576 * 2
    expert = 3 * h * 2048
    layer_moe = info.attention_params() + 257 * expert + h * 256  # 256 routed + 1 shared, router
    layer_dense = info.attention_params() + 3 * h * 18432
    embed = 2 * 129280 * h
    assert info.param_count() == embed + 3 * layer_dense + 58 * layer_moe
    assert info.active_param_count() == info.param_count() - 58 * 248 * expert


# ---------------------------------------------------------------------------------------------
# Memory on the real tiny model: 2 layers, h 64, 4 heads x 16, 2 KV heads, 4 experts (top-2) of
# width 32, vocab 128, fp32; the demo config puts it on 2 processes.


# The sizes these tests were written against; the demo config itself is tuned for learning.
PINNED = ["data.train_batch_size=8", "rollout.n=4", "actor.ppo_mini_batch_size=4",
          "actor.ppo_micro_batch_size_per_gpu=4", "data.max_response_length=32"]


def tiny_config(tiny_moe_dir: Path, *overrides: str):
    """The demo config on the tiny model, with GPU-style memory settings."""
    cfg, _ = load_config(REPO / "configs" / "tiny-moe-cpu.yaml", [
        f"model.path={tiny_moe_dir}", "actor.parallel.ep=1", *PINNED, *overrides])
    return cfg


def tiny_estimate(tiny_moe_dir: Path, *overrides: str):
    """Estimates of the demo config on the tiny model."""
    cfg = tiny_config(tiny_moe_dir, *overrides)
    model = load_model_info(tiny_moe_dir)
    return estimate(cfg, model, derive_sizes(cfg, model)), model


def tiny_tensor_count(tiny_moe_dir: Path) -> tuple[int, int]:
    """(non-norm parameters, routed-expert parameters) read from the safetensors file."""
    from safetensors import safe_open

    with safe_open(tiny_moe_dir / "model.safetensors", framework="pt") as f:
        shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}  # noqa: SIM118
    total = sum(math.prod(s) for k, s in shapes.items() if "norm" not in k)
    experts = sum(math.prod(s) for k, s in shapes.items() if ".experts." in k)
    return total, experts


def test_tiny_state_bytes_by_hand(tiny_moe_dir):
    est, model = tiny_estimate(tiny_moe_dir)
    params, _ = tiny_tensor_count(tiny_moe_dir)
    st = est.update.state
    assert est.params.total == model.param_count() == params
    assert st.dense_params + st.expert_params == params  # tp = pp = ep = 1: everything
    assert st.weights == params * 4  # fp32
    assert st.grads == params * 4
    assert st.optimizer == 8 * params / 2  # fp32 params: Adam moments only, over dp=2


def test_bf16_adds_the_master_copy_and_no_distributed_optimizer_replicates(tiny_moe_dir):
    params, _ = tiny_tensor_count(tiny_moe_dir)
    bf16, _ = tiny_estimate(tiny_moe_dir, "model.dtype=bfloat16")
    assert bf16.update.state.weights == params * 2 and bf16.update.state.grads == params * 4
    assert bf16.update.state.optimizer == 12 * params / 2
    replicated, _ = tiny_estimate(tiny_moe_dir, "actor.use_distributed_optimizer=false")
    assert replicated.update.state.optimizer == 8 * params


def test_expert_parallel_splits_experts_and_their_optimizer_shards(tiny_moe_dir):
    params, experts = tiny_tensor_count(tiny_moe_dir)
    est, _ = tiny_estimate(tiny_moe_dir, "actor.parallel.ep=2")
    st = est.update.state
    assert st.expert_params == experts // 2 and st.dense_params == params - experts
    # expert-dp = 2 / ep 2 = 1 shard; the non-expert part is sharded over dp = 2
    assert st.optimizer == 8 * ((params - experts) / 2 + experts / 2)


def test_tiny_activations_and_logits_by_hand(tiny_moe_dir):
    est, _ = tiny_estimate(tiny_moe_dir)
    tokens = 4 * (64 + 32)  # micro-batch of 4 sequences x longest sequence
    attention = 2 * 64 + 16 * (2 * 4 + 2 * 2)  # norm in/out + q, k, v and attention output
    moe = (2 * 64 + 2 * 4) + 2 * (64 + 3 * 32)  # norm in/out + fp32 router; top-2 experts
    assert est.update.tokens_per_micro_batch == tokens
    assert est.update.activations == 2 * (attention + moe) * 4 * tokens
    # log-probs from the hidden states: one chunk of logits (tokens x 128 fp32: bytes 4 + 2 x 4),
    # the output weight's gradient (128 x 64, fp32 + fp32) and hidden states + gradient
    assert est.update.logits == tokens * 128 * (4 + 8) + 128 * 64 * (4 + 4) + 2 * tokens * 64 * 4
    graphed, _ = tiny_estimate(tiny_moe_dir, "actor.cuda_graphs=true")
    assert graphed.update.logits == tokens * 128 * (4 + 4)  # the graphs keep whole logits
    full, _ = tiny_estimate(tiny_moe_dir, "actor.recompute.granularity=full")
    # two 1-layer units keep their inputs (h each); one unit is recomputed at a time
    assert full.update.activations == (2 * 64 + attention + moe) * 4 * tokens
    assert full.update.activations < est.update.activations


def test_the_log_prob_forward_by_hand(tiny_moe_dir):
    """No backward: one layer's activations for the forward's tokens, one chunk of logits with
    the hidden states (no gradients), next to the actor's state as the sync sees it; its own
    token budget (actor.log_prob_max_token_len_per_gpu, the reference's if larger)."""
    attention = 2 * 64 + 16 * (2 * 4 + 2 * 2)
    moe = (2 * 64 + 2 * 4) + 2 * (64 + 3 * 32)
    est, _ = tiny_estimate(tiny_moe_dir)
    tokens = 4 * (64 + 32)  # null: the training micro-batch
    lp = est.log_prob
    assert lp.tokens_per_micro_batch == tokens
    assert lp.activations == 4 * (attention + moe) * tokens
    assert lp.log_probs == tokens * 128 * (4 + 8) + tokens * 64 * 4
    assert lp.resident == est.sync_actor == est.update.state.total
    assert lp.total == lp.resident + lp.activations + lp.log_probs + lp.other_roles
    dynamic = ("actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=512")
    big, _ = tiny_estimate(tiny_moe_dir, *dynamic, "actor.log_prob_max_token_len_per_gpu=4096")
    assert big.log_prob.tokens_per_micro_batch == 4096
    assert big.log_prob.activations == 4 * (attention + moe) * 4096
    assert big.update.tokens_per_micro_batch == 512  # the update keeps its own budget
    ref, _ = tiny_estimate(tiny_moe_dir, *dynamic, "actor.log_prob_max_token_len_per_gpu=1024",
                           "ref.enabled=true", "ref.log_prob_max_token_len_per_gpu=2048")
    assert ref.log_prob.tokens_per_micro_batch == 2048
    # a forward larger than the update warns, naming the budget
    cfg = tiny_config(tiny_moe_dir, *dynamic, "actor.log_prob_max_token_len_per_gpu=262144",
                      "resources.gpu_memory_gb=0.5")
    found = [p for p in memory_warnings(cfg) if "log-prob forward" in p.line()]
    assert found and "actor.log_prob_max_token_len_per_gpu" in found[0].fields, found


def test_engine_and_sync_by_hand(tiny_moe_dir):
    est, model = tiny_estimate(tiny_moe_dir, "resources.gpu_memory_gb=0.01")
    e = est.engine
    usable = int(0.01 * GB * 0.8)
    assert e.weights == model.param_count() * 4 and e.usable == usable
    assert e.kv_bytes_per_sequence == 2 * 2 * 2 * 16 * 4 * 96  # K,V x layers x kv x dim x fp32
    assert e.sequences_fit == (usable - e.weights) // e.kv_bytes_per_sequence
    assert e.train_resident == 0 and not e.colocated  # the demo has its own rollout pool
    # actor state + the sender's two 16 MB bucket buffers (BufferPool's two slots)
    assert est.sync == est.update.state.total + 2 * 16 * 2**20
    assert BufferPool(torch.empty, lambda buffer: None, 16).slots == BUCKETS_IN_FLIGHT == 2


def test_fp8_engines_hold_one_byte_per_projection_weight(tiny_moe_dir):
    """rollout.quantization=fp8: the engine's projections take 1 byte (+ an fp32 scale per
    128x128 block), embeddings, output layer and routers keep rollout.dtype; the KV cache gets
    what that frees. Qwen3-30B-A3B: 30.5B parameters, 0.62B of them embeddings and head."""
    from config_archs import QWEN3_30B_A3B

    from megarl.config.model_info import model_info_from_dict

    est, model = tiny_estimate(tiny_moe_dir, "resources.gpu_memory_gb=0.01")
    fp8, _ = tiny_estimate(tiny_moe_dir, "resources.gpu_memory_gb=0.01",
                           "rollout.quantization=fp8", "rollout.backend=local")
    h, vocab, experts, layers = 64, 128, 4, 2
    router = layers * h * experts
    projections = model.param_count() - 2 * vocab * h - router
    assert model.fp8_params() == projections
    assert fp8.engine.weights == math.ceil(projections * (1 + 4 / 128**2)
                                           + (2 * vocab * h + router) * 4)
    assert fp8.engine.sequences_fit > est.engine.sequences_fit
    qwen = model_info_from_dict(QWEN3_30B_A3B)
    bf16, in_fp8 = (qwen.weight_bytes("bfloat16", q) for q in (None, "fp8"))
    assert 30e9 < qwen.param_count() < 31e9
    assert in_fp8 == pytest.approx(qwen.fp8_params() * (1 + 4 / 128**2)
                                   + (qwen.param_count() - qwen.fp8_params()) * 2)
    assert 0.5 < in_fp8 / bf16 < 0.52
    # rollout.fp8_attention=false: the attention projections (q, k, v, o) stay in bf16
    kept, _ = tiny_estimate(tiny_moe_dir, "resources.gpu_memory_gb=0.01",
                            "rollout.quantization=fp8", "rollout.backend=local",
                            "rollout.fp8_attention=false")
    heads, kv_heads, head_dim = 4, 2, 16
    attention = layers * h * head_dim * (2 * heads + 2 * kv_heads)
    assert kept.engine.weights == math.ceil((projections - attention) * (1 + 4 / 128**2)
                                            + (2 * vocab * h + router + attention) * 4)
    qwen_attention = 48 * 2048 * 128 * (2 * 32 + 2 * 4)  # Qwen3-30B-A3B: 48 layers, GQA 32/4
    assert qwen.weight_bytes("bfloat16", "fp8", fp8_attention=False) == pytest.approx(
        in_fp8 + qwen_attention * (2 - 1 - 4 / 128**2))


def test_colocated_offload_defaults_and_the_sync_with_param_offload(tiny_moe_dir):
    """Colocated: grads and optimizer state leave the GPU while the engine generates (the
    default); the sync reads the parameters even with param offload, which starts after it."""
    colocated = ("rollout.colocate=true", "resources.rollout_pool=null",
                 "resources.gpu_memory_gb=0.01")
    est, _ = tiny_estimate(tiny_moe_dir, *colocated)
    st, bucket = est.update.state, 2 * 16 * 2**20  # two bucket buffers
    assert est.actor_resident == est.engine.train_resident == st.weights
    assert est.sync == st.weights + bucket + est.engine.weights
    off, _ = tiny_estimate(tiny_moe_dir, *colocated, "actor.offload.param_offload=true")
    assert off.actor_resident == 0 and off.sync_actor == st.weights
    assert off.sync == est.sync
    # SGLang's sizing: the engine takes gpu_memory_utilization (0.8) of what is free when it
    # loads, so the parameters the actor keeps on the GPU shrink its share by 0.8 of them
    gpu = int(0.01 * GB)
    assert off.engine.usable == off.engine.total == int(gpu * 0.8)
    assert est.engine.usable == int((gpu - st.weights) * 0.8)
    assert est.engine.total == est.engine.usable + st.weights


def test_an_offloaded_optimizer_state_is_on_the_gpu_for_the_steps_only(tiny_moe_dir):
    """With ``optimizer_offload`` the update's peak is the larger of the forwards and backwards
    (no optimizer state) and the optimizer step (no activations); without it, their sum. The
    report says which, and the fix for a state-heavy update names the offload."""
    kept, _ = tiny_estimate(tiny_moe_dir, "actor.offload.optimizer_offload=false")
    u, st = kept.update, kept.update.state
    assert not u.optimizer_deferred
    assert u.total == st.weights + st.grads + st.optimizer + u.activations + u.logits
    moved, _ = tiny_estimate(tiny_moe_dir, "actor.offload.optimizer_offload=true")
    d = moved.update
    assert d.optimizer_deferred and d.state == st and d.activations == u.activations
    assert d.forward_backward == st.weights + st.grads + u.activations + u.logits
    assert d.optimizer_step == st.weights + st.grads + st.optimizer
    assert d.total == max(d.forward_backward, d.optimizer_step) == d.forward_backward < u.total
    # 64 tokens a micro-batch: the step (the state) is the peak
    small, _ = tiny_estimate(tiny_moe_dir, "actor.offload.optimizer_offload=true",
                             "actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=8")
    assert small.update.total == small.update.optimizer_step > small.update.forward_backward
    cfg = tiny_config(tiny_moe_dir, "actor.offload.optimizer_offload=true")
    text = "\n".join(format_estimates(cfg, load_model_info(tiny_moe_dir),
                                      derive_sizes(cfg, load_model_info(tiny_moe_dir))))
    assert "optimizer step: weights + grads + optimizer" in text
    assert "(actor.offload.optimizer_offload); peak" in text
    # a streamed step (offload.optimizer_step_chunk_mb) holds its window of the moments only;
    # the tiny model's moments fit in one window, a quarter of them is a smaller one
    assert 0 < d.state.moments <= d.state.optimizer and d.stream_window >= d.state.moments
    streamed = replace(d, stream_window=d.state.moments // 4)
    assert streamed.optimizer_step == (d.optimizer_step - d.state.moments
                                       + d.state.moments // 4)
    assert "Adam moments" in _step_optimizer(streamed) and "Adam" not in _step_optimizer(d)
    # a GPU too small for the state: with the state kept, the fix offers the offload
    tight = tiny_config(tiny_moe_dir, "actor.offload.optimizer_offload=false",
                        "actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=8",
                        "resources.gpu_memory_gb=0.0001")
    update = [p for p in memory_warnings(tight) if "in the update" in p.line()]
    assert "actor.offload.optimizer_offload=true" in update[0].fix
    assert "actor.offload.optimizer_offload" in update[0].fields
    tight_moved = tiny_config(tiny_moe_dir, "actor.offload.optimizer_offload=true",
                              "actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=8",
                              "resources.gpu_memory_gb=0.0001")
    update = [p for p in memory_warnings(tight_moved) if "in the update" in p.line()]
    assert "for the steps only" in update[0].message
    assert "actor.recompute.granularity" not in update[0].fields  # no activations at the peak


def test_pipeline_stages_and_micro_batches_in_flight():
    assert [list(stage_layers(61, 4, s)) for s in (0, 3)] == [list(range(16)), list(range(48, 61))]
    p4 = ParallelConfig(pp=4)
    assert micro_batches_in_flight(p4, 0, 8) == 4 and micro_batches_in_flight(p4, 3, 8) == 1
    assert micro_batches_in_flight(p4, 0, 2) == 2
    assert micro_batches_in_flight(ParallelConfig(pp=4, vpp=2), 0, 8) == 4 * (1 + 3 / 8)
    assert micro_batches_in_flight(ParallelConfig(), 0, 8) == 1


def test_pipeline_split_of_a_real_layout():
    """Qwen3-235B on pp 2: 47 layers per stage; embedding on stage 1, output layer on stage 2."""
    cfg, _ = load_config(REPO / "configs" / "qwen3-235b-a22b.yaml")
    model = load_model_info(CARDS / "qwen3-235b-a22b")
    u = estimate(cfg, model, derive_sizes(cfg, model)).update
    attn = 64 * 128 * 2 * 4096 + 4 * 128 * 2 * 4096
    dense = 47 * (attn + 4096 * 128) + 152064 * 4096  # attention + router, one vocab matrix
    assert u.state.dense_params == math.ceil(dense / 4)
    assert u.state.expert_params == 47 * 128 * 3 * 4096 * 1536 // 16
    # the first stage is the fuller one: 1F1B keeps 2 micro-batches in flight there, and the
    # last stage's log-probs hold a chunk of logits, not the whole micro-batch's
    assert u.stage == 0 and u.micro_batches_in_flight == 2 and u.logits == 0


# ---------------------------------------------------------------------------------------------
# The T1 warning


def memory_warnings(cfg) -> list:
    """The memory rule's findings for ``cfg`` (model from model.path)."""
    return [p for p in validate_config(cfg, allow_missing_files=True)
            if p.rule == "check_memory_fits"]


def test_warning_fires_for_a_too_small_gpu_and_names_the_knobs(tiny_moe_dir):
    assert memory_warnings(tiny_config(tiny_moe_dir, "resources.gpu_memory_gb=1")) == []
    found = memory_warnings(tiny_config(tiny_moe_dir, "resources.gpu_memory_gb=0.001"))
    update = [p for p in found if "in the update" in p.line()]
    assert update and update[0].severity == "warning"
    assert "resources.gpu_memory_gb" in update[0].fields
    assert "actor.ppo_micro_batch_size_per_gpu" in update[0].fields  # activations dominate
    assert "actor.recompute.granularity=full" in update[0].fix


def test_state_heavy_layout_points_at_parallelism(monkeypatch):
    monkeypatch.chdir(REPO)
    cfg, _ = load_config("configs/qwen3-30b-a3b.yaml", ["resources.gpu_memory_gb=40"])
    update, sync = memory_warnings(cfg)
    assert "needs ~46.1 GB in the update" in update.message and "has 40.0 GB" in update.message
    assert "actor.parallel.ep" in update.fields and "add GPUs" in update.fix
    assert "weight sync needs ~45.7 GB" in sync.message  # incl. two 1 GB bucket buffers
    assert "checkpoint_engine.bucket_size_mb" in sync.fields


def test_colocated_rollout_counts_what_the_actor_keeps(monkeypatch):
    """Qwen3-8B offloads grads and optimizer during rollout. Without that its colocated engine,
    which takes gpu_memory_utilization of what is free when it loads (SGLang's sizing), gets
    a smaller KV cache; at a low enough fraction none at all, which is refused with the fix."""
    monkeypatch.chdir(REPO)
    model = load_model_info(CARDS / "qwen3-8b")
    on, _ = load_config("configs/qwen3-8b.yaml")
    assert memory_warnings(on) == []
    kept = ["actor.offload.grad_offload=false", "actor.offload.optimizer_offload=false"]
    off, _ = load_config("configs/qwen3-8b.yaml", kept)
    assert memory_warnings(off) == []
    e_on = estimate(on, model, derive_sizes(on, model)).engine
    est = estimate(off, model, derive_sizes(off, model))
    e, state = est.engine, est.update.state
    assert e.train_resident == state.total and e_on.train_resident == state.weights
    assert e.usable == int((80 * GB - state.total) * off.rollout.gpu_memory_utilization)
    assert e.total == e.usable + state.total <= 80 * GB
    assert e.sequences_fit == (e.usable - e.weights) // e.kv_bytes_per_sequence
    assert 0 < e.sequences_fit < e_on.sequences_fit
    # at 0.17 the share, ~7.8 GB, leaves the 7.6 GB of weights no room for one sequence
    low, _ = load_config("configs/qwen3-8b.yaml", [*kept, "rollout.gpu_memory_utilization=0.17"])
    (problem,) = memory_warnings(low)
    assert "colocated engine" in problem.message and "no KV cache" in problem.message
    assert "actor.offload.optimizer_offload=true" in problem.fix
    need = (e.weights + e.kv_bytes_per_sequence) / (80 * GB - state.total)
    assert f"raise rollout.gpu_memory_utilization to {math.ceil(need * 20) / 20:.2f}" in problem.fix
    fixed, _ = load_config("configs/qwen3-8b.yaml", [
        *kept, f"rollout.gpu_memory_utilization={math.ceil(need * 20) / 20}"])
    assert memory_warnings(fixed) == []


def test_auto_max_num_seqs_of_a_colocated_engine_fits_its_kv_cache(monkeypatch):
    """``rollout.max_num_seqs: auto`` caps each engine at the full-length sequences its KV cache
    holds. For a colocated engine that cache is what its share of the memory free next to the
    train roles leaves after its weights (the estimate's rule), not a share of the whole GPU:
    Qwen3-8B's config (128 sequences per engine) fits 132 with grad/optimizer offload and 75
    without, where a share of the whole GPU said 148 either way. Block FP8 weights leave more."""
    monkeypatch.chdir(REPO)
    model = load_model_info(CARDS / "qwen3-8b")
    fits = {}
    for name, overrides in (("offload", []), ("kept", ["actor.offload.grad_offload=false",
                                                       "actor.offload.optimizer_offload=false"]),
                            ("fp8", ["rollout.quantization=fp8"])):
        cfg, _ = load_config("configs/qwen3-8b.yaml", overrides)
        assert cfg.rollout.colocate and cfg.rollout.max_num_seqs == "auto"
        whole_gpu = derive_sizes(cfg, model)
        sizes = resolve_sizes(cfg, model)
        engine = estimate(cfg, model, sizes).engine
        # by hand: SGLang's share of what is free next to the train roles, less the weights
        usable = int((80 * GB - engine.train_resident) * cfg.rollout.gpu_memory_utilization)
        tp = cfg.rollout.gpus_per_engine
        weights = math.ceil(model.weight_bytes("bfloat16", cfg.rollout.quantization) / tp)
        per_seq = model.kv_bytes_per_token("bfloat16", tp) * sizes.max_sequence_length
        fit = (usable - weights) // per_seq
        assert sizes.kv_cache_sequences_per_engine == engine.sequences_fit == fit
        assert whole_gpu.kv_cache_sequences_per_engine > fit
        assert sizes.max_num_seqs == min(fit, 128) and sizes.sequences_per_engine == 128
        fits[name] = fit
    assert fits["kept"] < fits["offload"] < fits["fp8"]
    assert (fits["offload"], fits["kept"]) == (132, 75)


def test_estimates_without_gpu_memory_or_model(tiny_moe_dir):
    cfg = tiny_config(tiny_moe_dir)
    model = load_model_info(tiny_moe_dir)
    lines = format_estimates(cfg, model, derive_sizes(cfg, model))
    assert lines[:2] == ["params/total: 0.000090624B", "params/active: 0.000066048B"]
    assert any("unknown: set resources.gpu_memory_gb" in line for line in lines)
    assert memory_warnings(cfg) == []
    assert format_estimates(cfg, None, derive_sizes(cfg)) == [
        "n/a: model.path has no readable config.json"]


def test_critic_and_reference_add_their_idle_state(tiny_moe_dir):
    base, _ = tiny_estimate(tiny_moe_dir)
    with_ref, _ = tiny_estimate(tiny_moe_dir, "actor.use_kl_loss=true")
    assert with_ref.update.other_roles == base.update.state.weights  # ref: weights only
    offloaded, _ = tiny_estimate(tiny_moe_dir, "actor.use_kl_loss=true",
                                 "ref.offload.param_offload=true")
    assert offloaded.update.other_roles == 0


def test_loaded_dict_configs_estimate_too():
    """Any config dict with an architecture gets estimates (no files needed)."""
    from config_archs import QWEN3_30B_A3B

    from megarl.config.model_info import model_info_from_dict

    cfg, _ = load_config_dict({"model": {"path": "/nowhere"}, "data": {"train_files": ["/t"]},
                               "actor": {"ppo_micro_batch_size_per_gpu": 2,
                                         "parallel": {"ep": 8}}})
    model = model_info_from_dict(QWEN3_30B_A3B)
    est = estimate(cfg, model, derive_sizes(cfg, model))
    assert est.params.total == model.param_count() and est.engine is not None


def test_the_log_prob_chunk_is_the_code_s():
    from megarl.config.estimates import LOG_PROB_CHUNK_ELEMENTS
    from megarl.megatron.vocab_parallel import CHUNK_ELEMENTS

    assert LOG_PROB_CHUNK_ELEMENTS == CHUNK_ELEMENTS


def test_lora_state_holds_grads_and_optimizer_of_the_adapters_only(tiny_moe_dir):
    """With actor.lora the update keeps fp32 grads and Adam moments of the adapters alone, as
    many as PEFT trains on the HF model (the tiny MoE: attention adapters; no dense MLP), and
    one adapter's worth less with an exclusion; the base weights stay."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_moe_dir)
    peft = get_peft_model(hf, LoraConfig(r=8, target_modules=["q_proj", "k_proj", "v_proj",
                                                                "o_proj"]))
    adapters = sum(p.numel() for p in peft.parameters() if p.requires_grad)
    full, _ = tiny_estimate(tiny_moe_dir, "actor.use_distributed_optimizer=false")
    lora, _ = tiny_estimate(tiny_moe_dir, "actor.use_distributed_optimizer=false",
                            "actor.lora.rank=8")
    assert lora.update.state.grads == adapters * 4
    assert lora.update.state.optimizer == adapters * 8  # fp32: the moments, no master copy
    assert lora.update.state.weights == full.update.state.weights + adapters * 4
    excluded, _ = tiny_estimate(tiny_moe_dir, "actor.use_distributed_optimizer=false",
                                "actor.lora.rank=8",
                                "actor.lora.exclude_modules=[layers.0.self_attention.linear_proj]")
    o_proj = 8 * (hf.config.num_attention_heads * hf.config.head_dim + hf.config.hidden_size)
    assert excluded.update.state.grads == (adapters - o_proj) * 4


def test_routed_expert_adapters_are_counted_as_peft_trains_them(tiny_moe_dir):
    """Adapters on the routed experts: as many as PEFT trains on HF's fused expert parameters,
    the experts' split over EP=2 (two GPUs hold half each), their Adam state over expert-DP."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_moe_dir)
    peft = get_peft_model(hf, LoraConfig(
        r=8, target_modules=["o_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))
    trained = {n: p.numel() for n, p in peft.named_parameters() if p.requires_grad}
    experts = sum(v for n, v in trained.items() if ".mlp.experts." in n)
    attention = sum(trained.values()) - experts
    assert experts > 0 and attention > 0
    targets = "actor.lora.target_modules=[linear_proj,experts.linear_fc1,experts.linear_fc2]"
    one, _ = tiny_estimate(tiny_moe_dir, "actor.use_distributed_optimizer=false",
                           "actor.lora.rank=8", targets)
    assert one.update.state.grads == (attention + experts) * 4
    assert one.update.state.optimizer == (attention + experts) * 8
    split, _ = tiny_estimate(tiny_moe_dir, "actor.use_distributed_optimizer=false",
                             "actor.lora.rank=8", targets, "actor.parallel.ep=2")
    assert split.update.state.grads == (attention + experts // 2) * 4
