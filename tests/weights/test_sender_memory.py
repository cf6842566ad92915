"""Peak sender memory is bounded by the bucket size, not by the model size.

A 200 MB "model" whose tensors are made one at a time (as an exporter gathers them) streams in
8 MB buckets over gloo to two engine processes. Two independent measures: the buffer pool's own
count of live bucket bytes must never exceed two buckets, and the process's peak resident memory
(``VmHWM``, reset through ``/proc/self/clear_refs``) may grow by at most three buckets and two
exported tensor, against the 200 MB that holding the model would cost (measured: 25 MB; it
scales with the bucket size: 12 MB with 4 MB buckets, 40 MB with 16 MB buckets).
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator

import pytest
import torch
from weights_harness import EnginePair

from megarl.weights import TensorSpec, WeightSender
from megarl.weights.transports import NcclSender

pytestmark = pytest.mark.timeout(180)

BUCKET_MB = 8
TENSORS = 50
SHAPE = (1024, 1024)
TENSOR_BYTES = SHAPE[0] * SHAPE[1] * 4
MB = 1 << 20
M_MMAP_THRESHOLD = -3


def specs() -> list[TensorSpec]:
    """50 float32 tensors of 4 MB: 200 MB."""
    return [TensorSpec(f"model.layers.{i}.weight", SHAPE, torch.float32) for i in range(TENSORS)]


def exported() -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor made when asked for and dropped by the consumer: never the whole model."""
    for i in range(TENSORS):
        tensor = torch.arange(TENSOR_BYTES // 4, dtype=torch.float32).add_(i)
        yield f"model.layers.{i}.weight", tensor.view(SHAPE)


def peak_rss_bytes() -> int:
    """This process's peak resident set size since the last reset."""
    with open("/proc/self/status") as status:
        line = next(l for l in status if l.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def return_freed_memory_at_once() -> None:
    """Have glibc unmap every freed allocation of 1 MB or more, so resident memory follows live
    bytes (by default freed heap memory stays resident and the peak measures fragmentation)."""
    ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 1 << 20)


def reset_peak_rss() -> None:
    """Set the peak resident set size to the current one (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def test_peak_sender_memory_is_two_buckets(engines: EnginePair) -> None:
    engines.setup(specs())
    sender = WeightSender(NcclSender(), engines.link, bucket_size_mb=BUCKET_MB)
    sender.connect()
    return_freed_memory_at_once()
    for _ in exported():  # torch's one-time set-up (thread pools) is not the sender's memory
        pass
    try:
        reset_peak_rss()
        before = peak_rss_bytes()
        report = sender.update(exported(), version="big", specs=specs(), verify_checksums=True)
        grown = peak_rss_bytes() - before
    finally:
        sender.close()
    assert report.bytes == TENSORS * TENSOR_BYTES
    assert report.num_buckets == TENSORS * TENSOR_BYTES // (BUCKET_MB * MB)
    assert report.mismatches == {0: [], 1: []}
    assert report.peak_buffer_bytes == 2 * BUCKET_MB * MB
    print(f"peak RSS grew by {grown / MB:.1f} MB for {report.bytes / MB:.0f} MB sent")
    assert grown < 3 * BUCKET_MB * MB + 2 * TENSOR_BYTES, f"peak RSS grew by {grown / MB:.1f} MB"
    last = f"model.layers.{TENSORS - 1}.weight"
    dumps = engines.dump([last])
    expected = torch.arange(TENSOR_BYTES // 4, dtype=torch.float32).add_(TENSORS - 1).view(SHAPE)
    assert all(torch.equal(d["state"][last], expected) for d in dumps)
