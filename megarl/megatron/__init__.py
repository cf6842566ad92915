"""The train-pool engine on megatron-core: parallel state, model build through mbridge, the
native (TransformerEngine-free) layer spec, the CPU compatibility layer and log-probs.

Submodules are imported explicitly (``from megarl.megatron.model import build_actor_model``):
importing megatron-core takes seconds, and this package stays cheap to import. The driver
imports only ``settings`` (the workers' specs), ``parallel``, ``offload`` and ``checkpoint_dirs``
(where to resume from), which do not import megatron-core (tests/test_layering.py checks it).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType


class EagerFusionsWithoutCuda(importlib.abc.MetaPathFinder):
    """Where CUDA is absent, megatron-core's fused functions run eagerly.

    megatron-core decorates its fusions (bias-SwiGLU, the router's expert-bias update, ...) with
    ``megatron.core.jit.jit_fuser``, which is ``torch.compile`` on torch >= 2.2. Decorating
    imports TorchDynamo and Inductor and starts Inductor's compile machinery: ~1 s of CPU in
    every process that imports megatron-core (a rank, a converter, a test), and the MoE router
    then traces its expert-bias update with Dynamo on the first forward, to compile nothing on a
    CPU. Without CUDA (megarl's CPU layer, :mod:`megarl.megatron.cpu_compat`) this finder calls
    megatron's own ``disable_jit_fuser()`` right after ``megatron.core.jit`` executes, before any
    fusion module binds the decorator: the same functions, run eagerly. With CUDA it does
    nothing. It acts once per process and only if megatron-core was not imported before this
    package (``sys.modules`` decides)."""

    NAME = "megatron.core.jit"

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.NAME:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            import torch

            if not torch.cuda.is_available():
                module.disable_jit_fuser()

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if "megatron.core.jit" not in sys.modules and not any(
        isinstance(f, EagerFusionsWithoutCuda) for f in sys.meta_path):
    sys.meta_path.insert(0, EagerFusionsWithoutCuda())
