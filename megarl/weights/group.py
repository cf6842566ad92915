"""A second, independent process group between the weight sender and the engine ranks.

The trainer already has a default group (Megatron's world) and so does every SGLang engine (its
TP world); the weight-update group spans processes of *different* default worlds, so
``torch.distributed.new_group`` (which needs every rank of one default group) cannot make it.

What is public in ``torch.distributed`` can build such a group — ``TCPStore`` plus a backend
object (``ProcessGroupGloo(store, rank, size)`` / ``ProcessGroupNCCL``) whose methods run the
collectives — but only if *both* ends build it that way: the store keys a group's backends use
depend on how it was built, and SGLang's engines build theirs with
``init_custom_process_group``: a TCP rendezvous, a ``PrefixStore`` named after the group, then
torch's ``_new_process_group_helper`` (which for ``gloo`` creates one backend per device type, each
rendezvousing separately). A sender built otherwise never meets them. So megarl builds the group
exactly that way, on both sides, and the result is an ordinary registered ``ProcessGroup``:
``dist.broadcast(t, src=0, group=g)`` works on it next to any default group.
"""

from __future__ import annotations

import inspect
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.distributed_c10d import Backend, _new_process_group_helper, _world


def open_weight_update_group(master_address: str, master_port: int, rank: int, world_size: int,
                             group_name: str = "weight_update_group", backend: str = "gloo",
                             timeout_s: float = 300.0) -> dist.ProcessGroup:
    """Join (rank 0: host) the group; blocks until all ``world_size`` ranks arrived.

    Wire-compatible with SGLang's ``/init_weights_update_group``: the sender is rank 0, engine
    ranks are ``rank_offset + r``.
    """
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, int(master_port), world_size, is_master=rank == 0,
                          timeout=timeout, wait_for_workers=False)
    store = dist.PrefixStore(group_name, store)
    params = inspect.signature(_new_process_group_helper).parameters
    options = "backend_options" if "backend_options" in params else "pg_options"
    group, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store,
                                         group_name=group_name, timeout=timeout,
                                         **{options: None})
    _world.pg_group_ranks[group] = {r: r for r in range(world_size)}
    return group


def close_weight_update_group(group: dist.ProcessGroup) -> None:
    """Leave and destroy a group made by :func:`open_weight_update_group`."""
    dist.destroy_process_group(group)
