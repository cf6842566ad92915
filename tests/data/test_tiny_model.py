"""make_tiny_model: a model in the dtype asked for, drawn where asked, the same for one seed."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from megarl.data.tiny_model import make_tiny_model


def dtype_of(model):
    """config.json's dtype (``dtype`` from transformers 5, ``torch_dtype`` before)."""
    cfg = json.loads((model / "config.json").read_text())
    return cfg.get("dtype", cfg.get("torch_dtype"))


def test_a_bf16_model_is_bf16_on_disk_and_equals_the_fp32_draw_rounded(tmp_path):
    """The bf16 model is the fp32 model of the same seed, each weight rounded to bf16 (HF draws
    in the model's dtype, so compare within bf16's rounding, not bit for bit)."""
    bf16 = make_tiny_model(tmp_path / "bf16", arch="qwen3_moe", dtype=torch.bfloat16)
    fp32 = make_tiny_model(tmp_path / "fp32", arch="qwen3_moe")
    assert dtype_of(bf16) == "bfloat16" and dtype_of(fp32) == "float32"
    low, high = load_file(bf16 / "model.safetensors"), load_file(fp32 / "model.safetensors")
    assert low.keys() == high.keys() and len(low) > 10
    assert {t.dtype for t in low.values()} == {torch.bfloat16}
    assert {t.dtype for t in high.values()} == {torch.float32}
    again = load_file(make_tiny_model(tmp_path / "again", arch="qwen3_moe", dtype=torch.bfloat16)
                      / "model.safetensors")
    assert all(torch.equal(low[k], again[k]) for k in low)  # one seed, one model
    # the same draw: the linear weights' norms agree to bf16's relative precision
    for name, weight in high.items():
        if weight.dim() == 2 and "norm" not in name:
            ratio = low[name].float().norm() / weight.norm()
            assert abs(ratio - 1) < 0.05, name
