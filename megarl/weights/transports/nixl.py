"""``nixl``: engines READ bucket buffers from the sender's registered memory with NIXL (UCX).

The sender's NIXL agent registers every bucket buffer; each engine runs its own agent with one
registered receive buffer, loads the sender's agent metadata (which carries the registrations),
and for each bucket posts a READ of the sender's descriptor into its receive buffer. The sender
takes no part in a transfer (one-sided), so all engines pull the same bucket concurrently.
Metadata is re-sent whenever the sender's registrations changed (a new or freed buffer).
Works on CPU memory (``DRAM``) and on GPU memory (``VRAM``, with GPUDirect where UCX has it).
"""

from __future__ import annotations

import base64
import threading
import time
import uuid
from typing import Any

import torch

from megarl.weights.buckets import Bucket, BucketMeta, unpack
from megarl.weights.transports.base import (
    Message,
    ReceiverTransport,
    SenderTransport,
    grown,
)

_POLL_S = 5e-5
"""Pause between transfer-state polls, so engines sharing cores leave them to UCX's threads."""


def _agent(name: str) -> Any:
    """A NIXL agent with the UCX backend and a progress thread (needed to serve remote READs)."""
    try:
        from nixl_cu12._api import nixl_agent, nixl_agent_config
    except ImportError as err:
        raise ImportError("the nixl transport needs NIXL: pip install 'megarl[nixl]' "
                          "(nixl-cu12)") from err
    return nixl_agent(name, nixl_agent_config(enable_prog_thread=True, backends=["UCX"]))


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


class NixlSender(SenderTransport):
    """Registers bucket buffers with a NIXL agent; engines pull them."""

    kind = "nixl"

    def __init__(self, device: torch.device | str = "cpu", timeout_s: float = 300.0) -> None:
        self.device = torch.device(device)
        self.timeout_s = timeout_s
        self.name = f"megarl-sender-{uuid.uuid4().hex[:8]}"
        self.agent = _agent(self.name)
        # Buffers are registered on the packing thread and described on the shipping thread;
        # the agent (no internal locking in this mode) is only used under this lock.
        self._lock = threading.Lock()
        self._registrations: dict[int, Any] = {}
        self._generation = 0
        self._generation_sent = -1

    def allocate(self, nbytes: int) -> torch.Tensor:
        """A buffer registered with the agent."""
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        with self._lock:
            self._registrations[buffer.data_ptr()] = self.agent.register_memory(buffer)
            self._generation += 1
        return buffer

    def free(self, buffer: torch.Tensor) -> None:
        """Deregister the buffer."""
        with self._lock:
            descs = self._registrations.pop(buffer.data_ptr(), None)
            if descs is not None:
                self.agent.deregister_memory(descs)
                self._generation += 1

    def _metadata(self) -> str:
        self._generation_sent = self._generation
        return _b64(self.agent.get_agent_metadata())

    def connect_requests(self, num_engines: int) -> list[Message]:
        """The sender agent's name and metadata."""
        with self._lock:
            metadata = self._metadata()
        return [{"agent": self.name, "agent_metadata": metadata, "timeout_s": self.timeout_s}
                for _ in range(num_engines)]

    def bucket_request(self, bucket: Bucket) -> Message:
        """The descriptor to READ, plus fresh agent metadata when registrations changed."""
        with self._lock:
            descs = self.agent.get_xfer_descs(bucket.buffer[: max(bucket.meta.nbytes, 1)])
            request = {"agent": self.name, "descs": _b64(self.agent.get_serialized_descs(descs))}
            if self._generation != self._generation_sent:
                request["agent_metadata"] = self._metadata()
        return request

    def close(self) -> None:
        """Deregister everything."""
        with self._lock:
            for descs in self._registrations.values():
                self.agent.deregister_memory(descs)
            self._registrations.clear()


class NixlReceiver(ReceiverTransport):
    """An engine's NIXL agent with one registered receive buffer."""

    kind = "nixl"

    def __init__(self, connect: Message, device: torch.device) -> None:
        super().__init__(connect, device)
        self.agent = _agent(f"megarl-engine-{uuid.uuid4().hex[:8]}")
        self.timeout_s = float(connect.get("timeout_s", 300.0))
        self._buffer: torch.Tensor | None = None
        self._registration: Any = None
        self._load_metadata(connect)

    def _load_metadata(self, request: Message) -> None:
        self.agent.add_remote_agent(base64.b64decode(request["agent_metadata"]))

    def _receive_buffer(self, nbytes: int) -> torch.Tensor:
        buffer = grown(self._buffer, nbytes, self.device)
        if buffer is not self._buffer:
            if self._registration is not None:
                self.agent.deregister_memory(self._registration)
            self._registration = self.agent.register_memory(buffer)
            self._buffer = buffer
        return buffer

    def receive(self, meta: BucketMeta, request: Message) -> list[tuple[str, torch.Tensor]]:
        """READ the bucket from the sender into the receive buffer."""
        if "agent_metadata" in request:
            self._load_metadata(request)
        nbytes = max(meta.nbytes, 1)
        buffer = self._receive_buffer(nbytes)
        remote = self.agent.deserialize_descs(base64.b64decode(request["descs"]))
        local = self.agent.get_xfer_descs(buffer[:nbytes])
        handle = self.agent.initialize_xfer("READ", local, remote, request["agent"])
        try:
            state = self.agent.transfer(handle)
            deadline = time.monotonic() + self.timeout_s
            while state == "PROC":
                time.sleep(_POLL_S)
                if time.monotonic() > deadline:
                    raise TimeoutError(f"NIXL READ of bucket {meta.index} from "
                                       f"{request['agent']} took over {self.timeout_s} s")
                state = self.agent.check_xfer_state(handle)
            if state != "DONE":
                raise RuntimeError(f"NIXL READ of bucket {meta.index} from {request['agent']} "
                                   f"failed (state {state}); see the UCX log (UCX_LOG_LEVEL=info)")
        finally:
            self.agent.release_xfer_handle(handle)
        return unpack(buffer, meta)

    def close(self) -> None:
        """Deregister the receive buffer."""
        if self._registration is not None:
            self.agent.deregister_memory(self._registration)
            self._registration = None
        self._buffer = None
