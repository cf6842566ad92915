"""Bucket plans, packing, zero-copy unpacking and the two-slot buffer pool."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from megarl.weights import (
    BucketMeta,
    BucketPlan,
    BufferPool,
    TensorSpec,
    pack,
    specs_of,
    unpack,
)


def spec(name: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> TensorSpec:
    """Shorthand."""
    return TensorSpec(name, shape, dtype)


def test_plan_keeps_order_aligns_offsets_and_isolates_oversized_tensors() -> None:
    specs = [spec("a", (10,)), spec("i", (3,), torch.int8), spec("b", (5,), torch.float64),
             spec("huge", (100,)), spec("c", (2, 2)), spec("flag", (), torch.bool)]
    plan = BucketPlan.from_specs(specs, bucket_bytes=128)
    layout = [[(t.name, t.offset) for t in b.tensors] for b in plan.buckets]
    # a: 40 bytes at 0; i: 3 bytes at 40; b (8-byte elements) at 48, not 43; huge (400 bytes)
    # exceeds the 128-byte bucket and gets one of its own; c and flag share the next.
    assert layout == [[("a", 0), ("i", 40), ("b", 48)], [("huge", 0)], [("c", 0), ("flag", 16)]]
    assert [b.nbytes for b in plan.buckets] == [88, 400, 17]
    assert plan.num_tensors == 6 and plan.total_bytes == 40 + 3 + 40 + 400 + 16 + 1
    assert [b.index for b in plan.buckets] == [0, 1, 2]


def test_cast_changes_only_floating_point_dtypes() -> None:
    specs = [spec("w", (4,)), spec("h", (4,), torch.float16), spec("n", (4,), torch.int64),
             spec("m", (4,), torch.bool)]
    plan = BucketPlan.from_specs(specs, 1 << 20, cast_dtype=torch.bfloat16)
    dtypes = {t.name: t.dtype for t in plan.buckets[0].tensors}
    assert dtypes == {"w": torch.bfloat16, "h": torch.bfloat16, "n": torch.int64,
                      "m": torch.bool}


def test_split_on_dtype_gives_sglang_flattened_buckets() -> None:
    g = torch.Generator().manual_seed(0)
    state = {"a": torch.randn(3, 5, generator=g), "b": torch.randn(7, generator=g),
             "ids": torch.arange(4), "c": torch.randn(2, 2, generator=g)}
    plan = BucketPlan.from_specs(specs_of(state), 1 << 20, torch.bfloat16, split_on_dtype=True)
    assert [b.names() for b in plan.buckets] == [["a", "b"], ["ids"], ["c"]]
    items = iter(state.items())
    first = plan.buckets[0]
    bucket = pack(torch.empty(first.nbytes, dtype=torch.uint8), first, items)
    # SGLang's FlattenedTensorBucket: torch.cat of the flattened tensors, no padding.
    reference = torch.cat([state["a"].flatten(), state["b"].flatten()]).to(torch.bfloat16)
    assert torch.equal(bucket.buffer, reference.view(torch.uint8))
    request = first.sglang_request()
    assert request == {"names": ["a", "b"], "dtypes": ["bfloat16", "bfloat16"],
                       "shapes": [[3, 5], [7]], "load_format": "flattened_bucket"}
    mixed = BucketPlan.from_specs(specs_of(state), 1 << 20, torch.bfloat16)
    with pytest.raises(ValueError, match="mixes dtypes.*split_on_dtype=True"):
        mixed.buckets[0].sglang_request()


def test_plan_json_round_trip_uses_sglang_dtype_names() -> None:
    specs = [spec("w", (2, 3)), spec("s", (), torch.int64), spec("e", (0, 4), torch.float16)]
    plan = BucketPlan.from_specs(specs, 16, torch.bfloat16)
    data = plan.to_json()
    assert data[0]["tensors"][0] == {"name": "w", "dtype": "bfloat16", "shape": [2, 3],
                                     "offset": 0}
    assert BucketPlan.from_json(data) == plan
    data[1]["index"] = 5
    with pytest.raises(ValueError, match="position 1 has index 5"):
        BucketPlan.from_json(data)
    with pytest.raises(ValueError, match="nbytes 3 does not match"):
        BucketMeta.from_json({**plan.buckets[0].to_json(), "nbytes": 3})
    with pytest.raises(ValueError, match="appears twice"):
        BucketPlan.from_specs([spec("w", (1,)), spec("w", (1,))], 16)


def test_pack_casts_and_unpack_returns_views_of_the_buffer() -> None:
    g = torch.Generator().manual_seed(1)
    state = {"w": torch.randn(6, 7, generator=g, dtype=torch.float64),
             "n": torch.randint(-9, 9, (5,), generator=g), "s": torch.tensor(2.5),
             "e": torch.empty(0, 3), "m": torch.tensor([True, False, True])}
    plan = BucketPlan.from_specs(specs_of(state), 1 << 20, torch.float16)
    meta = plan.buckets[0]
    buffer = torch.zeros(meta.nbytes + 100, dtype=torch.uint8)
    bucket = pack(buffer, meta, iter(state.items()))
    start, end = buffer.data_ptr(), buffer.data_ptr() + buffer.numel()
    for name, view in unpack(buffer, meta):
        expected = state[name].half() if state[name].is_floating_point() else state[name]
        assert view.dtype == expected.dtype and torch.equal(view, expected), name
        if view.numel():
            assert start <= view.data_ptr() < end, name
    views = dict(bucket.named_tensors())
    views["n"][0] = 123
    assert buffer[meta.tensors[1].offset: meta.tensors[1].offset + 8].view(torch.int64) == 123


def test_pack_rejects_tensors_that_differ_from_the_plan() -> None:
    plan = BucketPlan.from_specs([spec("a", (2,)), spec("b", (3,))], 1 << 10)
    meta = plan.buckets[0]
    buffer = torch.empty(meta.nbytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"b with shape \(4,\) arrived where the plan expects b "
                                         r"with shape \(3,\)"):
        pack(buffer, meta, iter([("a", torch.ones(2)), ("b", torch.ones(4))]))
    with pytest.raises(ValueError, match="ended before b"):
        pack(buffer, meta, iter([("a", torch.ones(2))]))


def test_buffer_pool_keeps_at_most_two_buffers_alive() -> None:
    allocated: list[int] = []
    live = [0]
    peak = [0]

    def allocate(n: int) -> torch.Tensor:
        allocated.append(n)
        live[0] += 1
        peak[0] = max(peak[0], live[0])
        return torch.empty(n, dtype=torch.uint8)

    def free(buffer: torch.Tensor) -> None:
        live[0] -= 1

    pool = BufferPool(allocate, free, size=64)
    handed: list[torch.Tensor] = []
    done = threading.Event()

    def consumer() -> None:
        while not done.is_set() or handed:
            if handed:
                time.sleep(0.002)
                pool.release(handed.pop(0))
            else:
                time.sleep(0.001)

    thread = threading.Thread(target=consumer)
    thread.start()
    for nbytes in [10, 64, 30, 200, 64, 5, 300, 8, 8, 8]:
        buffer = pool.acquire(nbytes)
        assert buffer.numel() >= nbytes
        handed.append(buffer)
    done.set()
    thread.join()
    assert peak[0] <= 2 and pool.peak_bytes <= 300 + 200
    assert allocated.count(64) < 6  # standard buffers are reused
    pool.close()
    assert live[0] == 0 and pool.live_bytes == 0


class _WatchedCondition(threading.Condition):
    """A condition that says when a thread first waits on it."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        self.waiting.set()  # still holding the lock: a notify cannot come before the wait
        return super().wait(timeout)


def test_buffer_pool_abort_wakes_a_blocked_acquire() -> None:
    pool = BufferPool(lambda n: torch.empty(n, dtype=torch.uint8), lambda b: None, size=8)
    pool._cond = _WatchedCondition()  # to abort once the acquire below is blocked, not before
    pool.acquire(8)
    pool.acquire(8)
    errors: list[BaseException] = []

    def blocked() -> None:
        try:
            pool.acquire(8)
        except BaseException as err:  # noqa: BLE001 - recorded for the assertion
            errors.append(err)

    thread = threading.Thread(target=blocked)
    thread.start()
    assert pool._cond.waiting.wait(timeout=10), "the third acquire did not block"
    pool.abort(RuntimeError("engine 1 died"))
    thread.join(timeout=5)
    assert errors and "engine 1 died" in str(errors[0])
    pool.reset()
    assert pool.acquire(8).numel() == 8
