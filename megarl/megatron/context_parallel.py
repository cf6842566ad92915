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
  reduce-scatter of their gradients) and lets each local query attend to the keys at or before
  its position in the same sequence. It runs through SDPA with a boolean mask, per sequence, on
  any device (on GPUs this is not yet the FlashAttention varlen kernel of the cp=1 path).
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as mpu
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

from megarl.megatron.packing import PackedBatch, context_parallel_positions


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


class _Layout:
    """Per packed row: this rank's positions and the gathered rows' order, cached for the layers
    of one micro-batch (keyed by the offsets tensor, which is held so its id stays unique)."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._value: tuple | None = None

    def get(self, cu_padded: torch.Tensor, cp_size: int, cp_rank: int):
        key = (id(cu_padded), cp_size, cp_rank)
        if self._key != key or self._value[0] is not cu_padded:
            bounds = cu_padded.tolist()
            device = cu_padded.device
            mine = context_parallel_positions(bounds, cp_size, cp_rank)
            by_rank = torch.cat(
                [context_parallel_positions(bounds, cp_size, r) for r in range(cp_size)]
            )
            starts = torch.repeat_interleave(
                torch.tensor(bounds[:-1]), torch.tensor(bounds).diff() // cp_size
            )
            self._key = key
            self._value = (cu_padded, bounds, mine.to(device), torch.argsort(by_rank).to(device),
                           (mine - starts).to(device))
        return self._value[1:]


_LAYOUT = _Layout()


def sequence_positions(cu_seqlens_padded: torch.Tensor, group=None) -> torch.Tensor:
    """``[T/cp]`` position inside its sequence of each of this CP rank's tokens (what RoPE
    rotates by), from the whole packed row's offsets."""
    group = mpu.get_context_parallel_group() if group is None else group
    return _LAYOUT.get(cu_seqlens_padded, group.size(), group.rank())[3]


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
    bounds, mine, row_order, _ = _LAYOUT.get(cu_seqlens_padded, cp_size, cp_rank)
    # [T, kv_heads, d] in row order: forward all-gather, backward reduce-scatter
    keys, values = (
        gather_from_sequence_parallel_region(t.contiguous(), True, group).index_select(0, row_order)
        for t in (key, value)
    )
    outs = []
    local = 0
    for start, end in itertools.pairwise(bounds):
        n_local = (end - start) // cp_size
        positions = mine[local : local + n_local] - start  # positions of the rank's queries
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
