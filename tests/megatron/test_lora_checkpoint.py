"""LoRA adapters in the run checkpoint: saved with their own TP sharding (each B of a fused
layer one sharded tensor), reloaded under another layout with the frozen base and the Adam
state of the adapters, so that the next step equals the step taken without the reload."""

from __future__ import annotations

import pytest
import torch
from test_checkpoint import child_processes_allowed, log_probs, sequences, train

from megarl.megatron.parallel import ParallelSizes

RANK, ALPHA = 4, 8.0


def build_lora_actor(model_dir, sizes, load_weights=True, seed=1234):
    """A TrainableActor (distributed Adam, LR warm-up) whose qwen3 layers all have adapters
    (A drawn from ``seed``)."""
    from megarl.megatron.lora import apply_lora
    from megarl.megatron.model import build_actor_model
    from megarl.megatron.optimizer import OptimizerSettings, TrainableActor
    from megarl.megatron.settings import LoraSettings

    model = build_actor_model(model_dir, sizes, torch.float32, spec="native",
                              load_weights=load_weights)
    apply_lora(model, LoraSettings(rank=RANK, alpha=ALPHA, seed=seed))
    return TrainableActor(model, OptimizerSettings(lr=1e-2, weight_decay=0.0, lr_warmup_steps=4,
                                                   total_steps=10))


def whole_adapters(model) -> dict[str, torch.Tensor]:
    """Every adapter under its PEFT name, gathered over TP and the pipeline stages."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from megarl.megatron.lora import peft_state_dict

    stages = [None] * mpu.get_pipeline_model_parallel_world_size()
    dist.all_gather_object(stages, peft_state_dict(model),
                           group=mpu.get_pipeline_model_parallel_group())
    return {k: v for stage in stages for k, v in stage.items()}


def save_or_resume(model_dir, sizes, root, resume: bool):
    """Run on each rank: two steps, save, step (``resume=False``), or a randomly initialised actor
    that loads the checkpoint, then steps; returns the adapters at the save (or just loaded),
    the log-probs there, and the adapters after the next step."""
    from megarl.megatron.checkpoint import load_checkpoint, save_checkpoint

    # the resuming actor starts from other adapters (another seed) and a random base
    actor = build_lora_actor(model_dir, sizes, load_weights=not resume, seed=7 if resume else 1)
    initial = whole_adapters(actor.model)
    if resume:
        loaded = load_checkpoint(root, actor)
        assert loaded.optimizer_restored
    else:
        train(actor, seed=0)  # at the warm-up's learning rate 0
        train(actor, seed=2)
        with child_processes_allowed():
            save_checkpoint(root, actor, 1)
    at_save = whole_adapters(actor.model)
    scores = log_probs(actor.model)
    train(actor, seed=1)
    return initial, at_save, scores, whole_adapters(actor.model)


@pytest.mark.parametrize("load_sizes", [ParallelSizes(tp=2), ParallelSizes(pp=2),
                                        ParallelSizes()], ids=["tp2", "pp2", "tp1"])
def test_adapters_resume_exactly_under_any_layout(pool1, pool2, tiny_models, tmp_path,
                                                  load_sizes):
    path = tiny_models["qwen3"]
    _, saved, saved_scores, continued = pool2.run(save_or_resume, path, ParallelSizes(tp=2),
                                                  tmp_path, False)[0]
    pool = pool1 if load_sizes == ParallelSizes() else pool2
    initial, loaded, scores, resumed = pool.run(save_or_resume, path, load_sizes, tmp_path,
                                                True)[0]
    assert set(loaded) == set(saved) and len(saved) == 2 * 7 * 2  # A, B x 7 projections x 2
    for name, value in saved.items():
        assert (initial[name] - value).abs().max() > 1e-3, name  # the load did something
        assert torch.equal(loaded[name], value), name
        # the next Adam step: exact on the saving layout; on another, its gradients round
        # otherwise and Adam scales the rounding of tiny ones up (measured 2.4e-6 at PP=2)
        atol = 1e-7 if load_sizes == ParallelSizes(tp=2) else 1e-5
        torch.testing.assert_close(resumed[name], continued[name], atol=atol, rtol=0, msg=name)
    for mine, ref in zip(scores, saved_scores):  # the base came back too
        torch.testing.assert_close(mine, ref, atol=1e-5, rtol=0)


def test_mcore_to_hf_merges_the_adapters(pool2, tiny_models, tmp_path):
    """megarl-convert mcore-to-hf of a LoRA run checkpoint (saved at TP=2) writes the merged
    weights ``W + alpha / r * B @ A``: the HF model scores like the actor at the save, and the
    adapted weights differ from the base."""
    from safetensors.torch import load_file
    from test_lora import hf_log_probs
    from transformers import AutoModelForCausalLM

    from bridge.mcore_to_hf import mcore_to_hf

    path = tiny_models["qwen3"]
    _, _, saved_scores, _ = pool2.run(save_or_resume, path, ParallelSizes(tp=2),
                                      tmp_path / "run", False)[0]
    mcore_to_hf(tmp_path / "run", tmp_path / "hf", hf_config=path)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    with torch.no_grad():
        for tokens, ref in zip(sequences(), saved_scores):
            torch.testing.assert_close(hf_log_probs(merged, tokens), ref, atol=1e-4, rtol=0)
    base = load_file(f"{path}/model.safetensors")
    out = {k: v for f in (tmp_path / "hf").glob("*.safetensors") for k, v in load_file(f).items()}
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"):
        assert (out[name] - base[name]).abs().max() > 1e-4, name
    assert torch.equal(out["model.norm.weight"], base["model.norm.weight"])


def save_plain(model_dir, sizes, root):
    """Run on each rank: a full-weight actor takes one step and is saved; its log-probs."""
    from test_checkpoint import build

    from megarl.megatron.checkpoint import save_checkpoint

    actor = build(model_dir, sizes)
    train(actor, seed=0)
    with child_processes_allowed():
        save_checkpoint(root, actor, 1)
    return log_probs(actor.model)


def first_weights_from(model_dir, sizes, root, lora: bool):
    """Run on each rank: a randomly initialised model (with seed-7 adapters if ``lora``) whose
    first weights come from ``root`` (``model.mcore_checkpoint``); its adapters and log-probs,
    or the error's text."""
    from megarl.megatron.checkpoint import load_model_weights
    from megarl.megatron.lora import apply_lora
    from megarl.megatron.model import build_actor_model
    from megarl.megatron.settings import LoraSettings

    model = build_actor_model(model_dir, sizes, torch.float32, spec="native",
                              load_weights=False)
    if lora:
        apply_lora(model, LoraSettings(rank=RANK, alpha=ALPHA, seed=7))
    before = whole_adapters(model)
    try:
        load_model_weights(root, model)
    except ValueError as err:
        return str(err)
    return before, whole_adapters(model), log_probs(model)


def test_first_weights_from_a_checkpoint_with_or_without_adapters(pool1, pool2, tiny_models,
                                                                  tmp_path):
    """``model.mcore_checkpoint`` with LoRA: a LoRA run's checkpoint gives base and adapters;
    a full-weight one the base, the adapters keeping their start (B = 0: the checkpoint's
    log-probs); a model without adapters refuses a checkpoint that holds some."""
    path = tiny_models["qwen3"]
    _, saved, saved_scores, _ = pool2.run(save_or_resume, path, ParallelSizes(tp=2),
                                          tmp_path / "lora", False)[0]
    _, adapters, scores = pool1.run(first_weights_from, path, ParallelSizes(), tmp_path / "lora",
                                    True)[0]
    assert set(adapters) == set(saved)
    for name, value in saved.items():
        assert torch.equal(adapters[name], value), name
    for mine, ref in zip(scores, saved_scores):
        torch.testing.assert_close(mine, ref, atol=1e-5, rtol=0)

    plain_scores = pool2.run(save_plain, path, ParallelSizes(tp=2), tmp_path / "plain")[0]
    before, adapters, scores = pool1.run(first_weights_from, path, ParallelSizes(),
                                         tmp_path / "plain", True)[0]
    for name, value in before.items():
        assert torch.equal(adapters[name], value), name
    for mine, ref in zip(scores, plain_scores):
        torch.testing.assert_close(mine, ref, atol=1e-5, rtol=0)

    error = pool1.run(first_weights_from, path, ParallelSizes(), tmp_path / "lora", False)[0]
    assert "holds LoRA adapters" in error


def test_megarl_convert_lora_to_peft(pool1, pool2, tiny_models, tmp_path):
    """`megarl-convert lora-to-peft` turns a LoRA run checkpoint (saved at TP=2) into a PEFT
    adapter that scores like the actor did at the save; a checkpoint without adapters is
    refused."""
    from peft import PeftModel
    from test_lora import hf_log_probs
    from transformers import AutoModelForCausalLM

    from bridge.checks import ConversionError
    from bridge.cli import EXIT_INPUT, main
    from bridge.lora_to_peft import lora_to_peft

    path = tiny_models["qwen3"]
    _, _, saved_scores, _ = pool2.run(save_or_resume, path, ParallelSizes(tp=2),
                                      tmp_path / "run", False)[0]
    summary = lora_to_peft(tmp_path / "run", tmp_path / "peft", path,
                           runner=lambda _, fn, *args: pool1.run(fn, *args))
    assert summary["rank"] == RANK
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model = PeftModel.from_pretrained(hf, str(tmp_path / "peft"))
    with torch.no_grad():
        for tokens, ref in zip(sequences(), saved_scores):
            torch.testing.assert_close(hf_log_probs(model, tokens), ref, atol=1e-4, rtol=0)
    pool2.run(save_plain, path, ParallelSizes(tp=2), tmp_path / "plain")
    with pytest.raises(ConversionError, match="no LoRA adapters"):
        lora_to_peft(tmp_path / "plain", tmp_path / "peft2", path)
    assert main(["lora-to-peft", "--mcore", str(tmp_path / "plain"), "--hf", path,
                 "--out", str(tmp_path / "peft2")]) == EXIT_INPUT
