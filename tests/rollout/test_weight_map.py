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
