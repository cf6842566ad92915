"""Megatron model-parallel groups (TP/PP/VPP/EP/ETP/CP, DP derived) on the current world.

The world is whatever ``torch.distributed`` was initialised with (torchrun, Ray worker group or
a test's spawned processes): NCCL on GPUs, gloo on the CPU. :func:`init_parallel` lays the
megatron groups over it from a :class:`ParallelSizes`; :func:`destroy_parallel` tears them down
so that a test process can build another layout.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megarl.megatron import cpu_compat


@dataclass(frozen=True)
class ParallelSizes:
    """Model-parallel layout of one actor engine; data parallelism fills the rest of the world."""

    tp: int = 1
    """Tensor-parallel size (attention heads, MLP columns, vocabulary)."""
    pp: int = 1
    """Pipeline-parallel size (layers split into stages)."""
    vpp: int | None = None
    """Virtual pipeline stages per rank (interleaved schedule); None for one chunk per rank."""
    ep: int = 1
    """Expert-parallel size (MoE experts split across ranks)."""
    etp: int | None = None
    """Expert tensor-parallel size; None means megatron's default (equal to ``tp``)."""
    cp: int = 1
    """Context-parallel size (sequence split for attention)."""
    sequence_parallel: bool | None = None
    """Sequence parallelism; None means on whenever ``tp > 1`` (required by MoE with TP)."""

    @property
    def model_parallel(self) -> int:
        """Ranks holding one replica of the dense part: tp * pp * cp."""
        return self.tp * self.pp * self.cp

    @property
    def expert_tp(self) -> int:
        """The effective expert tensor-parallel size."""
        return self.tp if self.etp is None else self.etp

    @property
    def use_sequence_parallel(self) -> bool:
        """Whether sequence parallelism is on for this layout."""
        return self.tp > 1 if self.sequence_parallel is None else self.sequence_parallel

    def data_parallel(self, world_size: int) -> int:
        """The data-parallel size on a world of ``world_size`` ranks (validates the layout)."""
        self.validate(world_size)
        return world_size // self.model_parallel

    def validate(self, world_size: int) -> None:
        """Raise ValueError naming the field when the sizes do not fit ``world_size`` ranks."""
        for name in ("tp", "pp", "ep", "cp"):
            if getattr(self, name) < 1:
                raise ValueError(f"parallel.{name}={getattr(self, name)}: must be >= 1")
        if world_size % self.model_parallel:
            raise ValueError(
                f"parallel: tp*pp*cp = {self.tp}*{self.pp}*{self.cp} = {self.model_parallel} "
                f"does not divide the world size {world_size}; choose sizes whose product "
                f"divides {world_size}"
            )
        expert_model_parallel = self.ep * self.expert_tp * self.pp
        if world_size % expert_model_parallel:
            raise ValueError(
                f"parallel: ep*etp*pp = {self.ep}*{self.expert_tp}*{self.pp} does not divide the "
                f"world size {world_size}; lower parallel.ep or parallel.etp"
            )
        if self.vpp is not None and (self.vpp < 1 or self.pp == 1):
            raise ValueError(
                f"parallel.vpp={self.vpp}: virtual stages need pp > 1 and vpp >= 1; "
                "set parallel.vpp=None for pp=1"
            )
        if self.tp == 1 and self.sequence_parallel:
            raise ValueError("parallel.sequence_parallel=True needs tp > 1; leave it None")


def default_backend() -> str:
    """``nccl`` when CUDA is available, else ``gloo``."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed_from_env(backend: str | None = None) -> None:
    """Initialise the default process group from torchrun-style environment variables.

    Does nothing when a group already exists. On GPUs, binds this process to LOCAL_RANK's device.
    """
    if dist.is_initialized():
        return
    backend = backend or default_backend()
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend)


def init_parallel(sizes: ParallelSizes, seed: int = 1234) -> None:
    """Create the megatron parallel groups for ``sizes`` over the current world and seed RNGs.

    ``torch.distributed`` must already be initialised. On a CPU-only process this also enables
    :mod:`megarl.megatron.cpu_compat`.
    """
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel

    if not dist.is_initialized():
        raise RuntimeError(
            "init_parallel: torch.distributed is not initialised; call "
            "init_distributed_from_env() (torchrun) or dist.init_process_group first"
        )
    sizes.validate(dist.get_world_size())
    cpu_compat.enable()
    if mpu.model_parallel_is_initialized():
        raise RuntimeError(
            "init_parallel: megatron parallel state already exists; call destroy_parallel() "
            "before creating another layout"
        )
    mpu.initialize_model_parallel(
        tensor_model_parallel_size=sizes.tp,
        pipeline_model_parallel_size=sizes.pp,
        virtual_pipeline_model_parallel_size=sizes.vpp,
        context_parallel_size=sizes.cp,
        expert_model_parallel_size=sizes.ep,
        expert_tensor_parallel_size=sizes.etp,
    )
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def destroy_parallel() -> None:
    """Tear down megatron's parallel groups and global buffers (the default group is kept)."""
    from megatron.core import parallel_state as mpu

    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()


def unwrap_chunk(chunk: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel of a model chunk, under megatron's DDP / Float16Module wrappers."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk
