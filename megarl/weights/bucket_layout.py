"""A bucket plan's layout, worked out once and reused by every sync while the plan is unchanged.

A weight sync sends the same tensors every step: the same names, shapes and dtypes in the same
buckets. Each bucket's ``flattened_bucket`` metadata records, the shape each exported tensor must
have and the byte range of each run of one dtype are therefore computed once per plan
(:class:`BucketLayout`) and kept by :class:`LayoutCache` while the plan compares equal. Packing a
bucket is then one check per tensor (the export yielded the planned name and shape) and one
``torch.cat`` per dtype run into the bucket buffer, which casts to the sent dtype on the way; per
tensor only a flat view remains. On the CPU, with the 3,147 tensors of the e2e MoE slice (the
``tensors`` shape of benchmarks/rollout_throughput.py), taking and packing one sync's tensors went
from ~30 ms (a cast, a record and three views per tensor) to ~10 ms.
"""

from __future__ import annotations

import copy
import types
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megarl.weights.buckets import parse_dtype
from megarl.weights.flattened import bucket_metadata
from megarl.weights.fp8 import FP8_DTYPE, quantize_blockwise

PlanEntry = tuple[str, Sequence[int], str]
"""(HF name, shape, dtype sent) of one tensor of a bucket plan."""


@dataclass
class BucketLayout:
    """One bucket of a plan as every sync packs it."""

    exported: list[tuple[str, torch.Size, bool]]
    """(name, shape, quantized) of each tensor the export yields for this bucket, in order; a
    quantized one is sent as its FP8 weight and scale (two records)."""
    metadata: list[types.SimpleNamespace]
    """The ``flattened_bucket`` records of the sent tensors (shared by every sync's payload)."""
    runs: list[tuple[int, int, torch.dtype, int, int]]
    """(first byte, end byte, dtype, first sent tensor, end sent tensor) of each run of
    consecutive sent tensors of one dtype, back to back in the buffer."""
    size: int
    """Bytes of the bucket."""


def bucket_layout(entries: Sequence[PlanEntry]) -> BucketLayout:
    """The layout of one planned bucket (tensors back to back, as ``plan_buckets`` checked)."""
    dtypes = [parse_dtype(dtype) for _, _, dtype in entries]
    metadata = bucket_metadata([(name, shape, dtype)
                                for (name, shape, _), dtype in zip(entries, dtypes)])
    exported, runs = [], []
    for index, ((name, shape, _), dtype, meta) in enumerate(zip(entries, dtypes, metadata)):
        if meta.start_idx % dtype.itemsize:
            raise ValueError(f"weight sync: {name} ({dtype}) would start at byte "
                             f"{meta.start_idx} of its bucket, not a multiple of its element "
                             "size")
        if not (index and dtypes[index - 1] == FP8_DTYPE):  # not the scale of an FP8 weight
            exported.append((name, torch.Size(shape), dtype == FP8_DTYPE))
        if runs and runs[-1][2] == dtype:
            runs[-1] = (runs[-1][0], meta.end_idx, dtype, runs[-1][3], index + 1)
        else:
            runs.append((meta.start_idx, meta.end_idx, dtype, index, index + 1))
    return BucketLayout(exported, metadata, runs, metadata[-1].end_idx if metadata else 0)


class LayoutCache:
    """The layouts of the last plan seen, rebuilt when a plan differs from it."""

    def __init__(self) -> None:
        self._plan: list | None = None
        self._layouts: list[BucketLayout] = []
        self.builds = 0
        """How many times layouts were computed (a changed plan rebuilds them)."""

    def get(self, plan: Sequence[Sequence[PlanEntry]]) -> list[BucketLayout]:
        """The layouts of ``plan``'s buckets (computed again only when ``plan`` changed)."""
        if self._plan is None or self._plan != plan:
            self._layouts = [bucket_layout(bucket) for bucket in plan]
            self._plan = copy.deepcopy(list(plan))
            self.builds += 1
        return self._layouts


def iter_layouts(named: Iterable[tuple[str, torch.Tensor]], layouts: Sequence[BucketLayout]
                 ) -> Iterator[tuple[BucketLayout, list[torch.Tensor]]]:
    """Each bucket's layout with the tensors it sends, taken from the export in order (an FP8
    weight quantized to its weight and scale; other tensors as exported, not yet cast); raises
    when the export does not yield the planned names and shapes (a plan made for another
    model or layout)."""
    items = iter(named)
    for index, layout in enumerate(layouts):
        tensors: list[torch.Tensor] = []
        for name, shape, quantized in layout.exported:
            got = next(items, None)
            if got is None or got[0] != name or got[1].shape != shape:
                found = "nothing" if got is None else f"{got[0]} {list(got[1].shape)}"
                raise RuntimeError(f"weight sync: bucket {index} expects {name} {list(shape)}, "
                                   f"the export yielded {found}; the plan is stale")
            if quantized:
                tensors.extend(quantize_blockwise(got[1].detach()))
            else:
                tensors.append(got[1])
        yield layout, tensors
    extra = next(items, None)
    if extra is not None:
        raise RuntimeError(f"weight sync: the export yielded {extra[0]} after the last planned "
                           "tensor; the plan is stale")


def cast_bucket(layout: BucketLayout, tensors: Sequence[torch.Tensor]
                ) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor in its sent dtype) of a bucket's tensors, one cast each (for callers that
    need the tensors themselves, not packed)."""
    return [(meta.name, tensor.detach().to(meta.dtype))
            for meta, tensor in zip(layout.metadata, tensors)]


def pack_layout(buffer: torch.Tensor, layout: BucketLayout, tensors: Sequence[torch.Tensor]
                ) -> dict[str, Any]:
    """Copy a bucket's ``tensors`` (from :func:`iter_layouts`) into the front of the uint8
    ``buffer``, each cast to its sent dtype; the ``flattened_bucket`` payload viewing it. The
    bytes equal :func:`~megarl.weights.flattened.flatten_into`'s of the cast tensors."""
    if layout.size > buffer.numel():
        raise ValueError(f"bucket buffer of {buffer.numel()} bytes cannot hold a bucket of "
                         f"{layout.size}")
    device, cuda = buffer.device, buffer.is_cuda
    with torch.no_grad():
        for start, end, dtype, first, last in layout.runs:
            flat = [t.reshape(-1) if t.is_cuda == cuda else t.to(device, non_blocking=True).reshape(-1)
                    for t in tensors[first:last]]
            torch.cat(flat, out=buffer[start:end].view(dtype))
    return {"flattened_tensor": buffer[:layout.size], "metadata": layout.metadata}
