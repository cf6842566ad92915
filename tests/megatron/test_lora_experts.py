"""LoRA on the routed experts (``experts.linear_fc1`` / ``experts.linear_fc2``) against HF
``peft``'s adapters on the fused expert parameters (``target_parameters``): one SGD step under
EP, expert-TP and PP equals PEFT's step on one process (adapters, log-probs, loss terms, grad
norm, the merged export); the run checkpoint reshards them; the exported adapter loads in PEFT."""

from __future__ import annotations

import json

import pytest
import torch
from test_checkpoint import child_processes_allowed
from test_lora import (
    ALPHA,
    RANK,
    assert_same_lora_update,
    hf_log_probs,
    initial_adapters,
    lora_update_on_rank,
    peft_model,
    peft_reference_step,
)
from test_lora_checkpoint import whole_adapters
from test_update import make_batch

from megarl.megatron.parallel import ParallelSizes

TARGETS = ("linear_qkv", "experts.linear_fc1", "experts.linear_fc2")
HF_TARGETS = ["q_proj", "k_proj", "v_proj"]
HF_PARAMS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


@pytest.fixture(scope="module")
def reference(tiny_models) -> tuple:
    """(batch, initial adapters, PEFT's SGD step) on the tiny Qwen3-MoE."""
    model_dir = tiny_models["qwen3_moe"]
    batch = make_batch(model_dir)
    start = initial_adapters(model_dir, HF_TARGETS, HF_PARAMS)
    return batch, start, peft_reference_step(model_dir, batch, start, "sgd", HF_TARGETS,
                                             HF_PARAMS)


def test_reference_moves_every_expert_adapter(tiny_models, reference):
    """PEFT's step moves each expert's A and B (else equality proves little), and the adapters
    are PEFT's fused layout: ``[E * r, in]`` and ``[out, r * E]`` per expert parameter."""
    _, start, ref = reference
    experts = {k: v for k, v in start.items() if ".mlp.experts." in k}
    assert len(experts) == 2 * 2 * 2  # A, B x gate_up, down x 2 layers
    for name, value in experts.items():
        moved = (ref["adapters"][name] - value).abs()
        if "lora_A" in name:  # every expert's rows
            per_expert = moved.reshape(4, RANK, -1).amax(dim=(1, 2))
        else:
            per_expert = moved.reshape(moved.shape[0], RANK, 4).amax(dim=(0, 1))
        assert per_expert.min() > 1e-4, (name, per_expert)
    assert start["base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.weight"].shape \
        == (4 * RANK, 64)  # gate_up: in = hidden
    assert start["base_model.model.model.layers.0.mlp.experts.lora_A.weight"].shape \
        == (4 * RANK, 32)  # down: in = expert ffn


LAYOUTS = [
    (ParallelSizes(), {}),
    (ParallelSizes(ep=2), {"budget": 16}),
    (ParallelSizes(tp=2), {"budget": 20}),  # ETP = TP = 2, sequence parallel
    (ParallelSizes(tp=2, etp=1), {}),  # experts whole on both TP ranks (expert-DP = 2)
    (ParallelSizes(pp=2), {"budget": 16}),
]


@pytest.mark.parametrize("sizes,kw", LAYOUTS, ids=["tp1", "ep2", "tp2-etp2", "tp2-etp1", "pp2"])
def test_expert_lora_sgd_step_matches_peft(pool1, pool2, tiny_models, reference, sizes, kw):
    batch, start, ref = reference
    pool = pool1 if sizes == ParallelSizes() else pool2
    results = pool.run(lora_update_on_rank, tiny_models["qwen3_moe"], sizes, batch, start,
                       targets=TARGETS, **kw)
    assert_same_lora_update(results, ref, start)


def save_and_reload(model_dir, sizes, root, batch, save: bool):
    """Run on each rank: adapters on the experts, one AdamW step, save (``save``); or a fresh
    actor (other adapters) that loads the checkpoint. Returns the whole adapters and scores."""
    from megarl.megatron.checkpoint import load_checkpoint, save_checkpoint
    from megarl.megatron.logprobs import compute_log_probs
    from megarl.megatron.lora import apply_lora
    from megarl.megatron.model import build_actor_model
    from megarl.megatron.optimizer import OptimizerSettings, TrainableActor
    from megarl.megatron.settings import LoraSettings
    from megarl.megatron.update import LossSettings, TrainSequence, train_step

    model = build_actor_model(model_dir, sizes, torch.float32, spec="native")
    apply_lora(model, LoraSettings(rank=RANK, alpha=ALPHA, seed=1 if save else 9,
                                   target_modules=TARGETS))
    actor = TrainableActor(model, OptimizerSettings(lr=1e-2, weight_decay=0.0))
    before = whole_adapters(model)
    if save:
        for _ in range(2):  # the second step moves A too (B is 0 before the first)
            train_step(actor, [TrainSequence(**s) for s in batch], LossSettings(),
                       max_tokens_per_micro_batch=16)
        with child_processes_allowed():
            save_checkpoint(root, actor, 1)
    else:
        assert load_checkpoint(root, actor).optimizer_restored
    scores = compute_log_probs(model, [s["tokens"] for s in batch]).log_probs
    return before, whole_adapters(model), scores


def test_expert_adapters_reshard_through_the_run_checkpoint(pool2, tiny_models, tmp_path):
    """Saved at EP=2, reloaded at TP=2 (ETP=2): every expert's adapters come back exactly."""
    model_dir = tiny_models["qwen3_moe"]
    batch = make_batch(model_dir)
    _, saved, saved_scores = pool2.run(save_and_reload, model_dir, ParallelSizes(ep=2),
                                       tmp_path, batch, True)[0]
    before, loaded, scores = pool2.run(save_and_reload, model_dir, ParallelSizes(tp=2),
                                       tmp_path, batch, False)[0]
    assert set(loaded) == set(saved) and any(".mlp.experts." in k for k in saved)
    for name, value in saved.items():
        assert (before[name] - value).abs().max() > 1e-4, name  # the load did something
        assert torch.equal(loaded[name], value), name
    for mine, want in zip(scores, saved_scores):
        torch.testing.assert_close(mine, want, atol=1e-5, rtol=0)


def train_and_export(model_dir, sizes, batch, out):
    """Run on each rank: expert adapters (layer 1's fc1 excluded), two AdamW steps, the PEFT
    adapter directory written; returns the stepped model's log-probs."""
    from megarl.megatron.logprobs import compute_log_probs
    from megarl.megatron.lora import apply_lora, save_peft_adapter
    from megarl.megatron.model import build_actor_model
    from megarl.megatron.optimizer import OptimizerSettings, TrainableActor
    from megarl.megatron.settings import LoraSettings
    from megarl.megatron.update import LossSettings, TrainSequence, train_step

    settings = LoraSettings(rank=RANK, alpha=ALPHA, seed=3, target_modules=TARGETS,
                            exclude_modules=("layers.1.mlp.experts.linear_fc1",))
    model = build_actor_model(model_dir, sizes, torch.float32, spec="native")
    apply_lora(model, settings)
    actor = TrainableActor(model, OptimizerSettings(lr=1e-2, weight_decay=0.0))
    for _ in range(2):
        train_step(actor, [TrainSequence(**s) for s in batch], LossSettings(),
                   max_tokens_per_micro_batch=16)
    save_peft_adapter(model, settings, out, base_model=model_dir)
    return compute_log_probs(model, [s["tokens"] for s in batch]).log_probs


def test_exported_expert_adapter_loads_in_peft(pool2, tiny_models, tmp_path):
    """Trained at EP=2, exported: ``PeftModel.from_pretrained`` on the HF model scores as the
    actor; the config lists each adapted expert parameter (not the excluded one)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model_dir = tiny_models["qwen3_moe"]
    batch = make_batch(model_dir)
    out = tmp_path / "adapter"
    trained = pool2.run(train_and_export, model_dir, ParallelSizes(ep=2), batch, out)[0]
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["target_parameters"] == ["model.layers.0.mlp.experts.gate_up_proj",
                                           "model.layers.0.mlp.experts.down_proj",
                                           "model.layers.1.mlp.experts.down_proj"]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    base = [hf_log_probs(hf, s["tokens"]).detach() for s in batch]
    model = PeftModel.from_pretrained(hf, str(out))
    with torch.no_grad():
        for s, mine, plain in zip(batch, trained, base):
            scored = hf_log_probs(model, s["tokens"])
            torch.testing.assert_close(scored, mine, atol=1e-4, rtol=0)
            assert (scored - plain).abs().max() > 1e-3


def test_peft_model_helper_adapts_the_fused_experts(tiny_models):
    """The reference really adapts the experts: PEFT's expert adapters change the scores."""
    model_dir = tiny_models["qwen3_moe"]
    start = initial_adapters(model_dir, HF_TARGETS, HF_PARAMS)
    only_experts = {k: (v if ".mlp.experts." in k else torch.zeros_like(v) if "lora_B" in k
                        else v) for k, v in start.items()}
    tokens = make_batch(model_dir)[0]["tokens"]
    with torch.no_grad():
        plain = hf_log_probs(peft_model(model_dir, {k: torch.zeros_like(v)
                                                    for k, v in start.items()},
                                        HF_TARGETS, HF_PARAMS), tokens)
        adapted = hf_log_probs(peft_model(model_dir, only_experts, HF_TARGETS, HF_PARAMS),
                               tokens)
    assert (adapted - plain).abs().max() > 1e-3
