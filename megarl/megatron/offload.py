"""Host-memory offload of a Megatron role's state between its phases (``actor.offload.*``).

While colocated engines generate, the actor's optimizer state, gradient buffers and (optionally)
parameters leave the GPU, and come back for the next forward or update; the optimizer state only
for the update's optimizer steps (:meth:`OffloadSettings.update_parts`), so the forwards and
backwards have its memory. Everything moves at the level of the *storage*: a storage is copied
to host memory (pinned on CUDA, plain on CPU; packed into each part's
:class:`~megarl.host_arena.HostArena`, whose slabs stay allocated for the next cycle and are not
rounded up per tensor as torch's pinned allocator would) and resized to 0 bytes; on reload it is
resized back and refilled. Every tensor that views it (DDP's
contiguous param/grad buffers, the params and ``main_grad`` views into them, the distributed
optimizer's shards, Adam's ``exp_avg``/``exp_avg_sq``) stays the same object and is valid again
after the reload, so megatron's buffers, buckets and optimizer need no re-wiring.

Parts (verl's names): ``param`` (model parameters), ``grad`` (DDP gradient buffers: freed, not
copied, since every update zeroes them first; reloaded as zeros) and ``optimizer`` (fp32 main
params that are not views of the model's own params, their grads, and the optimizer states).
A storage belongs to the first part that names it, in that order.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from megarl.host_arena import SLAB_BYTES, HostArena, HostCopy
from megarl.memory import free_cached_memory

PARTS = ("param", "grad", "optimizer")


@dataclass(frozen=True)
class OffloadSettings:
    """What a trained role keeps in host memory while it is idle (``<role>.offload``)."""

    param_offload: bool = False
    grad_offload: bool = False
    optimizer_offload: bool = False

    def parts(self) -> list[str]:
        """The parts switched on, in :data:`PARTS` order."""
        on = (self.param_offload, self.grad_offload, self.optimizer_offload)
        return [part for part, flag in zip(PARTS, on) if flag]

    def update_parts(self) -> list[str]:
        """The parts an update brings back before its first forward: all, except an offloaded
        optimizer state, which comes back only for each optimizer step (and leaves again before
        the next mini-batch's forward), so the forwards and backwards have its memory for their
        activations."""
        return [part for part in PARTS if not (part == "optimizer" and self.optimizer_offload)]


@dataclass
class _Stash:
    """One offloaded storage: the live (now empty) storage, its size, and its host copy."""

    storage: torch.UntypedStorage
    nbytes: int
    host: HostCopy | None


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over the whole of ``storage``."""
    flat = torch.empty(0, dtype=torch.uint8, device=storage.device)
    return flat.set_(storage, 0, (storage.nbytes(),), (1,))


def _inner_optimizers(optimizer: Any) -> list[Any]:
    """The torch optimizers inside a megatron (chained, distributed, mixed-precision) one."""
    if optimizer is None:
        return []
    megatron_opts = getattr(optimizer, "chained_optimizers", [optimizer])
    return [getattr(opt, "optimizer", opt) for opt in megatron_opts]


def _optimizer_tensors(optimizer: Any) -> Iterator[torch.Tensor]:
    """Main params, their grads and every state tensor of ``optimizer``."""
    for inner in _inner_optimizers(optimizer):
        for group in inner.param_groups:
            for param in group["params"]:
                yield param
                if param.grad is not None:
                    yield param.grad
        for state in inner.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))


@dataclass
class StateOffloader:
    """Moves one role's params, grad buffers and optimizer state to host memory and back."""

    chunks: list[torch.nn.Module]
    optimizer: Any = None
    stashes: dict[str, list[_Stash]] = field(default_factory=dict)
    arenas: dict[str, HostArena] = field(default_factory=dict)
    """Per part, the host slabs its storages are copied into (kept for the next offload)."""
    slab_bytes: int = SLAB_BYTES

    @property
    def offloaded(self) -> set[str]:
        """The parts that are in host memory now."""
        return set(self.stashes)

    def _tensors(self, part: str) -> Iterator[torch.Tensor]:
        params = [p for chunk in self.chunks for p in chunk.parameters()]
        if part == "param":
            yield from params
        elif part == "grad":
            for p in params:
                yield from (g for g in (getattr(p, "main_grad", None), p.grad) if g is not None)
        else:
            yield from _optimizer_tensors(self.optimizer)

    def _storages(self, part: str) -> list[torch.UntypedStorage]:
        """The distinct non-empty storages of ``part`` that no earlier part owns."""
        earlier = {s.data_ptr() for p in PARTS[:PARTS.index(part)]
                   for s in self._live_storages(p)}
        found: dict[int, torch.UntypedStorage] = {}
        for storage in self._live_storages(part):
            if storage.data_ptr() not in earlier:
                found.setdefault(storage.data_ptr(), storage)
        return list(found.values())

    def _live_storages(self, part: str) -> Iterator[torch.UntypedStorage]:
        for tensor in self._tensors(part):
            storage = tensor.untyped_storage()
            if storage.nbytes() > 0 and not (storage.device.type == "cpu" and self._on_gpu()):
                yield storage

    def _on_gpu(self) -> bool:
        params = (p for chunk in self.chunks for p in chunk.parameters())
        return any(p.device.type == "cuda" for p in params)

    @torch.no_grad()
    def offload(self, parts: Iterable[str]) -> int:
        """Move ``parts`` (of :data:`PARTS`) to host memory; returns the bytes freed."""
        todo = [p for p in PARTS if p in set(parts) and p not in self.stashes]
        unknown = set(parts) - set(PARTS)
        if unknown:
            raise ValueError(f"offload parts: unknown {sorted(unknown)}; use {list(PARTS)}")
        found = {part: self._storages(part) for part in todo}
        pin = self._on_gpu()
        freed = 0
        for part, storages in found.items():
            stashes = []
            arena = None
            if part != "grad":  # grads are zeroed before every update: nothing to keep
                arena = self.arenas.setdefault(part, HostArena(pin, self.slab_bytes))
                arena.reset()  # this part's earlier copies were all reloaded
                arena.reserve(s.nbytes() for s in storages)
            for storage in storages:
                host = None
                if arena is not None:
                    host = arena.take(storage.nbytes())
                    host.store(_bytes_of(storage), non_blocking=pin)
                stashes.append(_Stash(storage, storage.nbytes(), host))
            self.stashes[part] = stashes
        if pin:
            torch.cuda.synchronize()
        for stashes in (self.stashes[part] for part in found):
            for stash in stashes:
                stash.storage.resize_(0)
                freed += stash.nbytes
        if found:  # a full gc pass costs ~0.25 s in a rank that has not settled: only for a move
            free_cached_memory()
        return freed

    @torch.no_grad()
    def reload(self, parts: Iterable[str] = PARTS) -> int:
        """Bring ``parts`` back from host memory (in place); returns the bytes restored."""
        restored = 0
        for part in [p for p in PARTS if p in set(parts) and p in self.stashes]:
            for stash in self.stashes[part]:
                stash.storage.resize_(stash.nbytes)
                live = _bytes_of(stash.storage)
                if stash.host is None:
                    live.zero_()
                else:
                    stash.host.load_into(live, non_blocking=self.arenas[part].pin)
                restored += stash.nbytes
        if torch.cuda.is_available() and self._on_gpu():
            torch.cuda.synchronize()
        for part in [p for p in PARTS if p in set(parts)]:
            self.stashes.pop(part, None)
        return restored

    @property
    def host_bytes(self) -> int:
        """Host bytes the parts' slabs hold (kept between cycles)."""
        return sum(a.allocated_bytes for a in self.arenas.values())
