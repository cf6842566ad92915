"""``ipc``: colocated engines read bucket buffers straight from the sender's memory.

CPU buffers are files in ``/dev/shm`` mapped by the sender and by every engine, so bucket bytes
are never copied through a socket: the control message names the file and the engine unpacks
views of the mapping. CUDA buffers travel as CUDA IPC handles (``torch.multiprocessing``'s
``reduce_tensor``, the mechanism behind SGLang's ``/update_weights_from_tensor``), pickled and
base64-encoded into the message (so, as with SGLang, the control link must only carry messages
from the trusted trainer). The sender keeps every buffer alive until all engines replied
for the bucket; files are removed when a buffer is freed and at ``close``.
"""

from __future__ import annotations

import base64
import os
import pickle
import uuid
from pathlib import Path

import numpy as np
import torch
from torch.multiprocessing.reductions import reduce_tensor

from megarl.weights.buckets import Bucket, BucketMeta, unpack
from megarl.weights.transports.base import Message, ReceiverTransport, SenderTransport

SHM_DIR = Path("/dev/shm")


class IpcSender(SenderTransport):
    """Bucket buffers in shared memory (CPU) or shareable CUDA memory."""

    kind = "ipc"

    def __init__(self, device: torch.device | str = "cpu", shm_dir: Path = SHM_DIR) -> None:
        self.device = torch.device(device)
        self.shm_dir = Path(shm_dir)
        if self.device.type == "cpu" and not self.shm_dir.is_dir():
            raise FileNotFoundError(f"shm_dir {self.shm_dir} does not exist; pass a directory on "
                                    "a memory file system (tmpfs) that the engines can read")
        self._prefix = f"megarl-weights-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._paths: dict[int, Path] = {}
        self._count = 0

    def allocate(self, nbytes: int) -> torch.Tensor:
        """A shared-memory file mapping (CPU) or a CUDA buffer."""
        if self.device.type == "cuda":
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self._count += 1
        path = self.shm_dir / f"{self._prefix}-{self._count}"
        mapping = np.memmap(path, dtype=np.uint8, mode="w+", shape=(nbytes,))
        buffer = torch.from_numpy(mapping)
        self._paths[buffer.data_ptr()] = path
        return buffer

    def free(self, buffer: torch.Tensor) -> None:
        """Remove the buffer's file (the mapping goes when the tensor is dropped)."""
        path = self._paths.pop(buffer.data_ptr(), None)
        if path is not None:
            path.unlink(missing_ok=True)

    def connect_requests(self, num_engines: int) -> list[Message]:
        """Nothing to set up beyond the transport's name."""
        return [{} for _ in range(num_engines)]

    def bucket_request(self, bucket: Bucket) -> Message:
        """The file behind the buffer, or its CUDA IPC handle."""
        if bucket.buffer.is_cuda:
            handle = pickle.dumps(reduce_tensor(bucket.buffer))
            return {"cuda_ipc": base64.b64encode(handle).decode("ascii")}
        return {"path": str(self._paths[bucket.buffer.data_ptr()]),
                "size": bucket.buffer.numel()}

    def close(self) -> None:
        """Remove every file still present."""
        for path in self._paths.values():
            path.unlink(missing_ok=True)
        self._paths.clear()


class IpcReceiver(ReceiverTransport):
    """Maps the sender's buffers; keeps the last two mappings (the sender's two slots)."""

    kind = "ipc"

    def __init__(self, connect: Message, device: torch.device) -> None:
        super().__init__(connect, device)
        self._mappings: dict[str, torch.Tensor] = {}
        self._current: torch.Tensor | None = None

    def _map(self, path: str, size: int) -> torch.Tensor:
        if path not in self._mappings:
            while len(self._mappings) >= 2:
                self._mappings.pop(next(iter(self._mappings)))
            mapping = np.memmap(path, dtype=np.uint8, mode="r+", shape=(size,))
            self._mappings[path] = torch.from_numpy(mapping)
        return self._mappings[path]

    def receive(self, meta: BucketMeta, request: Message) -> list[tuple[str, torch.Tensor]]:
        """Views of the bucket inside the sender's memory."""
        if "cuda_ipc" in request:
            rebuild, args = pickle.loads(base64.b64decode(request["cuda_ipc"]))
            self._current = rebuild(*args)
        else:
            self._current = self._map(request["path"], int(request["size"]))
        return unpack(self._current, meta)

    def release(self) -> None:
        """Drop the reference to a CUDA buffer (file mappings stay cached)."""
        self._current = None

    def close(self) -> None:
        """Unmap everything."""
        self._mappings.clear()
        self._current = None
