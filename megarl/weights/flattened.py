"""SGLang's ``flattened_bucket`` weight payload: packing, serializing, and safe reading.

A bucket of HF-named tensors travels as one flat uint8 tensor plus per-tensor metadata, the
layout of SGLang's ``weight_sync/tensor_bucket.py``: every tensor flattened to its bytes and
concatenated in order, mixed dtypes allowed. SGLang's reader slices ``[start_idx:end_idx]`` and
calls ``.view(dtype)``, which fails unless the slice starts at a multiple of the dtype's size, so
:func:`flatten_into` / :func:`flatten_bucket` pad before a tensor that would start misaligned
(a bucket of one dtype, as megarl's sender builds, has no padding). :func:`bucket_metadata`
never pads: it describes what ``update_weights_from_distributed`` receives, laid out back to back
as SGLang's ``FlattenedTensorBucket(named_tensors=...)`` does. :func:`view_payload` builds a
payload without copying: the flat tensor is a view of the storage its tensors already share,
and the records point at their bytes (SGLang's ``reconstruct_tensors`` slices by the records
only, in any order, so gaps between them are never read). The metadata records (name, shape,
dtype, start_idx, end_idx, numel) are ``types.SimpleNamespace`` objects: SGLang reads them by
attribute only, and its allow-listing unpickler accepts ``types.*``, so the trainer needs no
SGLang installed to build a payload SGLang reads.

``serialize`` writes what SGLang's ``MultiprocessingSerializer.serialize(obj, output_str=True)``
writes (a ``ForkingPickler`` pickle, base64): CUDA tensors become CUDA IPC handles whose device
is the GPU's UUID (as SGLang's ``patch_torch`` does, so a receiver that sees the GPU under
another index still opens the right one); CPU tensors carry their bytes inline. ``deserialize``
reads such a string through an allow-list: tensors, dtypes, sizes, the metadata records, the
CUDA IPC rebuild function and torch's CPU shared-memory rebuilds (what SGLang's own serializer
writes for a CPU tensor: a file descriptor passed through ``multiprocessing.resource_sharer``, or
a shared-memory file name), each checked to rebuild only storages and tensors; nothing else (a
payload naming ``os.system`` or ``eval`` is refused).
"""

from __future__ import annotations

import base64
import functools
import io
import pickle
import time
import types
from collections.abc import Callable, Sequence
from multiprocessing import resource_sharer
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing
from torch.multiprocessing import reductions

FLATTENED_BUCKET = "flattened_bucket"
"""The ``load_format`` of SGLang's weight-update endpoints for this payload."""


def tensor_meta(name: str, tensor: torch.Tensor, start: int) -> types.SimpleNamespace:
    """The metadata record of ``tensor`` placed at byte ``start`` of a flat bucket."""
    numel = tensor.numel() * tensor.element_size()
    return types.SimpleNamespace(name=name, shape=torch.Size(tensor.shape), dtype=tensor.dtype,
                                 start_idx=start, end_idx=start + numel, numel=numel)


def bucket_metadata(specs: Sequence[tuple[str, Sequence[int], torch.dtype]]
                    ) -> list[types.SimpleNamespace]:
    """Metadata of a bucket of (name, shape, dtype) laid out back to back (no padding, as SGLang's
    ``FlattenedTensorBucket(named_tensors=...)``), without tensors."""
    out, start = [], 0
    for name, shape, dtype in specs:
        numel = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        out.append(types.SimpleNamespace(name=name, shape=torch.Size(shape), dtype=dtype,
                                         start_idx=start, end_idx=start + numel, numel=numel))
        start += numel
    return out


def _aligned(start: int, itemsize: int) -> int:
    """The first multiple of ``itemsize`` at or after byte ``start``."""
    return -(-start // itemsize) * itemsize


def flattened_size(named: Sequence[tuple[str, torch.Tensor]]) -> int:
    """Bytes :func:`flatten_into` uses for ``named``, padding included."""
    end = 0
    for _, tensor in named:
        end = _aligned(end, tensor.element_size()) + tensor.numel() * tensor.element_size()
    return end


def flatten_into(buffer: torch.Tensor, named: Sequence[tuple[str, torch.Tensor]]
                 ) -> dict[str, Any]:
    """Copy ``named`` into the front of the flat uint8 ``buffer``; the payload viewing it. Each
    tensor starts at a multiple of its element size (zero padding before it when needed), so
    SGLang's ``.view(dtype)`` of its slice works; tensors of one dtype get no padding. The
    copies are one ``torch.cat`` of the tensors' bytes: on CUDA a few batched kernels for a
    bucket of thousands of tensors, where a copy per tensor launched one each (on the CPU, with
    the e2e MoE slice's 3,147 tensors, 1.1-1.2x faster than that loop)."""
    metadata, pieces, end = [], [], 0
    with torch.no_grad():
        for name, tensor in named:
            meta = tensor_meta(name, tensor, _aligned(end, tensor.element_size()))
            if meta.end_idx > buffer.numel():
                raise ValueError(f"bucket buffer of {buffer.numel()} bytes cannot hold {name} "
                                 f"(needs {meta.end_idx})")
            if meta.start_idx > end:
                pieces.append(buffer.new_zeros(meta.start_idx - end))
            flat = tensor.to(buffer.device, non_blocking=True).reshape(-1)  # (a copy if strided)
            pieces.append(flat.view(torch.uint8))
            metadata.append(meta)
            end = meta.end_idx
        if pieces:
            torch.cat(pieces, out=buffer[:end])
    return {"flattened_tensor": buffer[:end], "metadata": metadata}


def flatten_bucket(named: Sequence[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """``{"flattened_tensor": uint8 tensor, "metadata": [records]}`` of ``named``, in a new
    buffer on the tensors' device (each tensor aligned as :func:`flatten_into` says)."""
    if not named:
        raise ValueError("a flattened bucket needs at least one tensor")
    buffer = torch.empty(flattened_size(named), dtype=torch.uint8, device=named[0][1].device)
    return flatten_into(buffer, named)


ZERO_COPY_MIN_TENSORS = 8
"""A storage sends its tensors as a view of itself when it holds at least this many of a
bucket's tensors (or :data:`ZERO_COPY_MIN_BYTES`): one post per storage must pay for itself."""
ZERO_COPY_MIN_BYTES = 64 << 20


def zero_copy_groups(named: Sequence[tuple[str, torch.Tensor]], device: torch.device,
                     min_tensors: int = ZERO_COPY_MIN_TENSORS, shared: bool = False
                     ) -> tuple[list[list[tuple[str, torch.Tensor]]], list[tuple[str, torch.Tensor]]]:
    """Split a bucket into groups that :func:`view_payload` sends without a copy, and the rest
    (in bucket order) to pack. A group is the contiguous tensors of one dtype on ``device``
    that share one storage (a Megatron actor's parameters are views of DDP's contiguous
    buffers), with ``min_tensors`` of them or :data:`ZERO_COPY_MIN_BYTES`; off
    CUDA, where the bytes between the tensors travel inline, a group must also fill at least
    half of the span it covers (unless ``shared``: CPU storages sent as shared memory)."""
    by_storage: dict[tuple[int, torch.dtype], list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in named:
        if tensor.device.type == device.type and tensor.is_contiguous() and tensor.numel():
            key = (tensor.untyped_storage().data_ptr(), tensor.dtype)
            by_storage.setdefault(key, []).append((name, tensor))
    groups, grouped = [], set()
    for group in by_storage.values():
        nbytes = sum(t.numel() * t.element_size() for _, t in group)
        if len(group) < min_tensors and nbytes < ZERO_COPY_MIN_BYTES:
            continue
        first, end = _span(group)
        if device.type != "cuda" and not shared and 2 * nbytes < end - first:
            continue
        groups.append(group)
        grouped.update(name for name, _ in group)
    return groups, [(name, t) for name, t in named if name not in grouped]


def _span(group: Sequence[tuple[str, torch.Tensor]]) -> tuple[int, int]:
    """First and last byte (exclusive) of ``group``'s tensors in their storage."""
    ends = [(t.storage_offset() * t.element_size(),
             (t.storage_offset() + t.numel()) * t.element_size()) for _, t in group]
    return min(e[0] for e in ends), max(e[1] for e in ends)


def view_payload(group: Sequence[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """The ``flattened_bucket`` payload of tensors that share one storage, without a copy: the
    flat tensor is a uint8 view of the storage from the group's first byte to its last, and each
    record's ``start_idx`` is its tensor's place in it (SGLang's reader slices by the records
    only, so the bytes between the tensors are never read)."""
    first, end = _span(group)
    sample = group[0][1]
    flat = torch.empty(0, dtype=torch.uint8, device=sample.device)
    flat.set_(sample.untyped_storage(), first, (end - first,), (1,))
    metadata = [tensor_meta(name, t, t.storage_offset() * t.element_size() - first)
                for name, t in group]
    return {"flattened_tensor": flat, "metadata": metadata}


def unflatten(payload: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """Named views of a flattened bucket (dict metadata records are accepted too)."""
    def get(obj: Any, key: str) -> Any:
        return obj[key] if isinstance(obj, dict) else getattr(obj, key)

    flat = payload["flattened_tensor"]
    out = []
    for meta in payload["metadata"]:
        dtype = get(meta, "dtype")
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"metadata of {get(meta, 'name')}: dtype {dtype!r} is not a "
                             "torch.dtype")
        piece = flat[get(meta, "start_idx"):get(meta, "end_idx")]
        if piece.storage_offset() % dtype.itemsize:  # mixed dtypes: SGLang itself would fail
            piece = piece.clone()
        out.append((str(get(meta, "name")), piece.view(dtype).reshape(tuple(get(meta, "shape")))))
    return out


# ----- serializing -----
_DEVICE_ARG = 6
"""Index of the device in the arguments of torch's ``rebuild_cuda_tensor``."""


def _device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def _local_device(device: int | str) -> int:
    """A CUDA device index of this process from an index or a GPU UUID."""
    if isinstance(device, int):
        return device
    for index in range(torch.cuda.device_count()):
        if _device_uuid(index) == device:
            return index
    raise ValueError(f"GPU {device} is not visible to this process "
                     f"(CUDA_VISIBLE_DEVICES gives it {torch.cuda.device_count()} devices); "
                     "the colocated engine must run on the trainer rank's GPU")


class _SharedFile:
    """Pickles as torch's ``rebuild_storage_filename`` of a CPU storage moved to shared memory."""

    def __init__(self, storage: torch.UntypedStorage) -> None:
        self.args = shm_managed(storage._share_filename_cpu_)
        storage._shared_incref()  # the receiver's rebuild drops this reference

    def __reduce__(self) -> tuple:
        return reductions.rebuild_storage_filename, (torch.UntypedStorage, *self.args)


class _SharedBytes:
    """Pickles as the uint8 typed storage over a :class:`_SharedFile` (what a tensor rebuilds
    on)."""

    def __init__(self, storage: torch.UntypedStorage) -> None:
        self.file = _SharedFile(storage)

    def __reduce__(self) -> tuple:
        return reductions.rebuild_typed_storage, (self.file, torch.uint8)


class _Pickler(ForkingPickler):
    """ForkingPickler that names the GPU by UUID and writes CPU tensors' bytes inline (or,
    with ``share_cpu``, moves their storage to shared memory and names its file)."""

    share_cpu = False

    def reducer_override(self, obj: Any) -> Any:
        if not isinstance(obj, torch.Tensor):
            return NotImplemented
        if obj.is_cuda:
            rebuild, args = reductions.reduce_tensor(obj)
            args = (*args[:_DEVICE_ARG], _device_uuid(args[_DEVICE_ARG]), *args[_DEVICE_ARG + 1:])
            return rebuild, args
        if self.share_cpu and obj.device.type == "cpu" and obj.dtype == torch.uint8:
            return reductions.rebuild_tensor, (torch.Tensor, _SharedBytes(obj.untyped_storage()),
                                               (obj.storage_offset(), tuple(obj.shape),
                                                obj.stride(), False))
        if obj.device.type != "cpu" or obj.dtype != torch.uint8 or obj.dim() != 1:
            raise TypeError(f"cannot serialize a {obj.dtype} {obj.device.type} tensor of "
                            f"{obj.dim()} dims inline; flatten it into a uint8 bucket first")
        data = bytearray(obj.contiguous().numpy().tobytes())
        return functools.partial(torch.frombuffer, dtype=torch.uint8), (data,)


def serialize(obj: Any, share_cpu: bool = False) -> str:
    """``obj`` as SGLang's ``MultiprocessingSerializer.serialize(obj, output_str=True)`` would
    write it (base64 of a ForkingPickler pickle), GPUs named by UUID. ``share_cpu``: a CPU
    uint8 tensor's storage moves to shared memory (torch's ``file_system`` strategy) and the
    receiver maps it, where by default its bytes are copied inline."""
    buf = io.BytesIO()
    pickler = _Pickler(buf, pickle.HIGHEST_PROTOCOL)
    pickler.share_cpu = share_cpu
    pickler.dump(obj)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _rebuild_cuda_tensor(*args: Any) -> torch.Tensor:
    """torch's ``rebuild_cuda_tensor`` with the device given as an index or a GPU UUID."""
    args = (*args[:_DEVICE_ARG], _local_device(args[_DEVICE_ARG]), *args[_DEVICE_ARG + 1:])
    return reductions.rebuild_cuda_tensor(*args)


class _SGLangMetadata(types.SimpleNamespace):
    """Stands in for SGLang's ``FlattenedTensorMetadata`` dataclass when reading its pickles
    (a pickled dataclass is rebuilt by ``cls.__new__`` and its ``__dict__``)."""


def _rebuild_partial(func: Any, args: tuple, keywords: dict) -> functools.partial:
    """``functools.partial`` as ``ForkingPickler`` writes it (the function passed the
    allow-list on its own)."""
    return functools.partial(func, *args, **keywords)


_STORAGES = (torch.UntypedStorage, torch.storage.TypedStorage)


def _storage_class(cls: Any) -> type:
    if cls not in _STORAGES:
        raise pickle.UnpicklingError(f"refusing to rebuild a storage of class {cls!r} in a "
                                     "weight payload")
    return cls


def _rebuild_tensor(cls: Any, storage: Any, metadata: tuple) -> torch.Tensor:
    """torch's CPU ``rebuild_tensor``, for plain tensors over a storage only."""
    if cls is not torch.Tensor or not isinstance(storage, _STORAGES):
        raise pickle.UnpicklingError(f"refusing to rebuild a {cls!r} over {type(storage)!r} in "
                                     "a weight payload")
    return reductions.rebuild_tensor(cls, storage, metadata)


def _rebuild_typed_storage(storage: Any, dtype: Any) -> torch.storage.TypedStorage:
    if not isinstance(storage, torch.UntypedStorage) or not isinstance(dtype, torch.dtype):
        raise pickle.UnpicklingError("refusing a typed storage over something else than an "
                                     "untyped storage in a weight payload")
    return reductions.rebuild_typed_storage(storage, dtype)


def _rebuild_storage_fd(cls: Any, df: Any, size: int) -> Any:
    """torch's ``rebuild_storage_fd``: the sender's file descriptor, received through its
    ``multiprocessing.resource_sharer`` (authenticated with this process's authkey)."""
    if not isinstance(df, resource_sharer.DupFd) or not isinstance(size, int):
        raise pickle.UnpicklingError("refusing a shared CPU storage without a DupFd handle in "
                                     "a weight payload")
    return reductions.rebuild_storage_fd(_storage_class(cls), df, size)


SHM_MANAGER_ATTEMPTS = 5
"""Tries of a ``file_system`` storage's rebuild whose shared-memory manager timed out."""


def _rebuild_storage_filename(cls: Any, manager: Any, handle: Any, size: int,
                              dtype: Any = None) -> Any:
    """torch's ``rebuild_storage_filename`` (the ``file_system`` sharing strategy)."""
    if not (isinstance(manager, bytes) and isinstance(handle, bytes) and isinstance(size, int)
            and (dtype is None or isinstance(dtype, torch.dtype))):
        raise pickle.UnpicklingError("refusing a malformed shared-memory file storage in a "
                                     "weight payload")
    return shm_managed(lambda: reductions.rebuild_storage_filename(
        _storage_class(cls), manager, handle, size, dtype))


def shm_managed(call: Callable[[], Any]) -> Any:
    """``call()``, a step that talks to torch's shared-memory manager, tried again (up to
    :data:`SHM_MANAGER_ATTEMPTS` times) when the manager did not answer: it answers within 1 s
    or the connection "has timed out" (libshm), and on a loaded machine it may not be scheduled
    in time; the step fails before it maps or releases anything. Other errors are raised."""
    for attempt in range(1, SHM_MANAGER_ATTEMPTS):
        try:
            return call()
        except RuntimeError as err:
            if "Shared memory manager" not in str(err):
                raise
            time.sleep(0.1 * attempt)
    return call()


def _rebuild_storage_empty(cls: Any) -> Any:
    return reductions.rebuild_storage_empty(_storage_class(cls))


def _getattr_frombuffer(owner: Any, name: str) -> Any:
    """``getattr`` as pickle uses it to name ``torch.frombuffer``, and for nothing else."""
    if owner is torch._C._VariableFunctionsClass and name == "frombuffer":
        return torch.frombuffer
    raise pickle.UnpicklingError(f"refusing getattr({owner!r}, {name!r}) in a weight payload")


_ALLOWED: dict[tuple[str, str], Any] = {
    ("types", "SimpleNamespace"): types.SimpleNamespace,
    ("functools", "partial"): functools.partial,
    ("multiprocessing.reduction", "_rebuild_partial"): _rebuild_partial,
    ("builtins", "bytearray"): bytearray,
    ("torch", "frombuffer"): torch.frombuffer,
    ("builtins", "getattr"): _getattr_frombuffer,
    ("torch._C", "_VariableFunctionsClass"): torch._C._VariableFunctionsClass,
    ("torch", "Size"): torch.Size,
    ("torch", "Tensor"): torch.Tensor,
    ("torch._tensor", "Tensor"): torch.Tensor,
    ("torch.storage", "TypedStorage"): torch.storage.TypedStorage,
    ("torch.storage", "UntypedStorage"): torch.UntypedStorage,
    ("torch", "UntypedStorage"): torch.UntypedStorage,
    ("torch", "TypedStorage"): torch.storage.TypedStorage,
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"): _rebuild_cuda_tensor,
    # what torch's ForkingPickler reductions write for a CPU tensor (SGLang's own serializer)
    ("torch.multiprocessing.reductions", "rebuild_tensor"): _rebuild_tensor,
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"): _rebuild_typed_storage,
    ("torch.multiprocessing.reductions", "rebuild_storage_fd"): _rebuild_storage_fd,
    ("torch.multiprocessing.reductions", "rebuild_storage_filename"): _rebuild_storage_filename,
    ("torch.multiprocessing.reductions", "rebuild_storage_empty"): _rebuild_storage_empty,
    ("multiprocessing.resource_sharer", "DupFd"): resource_sharer.DupFd,
    ("sglang.srt.patch_torch", "_rebuild_cuda_tensor_modified"): _rebuild_cuda_tensor,
    ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified"): _rebuild_cuda_tensor,
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"): _SGLangMetadata,
}
_DTYPES = {name: getattr(torch, name) for name in (
    "float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8",
    "bool", "float8_e4m3fn", "float8_e5m2") if hasattr(torch, name)}


class _SafeUnpickler(pickle.Unpickler):
    """Unpickles only tensors, dtypes, sizes, metadata records and CUDA IPC / CPU shared-memory
    rebuilds."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and name in _DTYPES:
            return _DTYPES[name]
        found = _ALLOWED.get((module, name))
        if found is None:
            raise pickle.UnpicklingError(f"refusing to unpickle {module}.{name}: a weight "
                                         "payload holds only tensors and their metadata")
        return found


def deserialize(data: str | bytes) -> Any:
    """Read a string written by :func:`serialize` or by SGLang's ``MultiprocessingSerializer``,
    through the allow-list."""
    raw = base64.b64decode(data, validate=True) if isinstance(data, str) else data
    return _SafeUnpickler(io.BytesIO(raw)).load()
