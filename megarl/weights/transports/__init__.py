"""Weight transports by name: ``nccl`` (gloo on CPU), ``nixl``, ``ipc``, ``disk``."""

from __future__ import annotations

import torch

from megarl.weights.transports.base import Message, ReceiverTransport, SenderTransport
from megarl.weights.transports.disk import DiskReceiver, DiskSender
from megarl.weights.transports.ipc import IpcReceiver, IpcSender
from megarl.weights.transports.nccl import NcclReceiver, NcclSender
from megarl.weights.transports.nixl import NixlReceiver, NixlSender

RECEIVERS: dict[str, type[ReceiverTransport]] = {
    cls.kind: cls for cls in (NcclReceiver, NixlReceiver, IpcReceiver, DiskReceiver)
}
SENDERS: dict[str, type[SenderTransport]] = {
    cls.kind: cls for cls in (NcclSender, NixlSender, IpcSender, DiskSender)
}


def open_receiver(kind: str, connect: Message, device: torch.device) -> ReceiverTransport:
    """The engine half of transport ``kind``, connected with the sender's ``connect`` message."""
    if kind not in RECEIVERS:
        raise ValueError(f"transport {kind!r} is not known; use one of {sorted(RECEIVERS)}")
    return RECEIVERS[kind](connect, device)


__all__ = [
    "RECEIVERS", "SENDERS", "DiskReceiver", "DiskSender", "IpcReceiver", "IpcSender",
    "Message", "NcclReceiver", "NcclSender", "NixlReceiver", "NixlSender", "ReceiverTransport",
    "SenderTransport", "open_receiver",
]
