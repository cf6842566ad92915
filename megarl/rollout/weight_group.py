"""The process group that carries weights from the trainer's sender to rollout engines.

It is created the way SGLang's engines create theirs (``init_custom_process_group``): a TCP
rendezvous at ``master_address:master_port`` where the sender is rank 0 and hosts the store, a
``PrefixStore`` named after the group, and a process group that is *not* the default one, so
it lives next to Megatron's groups in the trainer. Both sides of megarl use this function, and
a sender built this way also talks to real SGLang engines.
"""

from __future__ import annotations

import inspect
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import (
    Backend,
    PrefixStore,
    _new_process_group_helper,
    _world,
    rendezvous,
)

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float": torch.float32, "float16": torch.float16,
    "half": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64,
    "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8,
    "uint8": torch.uint8, "bool": torch.bool,
}


def parse_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` or ``"torch.bfloat16"`` -> ``torch.bfloat16``."""
    key = name.removeprefix("torch.")
    if key not in DTYPES:
        raise ValueError(f"dtype {name!r} is not known; use one of {sorted(DTYPES)}")
    return DTYPES[key]


def open_weight_update_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str = "weight_update_group",
    backend: str = "gloo",
    timeout_s: float = 300.0,
) -> dist.ProcessGroup:
    """Join (rank 0: create) the weight-update group; blocks until all ranks arrive."""
    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(
        rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    params = inspect.signature(_new_process_group_helper).parameters
    options_name = "backend_options" if "backend_options" in params else "pg_options"
    group, _ = _new_process_group_helper(
        world_size, rank, [], Backend(backend), store, group_name=group_name,
        **{options_name: None}, timeout=timeout,
    )
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def close_weight_update_group(group: dist.ProcessGroup) -> None:
    """Destroy a group made by :func:`open_weight_update_group`."""
    dist.destroy_process_group(group)
