"""The two halves every weight transport implements.

A transport moves bucket bytes; it does not decide what to send or check what arrives (that is
:mod:`megarl.weights.update`). Control messages (JSON-ready dicts) travel separately, over
whatever link reaches the engines (HTTP calls to SGLang-style servers, pipes, Ray); a transport
only says what its messages must carry.

Sender, per update: ``allocate`` bucket buffers (through the pool), then for each bucket
``bucket_request`` (the per-bucket fields of the control message, or None when the engines need
no message per bucket), the message is posted, then ``push`` moves the bytes; ``finish`` returns
the fields of a final ``load`` message for transports that hand over everything at the end.
Receiver: ``receive`` turns a bucket's message into (name, tensor) views that are valid until
``release``; ``load`` yields every bucket of a finished update (``disk``).
"""

from __future__ import annotations

import abc
from collections.abc import Iterator
from typing import Any, ClassVar

import torch

from megarl.weights.buckets import Bucket, BucketMeta, BucketPlan

Message = dict[str, Any]


class SenderTransport(abc.ABC):
    """The trainer's half: owns bucket memory and pushes bucket bytes to engines."""

    kind: ClassVar[str]

    def allocate(self, nbytes: int) -> torch.Tensor:
        """A flat uint8 buffer this transport can send from."""
        return torch.empty(nbytes, dtype=torch.uint8)

    def free(self, buffer: torch.Tensor) -> None:
        """Forget a buffer made by :meth:`allocate`."""

    @abc.abstractmethod
    def connect_requests(self, num_engines: int) -> list[Message]:
        """The ``connect`` message for each engine (index = engine)."""

    def join(self) -> None:
        """Finish connecting after the connect messages were posted (e.g. a rendezvous)."""

    @abc.abstractmethod
    def bucket_request(self, bucket: Bucket) -> Message | None:
        """Fields the engines need to find this bucket's bytes, or None for no message."""

    def push(self, bucket: Bucket) -> None:
        """Move the bucket's bytes once its message was posted (may block until received)."""

    def finish(self, plan: BucketPlan, version: str) -> Message | None:
        """Fields of a final ``load`` message after every bucket was pushed, or None."""
        return None

    def close(self) -> None:
        """Release connections and memory."""


class ReceiverTransport(abc.ABC):
    """The engine's half: turns control messages into tensor views of the bucket bytes."""

    kind: ClassVar[str]

    def __init__(self, connect: Message, device: torch.device) -> None:
        self.device = device

    @abc.abstractmethod
    def receive(self, meta: BucketMeta, request: Message) -> list[tuple[str, torch.Tensor]]:
        """The bucket's tensors (views valid until :meth:`release`)."""

    def release(self) -> None:
        """The last received bucket was applied; its memory may be reused."""

    def load(self, plan: BucketPlan, request: Message) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Every bucket of an update handed over at once (transports with a ``load`` message)."""
        raise ValueError(f"the {self.kind} transport sends buckets one by one; it has no 'load' "
                         "message")

    def close(self) -> None:
        """Release connections and memory."""


def grown(buffer: torch.Tensor | None, nbytes: int, device: torch.device) -> torch.Tensor:
    """``buffer`` if it holds ``nbytes``, else a new flat uint8 buffer of that size."""
    if buffer is not None and buffer.numel() >= nbytes:
        return buffer
    return torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)

