"""``nccl``: one broadcast per bucket over a process group of the sender and every engine rank.

The sender is rank 0, engine ``i`` is rank ``1 + i``; the group is built the way SGLang's
``/init_weights_update_group`` builds it (:mod:`megarl.weights.group`), so the same sender talks
to SGLang servers. Each bucket's metadata goes out in its control message (SGLang:
``/update_weights_from_distributed`` with ``load_format="flattened_bucket"``), then its flat
buffer is broadcast. CUDA buffers use NCCL; CPU buffers use gloo with the same code.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megarl.net import free_port
from megarl.weights.buckets import Bucket, BucketMeta, unpack
from megarl.weights.group import close_weight_update_group, open_weight_update_group
from megarl.weights.transports.base import (
    Message,
    ReceiverTransport,
    SenderTransport,
    grown,
)


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


class NcclSender(SenderTransport):
    """Rank 0 of the weight-update group; broadcasts bucket buffers."""

    kind = "nccl"

    def __init__(self, device: torch.device | str = "cpu", master_address: str = "127.0.0.1",
                 master_port: int | None = None, group_name: str = "weight_update_group",
                 timeout_s: float = 300.0) -> None:
        self.device = torch.device(device)
        self.master_address = master_address
        self.master_port = master_port or free_port(master_address)
        self.group_name = group_name
        self.timeout_s = timeout_s
        self.group: dist.ProcessGroup | None = None
        self._world_size = 0

    def allocate(self, nbytes: int) -> torch.Tensor:
        """A flat uint8 buffer on the sending device."""
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def connect_requests(self, num_engines: int) -> list[Message]:
        """SGLang's ``/init_weights_update_group`` fields, engine ``i`` at rank ``1 + i``."""
        self._world_size = 1 + num_engines
        return [{"master_address": self.master_address, "master_port": self.master_port,
                 "rank_offset": 1 + i, "world_size": self._world_size,
                 "group_name": self.group_name, "backend": _backend(self.device),
                 "timeout_s": self.timeout_s} for i in range(num_engines)]

    def join(self) -> None:
        """Host the rendezvous and wait until every engine rank joined."""
        self.group = open_weight_update_group(
            self.master_address, self.master_port, 0, self._world_size, self.group_name,
            _backend(self.device), self.timeout_s)

    def bucket_request(self, bucket: Bucket) -> Message:
        """Only the group name; the broadcast carries the bytes."""
        return {"group_name": self.group_name}

    def push(self, bucket: Bucket) -> None:
        """Broadcast the bucket's bytes from rank 0."""
        if self.group is None:
            raise RuntimeError("the nccl transport is not connected; call WeightSender.connect()")
        if bucket.meta.nbytes:
            dist.broadcast(bucket.buffer[: bucket.meta.nbytes], src=0, group=self.group)

    def close(self) -> None:
        """Destroy the group."""
        if self.group is not None:
            close_weight_update_group(self.group)
            self.group = None


class NcclReceiver(ReceiverTransport):
    """An engine rank of the weight-update group; receives each bucket by broadcast."""

    kind = "nccl"

    def __init__(self, connect: Message, device: torch.device) -> None:
        super().__init__(connect, device)
        backend = _backend(device)
        if connect.get("backend", backend) != backend:
            raise ValueError(f"backend {connect['backend']!r} cannot move tensors on {device}; "
                             f"the sender and this engine must use {backend!r} buffers")
        self.group = open_weight_update_group(
            connect["master_address"], int(connect["master_port"]), int(connect["rank_offset"]),
            int(connect["world_size"]), connect["group_name"], backend,
            float(connect.get("timeout_s", 300.0)))
        self._buffer: torch.Tensor | None = None

    def receive(self, meta: BucketMeta, request: Message) -> list[tuple[str, torch.Tensor]]:
        """Join the broadcast of this bucket into a reused receive buffer."""
        self._buffer = grown(self._buffer, meta.nbytes, self.device)
        if meta.nbytes:
            dist.broadcast(self._buffer[: meta.nbytes], src=0, group=self.group)
        return unpack(self._buffer, meta)

    def close(self) -> None:
        """Destroy the group."""
        close_weight_update_group(self.group)
        self._buffer = None
