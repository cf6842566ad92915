"""The native decode path's static KV cache and its size arithmetic.

One ``[rows_cap, len_cap, kv_heads, head_dim]`` buffer per layer for keys and one for values;
running row ``i`` lives in slot ``i`` with its tokens at positions ``0..len-1`` and the last
column is scratch (where padded graph rows write). Rows are rounded up to :data:`ROW_BUCKETS`
and lengths to :data:`LENGTH_STEP` (doubling when a length outgrows it, for callers that grow
token by token; the engine reserves each row's final length up front). The cache grows by copy: while the live rows are copied,
old and new buffers are both allocated, which :meth:`StaticKVCache.peak_tokens` counts, so the
engine can admit only what fits its token budget (``--max-total-tokens``).
"""

from __future__ import annotations

import torch

ROW_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
LENGTH_STEP = 256


def row_bucket(rows: int) -> int:
    """The row count a cache (and a decode graph) is sized for."""
    return next((b for b in ROW_BUCKETS if b >= rows), rows)


class StaticKVCache:
    """Per-layer K/V buffers ``[rows_cap, len_cap, kv_heads, head_dim]`` (module docstring)."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.shape_tail = (kv_heads, head_dim)
        self.layers, self.dtype, self.device = layers, dtype, device
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.rows_cap = self.len_cap = 0

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token slot takes over all layers (keys and values)."""
        kv_heads, head_dim = self.shape_tail
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.layers * kv_heads * head_dim * itemsize

    @property
    def allocated_tokens(self) -> int:
        """Token slots allocated now."""
        return self.rows_cap * self.len_cap

    def target(self, rows: int, length: int) -> tuple[int, int] | None:
        """The ``(rows_cap, len_cap)`` that :meth:`ensure` would allocate for ``rows`` slots of
        ``length`` tokens; None when the buffers already fit."""
        if rows <= self.rows_cap and length < self.len_cap:
            return None
        new_rows = row_bucket(max(rows, self.rows_cap))
        new_len = max(self.len_cap, -(-(length + 1) // LENGTH_STEP) * LENGTH_STEP)
        if length >= self.len_cap and self.len_cap:  # growing token by token: double
            new_len = max(new_len, 2 * self.len_cap)
        return new_rows, new_len

    def peak_tokens(self, rows: int, length: int, live_rows: int) -> int:
        """Token slots allocated at the peak of ``ensure(rows, length, live_rows)``: the old
        buffers stay while live rows are copied into the new ones."""
        shape = self.target(rows, length)
        if shape is None:
            return self.allocated_tokens
        new = shape[0] * shape[1]
        return new + (self.allocated_tokens if live_rows else 0)

    def ensure(self, rows: int, length: int, live_rows: int) -> bool:
        """Make room for ``rows`` slots of ``length`` tokens (+1 scratch column), keeping the
        first ``live_rows`` slots; True when the buffers were reallocated."""
        shape = self.target(rows, length)
        if shape is None:
            return False
        old_k, old_v, old_len = self.keys, self.values, self.len_cap
        if not live_rows:  # nothing to copy: the old buffers go first
            old_k, old_v = [], []
            self.free()
        full = (*shape, *self.shape_tail)
        self.keys = [torch.zeros(full, dtype=self.dtype, device=self.device)
                     for _ in range(self.layers)]
        self.values = [torch.zeros(full, dtype=self.dtype, device=self.device)
                       for _ in range(self.layers)]
        for new, old in zip(self.keys + self.values, old_k + old_v):
            new[:live_rows, :old_len] = old[:live_rows]
        self.rows_cap, self.len_cap = shape
        return True

    def keep(self, index: list[int]) -> None:
        """Move slots ``index`` to slots ``0..len(index)-1``."""
        if index == list(range(len(index))):
            return
        idx = torch.tensor(index, dtype=torch.long, device=self.device)
        for t in self.keys + self.values:
            t[: len(index)] = t.index_select(0, idx)

    def write(self, start: int, kv) -> None:
        """Put the prefill rows (a ``PrefillKV``) into slots ``start..start+rows-1``."""
        width = kv.keys[0].shape[1]
        for dst, src in zip(self.keys + self.values, kv.keys + kv.values):
            dst[start : start + kv.rows, :width] = src

    def free(self) -> None:
        """Drop the buffers."""
        self.keys, self.values = [], []
        self.rows_cap = self.len_cap = 0


def kv_slots(free_before_load: int, free_after_load: int, fraction: float,
             bytes_per_token: int) -> int:
    """SGLang's KV pool size (``ModelRunner.profile_max_num_token``, sglang 0.5.10): what is
    free after the weights loaded, less ``1 - mem_fraction_static`` of what was free before
    they did (the headroom for activations and graphs), in token slots. Memory other processes
    hold (a colocated actor's parameters) is never counted as the engine's."""
    rest = free_after_load - free_before_load * (1 - fraction)
    return int(rest // bytes_per_token)
