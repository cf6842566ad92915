"""megarl's flattened-bucket payload (``update_weights_from_tensor`` with ``load_format:
"flattened_bucket"``) against SGLang's own reader and writer: ``MultiprocessingSerializer`` and
``SafeUnpickler`` (``sglang/srt/utils/common.py``), ``FlattenedTensorBucket``
(``sglang/srt/weight_sync/tensor_bucket.py``), as ``model_runner.py``
``_update_weights_from_flattened_bucket`` uses them."""

from __future__ import annotations

import base64
import io
import os
import pickle
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from torch.multiprocessing import reductions

payload = pytest.importorskip(
    "megarl.weights.flattened",
    reason="megarl.weights.flattened is missing")


def _named() -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [
        ("layers.0.w", torch.randn(3, 5, generator=gen)),
        ("layers.0.b", torch.randn(7, generator=gen).to(torch.bfloat16)),
        ("layers.1.ids", torch.randint(-2**40, 2**40, (2, 3, 1), generator=gen)),
        ("scale", torch.tensor(1.5)),  # 0-d
        ("odd", torch.randn(1, 1, 3, generator=gen).to(torch.bfloat16)),
        ("empty", torch.zeros(0, 4)),
    ]


@contextmanager
def _sglang_importable(tensor_bucket: types.ModuleType) -> Iterator[None]:
    """SGLang's unpickler imports the classes a pickle names: let
    ``sglang.srt.weight_sync.tensor_bucket`` resolve to the module loaded by path, without
    SGLang's package __init__; sys.modules is restored afterwards."""
    names = ["sglang", "sglang.srt", "sglang.srt.weight_sync"]
    saved = {n: sys.modules[n] for n in [*names, tensor_bucket.__name__] if n in sys.modules}
    for name in names:
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules[tensor_bucket.__name__] = tensor_bucket
    try:
        yield
    finally:
        for name in [*names, tensor_bucket.__name__]:
            sys.modules.pop(name, None)
        sys.modules.update(saved)


def _assert_same(got: list[tuple[str, torch.Tensor]],
                 want: list[tuple[str, torch.Tensor]]) -> None:
    assert [n for n, _ in got] == [n for n, _ in want]
    for (name, a), (_, b) in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a, b), name


def _aligned(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """``named`` with the widest dtypes first: SGLang's writer does not pad, and its reader's
    ``.view(dtype)`` needs every tensor to start at a multiple of its element size."""
    return sorted(named, key=lambda nt: -nt[1].element_size())


def test_sglang_reads_megarls_payload(sglang_serializer: types.SimpleNamespace,
                                      sglang_tensor_bucket: types.ModuleType) -> None:
    named = _named()  # fp32, bf16, then int64 at byte 74: megarl must align it (pad or order)
    data = payload.serialize(payload.flatten_bucket(named))
    assert isinstance(data, str)
    _assert_same(_sglang_reconstructs(data, sglang_serializer, sglang_tensor_bucket), named)


def _sglang_reconstructs(data: str, sglang_serializer: types.SimpleNamespace,
                         sglang_tensor_bucket: types.ModuleType) -> list[tuple[str, torch.Tensor]]:
    """What SGLang's ``_update_weights_from_flattened_bucket`` loads from ``data``."""
    with _sglang_importable(sglang_tensor_bucket):
        obj = sglang_serializer.MultiprocessingSerializer.deserialize(data)
    assert set(obj) == {"flattened_tensor", "metadata"}
    assert obj["flattened_tensor"].dtype == torch.uint8
    # model_runner.py _update_weights_from_flattened_bucket reads these attributes
    metadata = [sglang_tensor_bucket.FlattenedTensorMetadata(
        name=m.name, shape=m.shape, dtype=m.dtype, start_idx=m.start_idx, end_idx=m.end_idx,
        numel=m.numel) for m in obj["metadata"]]
    bucket = sglang_tensor_bucket.FlattenedTensorBucket(
        flattened_tensor=obj["flattened_tensor"], metadata=metadata)
    return bucket.reconstruct_tensors()


def test_sglang_reads_megarls_zero_copy_payload(sglang_serializer: types.SimpleNamespace,
                                                sglang_tensor_bucket: types.ModuleType) -> None:
    """The colocated sender's payload without a copy: views of one buffer in reverse order with
    bytes between them that belong to no record (as in a DDP buffer) read back by SGLang's own
    classes as the tensors themselves."""
    gen = torch.Generator().manual_seed(1)
    buffer = torch.randn(4096, generator=gen).to(torch.bfloat16)
    named = [(f"layers.{i}.w", buffer[3000 - 700 * i:3000 - 700 * i + 600].view(20, 30))
             for i in range(4)] + [("norm", buffer[3900:3964])]
    groups, rest = payload.zero_copy_groups(named, torch.device("cpu"), min_tensors=2)
    assert rest == [] and len(groups) == 1
    built = payload.view_payload(groups[0])
    assert built["flattened_tensor"].untyped_storage().data_ptr() == \
        buffer.untyped_storage().data_ptr()  # a view, not a copy
    _assert_same(_sglang_reconstructs(payload.serialize(built), sglang_serializer,
                                      sglang_tensor_bucket), named)


@contextmanager
def _sharing_strategy(strategy: str) -> Iterator[None]:
    saved = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy(strategy)
    try:
        yield
    finally:
        torch.multiprocessing.set_sharing_strategy(saved)


@pytest.mark.parametrize("strategy", ["file_descriptor", "file_system"])
def test_megarl_reads_sglangs_payload(strategy: str, sglang_serializer: types.SimpleNamespace,
                                      sglang_tensor_bucket: types.ModuleType) -> None:
    """What slime and SGLang's own Engine send: FlattenedTensorBucket metadata objects, named
    ``sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata`` in the pickle, and a CPU
    tensor as torch's ForkingPickler shares it (``rebuild_tensor`` over ``rebuild_storage_fd``
    with a ``resource_sharer.DupFd``, or ``rebuild_storage_filename`` under the ``file_system``
    strategy). megarl reads it where sglang cannot be imported (the embedded server), so its
    deserialize must resolve those names itself."""
    named = _aligned(_named())
    bucket = sglang_tensor_bucket.FlattenedTensorBucket(named_tensors=named)
    with _sglang_importable(sglang_tensor_bucket), _sharing_strategy(strategy):
        data = sglang_serializer.MultiprocessingSerializer.serialize(
            {"flattened_tensor": bucket.get_flattened_tensor(),
             "metadata": bucket.get_metadata()}, output_str=True)
    obj = payload.deserialize(data)
    flat = obj["flattened_tensor"]
    got = [(m.name, flat[m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape))
           for m in obj["metadata"]]
    _assert_same(got, named)


def test_megarl_aligns_mixed_dtypes_and_pads_nothing_for_one() -> None:
    """SGLang's reader needs each tensor at a multiple of its element size; a bucket of one
    dtype (what megarl's sender builds) has no padding and matches ``bucket_metadata``, the
    unpadded layout a broadcast receiver assumes (SGLang's FlattenedTensorBucket's)."""
    mixed = payload.flatten_bucket(_named())
    for meta in mixed["metadata"]:
        assert meta.start_idx % meta.dtype.itemsize == 0, meta
    one = [(n, t.to(torch.bfloat16)) for n, t in _named()]
    flat = payload.flatten_bucket(one)
    want = payload.bucket_metadata([(n, t.shape, t.dtype) for n, t in one])
    assert [vars(m) for m in flat["metadata"]] == [vars(m) for m in want]
    assert flat["flattened_tensor"].numel() == sum(t.numel() * 2 for _, t in one)


def test_flatten_into_copies_every_kind_of_tensor_bit_exactly() -> None:
    """The bucket's bytes are one ``torch.cat``: strided views, 0-dim tensors, tensors that
    require grad, FP8 and mixed dtypes (zero padding between) all land at their records, and
    SGLang-style slicing reads each back bit for bit; the padding bytes are zero."""
    g = torch.Generator().manual_seed(5)
    weight = torch.randn(6, 10, generator=g)
    named = [("a.t", weight.t()), ("b.half", torch.randn(3, generator=g).half()),
             ("c.grad", torch.randn(4, 5, generator=g, requires_grad=True)),
             ("d.scalar", torch.tensor(2.5, dtype=torch.float64)),
             ("e.fp8", torch.randn(8, 16, generator=g).to(torch.float8_e4m3fn)),
             ("f.rows", weight[::2]), ("g.bf16", torch.randn(7, generator=g).bfloat16())]
    buffer = torch.full((payload.flattened_size(named) + 16,), 255, dtype=torch.uint8)
    out = payload.flatten_into(buffer, named)
    flat, records = out["flattened_tensor"], out["metadata"]
    assert flat.numel() == payload.flattened_size(named)
    covered = torch.zeros(flat.numel(), dtype=torch.bool)
    for (name, tensor), meta in zip(named, records):
        assert meta.name == name and meta.start_idx % tensor.element_size() == 0
        got = flat[meta.start_idx:meta.end_idx].view(meta.dtype).reshape(meta.shape)
        want = tensor.detach().contiguous()
        assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), name
        covered[meta.start_idx:meta.end_idx] = True
    assert (~covered).any() and not flat[~covered].any()  # padding exists and is zero
    with pytest.raises(ValueError, match="cannot hold g.bf16"):
        payload.flatten_into(buffer[:flat.numel() - 1], named)


class _Rebuild:
    def __init__(self, fn: object, *args: object) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        return self.fn, self.args


@pytest.mark.parametrize("call", [
    _Rebuild(reductions.rebuild_storage_empty, types.SimpleNamespace),
    _Rebuild(reductions.rebuild_tensor, bytearray, None, (0, (1,), (1,), False)),
    _Rebuild(reductions.rebuild_storage_fd, torch.UntypedStorage, 3, 8),
], ids=["storage_of_another_class", "tensor_of_another_class", "fd_without_dupfd"])
def test_megarl_checks_the_rebuilds_it_allows(call: _Rebuild) -> None:
    """torch's CPU rebuilds are allowed, but only over storages and tensors."""
    data = base64.b64encode(pickle.dumps({"flattened_tensor": call})).decode()
    with pytest.raises(pickle.UnpicklingError, match="refusing"):
        payload.deserialize(data)


class _Call:
    def __init__(self, fn: object, arg: str) -> None:
        self.fn, self.arg = fn, arg

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return self.fn, (self.arg,)


@pytest.mark.parametrize("fn", [os.system, eval], ids=["os.system", "builtins.eval"])
def test_megarl_refuses_code_in_a_payload(fn: object, tmp_path: object) -> None:
    marker = f"{tmp_path}/ran"
    arg = f"touch {marker}" if fn is os.system else f"open({marker!r}, 'w')"
    data = base64.b64encode(pickle.dumps({"flattened_tensor": _Call(fn, arg)})).decode()
    with pytest.raises(Exception) as err:
        payload.deserialize(data)
    assert not os.path.exists(marker), "the payload's code ran"
    assert not isinstance(err.value, (TypeError, AttributeError)), err.value


def test_sglangs_unpickler_refuses_it_too(sglang_serializer: types.SimpleNamespace) -> None:
    """The reference: SGLang's SafeUnpickler blocks these (CVE-2025-10164)."""
    data = pickle.dumps(_Call(os.system, "true"))
    with pytest.raises(RuntimeError, match="Blocked"):
        sglang_serializer.SafeUnpickler(io.BytesIO(data)).load()
