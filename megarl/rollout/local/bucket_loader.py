"""Loading ``flattened_bucket`` payloads into the live weights, each bucket's copy planned once.

A weight sync sends the same buckets every step: the same records (name, shape, dtype, byte
range) in the same order. The first time :class:`BucketLoader` sees a bucket's records it checks
them against the :class:`~megarl.rollout.local.weights.WeightMap` (unknown names, shapes, FP8)
and plans the copy (:class:`LoadPlan`): where each record's bytes lie in the flat tensor, and
where its destination lies in its live parameter: every view the engine writes through is, for
the models it serves, a contiguous block of elements of one parameter. Records adjacent on both
sides (an expert's gate and up halves, sent one after the other) become one copy. A later
payload with equal records costs one ``Tensor.split`` per run of one dtype in the flat tensor,
one per live parameter, and one ``torch._foreach_copy_``: no view is made per tensor in Python.
On the CPU, with the e2e MoE slice's 3,147 tensors (2,123 copies once merged), the engine's
load went from ~40 ms (a slice, two views and a checked view of the parameter per tensor) to
~10 ms.

The plan keeps element ranges, never views: a view would keep a parameter's memory alive after
the engine released it. Before each copy every parameter's element count and contiguity are
checked; a parameter that changed, or records whose destinations overlap (tied weights sent under
both names), are loaded through :meth:`WeightMap.load_many` one tensor at a time, in order.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from operator import attrgetter, itemgetter
from typing import Any

import torch

from megarl.rollout.local.weights import WeightMap
from megarl.weights.flattened import unflatten

_FIELDS = ("name", "shape", "dtype", "start_idx", "end_idx")


@dataclass(frozen=True)
class BucketRecords:
    """The metadata records of one ``flattened_bucket`` payload, field by field."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    starts: tuple[int, ...]
    ends: tuple[int, ...]


def bucket_records(metadata: Sequence[Any]) -> BucketRecords:
    """The records of a payload (SGLang's metadata objects, or dicts); raises ``TypeError``
    when a dtype is not a ``torch.dtype`` and ``KeyError`` / ``AttributeError`` when a field
    is missing."""
    get = itemgetter if metadata and isinstance(metadata[0], dict) else attrgetter
    names, shapes, dtypes, starts, ends = (tuple(map(get(key), metadata)) for key in _FIELDS)
    for name, dtype in zip(names, dtypes):
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"metadata of {name}: dtype {dtype!r} is not a torch.dtype")
    return BucketRecords(tuple(map(str, names)), tuple(map(tuple, shapes)), dtypes,
                         tuple(map(int, starts)), tuple(map(int, ends)))


@dataclass
class LoadPlan:
    """How one bucket's records are copied into the live weights (see the module doc)."""

    names: tuple[str, ...]
    runs: list[tuple[int, int, torch.dtype, list[int]]] = field(default_factory=list)
    """(first byte, end byte, dtype, elements of each piece) of each run of the flat tensor
    that one ``split`` cuts into pieces (a piece between two records is never copied)."""
    lives: list[tuple[str, int, list[int]]] = field(default_factory=list)
    """(live tensor's name, its element count, elements of each piece) of each destination
    parameter, cut the same way."""
    src_pick: list[int] = field(default_factory=list)
    """Index, among all flat pieces, of the source of each copy."""
    dst_pick: list[int] = field(default_factory=list)
    """Index, among all parameter pieces, of the destination of each copy."""
    ordered: bool = False
    """Two records write the same memory: load them one at a time, in order."""


def _contiguous(size: Sequence[int], stride: Sequence[int]) -> bool:
    expected = 1
    for dim, step in reversed(list(zip(size, stride))):
        if dim != 1 and step != expected:
            return False
        expected *= dim
    return True


def _checked_copies(records: BucketRecords, weights: WeightMap
                    ) -> list[tuple[int, int, torch.dtype, str, int, int]] | None:
    """(first byte, end byte, dtype, live name, first element, elements) of every non-empty
    record in flat-tensor order, records adjacent on both sides merged, after checking that
    each can be written as it is; None when a destination is not a contiguous block of its
    parameter. Raises ``ValueError`` naming unknown names or a mismatched shape or dtype."""
    unknown = [name for name in records.names if not weights.knows(name)]
    if unknown:
        raise ValueError(f"{len(unknown)} unknown weight names, e.g. {unknown[:3]}; the model "
                         f"has e.g. {weights.checkpoint_names()[:3]}")
    copies, strided = [], False
    for index, name in enumerate(records.names):
        shape, dtype = records.shapes[index], records.dtypes[index]
        weights.target(name, torch.empty(shape, dtype=dtype, device="meta"))
        start, end = records.starts[index], records.ends[index]
        numel = math.prod(shape)
        if end - start != numel * dtype.itemsize:
            raise ValueError(f"metadata of {name}: bytes {start}:{end} do not hold a "
                             f"{dtype} tensor of shape {list(shape)}")
        live_name, size, stride, offset = weights.location(name)
        strided = strided or not _contiguous(size, stride)
        if numel:
            copies.append((start, end, dtype, live_name, offset, numel))
    if strided:
        return None
    copies.sort(key=itemgetter(0))
    merged = copies[:1]
    for copy in copies[1:]:
        last = merged[-1]
        if (copy[0] == last[1] and copy[2] == last[2] and copy[3] == last[3]
                and copy[4] == last[4] + last[5]):
            merged[-1] = (last[0], copy[1], last[2], last[3], last[4], last[5] + copy[5])
        else:
            merged.append(copy)
    return merged


def _overlapping(lives: Sequence[torch.Tensor]) -> bool:
    """Whether two of ``lives`` share memory (tied weights under two names)."""
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
                   for t in lives if t.numel())
    return any(later[0] < earlier[1] for earlier, later in itertools.pairwise(spans))


def plan_load(records: BucketRecords, weights: WeightMap) -> LoadPlan:
    """The :class:`LoadPlan` of ``records`` into ``weights`` (raises ``ValueError`` as
    :func:`_checked_copies` does)."""
    plan = LoadPlan(records.names)
    copies = _checked_copies(records, weights)
    if copies is None or _overlapping([weights.live(n) for n in {c[3] for c in copies}]):
        plan.ordered = True
        return plan
    pieces = 0
    for start, end, dtype, _, _, numel in copies:
        run = plan.runs[-1] if plan.runs else None
        gap = start - run[1] if run else -1
        if run is None or run[2] != dtype or gap < 0 or gap % dtype.itemsize:
            plan.runs.append((start, end, dtype, [numel]))
        else:
            if gap:
                run[3].append(gap // dtype.itemsize)
                pieces += 1
            run[3].append(numel)
            plan.runs[-1] = (run[0], end, dtype, run[3])
        plan.src_pick.append(pieces)
        pieces += 1
    by_live: dict[str, list[tuple[int, int, int]]] = {}
    for index, (_, _, _, live_name, offset, numel) in enumerate(copies):
        by_live.setdefault(live_name, []).append((offset, numel, index))
    plan.dst_pick = [0] * len(copies)
    pieces = 0
    for live_name, ranges in by_live.items():
        live = weights.live(live_name)
        ranges.sort()
        sizes, end = [], 0
        for offset, numel, index in ranges:
            if offset < end:
                plan.ordered = True
                return plan
            if offset > end:
                sizes.append(offset - end)
                pieces += 1
            sizes.append(numel)
            plan.dst_pick[index] = pieces
            pieces += 1
            end = offset + numel
        if end < live.numel():
            sizes.append(live.numel() - end)
            pieces += 1
        plan.lives.append((live_name, live.numel(), sizes))
    return plan


class BucketLoader:
    """Loads ``flattened_bucket`` payloads into ``weights``, planning each distinct bucket once
    (:func:`plan_load`; up to ``max_plans`` kept, the oldest dropped first). Call it from the
    engine thread only."""

    def __init__(self, weights: WeightMap, max_plans: int = 256) -> None:
        self.weights = weights
        self.max_plans = max_plans
        self._plans: dict[BucketRecords, LoadPlan] = {}
        self.planned = 0
        """How many plans were made (a bucket seen again with equal records reuses its own)."""

    def plan(self, records: BucketRecords) -> LoadPlan:
        """The plan of ``records`` (made now if these records were not seen before)."""
        plan = self._plans.get(records)
        if plan is None:
            plan = plan_load(records, self.weights)
            if len(self._plans) >= self.max_plans:
                del self._plans[next(iter(self._plans))]
            self._plans[records] = plan
            self.planned += 1
        return plan

    @torch.no_grad()
    def load(self, records: BucketRecords, payload: dict[str, Any],
             plan: LoadPlan | None = None) -> int:
        """Copy a payload's tensors (its ``records``, from :func:`bucket_records`; ``plan``:
        theirs, if :meth:`plan` gave it already) into the weights; returns how many records it
        held. Raises ``ValueError`` before writing anything when a record cannot be written."""
        plan = plan or self.plan(records)
        dsts = self.destinations(plan)
        if dsts is None:
            return self.weights.load_many(unflatten(payload))
        srcs = self.sources(plan, payload)
        if srcs:
            torch._foreach_copy_(dsts, srcs)
        self.weights.mark_written(plan.names)
        return len(plan.names)

    def sources(self, plan: LoadPlan, payload: dict[str, Any]) -> list[torch.Tensor]:
        """The source of each of ``plan``'s copies: views of the payload's flat tensor (a kept
        payload's stay valid from sync to sync). Raises ``ValueError`` when its records run
        past the flat tensor."""
        flat = payload["flattened_tensor"]
        end = max((run[1] for run in plan.runs), default=0)
        if end > flat.numel():
            raise ValueError(f"the flat tensor has {flat.numel()} bytes; its records end at "
                             f"byte {end}")
        pieces: list[torch.Tensor] = []
        for start, end, dtype, sizes in plan.runs:
            piece = flat[start:end]
            if piece.storage_offset() % dtype.itemsize:  # misaligned: SGLang itself would fail
                piece = piece.clone()
            pieces.extend(piece.view(dtype).split(sizes))
        return [pieces[i] for i in plan.src_pick]

    def destinations(self, plan: LoadPlan) -> list[torch.Tensor] | None:
        """The destination of each of ``plan``'s copies in the live weights now, or None when
        they must be loaded one tensor at a time (records that overlap, a parameter that
        changed size or is not contiguous). Never kept: a view would keep a parameter's memory
        alive after the engine released it."""
        if plan.ordered:
            return None
        lives = [self.weights.live(name) for name, _, _ in plan.lives]
        if any(live.numel() != numel or not live.is_contiguous()
               for live, (_, numel, _) in zip(lives, plan.lives)):
            return None
        pieces: list[torch.Tensor] = []
        for live, (_, _, sizes) in zip(lives, plan.lives):
            pieces.extend(live.view(-1).split(sizes))
        return [pieces[i] for i in plan.dst_pick]
