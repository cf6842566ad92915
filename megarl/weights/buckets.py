"""Buckets: named tensors packed into one flat byte buffer, planned before any data moves.

A weight update is laid out once from the tensors' *specs* (name, shape, dtype) into a
:class:`BucketPlan`: consecutive tensors, in the order the exporter yields them, fill buckets of
at most ``bucket_bytes``; a tensor larger than a bucket gets a bucket of its own. Each tensor
sits at a byte offset aligned to its element size, so a bucket whose tensors share one dtype has
no padding and is byte-identical to SGLang's ``FlattenedTensorBucket`` (the ``flattened_bucket``
load format). Floating-point tensors may be cast to a target dtype (the rollout dtype, e.g.
bfloat16) while they are packed; integer and bool tensors keep theirs.

Because the plan exists before the first byte is packed, every receiver can check the whole
update (names, shapes, dtypes) up front and reject it before anything is overwritten.
The plan and its buckets serialise to JSON with SGLang's dtype names (``"bfloat16"``).

:class:`BufferPool` bounds the sender's memory: at most two bucket buffers exist at a time
(double buffering: one being packed while the other is in flight); buffers of the standard size
are reused from bucket to bucket and from update to update.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the names SGLang's weight-update requests use)."""
    return str(dtype).removeprefix("torch.")


_DTYPES: dict[str, torch.dtype] = {
    name: value for name, value in vars(torch).items() if isinstance(value, torch.dtype)
}


def parse_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` or ``"torch.bfloat16"`` -> ``torch.bfloat16``."""
    key = name.removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"dtype {name!r} is not a torch dtype; use a name such as 'bfloat16', "
                         "'float32' or 'int64'")
    return _DTYPES[key]


def _numel(shape: Sequence[int]) -> int:
    count = 1
    for size in shape:
        count *= int(size)
    return count


class TensorSpec(NamedTuple):
    """What a weight update will carry for one tensor, before its data exists."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


def specs_of(named: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
             ) -> list[TensorSpec]:
    """The specs of a state dict or of (name, tensor) pairs, in order."""
    items = named.items() if isinstance(named, Mapping) else named
    return [TensorSpec(name, tuple(t.shape), t.dtype) for name, t in items]


@dataclass(frozen=True)
class TensorMeta:
    """Where one tensor lives inside a bucket's byte buffer."""

    name: str
    dtype: torch.dtype
    """The dtype on the wire (after the optional cast)."""
    shape: tuple[int, ...]
    offset: int
    """Byte offset in the bucket buffer; a multiple of the dtype's element size."""

    @property
    def nbytes(self) -> int:
        """Bytes the tensor occupies."""
        return _numel(self.shape) * self.dtype.itemsize

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (dtype as its SGLang name)."""
        return {"name": self.name, "dtype": dtype_name(self.dtype), "shape": list(self.shape),
                "offset": self.offset}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> TensorMeta:
        """The inverse of :meth:`to_json`."""
        return cls(str(data["name"]), parse_dtype(str(data["dtype"])),
                   tuple(int(s) for s in data["shape"]), int(data["offset"]))


@dataclass(frozen=True)
class BucketMeta:
    """The layout of one bucket: its tensors in order and the length of its buffer."""

    index: int
    tensors: tuple[TensorMeta, ...]

    @property
    def nbytes(self) -> int:
        """Length of the bucket's byte buffer (end of its last tensor)."""
        return max((t.offset + t.nbytes for t in self.tensors), default=0)

    def names(self) -> list[str]:
        """Tensor names in bucket order."""
        return [t.name for t in self.tensors]

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {"index": self.index, "nbytes": self.nbytes,
                "tensors": [t.to_json() for t in self.tensors]}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> BucketMeta:
        """The inverse of :meth:`to_json`; the stated ``nbytes`` must match the layout."""
        meta = cls(int(data["index"]), tuple(TensorMeta.from_json(t) for t in data["tensors"]))
        if "nbytes" in data and int(data["nbytes"]) != meta.nbytes:
            raise ValueError(f"bucket {meta.index}: nbytes {data['nbytes']} does not match its "
                             f"tensors' layout ({meta.nbytes} bytes); the metadata is corrupt")
        return meta

    def sglang_request(self) -> dict[str, Any]:
        """``names``/``dtypes``/``shapes``/``load_format`` of SGLang's
        ``/update_weights_from_distributed`` for broadcasting this bucket as one buffer."""
        dtypes = {t.dtype for t in self.tensors}
        if len(dtypes) != 1:
            raise ValueError(f"bucket {self.index} mixes dtypes {sorted(map(dtype_name, dtypes))}"
                             "; SGLang's flattened_bucket needs one dtype per bucket: plan with "
                             "split_on_dtype=True")
        return {"names": self.names(), "dtypes": [dtype_name(t.dtype) for t in self.tensors],
                "shapes": [list(t.shape) for t in self.tensors], "load_format": "flattened_bucket"}


@dataclass(frozen=True)
class BucketPlan:
    """Every bucket of one weight update, laid out from tensor specs."""

    buckets: tuple[BucketMeta, ...]

    @classmethod
    def from_specs(cls, specs: Iterable[TensorSpec], bucket_bytes: int,
                   cast_dtype: torch.dtype | None = None,
                   split_on_dtype: bool = False) -> BucketPlan:
        """Lay tensors out in order into buckets of at most ``bucket_bytes``.

        ``cast_dtype`` replaces the dtype of floating-point tensors. ``split_on_dtype`` starts a
        new bucket whenever the wire dtype changes (SGLang's flattened_bucket needs that).
        """
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be > 0 (got {bucket_bytes}); set "
                             "checkpoint_engine.bucket_size_mb to a positive size")
        buckets: list[BucketMeta] = []
        current: list[TensorMeta] = []
        end = 0
        seen: set[str] = set()
        for name, shape, dtype in specs:
            if name in seen:
                raise ValueError(f"tensor {name} appears twice in the weight update; every name "
                                 "must be sent once")
            seen.add(name)
            wire = cast_dtype if cast_dtype is not None and dtype.is_floating_point else dtype
            size = _numel(shape) * wire.itemsize
            offset = -(-end // wire.itemsize) * wire.itemsize
            dtype_break = split_on_dtype and current and current[-1].dtype != wire
            if current and (offset + size > bucket_bytes or dtype_break):
                buckets.append(BucketMeta(len(buckets), tuple(current)))
                current, offset = [], 0
            current.append(TensorMeta(name, wire, tuple(int(s) for s in shape), offset))
            end = offset + size
        if current:
            buckets.append(BucketMeta(len(buckets), tuple(current)))
        return cls(tuple(buckets))

    @property
    def num_tensors(self) -> int:
        """Tensors in the update."""
        return sum(len(b.tensors) for b in self.buckets)

    @property
    def total_bytes(self) -> int:
        """Bytes of tensor data on the wire (padding excluded)."""
        return sum(t.nbytes for b in self.buckets for t in b.tensors)

    @property
    def max_bucket_bytes(self) -> int:
        """Length of the largest bucket buffer."""
        return max((b.nbytes for b in self.buckets), default=0)

    def to_json(self) -> list[dict[str, Any]]:
        """A JSON-ready list of buckets."""
        return [b.to_json() for b in self.buckets]

    @classmethod
    def from_json(cls, data: Sequence[Mapping[str, Any]]) -> BucketPlan:
        """The inverse of :meth:`to_json`."""
        buckets = tuple(BucketMeta.from_json(b) for b in data)
        for position, bucket in enumerate(buckets):
            if bucket.index != position:
                raise ValueError(f"bucket at position {position} has index {bucket.index}; "
                                 "buckets must be listed in order")
        return cls(buckets)


@dataclass(frozen=True)
class Bucket:
    """A packed bucket: its layout and the byte buffer holding its tensors."""

    meta: BucketMeta
    buffer: torch.Tensor
    """A flat uint8 tensor of at least ``meta.nbytes`` bytes (a pool buffer may be longer)."""

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Zero-copy views of the tensors inside the buffer."""
        return unpack(self.buffer, self.meta)


def tensor_view(buffer: torch.Tensor, meta: TensorMeta) -> torch.Tensor:
    """The view of ``buffer`` (flat uint8) that holds the tensor ``meta`` describes."""
    raw = buffer[meta.offset: meta.offset + meta.nbytes]
    return raw.view(meta.dtype).view(meta.shape)


def unpack(buffer: torch.Tensor, meta: BucketMeta) -> list[tuple[str, torch.Tensor]]:
    """(name, view) for every tensor of a bucket; no data is copied."""
    if buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise ValueError(f"bucket {meta.index}: the buffer must be a flat uint8 tensor, got "
                         f"{buffer.dtype} with shape {tuple(buffer.shape)}")
    if buffer.numel() < meta.nbytes:
        raise ValueError(f"bucket {meta.index}: buffer has {buffer.numel()} bytes, the layout "
                         f"needs {meta.nbytes}")
    return [(t.name, tensor_view(buffer, t)) for t in meta.tensors]


@torch.no_grad()
def pack(buffer: torch.Tensor, meta: BucketMeta,
         named: Iterator[tuple[str, torch.Tensor]]) -> Bucket:
    """Copy (and cast) the next ``len(meta.tensors)`` tensors of ``named`` into ``buffer``.

    Every tensor must match the plan's name and shape; a mismatch means the exporter yielded
    something other than what the receivers agreed to, and raises before it is packed.
    """
    for slot in meta.tensors:
        try:
            name, tensor = next(named)
        except StopIteration:
            raise ValueError(f"the exported tensors ended before {slot.name} (bucket "
                             f"{meta.index}); the plan has more tensors than the exporter "
                             "yields — rebuild the plan from the current specs") from None
        if name != slot.name or tuple(tensor.shape) != slot.shape:
            raise ValueError(f"exported tensor {name} with shape {tuple(tensor.shape)} arrived "
                             f"where the plan expects {slot.name} with shape {slot.shape} "
                             f"(bucket {meta.index}); rebuild the plan from the current specs")
        tensor_view(buffer, slot).copy_(tensor)
    if buffer.is_cuda:
        torch.cuda.current_stream(buffer.device).synchronize()
    return Bucket(meta, buffer)


class PoolClosed(RuntimeError):
    """Raised to a waiter of a :class:`BufferPool` that was aborted."""


class BufferPool:
    """At most ``slots`` flat byte buffers alive at a time, standard-size ones reused.

    ``acquire`` blocks while ``slots`` buffers are in use. A request larger than ``size`` (a
    tensor larger than a bucket) gets a dedicated buffer that is freed on release; idle
    standard buffers are freed first when the count would exceed ``slots``. ``peak_bytes``
    records the most bytes that were ever allocated at once.
    """

    def __init__(self, allocate: Callable[[int], torch.Tensor],
                 free: Callable[[torch.Tensor], None], size: int, slots: int = 2) -> None:
        self._allocate = allocate
        self._free = free
        self.size = size
        self.slots = slots
        self._idle: list[torch.Tensor] = []
        self._busy: list[torch.Tensor] = []
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self.live_bytes = 0
        self.peak_bytes = 0

    def acquire(self, nbytes: int) -> torch.Tensor:
        """A buffer of at least ``nbytes`` bytes; blocks while all slots are busy."""
        with self._cond:
            while len(self._busy) >= self.slots and self._error is None:
                self._cond.wait()
            if self._error is not None:
                raise PoolClosed(f"buffer pool aborted: {self._error}") from self._error
            want = max(nbytes, self.size)
            buffer = next((b for b in self._idle if b.numel() == want), None)
            if buffer is not None:
                self._idle.remove(buffer)
            else:
                while self._idle and len(self._idle) + len(self._busy) >= self.slots:
                    self._release_memory(self._idle.pop())
                buffer = self._allocate(want)
                self.live_bytes += buffer.numel()
                self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            self._busy.append(buffer)
            return buffer

    def release(self, buffer: torch.Tensor) -> None:
        """Give a buffer back; oversized ones are freed, standard ones kept for reuse."""
        with self._cond:
            self._busy = [b for b in self._busy if b is not buffer]
            if buffer.numel() == self.size:
                self._idle.append(buffer)
            else:
                self._release_memory(buffer)
            self._cond.notify_all()

    def abort(self, error: BaseException) -> None:
        """Wake every waiter with :class:`PoolClosed`; later acquires raise too."""
        with self._cond:
            self._error = error
            self._cond.notify_all()

    def reset(self) -> None:
        """Clear an abort and take back every busy buffer (after a failed update)."""
        with self._cond:
            self._error = None
            busy, self._busy = self._busy, []
            for buffer in busy:
                if buffer.numel() == self.size:
                    self._idle.append(buffer)
                else:
                    self._release_memory(buffer)

    def close(self) -> None:
        """Free every idle buffer (busy ones are freed when released)."""
        with self._cond:
            while self._idle:
                self._release_memory(self._idle.pop())

    def _release_memory(self, buffer: torch.Tensor) -> None:
        self.live_bytes -= buffer.numel()
        self._free(buffer)
