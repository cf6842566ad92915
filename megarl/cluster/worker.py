"""The base class of every worker (actor, reference, critic, rollout server) and its identity.

A worker is an ordinary class deriving from :class:`Worker`. The worker group that starts it
(:class:`~megarl.cluster.worker_group.RayWorkerGroup` on Ray, or
:class:`~megarl.cluster.naive.NaiveWorkerGroup` under torchrun) gives it a :class:`WorkerInfo`
before its ``__init__`` runs, so ``self.rank`` and friends are usable in ``__init__``. The same
worker class runs unchanged in both modes; :meth:`Worker.init_distributed` creates (or, under
torchrun, reuses) the default ``torch.distributed`` group from the ``MASTER_ADDR`` /
``MASTER_PORT`` / ``RANK`` / ``WORLD_SIZE`` environment that the group sets.
"""

from __future__ import annotations

import importlib
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal, Protocol

from megarl.cluster.errors import ClusterError

Device = Literal["cpu", "cuda"]


@dataclass(frozen=True)
class WorkerInfo:
    """Who a worker is: its role, rank in the role's group, where it runs and its rendezvous."""

    role: str
    """The worker group's role name (``train``, ``rollout``, ...)."""
    rank: int
    """Rank within the role's group (0 .. world_size-1), ordered by node IP then device."""
    world_size: int
    """Number of workers in the role's group."""
    local_rank: int
    """Index among this group's workers on the same node."""
    local_world_size: int
    """This group's workers on the same node."""
    master_addr: str
    """IP of rank 0's node: the torch.distributed rendezvous host."""
    master_port: int
    """A port rank 0 found free: the torch.distributed rendezvous port."""
    node_ip: str
    """This worker's node IP."""
    hostname: str
    """This worker's host name (for messages)."""
    device: Device
    """``cuda`` when the worker holds a GPU, else ``cpu``."""
    log_path: str | None = None
    """The file receiving this worker's stdout/stderr (None where the launcher keeps them)."""

    def env(self) -> dict[str, str]:
        """The torchrun-style environment variables of this worker."""
        return {
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "MEGARL_ROLE": self.role,
        }

    @classmethod
    def from_env(cls, role: str = "worker", device: Device = "cpu") -> WorkerInfo:
        """Identity from torchrun-style variables; a lone process (rank 0 of 1) when unset."""
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        return cls(
            role=os.environ.get("MEGARL_ROLE", role),
            rank=int(os.environ.get("RANK", "0")),
            world_size=world_size,
            local_rank=int(os.environ.get("LOCAL_RANK", "0")),
            local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size))),
            master_addr=os.environ.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(os.environ.get("MASTER_PORT", "29500")),
            node_ip=host_ip(),
            hostname=socket.gethostname(),
            device=device,
        )


def host_ip() -> str:
    """This host's IP address as its host name resolves (127.0.0.1 when it does not)."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class Worker:
    """Base class of the classes a worker group runs, one instance per rank."""

    _megarl_info: WorkerInfo | None = None

    @classmethod
    def create_with_info(
        cls, info: WorkerInfo, args: Sequence[Any], kwargs: dict[str, Any]
    ) -> Worker:
        """Instantiate with ``info`` set before ``__init__`` runs (used by the worker groups)."""
        worker = cls.__new__(cls)
        worker._megarl_info = info
        worker.__init__(*args, **kwargs)
        return worker

    @property
    def info(self) -> WorkerInfo:
        """This worker's identity (from the environment when built outside a worker group)."""
        if self._megarl_info is None:
            self._megarl_info = WorkerInfo.from_env(role=type(self).__name__)
        return self._megarl_info

    @property
    def role(self) -> str:
        """The role name of this worker's group."""
        return self.info.role

    @property
    def rank(self) -> int:
        """Rank within the role's group."""
        return self.info.rank

    @property
    def world_size(self) -> int:
        """Size of the role's group."""
        return self.info.world_size

    @property
    def local_rank(self) -> int:
        """Index among the group's workers on this node."""
        return self.info.local_rank

    @property
    def device(self) -> str:
        """The torch device this worker computes on: ``cuda:<i>`` or ``cpu``."""
        if self.info.device == "cpu":
            return "cpu"
        import torch

        return f"cuda:{self.local_rank % max(1, torch.cuda.device_count())}"

    def init_distributed(self, backend: str | None = None, timeout_s: float = 1800.0) -> None:
        """Create the default torch.distributed group of this role from the environment.

        ``backend`` defaults to nccl on GPU and gloo on CPU. Under torchrun (naive mode) the
        group already exists and is reused when its size matches this role's.
        """
        import torch
        import torch.distributed as dist

        info = self.info
        if info.device == "cuda":
            torch.cuda.set_device(self.device)
        if dist.is_initialized():
            if dist.get_world_size() != info.world_size or dist.get_rank() != info.rank:
                raise ClusterError(
                    f"{info.role} rank {info.rank}: a torch.distributed group of size "
                    f"{dist.get_world_size()} (rank {dist.get_rank()}) already exists in this "
                    f"process but the role has {info.world_size} ranks; in naive mode every role "
                    "spans all torchrun ranks, so launch torchrun with "
                    f"--nproc-per-node={info.world_size}"
                )
            return
        backend = backend or ("nccl" if info.device == "cuda" else "gloo")
        dist.init_process_group(
            backend=backend, init_method="env://", rank=info.rank,
            world_size=info.world_size, timeout=timedelta(seconds=timeout_s),
        )


class CallHandle(Protocol):
    """An in-flight call on every rank of a group; ``get`` returns the results by rank."""

    def get(self, timeout_s: float | None = None) -> list[Any]:
        """Wait for every rank; raise on an exception, a dead worker or the timeout."""
        ...


class WorkerGroup(Protocol):
    """What the trainer sees of a role's workers, with or without Ray."""

    role: str

    @property
    def world_size(self) -> int:
        """Number of ranks."""
        ...

    def execute_all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``method`` with the same arguments on every rank; results by rank."""
        ...

    def execute_rank_split(
        self, method: str, per_rank_args: Sequence[Sequence[Any]], **kwargs: Any
    ) -> list[Any]:
        """Call ``method`` with ``per_rank_args[r]`` on rank r; results by rank."""
        ...

    def execute_all_async(self, method: str, *args: Any, **kwargs: Any) -> CallHandle:
        """Start ``method`` on every rank; ``.get()`` the handle for the results."""
        ...

    def execute_rank_split_async(
        self, method: str, per_rank_args: Sequence[Sequence[Any]], **kwargs: Any
    ) -> CallHandle:
        """Start ``method`` with per-rank arguments; ``.get()`` the handle for the results."""
        ...

    def shutdown(self) -> None:
        """Stop the workers."""
        ...


WorkerClass = type[Worker] | str
"""A worker class, or its ``"module:Name"`` path: imported only where the worker runs, so that
the driver need not import what the worker does (megatron-core for the train workers)."""


def worker_class(ref: WorkerClass) -> type[Worker]:
    """The class of ``ref`` (imported here for a ``"module:Name"`` path); a TypeError unless it
    is a :class:`Worker` subclass."""
    cls: Any = ref
    if isinstance(ref, str):
        module, _, name = ref.partition(":")
        cls = getattr(importlib.import_module(module), name)
    if not (isinstance(cls, type) and issubclass(cls, Worker)):
        raise TypeError(f"worker class must be a subclass of megarl.cluster.Worker or its "
                        f"'module:Name' path, got {ref!r}")
    return cls


def worker_class_name(ref: WorkerClass) -> str:
    """The class name of ``ref``, without importing a path."""
    return ref.rpartition(":")[2] if isinstance(ref, str) else ref.__name__
