"""GPU kernels shared by the train-pool and rollout-pool engines (neither imports the other).

:func:`triton_kernels` returns :mod:`megarl.kernels.triton_ops` (Triton SwiGLU and RoPE,
forward and backward) when CUDA and Triton are there, else None.
"""

from __future__ import annotations

from types import ModuleType

import torch

_TRITON: ModuleType | bool | None = None


def triton_kernels() -> ModuleType | None:
    """:mod:`megarl.kernels.triton_ops` when CUDA and Triton are there, else None."""
    global _TRITON
    if _TRITON is None:
        try:
            import megarl.kernels.triton_ops as module
        except ImportError:
            module = False
        _TRITON = module if torch.cuda.is_available() else False
    return _TRITON or None
