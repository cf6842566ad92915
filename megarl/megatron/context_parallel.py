"""Context parallelism (CP) for packed THD micro-batches: the per-token gather back to the whole
row, and causal attention whose keys and values come from every CP rank.

Layout (megatron-core's): every padded sequence of a packed row is cut into ``2 x cp`` equal
chunks and CP rank ``r`` holds chunks ``r`` and ``2cp-1-r`` (so causal attention work is
balanced); :func:`megarl.megatron.packing.split_for_context_parallel` makes a rank's batch, whose
``cu_seqlens_padded`` stay those of the whole row.

- :func:`gather_context_parallel` turns a rank's ``[T/cp]`` per-token values (log-probs, entropy,
  values) into the whole row's ``[T]`` on every CP rank; its backward keeps the rank's own slice,
  so a loss computed identically on every CP rank from the whole row back-propagates into each
  rank's tokens exactly once.
- :func:`context_parallel_attention` all-gathers K and V over the CP group (backward:
  reduce-scatter of their gradients) and hands them, in row order, to :func:`attend_gathered`,
  which lets each local query attend to the keys at or before its position in the same sequence
  (and needs no process group: tests, or several CP ranks emulated on one device).

On GPUs (bf16/fp16, no dropout) :func:`attend_gathered` is one FlashAttention varlen call per
layer: each local chunk is a query segment whose key segment is its sequence's prefix up to the
chunk's end (:func:`chunk_segments`, packed by an index_select of the gathered keys/values), and
FlashAttention-2's causal mask, aligned to the bottom right when keys outnumber queries, lets
query ``i`` of the chunk see exactly the keys at or before its position. That alignment is checked
once per device and dtype against the SDPA-mask path (:func:`flash_segments_checked`); elsewhere,
or if the check fails, SDPA with a boolean mask runs once per sequence.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as mpu
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

from megarl.megatron.native_ops import (
    flash_varlen_segments,
    flash_varlen_supported,
)
from megarl.megatron.packing import PackedBatch, context_parallel_positions

logger = logging.getLogger(__name__)


def gather_context_parallel(values: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
    """``[T/cp, ...]`` values of this CP rank's tokens -> ``[T, ...]`` of the whole packed row
    (every CP rank gets the same); the identity without CP. Differentiable: the gradient of the
    result flows to this rank's own positions only."""
    if batch.cp_gather_index is None:
        return values
    gathered = gather_from_sequence_parallel_region(
        values, tensor_parallel_output_grad=False, group=mpu.get_context_parallel_group()
    )
    return gathered.index_select(0, batch.cp_gather_index)


def rows_of_this_rank(rows: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
    """The rows of this CP rank's tokens, in its order, from ``[T, ...]`` rows of the whole
    packed row (the inverse of :func:`gather_context_parallel`); the identity without CP."""
    if batch.cp_gather_index is None:
        return rows
    local = batch.num_tokens
    start = mpu.get_context_parallel_rank() * local
    positions = torch.argsort(batch.cp_gather_index)[start : start + local]
    return rows.index_select(0, positions.to(rows.device))


VarlenKernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int, float | None],
    torch.Tensor,
]
"""``(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale) -> out``: causal
attention of packed query segments to key segments that end with them (bottom-right causal
mask), as :func:`~megarl.megatron.native_ops.flash_varlen_segments`."""


@dataclass(frozen=True)
class ChunkSegments:
    """A CP rank's queries as varlen segments, one per local chunk (two per sequence, in the
    rank's token order), each attending to its sequence's keys up to the chunk's end."""

    key_index: torch.Tensor
    """``[Tk]`` rows of the row-ordered keys/values, segment after segment (a sequence's first
    keys appear in both of its segments)."""
    cu_seqlens_q: torch.Tensor
    """int32 ``[2 x sequences + 1]`` offsets of the query segments in the rank's tokens."""
    cu_seqlens_k: torch.Tensor
    """int32 ``[2 x sequences + 1]`` offsets of the key segments in the packed keys."""
    max_seqlen_q: int
    """Longest query segment (chunk)."""
    max_seqlen_k: int
    """Longest key segment."""


def chunk_segments(bounds: list[int], cp_size: int, cp_rank: int,
                   device: torch.device | str = "cpu") -> ChunkSegments:
    """The varlen segments of CP rank ``cp_rank``'s chunks of the padded sequences ``bounds``
    (the whole row's offsets): chunk ``c`` of a sequence starting at ``s`` with chunks of ``n``
    tokens is the query segment ``n`` long whose keys are rows ``s .. s + (c+1) n - 1``, so with
    a bottom-right causal mask each query sees exactly the keys at or before its position."""
    q_lens, k_lens, k_rows = [], [], []
    for start, end in itertools.pairwise(bounds):
        chunk = (end - start) // (2 * cp_size)
        for c in (cp_rank, 2 * cp_size - 1 - cp_rank):
            q_lens.append(chunk)
            k_lens.append((c + 1) * chunk)
            k_rows.append(torch.arange(start, start + (c + 1) * chunk))
    cu_q, cu_k = (torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)
                  for lens in (q_lens, k_lens))
    return ChunkSegments(
        key_index=torch.cat(k_rows).to(device), cu_seqlens_q=cu_q.to(device),
        cu_seqlens_k=cu_k.to(device), max_seqlen_q=max(q_lens, default=0),
        max_seqlen_k=max(k_lens, default=0),
    )


@dataclass(frozen=True)
class _RankLayout:
    """One CP rank's view of a packed row (all index tensors on the row's device)."""

    cp_size: int
    cp_rank: int
    bounds: list[int]
    """The whole row's padded sequence offsets."""
    mine: torch.Tensor
    """``[T/cp]`` row positions of the rank's tokens, in its order."""
    row_order: torch.Tensor
    """``[T]`` reorders the ranks' gathered tokens (rank after rank) into the row."""
    positions: torch.Tensor
    """``[T/cp]`` position inside its sequence of each of the rank's tokens."""
    segments: ChunkSegments
    """The rank's chunks as varlen segments."""


def _rank_layout(cu_padded: torch.Tensor, cp_size: int, cp_rank: int) -> _RankLayout:
    """CP rank ``cp_rank``'s layout of the packed row with offsets ``cu_padded`` (one host
    sync)."""
    bounds = cu_padded.tolist()
    device = cu_padded.device
    mine = context_parallel_positions(bounds, cp_size, cp_rank)
    by_rank = torch.cat([context_parallel_positions(bounds, cp_size, r) for r in range(cp_size)])
    starts = torch.repeat_interleave(
        torch.tensor(bounds[:-1]), torch.tensor(bounds).diff() // cp_size
    )
    return _RankLayout(
        cp_size=cp_size, cp_rank=cp_rank, bounds=bounds, mine=mine.to(device),
        row_order=torch.argsort(by_rank).to(device), positions=(mine - starts).to(device),
        segments=chunk_segments(bounds, cp_size, cp_rank, device),
    )


class _Layout:
    """The :class:`_RankLayout` of the current packed row, cached for the layers of one
    micro-batch (keyed by the offsets tensor, which is held so its id stays unique)."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._value: tuple[torch.Tensor, _RankLayout] | None = None

    def get(self, cu_padded: torch.Tensor, cp_size: int, cp_rank: int) -> _RankLayout:
        key = (id(cu_padded), cp_size, cp_rank)
        if self._key != key or self._value[0] is not cu_padded:
            self._key = key
            self._value = (cu_padded, _rank_layout(cu_padded, cp_size, cp_rank))
        return self._value[1]


_LAYOUT = _Layout()


def sequence_positions(cu_seqlens_padded: torch.Tensor, group=None) -> torch.Tensor:
    """``[T/cp]`` position inside its sequence of each of this CP rank's tokens (what RoPE
    rotates by), from the whole packed row's offsets."""
    group = mpu.get_context_parallel_group() if group is None else group
    return _LAYOUT.get(cu_seqlens_padded, group.size(), group.rank()).positions


def context_parallel_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    *,
    scale: float | None,
    dropout_p: float,
    group=None,
) -> torch.Tensor:
    """Causal attention of this CP rank's queries ``[T/cp, heads, d]`` over the whole packed row
    (``cu_seqlens_padded`` are the whole row's offsets); key/value ``[T/cp, kv_heads, d]``.
    Returns ``[T/cp, heads, d]`` in the rank's token order."""
    group = mpu.get_context_parallel_group() if group is None else group
    cp_size, cp_rank = group.size(), group.rank()
    row_order = _LAYOUT.get(cu_seqlens_padded, cp_size, cp_rank).row_order
    # [T, kv_heads, d] in row order: forward all-gather, backward reduce-scatter
    keys, values = (
        gather_from_sequence_parallel_region(t.contiguous(), True, group).index_select(0, row_order)
        for t in (key, value)
    )
    return attend_gathered(query, keys, values, cu_seqlens_padded, cp_size, cp_rank,
                           scale=scale, dropout_p=dropout_p)


def attend_gathered(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    cp_size: int,
    cp_rank: int,
    *,
    scale: float | None,
    dropout_p: float,
    varlen: VarlenKernel | None = None,
) -> torch.Tensor:
    """Causal attention of CP rank ``cp_rank``'s queries ``[T/cp, heads, d]`` (its token order)
    to the whole row's keys and values ``[T, kv_heads, d]`` (row order), with no communication.
    Returns ``[T/cp, heads, d]``.

    With ``varlen`` (a :data:`VarlenKernel`; no dropout) the rank's chunks are its segments;
    without, FlashAttention varlen does that where it runs (CUDA, bf16/fp16, no dropout) and its
    causal alignment passed :func:`flash_segments_checked`, else SDPA with a boolean mask runs
    once per sequence."""
    layout = _LAYOUT.get(cu_seqlens_padded, cp_size, cp_rank)
    if varlen is not None and dropout_p != 0.0:
        raise ValueError("attend_gathered: a varlen kernel runs without dropout")
    if (varlen is None and flash_varlen_supported(query, dropout_p)
            and flash_segments_checked(query, keys, values)):
        varlen = flash_varlen_segments
    if varlen is None:
        return _attend_masked(query, keys, values, layout, scale, dropout_p)
    return _attend_segments(query, keys, values, layout.segments, scale, varlen)


def _attend_segments(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     segments: ChunkSegments, scale: float | None,
                     varlen: VarlenKernel) -> torch.Tensor:
    """One varlen call: every local chunk attends to its sequence's prefix up to its end (the
    gradient of the packed keys/values flows back through the index_select)."""
    k, v = (t.index_select(0, segments.key_index) for t in (keys, values))
    return varlen(query, k, v, segments.cu_seqlens_q, segments.cu_seqlens_k,
                  segments.max_seqlen_q, segments.max_seqlen_k, scale)


def _attend_masked(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   layout: _RankLayout, scale: float | None, dropout_p: float) -> torch.Tensor:
    """SDPA with a boolean mask, one call per sequence (any device, dropout allowed)."""
    cp_size, cp_rank = layout.cp_size, layout.cp_rank
    outs = []
    local = 0
    for start, end in itertools.pairwise(layout.bounds):
        n_local = (end - start) // cp_size
        positions = layout.positions[local : local + n_local]  # of the rank's queries
        # keys any of them can see: up to the end of its later chunk, 2cp-1-r
        span = (2 * cp_size - cp_rank) * ((end - start) // (2 * cp_size))
        q = query[local : local + n_local].transpose(0, 1).unsqueeze(0)
        k, v = (t[start : start + span].transpose(0, 1).unsqueeze(0) for t in (keys, values))
        mask = positions[:, None] >= torch.arange(span, device=positions.device)[None, :]
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        outs.append(out[0].transpose(0, 1))
        local += n_local
    return torch.cat(outs, dim=0)


_FLASH_CHECKS: dict[tuple[torch.device, torch.dtype], bool] = {}
_CHECK_BOUNDS = [0, 8, 32, 44]  # under cp=2: chunks of 2, 6 and 3 tokens
_CHECK_TOLERANCE = 2e-2  # relative L2 error; bf16 kernels land around 5e-3


def flash_segments_checked(query: torch.Tensor, keys: torch.Tensor,
                           values: torch.Tensor) -> bool:
    """Whether FlashAttention varlen may run :func:`attend_gathered`'s segments on this device
    and dtype: on first use, every rank of cp=2 on a small random case (shaped like these
    tensors) through the flash path and through the SDPA-mask path (fp32); the verdict is kept
    for the process, and a disagreement is logged once."""
    device_key = (query.device, query.dtype)
    verdict = _FLASH_CHECKS.get(device_key)
    if verdict is None:
        try:
            with torch.inference_mode(False):
                error = segments_error(flash_varlen_segments, query, keys, values)
        except (RuntimeError, TypeError) as err:
            error, reason = float("nan"), f"failed ({err})"
        else:
            reason = f"disagrees with the SDPA-mask path (relative error {error:.2e})"
        verdict = _FLASH_CHECKS[device_key] = error < _CHECK_TOLERANCE
        if verdict:
            logger.info("Context-parallel attention on %s %s: FlashAttention varlen "
                        "(relative error %.2e against the SDPA-mask path)", *device_key, error)
        else:
            logger.warning(
                "Context-parallel attention on %s %s: FlashAttention varlen with key segments "
                "longer than their queries (bottom-right causal mask) %s; using SDPA with a "
                "mask, one call per sequence, from now on", *device_key, reason)
    return verdict


def segments_error(varlen: VarlenKernel, query: torch.Tensor, keys: torch.Tensor,
                   values: torch.Tensor) -> float:
    """Largest relative L2 error, over the output and the q/k/v gradients, of the segment path
    through ``varlen`` against the SDPA-mask path in fp32, for every rank of cp=2 on a small
    random row with these tensors' heads, head dims, device and dtype."""
    device, dtype = query.device, query.dtype
    cu = torch.tensor(_CHECK_BOUNDS, device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    total = _CHECK_BOUNDS[-1]
    inputs = [torch.randn(total, *t.shape[1:], generator=gen, device=device, dtype=dtype)
              for t in (query, keys, values)]
    grad = torch.randn(total, query.shape[1], values.shape[-1], generator=gen, device=device,
                       dtype=dtype)
    layouts = [_rank_layout(cu, 2, rank) for rank in range(2)]

    def run(attend, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        q, k, v = (t.detach().clone().requires_grad_() for t in tensors)
        with torch.enable_grad():
            out = torch.cat([attend(q.index_select(0, layout.mine), k, v, layout)
                             for layout in layouts])
            out.backward(grad.to(out.dtype))
        return [out.detach(), q.grad, k.grad, v.grad]

    ours = run(lambda q, k, v, layout: _attend_segments(q, k, v, layout.segments, None, varlen),
               inputs)
    ref = run(lambda q, k, v, layout: _attend_masked(q, k, v, layout, None, 0.0),
              [t.float() for t in inputs])
    return max(float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-12))
               for a, b in zip(ours, ref))
