"""Ray resource pools, worker groups and the no-Ray (torchrun) mode.

The trainer creates pools (:func:`create_pools`), starts one :class:`RayWorkerGroup` per role on
them (or, with ``trainer.worker_group=naive``, one :class:`NaiveWorkerGroup` per role inside
torchrun processes) and drives every role through the same ``execute_all`` /
``execute_rank_split`` calls. Workers derive from :class:`Worker`.
"""

from megarl.cluster.errors import (
    ClusterError,
    PoolSchedulingError,
    RayStartError,
    WorkerDiedError,
    WorkerError,
    WorkerTimeoutError,
)
from megarl.cluster.naive import (
    NaiveCall,
    NaiveContext,
    NaiveWorkerGroup,
    init_naive,
    torchrun_world_size,
)
from megarl.cluster.pools import ResourcePool, create_pools, create_resource_pool, resolve_device
from megarl.cluster.ray_init import RayRuntime, find_local_ray, init_ray, write_timeline
from megarl.cluster.worker import CallHandle, Worker, WorkerGroup, WorkerInfo
from megarl.cluster.worker_group import GroupCall, RayWorkerGroup

__all__ = [
    "CallHandle", "ClusterError", "GroupCall", "NaiveCall", "NaiveContext", "NaiveWorkerGroup",
    "PoolSchedulingError", "RayRuntime", "RayStartError", "RayWorkerGroup", "ResourcePool",
    "Worker", "WorkerDiedError", "WorkerError", "WorkerGroup", "WorkerInfo",
    "WorkerTimeoutError", "create_pools", "create_resource_pool", "find_local_ray", "init_naive",
    "init_ray", "resolve_device", "torchrun_world_size", "write_timeline",
]
