"""Checkpoint (per-expert) names resolve to writable views of transformers' fused tensors."""

from __future__ import annotations

import pytest
import torch

from megarl.data.tiny_model import make_tiny_model
from megarl.rollout.local.weights import UnknownWeight, WeightMap, iter_safetensors


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral", "qwen3", "llama"])
def test_every_checkpoint_tensor_round_trips(arch, tmp_path):
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(tmp_path / arch, arch=arch, with_tokenizer=False)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    weights = WeightMap(model)
    checkpoint = dict(iter_safetensors(path))
    assert set(weights.checkpoint_names()) == set(checkpoint)
    for name, tensor in checkpoint.items():
        assert torch.equal(weights.view(name), tensor), name
    # writing new values by checkpoint name changes exactly that slice of the live model
    gen = torch.Generator().manual_seed(0)
    fresh = {n: torch.randn(t.shape, generator=gen) for n, t in checkpoint.items()}
    weights.load_many(fresh.items())
    for name, tensor in fresh.items():
        assert torch.equal(weights.view(name), tensor), name
    with torch.no_grad():
        model.save_pretrained(tmp_path / "saved")
    assert all(torch.equal(t, fresh[n]) for n, t in iter_safetensors(tmp_path / "saved"))


def test_bad_names_and_shapes_are_rejected(tmp_path):
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(tmp_path / "m", arch="qwen3_moe", with_tokenizer=False)
    weights = WeightMap(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))
    with pytest.raises(UnknownWeight, match="not a checkpoint name"):
        weights.view("model.layers.9.mlp.gate.weight")
    with pytest.raises(ValueError, match="shape"):
        weights.load("model.norm.weight", torch.zeros(3))


@pytest.mark.parametrize("tied", [False, True])
def test_dropped_weights_wait_for_every_view_and_come_back_exactly(tmp_path, tied):
    """A release without CPU backup drops every parameter's storage (on the CPU too) and keeps
    the bytes it will ask back; after the reload (zeros) each checkpoint view is unwritten until
    a load writes it (tied embeddings: one view under two names), a parameter written by its
    own name counts whole, and the reloaded model computes what it did before, bit for bit."""
    from megarl.rollout.local.model_runner import ModelRunner

    path = make_tiny_model(tmp_path / "m", arch="qwen3_moe", with_tokenizer=False,
                           tie_word_embeddings=tied)
    runner = ModelRunner(path, weights_cpu_backup=False)
    ids = torch.tensor([[5, 9, 30, 7]])
    with torch.no_grad():
        before = runner.model(ids).logits
    total, checkpoint = runner.weight_bytes(), list(iter_safetensors(path))
    weights = runner.weight_map
    runner.offload()
    assert all(p.numel() == 0 for p in runner.model.parameters())
    assert runner.weight_bytes() == total
    runner.reload()
    assert not any(p.any() for p in runner.model.parameters())
    assert len(weights.unwritten()) == len(checkpoint)  # tied: lm_head is embed_tokens' view
    weights.load_many(checkpoint[1:])
    assert weights.unwritten() == [checkpoint[0][0]]
    weights.load_many(checkpoint[:1])
    assert weights.unwritten() == []
    with torch.no_grad():
        assert torch.equal(runner.model(ids).logits, before)
    # a fused expert tensor written by its parameter name covers every expert's view of it
    runner.offload()
    runner.reload()
    fused = "model.layers.0.mlp.experts.gate_up_proj"
    live = dict(runner.model.named_parameters())[fused]
    expert_views = [n for n in weights.unwritten() if ".mlp.experts." in n and
                    n.startswith("model.layers.0.") and n.endswith(("gate_proj.weight",
                                                                    "up_proj.weight"))]
    assert len(expert_views) == 2 * runner.config.num_experts
    weights.load(fused, torch.ones(live.shape))
    assert not set(expert_views) & set(weights.unwritten())
    # with a CPU backup nothing is dropped (on the CPU the weights stay where they are)
    backed = ModelRunner(path, weights_cpu_backup=True)
    backed.offload()
    backed.reload()
    assert backed.weight_map.unwritten() == []
    with torch.no_grad():
        assert torch.equal(backed.model(ids).logits, before)


def test_a_dummy_start_reads_no_checkpoint_and_waits_for_every_weight(tmp_path):
    """``load_format="dummy"`` (SGLang's ``--load-format dummy``, ``rollout.load_format``)
    builds the model from config.json alone: it starts with the safetensors gone, every
    checkpoint view is unwritten (so ``/generate`` is refused, saying why), and once a weight
    update has written the checkpoint the model computes what one loaded from disk does, bit
    for bit."""
    import shutil

    from megarl.rollout.local.model_runner import ModelRunner
    from megarl.rollout.local.weights import unusable_weights

    path = make_tiny_model(tmp_path / "m", arch="qwen3_moe", with_tokenizer=False)
    ids = torch.tensor([[5, 9, 30, 7]])
    loaded = ModelRunner(path)
    with torch.no_grad():
        expected = loaded.model(ids).logits
    checkpoint = list(iter_safetensors(path))
    bare = tmp_path / "config_only"
    bare.mkdir()
    shutil.copy(path / "config.json", bare / "config.json")
    runner = ModelRunner(bare, load_format="dummy")
    weights = runner.weight_map
    assert weights.checkpoint_names() == loaded.weight_map.checkpoint_names()
    assert len(weights.unwritten()) == len(checkpoint)
    why = unusable_weights(set(), weights)
    assert "--load-format dummy" in why and f"{len(checkpoint)} tensors" in why, why
    with torch.no_grad():
        assert not torch.allclose(runner.model(ids).logits, expected)  # random, not the model
    weights.load_many(checkpoint)
    assert weights.unwritten() == []
    with torch.no_grad():
        assert torch.equal(runner.model(ids).logits, expected)
    with pytest.raises(ValueError, match="load_format='safetensors'"):
        ModelRunner(path, load_format="safetensors")
