"""The trainer's half of SGLang's weight-update protocol, one bucket at a time.

Both paths take the HF-named tensors of an export (every train rank yields every tensor, in the
same order) and a bucket plan (names and shapes per bucket, the same on every rank and on the
driver, which posts the matching HTTP calls), and send each bucket as SGLang's
``flattened_bucket``: the tensors' bytes back to back in one uint8 buffer.

- :func:`broadcast_buckets` (separate pools): train rank 0 broadcasts one flat buffer per bucket
  over the weight-update group while the driver's ``/update_weights_from_distributed`` call for
  that bucket is in flight on every engine.
- :class:`ColocatedSender` (colocated, ``checkpoint_engine.backend=ipc``): the train ranks that
  share one engine's GPUs (engine TP rank r = the r-th of them) each pack the bucket on their
  own GPU, serialize it as CUDA IPC handles (shared bytes inline on CPU), gather the strings to
  the engine's first rank over gloo, which posts ``/update_weights_from_tensor`` with one entry
  per engine TP rank. Every rank keeps a bucket's buffer alive until the engine replied, and
  holds at most two buckets: bucket k+1 is packed while bucket k is in flight. With
  ``zero_copy`` (an engine of one GPU) nothing is packed that need not be: the tensors of a
  bucket that are views of one storage (a Megatron actor's parameters live in DDP's contiguous
  buffers) go as a ``flattened_bucket`` whose flat tensor is a view of that storage, its records
  pointing at each tensor's bytes (:func:`~megarl.weights.flattened.view_payload`), so the
  engine's load is the only copy; the rest (the split q/k/v, casts, FP8) is packed and posted
  beside. It is off by default: on an H100 the 30B-A3B slice (11.2 GB, 3,147 tensors) synced in
  96 ms with it and in 77 ms packed, the engine taking 59 ms against 11 ms to load the views
  (benchmarks/colocated_sync.py; RESULTS.md).

**Persistent** (``send(persist=...)``, the default of a Megatron actor on one rank beside
megarl's embedded engine of one GPU, :meth:`ActorWorker._persist`): the views are sent once, and
the engine keeps them (``megarl_keep``: the CUDA IPC mapping stays open, or on the CPU the
storage moves to shared memory and the engine maps it). While the actor's memory stays where it
was (:class:`Persist`'s token: the export's plan and the parameters' storages) a later sync
exports only the tensors made afresh (a split QKV) and packs them into the buffer the engine
kept as the program's last part, then posts ``megarl_replay`` with no payload: the engine copies
every kept part in again, in one ``torch._foreach_copy_``. A sync is then one post and one copy
of the weights on the engine, whatever the tensor count. A changed token, a plan that changed
or an engine that no longer holds the program (restarted) registers again in the same sync; a
registration whose leftover tensors are not exactly the export's fresh ones keeps no buffer.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megarl.weights.bucket_layout import (
    LayoutCache,
    bucket_layout,
    cast_bucket,
    iter_layouts,
    pack_layout,
)
from megarl.weights.buckets import dtype_name, parse_dtype
from megarl.weights.flattened import (
    FLATTENED_BUCKET,
    flatten_into,
    flattened_size,
    serialize,
    view_payload,
    zero_copy_groups,
)
from megarl.weights.fp8 import FP8_DTYPE, is_quantized_shape, scale_name, scale_shape

BucketSpec = list[tuple[str, list[int], str]]
"""One bucket of a plan: (HF name, shape, dtype sent) of each tensor, in send order."""


def sent_specs(specs: Sequence[tuple[str, Sequence[int]]], dtype: str,
               quantization: str | None = None, ignored: Sequence[str] = ()
               ) -> list[BucketSpec]:
    """What the engines receive for each exported (name, shape), as one group per tensor: the
    tensor in ``dtype``, or with ``quantization="fp8"`` a weight that FP8 checkpoints quantize
    (not in a module named in ``ignored``, the engines' ``ignored_layers``) as its
    ``float8_e4m3fn`` weight followed by its fp32 ``weight_scale_inv`` (docs/fp8.md)."""
    groups = []
    for name, shape in specs:
        if quantization == "fp8" and is_quantized_shape(name, shape, ignored):
            groups.append([(name, list(shape), dtype_name(FP8_DTYPE)),
                           (scale_name(name), list(scale_shape(shape)), "float32")])
        elif quantization not in (None, "fp8"):
            raise ValueError(f"quantization={quantization!r}: use fp8 or null")
        else:
            groups.append([(name, list(shape), dtype)])
    return groups


def _entry_bytes(entry: tuple[str, Sequence[int], str]) -> int:
    return parse_dtype(entry[2]).itemsize * torch.Size(entry[1]).numel()


def plan_buckets(specs: Sequence[tuple[str, Sequence[int]]], dtype: str, bucket_size_mb: float,
                 quantization: str | None = None, ignored: Sequence[str] = ()
                 ) -> list[BucketSpec]:
    """Group the tensors sent for ``specs`` (:func:`sent_specs`), in export order, into buckets
    of at most ``bucket_size_mb`` (a larger tensor gets a bucket of its own; a weight and its
    scale share one). Raises when a tensor would start at a byte offset its dtype cannot be
    viewed at: the receiver of a broadcast lays a bucket out back to back, as SGLang does."""
    limit = bucket_size_mb * 2**20
    buckets: list[BucketSpec] = [[]]
    used = 0
    for group in sent_specs(specs, dtype, quantization, ignored):
        size = sum(_entry_bytes(e) for e in group)
        if buckets[-1] and used + size > limit:
            buckets.append([])
            used = 0
        buckets[-1].extend(group)
        used += size
    plan = [b for b in buckets if b]
    for bucket in plan:
        offset = 0
        for entry in bucket:
            if offset % parse_dtype(entry[2]).itemsize:
                raise ValueError(f"weight sync: {entry[0]} ({entry[2]}) would start at byte "
                                 f"{offset} of its bucket, not a multiple of its element size; "
                                 "the tensor before it has an odd number of bytes")
            offset += _entry_bytes(entry)
    return plan


def iter_buckets(named: Iterable[tuple[str, torch.Tensor]], plan: Sequence[BucketSpec]
                 ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The export's tensors as ``plan`` sends them (cast to the planned dtype, or quantized to
    block FP8 with the scale after the weight, on the tensor's device), grouped in its buckets;
    raises when the export does not yield the planned tensors (a plan made for another model
    or layout)."""
    for layout, tensors in iter_layouts(named, [bucket_layout(b) for b in plan]):
        yield cast_bucket(layout, tensors)


def broadcast_buckets(named: Iterable[tuple[str, torch.Tensor]], plan: Sequence[BucketSpec],
                      group: dist.ProcessGroup | None, device: torch.device) -> int:
    """Rank 0 of the weight group (``group`` given) broadcasts each bucket's flat bytes; other
    train ranks (``group=None``) only take part in the export. Returns the bytes sent."""
    layouts = [bucket_layout(b) for b in plan]
    buffer = None
    sent = 0
    for layout, tensors in iter_layouts(named, layouts):
        if group is None:
            continue
        if buffer is None:
            size = max(lay.size for lay in layouts)
            buffer = torch.empty(size, dtype=torch.uint8, device=device)
        flat = pack_layout(buffer, layout, tensors)["flattened_tensor"]
        dist.broadcast(flat, src=0, group=group)
        sent += flat.numel()
    return sent


class _Post:
    """One ``/update_weights_from_tensor`` call running on a thread."""

    def __init__(self, http: Any, url: str, body: dict[str, Any]) -> None:
        self.error: str | None = None
        self._thread = threading.Thread(target=self._run, args=(http, url, body), daemon=True)
        self._thread.start()

    def _run(self, http: Any, url: str, body: dict[str, Any]) -> None:
        try:
            response = http.post(url + "/update_weights_from_tensor", json=body)
        except Exception as err:  # noqa: BLE001 - reported to every rank of the engine
            self.error = f"POST {url}/update_weights_from_tensor failed: {err}"
            return
        data = response.json() if response.content else None
        if response.status_code >= 400 or (isinstance(data, dict)
                                           and data.get("success") is False):
            detail = data.get("message") if isinstance(data, dict) else response.text[:500]
            if isinstance(data, dict) and isinstance(data.get("error"), dict):
                detail = data["error"].get("message")
            self.error = (f"POST {url}/update_weights_from_tensor -> HTTP "
                          f"{response.status_code}: {detail}")

    def wait(self) -> str | None:
        """Block until the engine replied; the error, if any."""
        self._thread.join()
        return self.error


KEEP_FIELD = "megarl_keep"
"""Body field of an embedded engine's ``/update_weights_from_tensor``: ``{"program": name,
"part": k}`` keeps the payload's views as part k of a program (part 0 starts it anew)."""
EMBEDDED_VERSION = "megarl-embedded"
"""``/get_server_info``'s ``version`` of megarl's embedded engine."""
REPLAY_FIELD = "megarl_replay"
"""Body field naming a program the engine copies in again before it loads the payload."""


@dataclass(frozen=True)
class Persist:
    """What a persistent colocated sync needs from the export (:meth:`ColocatedSender.send`)."""

    token: Hashable
    """Equal while the export yields views of the same memory at the same places."""
    storages: frozenset[tuple[int, int]]
    """(data pointer, bytes) of the storages those views live in: the actor's own memory."""
    copy_names: tuple[str, ...]
    """The tensors the export makes afresh at every sync (a split QKV), in export order."""
    export_copies: Callable[[], Iterable[tuple[str, torch.Tensor]]]
    """Yields exactly those tensors (no view is made)."""


@dataclass(frozen=True)
class _Program:
    """Views an engine keeps, and what a sync sends beside them."""

    name: str
    token: Hashable
    builds: int
    copies: list[tuple[str, torch.Size, torch.dtype]]
    """(name, shape, dtype sent) of the tensors packed into ``buffer``, in order."""
    buffer: torch.Tensor | None
    nbytes: int


class _Registration:
    """The views a registering sync asks the engine to keep, and the tensors left to pack."""

    def __init__(self, name: str, persist: Persist, builds: int) -> None:
        self.name, self.persist, self.builds = name, persist, builds
        self.copy_names = set(persist.copy_names)
        self.parts = 0
        self.copies: list[tuple[str, torch.Size, torch.dtype]] = []
        self.buffer: torch.Tensor | None = None
        """Where the tensors left to pack went (kept by the engine as the last part)."""
        self.nbytes = 0

    def split(self, cast: list[tuple[str, torch.Tensor]], device: torch.device
              ) -> tuple[list[list[tuple[str, torch.Tensor]]], list[tuple[str, torch.Tensor]]]:
        """Groups of views of the actor's storages (each kept by the engine), and the rest."""
        storages = self.persist.storages
        stable = [(name, t) for name, t in cast if name not in self.copy_names
                  and (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) in storages]
        groups, _ = zero_copy_groups(stable, device, min_tensors=1, shared=True)
        grouped = {name for group in groups for name, _ in group}
        rest = [(name, t) for name, t in cast if name not in grouped]
        self.copies.extend((name, t.shape, t.dtype) for name, t in rest)
        self.nbytes += sum(t.numel() * t.element_size() for _, t in cast)
        return groups, rest

    def part(self) -> dict[str, Any]:
        """The keep mark of the next kept post."""
        self.parts += 1
        return {"program": self.name, "part": self.parts - 1}

    def program(self) -> _Program | None:
        """The program registered, or None when the export's fresh tensors were not exactly
        the ones left to pack (the engine would then hold something a later sync changes)."""
        if [name for name, _, _ in self.copies] != list(self.persist.copy_names):
            return None
        return _Program(self.name, self.persist.token, self.builds, self.copies, self.buffer,
                        self.nbytes)


class ColocatedSender:
    """Sends buckets to the engine whose GPUs this train rank shares (see the module doc)."""

    def __init__(self, rank: int, world_size: int, urls: Sequence[str], gpus_per_engine: int,
                 api_key: str | None = None, timeout_s: float = 600.0,
                 zero_copy: bool = False) -> None:
        if world_size != len(urls) * gpus_per_engine:
            raise ValueError(f"colocated weight sync: {world_size} train ranks but {len(urls)} "
                             f"engines x {gpus_per_engine} GPUs each; with rollout.colocate every "
                             "train GPU must hold one engine rank")
        self.engine = rank // gpus_per_engine
        self.tp_rank = rank % gpus_per_engine
        self.url = urls[self.engine].rstrip("/")
        self.group = self._engine_groups(world_size, gpus_per_engine)
        self.size = gpus_per_engine
        self.leader = self.engine * gpus_per_engine
        self.zero_copy = zero_copy
        self.layouts = LayoutCache()
        """The plan's bucket layouts, kept from sync to sync while the plan is unchanged."""
        self._program: _Program | None = None
        self._unkept: Hashable | None = None
        """The token of a registration whose program did not hold (not tried again)."""
        self._embedded: bool | None = None
        self.seconds: dict[str, float] = {}
        """Where the last :meth:`send` spent its time: ``pack`` (export, cast, copy into the
        bucket, serialize, gather) and ``engine`` (waiting for the engine's replies)."""
        self.posts: dict[str, int] = {}
        """How many posts the last :meth:`send` made of each kind (``zero_copy``, ``packed``)."""
        self._http = None
        if self.tp_rank == 0:
            import httpx

            headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
            self._http = httpx.Client(timeout=httpx.Timeout(timeout_s, connect=10.0),
                                      headers=headers, trust_env=False)  # no env proxy (M5)

    def _engine_groups(self, world_size: int, size: int) -> dist.ProcessGroup | None:
        """A gloo group per engine (collective: every train rank creates all of them)."""
        if size == 1:
            return None
        mine = None
        for first in range(0, world_size, size):
            group = dist.new_group(list(range(first, first + size)), backend="gloo")
            if first == self.engine * size:
                mine = group
        return mine

    def send(self, named: Iterable[tuple[str, torch.Tensor]], plan: Sequence[BucketSpec],
             device: torch.device, version: str, persist: Persist | None = None) -> int:
        """Send every bucket of ``plan``; the last post carries ``version``. Returns the tensor
        bytes this rank sent. A bucket goes as one post per :func:`zero_copy_groups` group (a
        view of the actor's own memory) and one post of the rest, packed into a buffer.

        ``persist`` (an embedded engine of one GPU, :meth:`persistent_engine`): the engine keeps
        the views it is sent (a *program*), and while ``persist.token`` and the plan stay the
        same a later sync sends only ``persist.export_copies()`` packed, with one post that
        replays the program (see the module doc)."""
        self.seconds = {"pack": 0.0, "engine": 0.0}
        self.posts = {"zero_copy": 0, "packed": 0, "replayed": 0}
        start = time.perf_counter()
        layouts = self.layouts.get(plan)
        keep = None
        if persist is not None and self.size == 1 and persist.token != self._unkept:
            program = self._program
            if (program is not None and program.token == persist.token
                    and program.builds == self.layouts.builds):
                sent = self._replay(program, persist, device, version, start)
                if sent is not None:
                    return sent
                start = time.perf_counter()
            keep = _Registration(f"colocated-{self.engine}", persist, self.layouts.builds)
        self._program = None
        sent = self._send_buckets(named, layouts, device, version, start, keep)
        if keep is not None:
            self._program = keep.program()
            if self._program is None:
                self._unkept = persist.token
        return sent

    def _replay(self, program: _Program, persist: Persist, device: torch.device,
                version: str, start: float) -> int | None:
        """One post and no payload: the export's fresh tensors are packed into the buffer the
        engine keeps, and the engine copies in every part of the program. None (nothing sent)
        when the export's fresh tensors are not the registered ones or the engine does not
        hold the program (a restarted engine): register again."""
        named = [(name, t.detach()) for name, t in persist.export_copies()]
        if [(name, t.shape) for name, t in named] != [(n, s) for n, s, _ in program.copies]:
            return None
        if program.buffer is not None:
            flatten_into(program.buffer, [(name, t.to(dtype)) for (name, t), (_, _, dtype)
                                          in zip(named, program.copies)])
        if device.type == "cuda":  # the engine reads the actor's memory and the buffer
            torch.cuda.current_stream(device).synchronize()
        waited = time.perf_counter()
        self.seconds["pack"] += waited - start
        body = {"serialized_named_tensors": [], "load_format": FLATTENED_BUCKET,
                "flush_cache": True, "abort_all_requests": False, "weight_version": version,
                REPLAY_FIELD: program.name}
        error = _Post(self._http, self.url, body).wait() if self._http is not None else None
        self.seconds["engine"] += time.perf_counter() - waited
        if error is not None:
            self._program = None
            if "is not held" in error:
                return None
            raise RuntimeError(f"colocated weight sync to engine {self.engine} ({self.url}): "
                               f"{error}")
        self.posts["replayed"] += 1
        return program.nbytes

    def persistent_engine(self) -> bool:
        """Whether the engine keeps views between syncs (megarl's embedded engine does; a
        SGLang server does not), asked once through ``/get_server_info``."""
        if self._embedded is None:
            self._embedded = False
            if self._http is not None and self.size == 1:
                try:
                    info = self._http.get(self.url + "/get_server_info").json()
                    self._embedded = info.get("version") == EMBEDDED_VERSION
                except Exception:  # noqa: BLE001 - an engine that cannot say keeps nothing
                    self._embedded = False
        return self._embedded

    def _send_buckets(self, named: Iterable[tuple[str, torch.Tensor]],
                      layouts: Sequence[Any], device: torch.device, version: str,
                      start: float, keep: _Registration | None) -> int:
        """Every bucket, as :meth:`send` says. With ``keep`` the engine keeps each bucket's views
        and, last, one buffer that packs every tensor left (the one a replay refills)."""
        buffers: list[torch.Tensor | None] = [None, None]
        pending: _Post | None = None
        sent = copies = 0
        left: list[tuple[str, torch.Tensor]] = []

        def post(payload: dict[str, Any], mark: dict[str, Any] | None, last: bool) -> None:
            nonlocal pending, start
            if device.type == "cuda":
                torch.cuda.current_stream(device).synchronize()
            entries = self._gather(serialize(payload, share_cpu=mark is not None))
            waited = time.perf_counter()
            self.seconds["pack"] += waited - start
            self._settle(pending)  # the engine loads posts in order: one at a time
            start = time.perf_counter()
            self.seconds["engine"] += start - waited
            pending = None
            if self._http is not None:
                body = {"serialized_named_tensors": entries, "load_format": FLATTENED_BUCKET,
                        "flush_cache": last, "abort_all_requests": False,
                        "weight_version": version if last else None}
                if mark is not None:
                    body[KEEP_FIELD] = mark
                pending = _Post(self._http, self.url, body)

        for index, (layout, tensors) in enumerate(iter_layouts(named, layouts)):
            final = index == len(layouts) - 1
            sent += layout.size
            if keep is not None:
                groups, rest = keep.split(cast_bucket(layout, tensors), device)
                left += rest
                self.posts["zero_copy"] += len(groups)
                for number, group in enumerate(groups):
                    post(view_payload(group), keep.part(),
                         final and number == len(groups) - 1 and not left)
                continue
            payloads, rest, need = [], None, layout.size
            if self.zero_copy and self.size == 1:
                groups, rest = zero_copy_groups(cast_bucket(layout, tensors), device)
                payloads = [view_payload(group) for group in groups]
                need = flattened_size(rest)
            self.posts["zero_copy"] += len(payloads)
            if need:
                # buffers[copies % 2] held the packed post before last, whose reply came before
                # the last post went out: at most two packed buffers, one in flight
                slot = copies % 2
                if buffers[slot] is None or buffers[slot].numel() < need:
                    buffers[slot] = None
                    buffers[slot] = torch.empty(need, dtype=torch.uint8, device=device)
                payloads.append(pack_layout(buffers[slot], layout, tensors) if rest is None
                                else flatten_into(buffers[slot], rest))
                copies += 1
                self.posts["packed"] += 1
            for number, payload in enumerate(payloads):
                post(payload, None, final and number == len(payloads) - 1)
        if keep is not None and left:
            buffer = torch.empty(flattened_size(left), dtype=torch.uint8, device=device)
            # kept only when a replay refills it: otherwise the engine would hold it for good
            held = [name for name, _ in left] == list(keep.persist.copy_names)
            if held:
                keep.buffer = buffer
            post(flatten_into(buffer, left), keep.part() if held else None, True)
            self.posts["packed"] += 1
        waited = time.perf_counter()
        self.seconds["pack"] += waited - start
        self._settle(pending)
        self.seconds["engine"] += time.perf_counter() - waited
        return sent

    def _gather(self, entry: str) -> list[str]:
        """Every engine TP rank's entry, in TP order, on the engine's first rank."""
        if self.group is None:
            return [entry]
        out: list[Any] = [None] * self.size if self.tp_rank == 0 else None
        dist.gather_object(entry, out, dst=self.leader, group=self.group)
        return out or []

    def _settle(self, pending: _Post | None) -> None:
        """Wait for the leader's last post; every rank of the engine learns its outcome (so a
        failure raises on all of them and their buffers stay alive until the reply)."""
        error = pending.wait() if pending is not None else None
        if self.group is not None:
            box = [error]
            dist.broadcast_object_list(box, src=self.leader, group=self.group)
            error = box[0]
        if error is not None:
            raise RuntimeError(f"colocated weight sync to engine {self.engine} ({self.url}): "
                               f"{error}")

    def close(self) -> None:
        """Close the HTTP connection."""
        if self._http is not None:
            self._http.close()
