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
