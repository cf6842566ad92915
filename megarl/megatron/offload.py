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
A storage belongs to the first part that names it, in that order. Inside, ``optimizer`` is kept
as two stores with their own host slabs: the Adam moments (state tensors of a parameter's shape
that own their storage: ``exp_avg``, ``exp_avg_sq``) and the rest.

**The streamed optimizer step** (``stream_bytes`` > 0, ``offload.optimizer_step_chunk_mb``). The
moments are two thirds of an fp32 Adam's state (8 of 12 bytes a parameter). For a step,
:meth:`StateOffloader.reload_for_step` brings back the rest only; the step then runs over the
parameters in chunks of about ``stream_bytes`` of moments: chunk k+1's moments come in on one
copy stream while chunk k is updated, and chunk k-1's go back out on another (both directions
at once over PCIe), so the GPU holds at most three chunks of moments instead of all of them.
Each chunk is a call of the torch optimizer's own ``step`` over its parameters (the groups
narrowed to them), so the result is the unchunked step's, bit for bit.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from megarl.host_arena import SLAB_BYTES, HostArena, HostCopy
from megarl.memory import free_cached_memory

PARTS = ("param", "grad", "optimizer")
_STORES = ("param", "grad", "optimizer", "moments")
"""What the offloader keeps apart: the parts, with ``optimizer``'s Adam moments on their own."""


@dataclass(frozen=True)
class OffloadSettings:
    """What a trained role keeps in host memory while it is idle (``<role>.offload``)."""

    param_offload: bool = False
    grad_offload: bool = False
    optimizer_offload: bool = False
    optimizer_step_chunk_mb: int = 0
    """With ``optimizer_offload``: the optimizer steps stream Adam's moments through the GPU
    this many MiB at a time (0: the whole state comes back for a step)."""

    @property
    def stream_bytes(self) -> int:
        """The streamed step's chunk in bytes (0: no streaming)."""
        return self.optimizer_step_chunk_mb << 20 if self.optimizer_offload else 0

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


def _is_moment(name: Any, value: Any, param: torch.Tensor) -> bool:
    """Whether a state entry is one of Adam's moments that the streamed step can move alone: a
    tensor of the parameter's shape that is the whole of its storage."""
    return (name != "step" and isinstance(value, torch.Tensor) and value.shape == param.shape
            and value.storage_offset() == 0 and value.untyped_storage().nbytes()
            in (0, value.numel() * value.element_size()))


def _moments(inner: Any, param: torch.Tensor) -> list[torch.Tensor]:
    """``param``'s moments in ``inner``'s state (none before its first step)."""
    return [v for k, v in inner.state.get(param, {}).items() if _is_moment(k, v, param)]


def _optimizer_tensors(optimizer: Any, moments: bool) -> Iterator[torch.Tensor]:
    """Main params, their grads and the state tensors of ``optimizer`` that are not moments; or,
    with ``moments``, the moments alone."""
    for inner in _inner_optimizers(optimizer):
        if not moments:
            for group in inner.param_groups:
                for param in group["params"]:
                    yield param
                    if param.grad is not None:
                        yield param.grad
        for param, state in inner.state.items():
            yield from (v for k, v in state.items() if isinstance(v, torch.Tensor)
                        and _is_moment(k, v, param) == moments)


def _public(store: str) -> str:
    return "optimizer" if store == "moments" else store


def _stores(parts: Iterable[str]) -> list[str]:
    """The stores of ``parts`` (of :data:`PARTS`), in :data:`_STORES` order."""
    parts = set(parts)
    unknown = parts - set(PARTS)
    if unknown:
        raise ValueError(f"offload parts: unknown {sorted(unknown)}; use {list(PARTS)}")
    return [s for s in _STORES if _public(s) in parts]


@dataclass
class StateOffloader:
    """Moves one role's params, grad buffers and optimizer state to host memory and back."""

    chunks: list[torch.nn.Module]
    optimizer: Any = None
    stashes: dict[str, list[_Stash]] = field(default_factory=dict)
    """Per store (:data:`_STORES`), its storages in host memory now."""
    arenas: dict[str, HostArena] = field(default_factory=dict)
    """Per store, the host slabs its storages are copied into (kept for the next offload)."""
    slab_bytes: int = SLAB_BYTES
    stream_bytes: int = 0
    """Moments per chunk of a streamed optimizer step (module docstring); 0: no streaming."""
    stream_peak_bytes: int = 0
    """The most bytes of moments the last streamed step held on the device at once."""
    stream_chunks: int = 0
    """The chunks of the last streamed step (over the inner optimizers of a chained one)."""
    _armed: bool = False

    def __post_init__(self) -> None:
        if self.stream_bytes > 0:
            for inner in _inner_optimizers(self.optimizer):
                # an instance attribute: megatron's step_with_ready_grads calls inner.step()
                inner.step = functools.partial(self._streamed_step, inner, inner.step)

    @property
    def offloaded(self) -> set[str]:
        """The parts that are in host memory now (wholly or in part)."""
        return {_public(store) for store in self.stashes}

    def _tensors(self, store: str) -> Iterator[torch.Tensor]:
        params = [p for chunk in self.chunks for p in chunk.parameters()]
        if store == "param":
            yield from params
        elif store == "grad":
            for p in params:
                yield from (g for g in (getattr(p, "main_grad", None), p.grad) if g is not None)
        else:
            yield from _optimizer_tensors(self.optimizer, moments=store == "moments")

    def _storages(self, store: str) -> list[torch.UntypedStorage]:
        """The distinct non-empty storages of ``store`` that no earlier store owns."""
        earlier = {s.data_ptr() for p in _STORES[:_STORES.index(store)]
                   for s in self._live_storages(p)}
        found: dict[int, torch.UntypedStorage] = {}
        for storage in self._live_storages(store):
            if storage.data_ptr() not in earlier:
                found.setdefault(storage.data_ptr(), storage)
        return list(found.values())

    def _live_storages(self, store: str) -> Iterator[torch.UntypedStorage]:
        for tensor in self._tensors(store):
            storage = tensor.untyped_storage()
            if storage.nbytes() > 0 and not (storage.device.type == "cpu" and self._on_gpu()):
                yield storage

    def _on_gpu(self) -> bool:
        params = (p for chunk in self.chunks for p in chunk.parameters())
        return any(p.device.type == "cuda" for p in params)

    def _arena(self, store: str) -> HostArena:
        """``store``'s slabs; every range handed out is free again when it holds nothing."""
        if store not in self.arenas:
            self.arenas[store] = HostArena(self._on_gpu(), self.slab_bytes)
        arena = self.arenas[store]
        if not self.stashes.get(store):
            arena.reset()  # this store's earlier copies were all reloaded
        return arena

    @torch.no_grad()
    def offload(self, parts: Iterable[str]) -> int:
        """Move ``parts`` (of :data:`PARTS`) to host memory; returns the bytes freed. What of
        them is in host memory already stays there."""
        self._armed = False
        found = {store: self._storages(store) for store in _stores(parts)}
        for store in found:  # in host memory from now on, also where nothing needed moving
            self.stashes.setdefault(store, [])
        found = {store: storages for store, storages in found.items() if storages}
        pin = self._on_gpu()
        freed = 0
        moved: list[_Stash] = []
        for store, storages in found.items():
            arena = None
            if store != "grad":  # grads are zeroed before every update: nothing to keep
                arena = self._arena(store)
                arena.reserve(s.nbytes() for s in storages)
            for storage in storages:
                host = None
                if arena is not None:
                    host = arena.take(storage.nbytes())
                    host.store(_bytes_of(storage), non_blocking=pin)
                moved.append(_Stash(storage, storage.nbytes(), host))
                self.stashes[store].append(moved[-1])
        if pin:
            torch.cuda.synchronize()
        for stash in moved:
            stash.storage.resize_(0)
            freed += stash.nbytes
        if found:  # a full gc pass costs ~0.25 s in a rank that has not settled: only for a move
            free_cached_memory()
        return freed

    @torch.no_grad()
    def reload(self, parts: Iterable[str] = PARTS) -> int:
        """Bring ``parts`` back from host memory (in place); returns the bytes restored."""
        self._armed = False
        return self._reload(_stores(parts))

    @torch.no_grad()
    def reload_for_step(self, parts: Iterable[str] = ("optimizer",)) -> int:
        """As :meth:`reload`, for the optimizer step that follows: with ``stream_bytes`` the
        Adam moments stay in host memory and that step streams them (module docstring)."""
        if self.stream_bytes <= 0:
            return self.reload(parts)
        restored = self._reload([s for s in _stores(parts) if s != "moments"])
        self._armed = "optimizer" in set(parts)
        self.stream_peak_bytes = self.stream_chunks = 0
        return restored

    def _reload(self, stores: list[str]) -> int:
        restored = 0
        for store in [s for s in stores if s in self.stashes]:
            for stash in self.stashes.pop(store):
                stash.storage.resize_(stash.nbytes)
                live = _bytes_of(stash.storage)
                if stash.host is None:
                    live.zero_()
                else:
                    stash.host.load_into(live, non_blocking=self.arenas[store].pin)
                restored += stash.nbytes
        if torch.cuda.is_available() and self._on_gpu():
            torch.cuda.synchronize()
        return restored

    @property
    def host_bytes(self) -> int:
        """Host bytes the parts' slabs hold (kept between cycles)."""
        return sum(a.allocated_bytes for a in self.arenas.values())

    # -- the streamed optimizer step ---------------------------------------------------------

    @torch.no_grad()
    def _streamed_step(self, inner: Any, step: Callable[..., Any], closure: Any = None) -> Any:
        """``inner.step`` in chunks of moments (module docstring) from :meth:`reload_for_step`
        to the next offload or reload (every inner optimizer of a chained one streams); the
        plain step otherwise (e.g. megatron's dummy step at a checkpoint load, which runs with
        everything reloaded)."""
        if not self._armed or closure is not None:
            return step(closure) if closure is not None else step()
        groups = inner.param_groups
        kept = [group["params"] for group in groups]
        todo = [(g, p) for g, params in enumerate(kept) for p in params if p.grad is not None]
        if not todo:
            return step()
        held = {stash.storage._cdata: stash for stash in self.stashes.get("moments", [])}
        arena = self._arena("moments")
        chunks = self._plan(inner, todo, arena)
        mover = _Mover(self._on_gpu())
        peak = 0
        try:
            incoming = mover.bring_in(self._held_moments(inner, chunks[0], held))
            outgoing: tuple[list[_Stash], Any] | None = None
            for k, chunk in enumerate(chunks):
                mover.wait(incoming)
                if k + 1 < len(chunks):
                    incoming = mover.bring_in(self._held_moments(inner, chunks[k + 1], held))
                for g, group in enumerate(groups):
                    group["params"] = [p for gp, p in chunk if gp == g]
                step()
                leaving = self._moment_stashes(inner, chunk, held, arena)
                live = sum(s.nbytes for s in leaving) + (
                    sum(s.nbytes for s in outgoing[0]) if outgoing else 0)
                peak = max(peak, live + (mover.incoming_bytes if k + 1 < len(chunks) else 0))
                if outgoing is not None:
                    mover.release(outgoing)
                outgoing = mover.send_out(leaving)
            if outgoing is not None:
                mover.release(outgoing)
            mover.finish()
        finally:
            for group, params in zip(groups, kept):
                group["params"] = params
        self.stream_peak_bytes = max(self.stream_peak_bytes, peak)
        self.stream_chunks += len(chunks)
        return None

    def _plan(self, inner: Any, todo: list[tuple[int, torch.Tensor]],
              arena: HostArena) -> list[list[tuple[int, torch.Tensor]]]:
        """``todo`` in consecutive chunks of at most ``stream_bytes`` of moments (one parameter
        at least); host ranges are reserved for the moments a first step makes."""
        chunks: list[list[tuple[int, torch.Tensor]]] = [[]]
        size, new = 0, []
        for g, param in todo:
            moments = _moments(inner, param)
            if moments:  # each the whole of its storage (_is_moment), in host memory or not
                nbytes = sum(m.numel() * m.element_size() for m in moments)
            else:  # made by this step: Adam's two, in the parameter's dtype
                nbytes = 2 * param.numel() * param.element_size()
                new += [nbytes // 2] * 2
            if chunks[-1] and size + nbytes > self.stream_bytes:
                chunks.append([])
                size = 0
            chunks[-1].append((g, param))
            size += nbytes
        arena.reserve(new)
        return chunks

    def _held_moments(self, inner: Any, chunk: list[tuple[int, torch.Tensor]],
                      held: dict[int, _Stash]) -> list[_Stash]:
        """The stashes of ``chunk``'s moments that are in host memory."""
        keys = [m.untyped_storage()._cdata for _, p in chunk for m in _moments(inner, p)]
        return [held[key] for key in keys if key in held]

    def _moment_stashes(self, inner: Any, chunk: list[tuple[int, torch.Tensor]],
                        held: dict[int, _Stash], arena: HostArena) -> list[_Stash]:
        """A stash for each of ``chunk``'s moments after its step: the one it came from, or a
        new range of the moments' slabs for one the step made."""
        out = []
        for _, param in chunk:
            for moment in _moments(inner, param):
                storage = moment.untyped_storage()
                stash = held.get(storage._cdata)
                if stash is None:
                    stash = _Stash(storage, storage.nbytes(), arena.take(storage.nbytes()))
                    self.stashes.setdefault("moments", []).append(stash)
                    held[storage._cdata] = stash
                out.append(stash)
        return out


class _Mover:
    """The streamed step's copies: in on one CUDA stream, out on another, each ordered against
    the compute stream by events (plain copies on a CPU)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.up = torch.cuda.Stream() if cuda else None
        self.down = torch.cuda.Stream() if cuda else None
        self.incoming_bytes = 0

    def bring_in(self, stashes: list[_Stash]) -> Any:
        """Allocate ``stashes``' storages (on the compute stream) and copy their bytes in;
        returns what :meth:`wait` waits for."""
        for stash in stashes:
            stash.storage.resize_(stash.nbytes)
        self.incoming_bytes = sum(s.nbytes for s in stashes)
        if not self.cuda:
            for stash in stashes:
                stash.host.load_into(_bytes_of(stash.storage))
            return None
        self.up.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.up):
            for stash in stashes:
                stash.host.load_into(_bytes_of(stash.storage), non_blocking=True)
        return self.up.record_event()

    def wait(self, event: Any) -> None:
        if event is not None:
            torch.cuda.current_stream().wait_event(event)

    def send_out(self, stashes: list[_Stash]) -> tuple[list[_Stash], Any]:
        """Copy ``stashes``' bytes to their host ranges once the compute stream has written
        them; :meth:`release` frees their device memory."""
        if not self.cuda:
            for stash in stashes:
                stash.host.store(_bytes_of(stash.storage))
            return stashes, None
        self.down.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.down):
            for stash in stashes:
                stash.host.store(_bytes_of(stash.storage), non_blocking=True)
        return stashes, self.down.record_event()

    def release(self, sent: tuple[list[_Stash], Any]) -> None:
        """Free the device memory of stashes sent out: the compute stream, which may reuse it,
        first waits for their copies."""
        stashes, event = sent
        self.wait(event)
        for stash in stashes:
            stash.storage.resize_(0)

    def finish(self) -> None:
        if self.cuda:
            torch.cuda.current_stream().synchronize()
