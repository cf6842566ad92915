"""HostArena: host copies packed into power-of-two slabs (what offload and the engine's release
copy into instead of one pinned buffer per tensor, which torch rounds up to a power of two)."""

from __future__ import annotations

import pytest
import torch

from megarl.host_arena import ALIGN, HostArena


def test_ranges_span_slabs_and_round_trip_bit_exact():
    arena = HostArena(pin=False, slab_bytes=4096)
    sizes = [3000, 5000, 100]
    arena.reserve(sizes)
    # aligned: 3072 + 5120 + 512 = 8704 bytes: two full slabs, then the next power of two of 512
    assert [s.numel() for s in arena.slabs] == [4096, 4096, 512]
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in sizes]
    copies = [arena.take(n) for n in sizes]
    assert [[(s.data_ptr() - arena.slabs[0].data_ptr()) for s in c.segments][:1]
            for c in copies[:1]] == [[0]]
    assert [[s.numel() for s in c.segments] for c in copies] == [[3000], [1024, 3976], [100]]
    for c, d in zip(copies, data):
        c.store(d)
    for c, d in zip(copies, data):
        out = torch.empty_like(d)
        c.load_into(out)
        assert torch.equal(out, d) and torch.equal(c.tensor(), d)
    ptrs = {id(s) for s in arena.slabs}
    arena.reset()
    arena.reserve(sizes)  # the same sizes again: nothing new
    assert {id(s) for s in arena.slabs} == ptrs and arena.allocated_bytes == 8704
    again = [arena.take(n) for n in sizes]
    assert [c.segments[0].data_ptr() for c in again] == [c.segments[0].data_ptr() for c in copies]


def test_ranges_are_aligned_and_a_take_past_the_reservation_adds_a_slab():
    arena = HostArena(pin=False, slab_bytes=1 << 20)
    arena.reserve([1, 700])  # 512 + 1024 aligned bytes: one slab of 2048
    first, second = arena.take(1), arena.take(700)
    assert [s.numel() for s in arena.slabs] == [2048]
    assert second.segments[0].data_ptr() - first.segments[0].data_ptr() == ALIGN
    third = arena.take(5000)  # not reserved: a slab for it (5120 aligned -> 8192)
    assert [s.numel() for s in arena.slabs] == [2048, 8192]
    assert [s.numel() for s in third.segments] == [512, 4488]  # the first slab's tail, then on


@pytest.mark.parametrize("bad", [0, 1000, 3 * 4096, 256])
def test_slab_size_must_be_a_power_of_two_of_at_least_the_alignment(bad):
    with pytest.raises(ValueError, match="slab_bytes"):
        HostArena(pin=False, slab_bytes=bad)


def test_the_host_estimate_counts_the_same_slabs():
    from megarl.config import host_estimates
    from megarl.host_arena import SLAB_BYTES

    assert host_estimates.SLAB_BYTES == SLAB_BYTES
