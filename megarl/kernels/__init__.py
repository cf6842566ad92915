"""GPU kernels shared by the train-pool and rollout-pool engines (neither imports the other).

:func:`triton_kernels` returns :mod:`megarl.kernels.triton_ops` (Triton SwiGLU and RoPE,
forward and backward) when CUDA and Triton are there, else None; :func:`triton_vocab_kernels`
the same for :mod:`megarl.kernels.triton_vocab` (the log-prob path's softmax statistics and
logit gradient).
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

_LOADED: dict[str, ModuleType | None] = {}


def _kernels(name: str) -> ModuleType | None:
    """``megarl.kernels.<name>`` when CUDA and Triton are there (imported once), else None."""
    if name not in _LOADED:
        module = None
        if torch.cuda.is_available():
            try:
                module = importlib.import_module(f"megarl.kernels.{name}")
            except ImportError:
                module = None
        _LOADED[name] = module
    return _LOADED[name]


def triton_kernels() -> ModuleType | None:
    """:mod:`megarl.kernels.triton_ops` when CUDA and Triton are there, else None."""
    return _kernels("triton_ops")


def triton_vocab_kernels() -> ModuleType | None:
    """:mod:`megarl.kernels.triton_vocab` when CUDA and Triton are there, else None."""
    return _kernels("triton_vocab")
