"""Host buffers for state that leaves the GPU (the actor's offload, the embedded engine's released
weights), packed into power-of-two slabs.

torch's pinned-memory allocator (``CachingHostAllocator``) rounds every buffer up to the next
power of two and keeps it cached: one pinned buffer per tensor costs up to twice the tensor (a
12 MiB expert pins 16 MiB, a 10.4 GB DDP buffer 16 GB). A :class:`HostArena` allocates slabs of
:data:`SLAB_BYTES` (a power of two, so nothing is rounded) and, for what is left over, one slab of
the next power of two of it; it hands out aligned byte ranges of them, and a tensor larger than
a slab spans several (:class:`HostCopy` keeps its segments). The slabs stay allocated across
cycles: after :meth:`HostArena.reset` the next cycle of the same sizes allocates nothing. At most
one slab per arena is partly unused, so what an arena holds is its bytes plus less than
:data:`SLAB_BYTES`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

SLAB_BYTES = 1 << 30
"""Bytes of a full slab (a power of two: torch's pinned allocator adds nothing to it)."""
ALIGN = 512
"""Every range starts at a multiple of this many bytes."""


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def _next_power_of_two(nbytes: int) -> int:
    return 1 << max(0, nbytes - 1).bit_length()


class HostCopy:
    """The host copy of one flat byte tensor: its segments, in order, in an arena's slabs."""

    def __init__(self, segments: list[torch.Tensor]) -> None:
        self.segments = segments

    @property
    def nbytes(self) -> int:
        return sum(s.numel() for s in self.segments)

    def store(self, src: torch.Tensor, non_blocking: bool = False) -> None:
        """Copy the flat uint8 tensor ``src`` (of :attr:`nbytes`) in."""
        offset = 0
        for seg in self.segments:
            seg.copy_(src[offset:offset + seg.numel()], non_blocking=non_blocking)
            offset += seg.numel()

    def load_into(self, dst: torch.Tensor, non_blocking: bool = False) -> None:
        """Copy out into the flat uint8 tensor ``dst`` (of :attr:`nbytes`)."""
        offset = 0
        for seg in self.segments:
            dst[offset:offset + seg.numel()].copy_(seg, non_blocking=non_blocking)
            offset += seg.numel()

    def tensor(self) -> torch.Tensor:
        """The bytes as one flat tensor: a view when they lie in one segment, else a copy."""
        if len(self.segments) == 1:
            return self.segments[0]
        return torch.cat(self.segments)


class HostArena:
    """Slabs of host memory (pinned when ``pin``) handed out as byte ranges (module docstring)."""

    def __init__(self, pin: bool, slab_bytes: int = SLAB_BYTES) -> None:
        if slab_bytes < ALIGN or slab_bytes & (slab_bytes - 1):
            raise ValueError(f"slab_bytes={slab_bytes}: must be a power of two >= {ALIGN}")
        self.pin = pin
        self.slab_bytes = slab_bytes
        self.slabs: list[torch.Tensor] = []
        self._slab = 0  # the slab the next range starts in, and where in it
        self._offset = 0

    @property
    def allocated_bytes(self) -> int:
        """Host bytes the slabs hold."""
        return sum(s.numel() for s in self.slabs)

    def _free_bytes(self) -> int:
        if self._slab >= len(self.slabs):
            return 0
        return (self.slabs[self._slab].numel() - self._offset
                + sum(s.numel() for s in self.slabs[self._slab + 1:]))

    def reserve(self, sizes: Iterable[int]) -> None:
        """Make sure ranges of ``sizes`` bytes (taken in this order) fit: full slabs for the
        shortfall, then one slab of the next power of two of what is left."""
        need = sum(_aligned(n) for n in sizes) - self._free_bytes()
        while need > 0:
            size = self.slab_bytes if need >= self.slab_bytes else _next_power_of_two(need)
            self.slabs.append(torch.empty(size, dtype=torch.uint8, pin_memory=self.pin))
            need -= size

    def take(self, nbytes: int) -> HostCopy:
        """A range of ``nbytes`` (spanning slabs when it must); :meth:`reserve` it first, or
        a slab is added for it."""
        segments: list[torch.Tensor] = []
        left = nbytes
        while left > 0:
            if self._slab >= len(self.slabs):
                self.reserve([left])
            slab = self.slabs[self._slab]
            n = min(left, slab.numel() - self._offset)
            segments.append(slab[self._offset:self._offset + n])
            left -= n
            self._offset = min(slab.numel(), _aligned(self._offset + n))
            if self._offset >= slab.numel():
                self._slab, self._offset = self._slab + 1, 0
        return HostCopy(segments)

    def reset(self) -> None:
        """Every range handed out is free again (their copies must no longer be used)."""
        self._slab = self._offset = 0
