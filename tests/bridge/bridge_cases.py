"""Shared cases and tensor checks of the conversion tests (a uniquely named module: test folders
each have a ``conftest``, so ``from conftest import`` would pick whichever is first on sys.path)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from bridge.checks import Layout

FAMILIES = ("qwen3", "qwen3_moe", "qwen2", "qwen2_moe", "mixtral", "llama", "deepseek_v3")
MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3")
# the layout each family is converted with for the shared checkpoints
SAVE_LAYOUT = {name: Layout(ep=2) if name in MOE_FAMILIES else Layout(tp=2) for name in FAMILIES}


def read_tensors(directory: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of every safetensors file in ``directory``."""
    tensors = {}
    for file in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            tensors.update({name: f.get_tensor(name) for name in f.keys()})  # noqa: SIM118 - safe_open is no dict
    return tensors


def assert_same_tensors(expected: dict, actual: dict) -> None:
    """Same names, dtypes, shapes and bits."""
    assert sorted(actual) == sorted(expected)
    for name, tensor in expected.items():
        got = actual[name]
        assert got.dtype == tensor.dtype, name
        assert got.shape == tensor.shape, name
        assert torch.equal(got.view(torch.uint8), tensor.view(torch.uint8)), name


def fp8_copies(source: str | Path, fp8_dir: Path, dequantized_dir: Path) -> int:
    """Two copies of an HF model directory: ``fp8_dir`` in the FP8 release format (every
    projection weight as float8_e4m3fn + ``weight_scale_inv``, config.json with the released
    checkpoints' ``quantization_config``), and ``dequantized_dir`` holding what those FP8
    tensors stand for (fp32, no quantization_config). Returns how many weights were quantized."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from megarl.weights.fp8 import (
        QUANTIZATION_CONFIG,
        dequantize_blockwise,
        fp8_payload,
        scale_name,
    )

    for target in (fp8_dir, dequantized_dir):
        shutil.copytree(source, target)
    tensors = load_file(Path(source) / "model.safetensors")
    payload = fp8_payload(tensors)
    quantized = [name for name in tensors if scale_name(name) in payload]
    save_file(payload, fp8_dir / "model.safetensors", metadata={"format": "pt"})
    dequantized = {name: dequantize_blockwise(payload[name], payload[scale_name(name)],
                                              dtype=tensor.dtype)
                   if name in quantized else tensor for name, tensor in tensors.items()}
    save_file(dequantized, dequantized_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((fp8_dir / "config.json").read_text())
    config["quantization_config"] = dict(QUANTIZATION_CONFIG)
    (fp8_dir / "config.json").write_text(json.dumps(config, indent=2))
    return len(quantized)
