"""``disk``: safetensors shards in a shared directory, published atomically.

Each bucket becomes one shard, written zero-copy from the bucket buffer into a staging
directory next to the target; after the last one an HF index (``model.safetensors.index.json``)
is written, everything is fsynced and the staging directory is renamed to its final name in one
step, so a reader never sees a half-written update. The engines then load the directory (SGLang:
``/update_weights_from_disk`` with ``model_path``). Every shard header is checked against the
announced plan before the first tensor is applied. The sender keeps the two newest directories
and removes older ones.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import uuid
from collections.abc import Iterator
from pathlib import Path

import torch

from megarl.weights.buckets import Bucket, BucketMeta, BucketPlan, dtype_name
from megarl.weights.transports.base import Message, ReceiverTransport, SenderTransport

INDEX_FILE = "model.safetensors.index.json"
_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL", torch.uint16: "U16", torch.uint32: "U32",
    torch.uint64: "U64", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.complex64: "C64",
}


def shard_name(index: int) -> str:
    """File name of bucket ``index``'s shard."""
    return f"model-{index + 1:05d}.safetensors"


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_shard(path: Path, bucket: Bucket) -> None:
    """Write a bucket as a safetensors file, straight from its buffer (no per-tensor copies)."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    start = 0
    for slot in bucket.meta.tensors:
        if slot.dtype not in _SAFETENSORS_DTYPES:
            raise ValueError(f"weight {slot.name}: dtype {dtype_name(slot.dtype)} has no "
                             "safetensors code; use another transport or cast it")
        header[slot.name] = {"dtype": _SAFETENSORS_DTYPES[slot.dtype], "shape": list(slot.shape),
                             "data_offsets": [start, start + slot.nbytes]}
        start += slot.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for slot in bucket.meta.tensors:
            raw = bucket.buffer[slot.offset: slot.offset + slot.nbytes]
            f.write(raw.cpu().numpy().data)
        f.flush()
        os.fsync(f.fileno())


class DiskSender(SenderTransport):
    """Writes each update to ``root/<version>-<id>`` atomically."""

    kind = "disk"

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._staging: Path | None = None
        self._published: list[Path] = []

    def connect_requests(self, num_engines: int) -> list[Message]:
        """Nothing to set up beyond the transport's name."""
        return [{} for _ in range(num_engines)]

    def bucket_request(self, bucket: Bucket) -> None:
        """No message per bucket: engines load the finished directory."""

    def push(self, bucket: Bucket) -> None:
        """Write the bucket's shard into the staging directory."""
        if self._staging is None:
            self._staging = self.root / f".staging-{uuid.uuid4().hex[:12]}"
            self._staging.mkdir()
        write_shard(self._staging / shard_name(bucket.meta.index), bucket)

    def finish(self, plan: BucketPlan, version: str) -> Message:
        """Write the index, publish the directory by rename, and name it in a ``load`` message."""
        staging, self._staging = self._staging, None
        if staging is None:
            staging = self.root / f".staging-{uuid.uuid4().hex[:12]}"
            staging.mkdir()
        index = {"metadata": {"total_size": plan.total_bytes, "weight_version": version},
                 "weight_map": {t.name: shard_name(b.index)
                                for b in plan.buckets for t in b.tensors}}
        (staging / INDEX_FILE).write_text(json.dumps(index, indent=1))
        _fsync(staging / INDEX_FILE)
        _fsync(staging)
        label = re.sub(r"[^A-Za-z0-9_.-]", "_", version) or "weights"
        final = self.root / f"{label}-{uuid.uuid4().hex[:8]}"
        os.rename(staging, final)
        _fsync(self.root)
        self._published.append(final)
        while len(self._published) > 2:
            shutil.rmtree(self._published.pop(0), ignore_errors=True)
        return {"path": str(final)}

    def close(self) -> None:
        """Remove an unfinished staging directory (published ones stay for readers)."""
        if self._staging is not None:
            shutil.rmtree(self._staging, ignore_errors=True)
            self._staging = None


class DiskReceiver(ReceiverTransport):
    """Loads a published directory one shard (bucket) at a time."""

    kind = "disk"

    def receive(self, meta: BucketMeta, request: Message) -> list[tuple[str, torch.Tensor]]:
        """Not used: the disk transport hands over whole updates through ``load``."""
        raise ValueError("the disk transport has no per-bucket messages; the sender's 'load' "
                         "message names the directory")

    def load(self, plan: BucketPlan, request: Message) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Check every shard header against the plan, then yield each shard's tensors."""
        from safetensors import safe_open
        from safetensors.torch import load_file

        directory = Path(request["path"])
        for meta in plan.buckets:
            file = directory / shard_name(meta.index)
            if not file.is_file():
                raise FileNotFoundError(f"{file}: shard of bucket {meta.index} is missing; the "
                                        "directory was not written by this update")
            with safe_open(str(file), framework="pt") as f:
                names = f.keys()
                found = {name: (tuple(f.get_slice(name).get_shape()),
                                f.get_slice(name).get_dtype()) for name in names}
            expected = {t.name: (t.shape, _SAFETENSORS_DTYPES[t.dtype]) for t in meta.tensors}
            if found != expected:
                wrong = sorted(set(found.items()) ^ set(expected.items()))[:3]
                raise ValueError(f"{file}: tensors differ from the announced bucket "
                                 f"{meta.index}, e.g. {wrong}; the directory belongs to another "
                                 "update")
        for meta in plan.buckets:
            tensors = load_file(str(directory / shard_name(meta.index)), device=str(self.device))
            yield [(t.name, tensors[t.name]) for t in meta.tensors]
