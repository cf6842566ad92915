"""HF -> megatron dist checkpoint (TP=2 or EP=2, on two gloo ranks) -> HF reproduces every
tensor bit for bit, in the same dtype, with the config and tokenizer files, for every family."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from bridge_cases import FAMILIES, MOE_FAMILIES, assert_same_tensors, read_tensors
from safetensors.torch import save_file

from bridge.checks import Layout
from bridge.hf_to_mcore import hf_to_mcore
from bridge.mcore_to_hf import mcore_to_hf
from megarl.data.tiny_model import make_tiny_model


def assert_hf_directory(out: Path, source: Path, n_files: int | None = None) -> None:
    """Sharded files named like HF's, an index covering every tensor, config and tokenizer."""
    files = sorted(p.name for p in out.glob("*.safetensors"))
    count = len(files)
    assert files == [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    if n_files is not None:
        assert count == n_files
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(files)
    tensors = read_tensors(out)
    assert set(index["weight_map"]) == set(tensors)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size()
                                                  for t in tensors.values())
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (source / name).read_bytes()
    assert not list(out.parent.glob("*.incomplete-*"))


@pytest.mark.parametrize("name", FAMILIES)
def test_round_trip_is_bit_exact(tiny_models, converted, tmp_path, name):
    """Saved with EP=2 (MoE) or TP=2 (dense), exported in one process."""
    out = tmp_path / "hf"
    summary = mcore_to_hf(converted[name], out)
    source = Path(tiny_models[name])
    assert_same_tensors(read_tensors(source), read_tensors(out))
    assert_hf_directory(out, source, n_files=1)
    assert json.loads((out / "config.json").read_text()) == json.loads(
        (source / "config.json").read_text())
    assert summary["tensors"] == len(read_tensors(source))


@pytest.mark.parametrize("name", MOE_FAMILIES)
def test_moe_round_trip_under_tensor_parallel(tiny_models, ranks, tmp_path, name):
    """TP=2 splits attention, dense MLPs and (ETP=2) every expert's matrices."""
    hf_to_mcore(tiny_models[name], tmp_path / "mcore", Layout(tp=2), runner=ranks.runner)
    mcore_to_hf(tmp_path / "mcore", tmp_path / "hf", max_shard_bytes=40_000)
    assert_same_tensors(read_tensors(tiny_models[name]), read_tensors(tmp_path / "hf"))
    assert_hf_directory(tmp_path / "hf", Path(tiny_models[name]))
    assert len(list((tmp_path / "hf").glob("*.safetensors"))) > 3


def test_bf16_tied_embeddings_over_pipeline_stages(ranks, tmp_path):
    """bf16 weights, tied input/output embeddings, two pipeline stages (the last stage holds
    a copy of the embedding as its output layer): still bit-exact, lm_head stays absent."""
    source = make_tiny_model(tmp_path / "tied", arch="qwen2", seed=7, tie_word_embeddings=True)
    fp32 = read_tensors(source)
    assert "lm_head.weight" not in fp32
    save_file({k: v.to(torch.bfloat16) for k, v in fp32.items()}, source / "model.safetensors",
              metadata={"format": "pt"})
    summary = hf_to_mcore(source, tmp_path / "mcore", Layout(pp=2), runner=ranks.runner)
    assert summary["dtype"] == "bfloat16"
    mcore_to_hf(tmp_path / "mcore", tmp_path / "hf")
    assert_same_tensors(read_tensors(source), read_tensors(tmp_path / "hf"))


def test_export_in_another_dtype_loads_in_transformers(tiny_models, converted, tmp_path):
    """--dtype bf16 casts every tensor, says so in config.json, and transformers loads it."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "hf"
    mcore_to_hf(converted["qwen3_moe"], out, dtype=torch.bfloat16, max_shard_bytes=100_000)
    expected = {k: v.to(torch.bfloat16) for k, v in read_tensors(tiny_models["qwen3_moe"]).items()}
    assert_same_tensors(expected, read_tensors(out))
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.bfloat16)
    reference = AutoModelForCausalLM.from_pretrained(tiny_models["qwen3_moe"],
                                                     dtype=torch.bfloat16)
    ids = torch.arange(5, 25)[None]
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)
