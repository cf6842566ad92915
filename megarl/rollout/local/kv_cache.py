"""The native decode path's paged KV cache and its size arithmetic.

One pool of pages per layer for keys and one for values, ``[pages, page_size, kv_heads,
head_dim]``, and one page table ``[rows, columns]`` (int32, on the device): running row ``i``
keeps its token ``t`` at ``pool[table[i, t // page_size], t % page_size]``. A row holds only
the pages its own tokens need, so rows of very different lengths share the pool without the
rectangle of rows x the longest row a static cache allocates (on the dense e2e shape that
rectangle held ~72 rows where ~490 fitted). Dropping or reordering rows moves table rows, never
K/V. Page 0 is scratch: table entries no row owns point at it, and a decode graph's padded rows
write there.

The pool grows by copy (while the live pages are copied the old and the new pool are both
allocated, which :meth:`PagedKVCache.peak_tokens` counts); the engine sizes it once for its
token budget (``--max-total-tokens``) so that it does not grow while rows run. Row counts are
rounded up to :data:`ROW_BUCKETS` (the decode graphs' buckets) and the table's columns to
:data:`LENGTH_STEP` tokens.
"""

from __future__ import annotations

import torch

ROW_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
LENGTH_STEP = 256
WRITE_CHUNK_BYTES = 64 << 20
"""The most K (or V) bytes of one layer a prefill write gathers at once."""
PAGE_SIZE = 64
"""Tokens a page holds: the split-K attention kernel's tile of keys."""


def row_bucket(rows: int) -> int:
    """The row count a page table (and a decode graph) is sized for."""
    return next((b for b in ROW_BUCKETS if b >= rows), rows)


def pages_for(length: int, page_size: int = PAGE_SIZE) -> int:
    """Pages that hold ``length`` tokens."""
    return -(-length // page_size)


class PoolExhausted(torch.OutOfMemoryError):
    """Rows need pages and the pool cannot give them (it may not grow past the device's free
    memory): the engine recovers as from any step out of memory."""


class PagedKVCache:
    """Per-layer K/V page pools and the running rows' page table (module docstring)."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, page_size: int = PAGE_SIZE) -> None:
        self.shape_tail = (kv_heads, head_dim)
        self.layers, self.dtype, self.device, self.page_size = layers, dtype, device, page_size
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.table = torch.zeros(0, 0, dtype=torch.int32, device=device)
        self.row_pages: list[list[int]] = []
        """Per running row, its pages in token order (host copy of the table's rows)."""
        self._free: list[int] = []
        self.pages_cap = 0
        """Pages a row may own (the pool holds one more: the scratch page 0)."""

    # ----- sizes -----
    @property
    def bytes_per_token(self) -> int:
        """Bytes one token slot takes over all layers (keys and values)."""
        kv_heads, head_dim = self.shape_tail
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.layers * kv_heads * head_dim * itemsize

    @property
    def allocated_tokens(self) -> int:
        """Token slots the pools hold now (the scratch page included)."""
        return (self.pages_cap + 1) * self.page_size if self.keys else 0

    @property
    def rows_cap(self) -> int:
        """Rows the page table holds."""
        return int(self.table.shape[0])

    @property
    def len_cap(self) -> int:
        """Tokens a row may hold at most (the page table's columns)."""
        return int(self.table.shape[1]) * self.page_size

    @property
    def free_pages(self) -> int:
        """Pages no row owns."""
        return len(self._free)

    @property
    def used_pages(self) -> int:
        """Pages the running rows own."""
        return self.pages_cap - len(self._free)

    def pages_for(self, length: int) -> int:
        """Pages that hold ``length`` tokens."""
        return pages_for(length, self.page_size)

    def pool_target(self, pages: int, pool: int | None) -> int | None:
        """The usable pages :meth:`ensure_pool` would allocate for ``pages`` pages: ``pool``
        (a budget in pages) or twice the pool if more; None when the pool holds them."""
        if pages <= self.pages_cap:
            return None
        return max(pages, pool if pool is not None else 2 * self.pages_cap)

    def peak_tokens(self, pages: int, pool: int | None) -> int:
        """Token slots allocated at the peak of :meth:`ensure_pool` ``(pages, pool)``: the old
        pool stays while live pages are copied."""
        target = self.pool_target(pages, pool)
        if target is None:
            return self.allocated_tokens
        return (target + 1) * self.page_size + (self.allocated_tokens if self.used_pages else 0)

    # ----- allocation -----
    def ensure_pool(self, pages: int, pool: int | None = None, limit: int | None = None) -> bool:
        """Make room for ``pages`` pages in use at once (see :meth:`pool_target`; at most
        ``limit`` pages where that is more than ``pages``); True when the pools were allocated
        anew (page ids stay valid: the live pages are copied)."""
        target = self.pool_target(pages, pool)
        if target is None:
            return False
        if limit is not None:
            target = max(pages, min(target, limit))
        live = self.used_pages > 0
        old_k, old_v = (self.keys, self.values) if live else ([], [])
        if not live:
            self.keys, self.values = [], []
        full = (target + 1, self.page_size, *self.shape_tail)
        keys = [torch.zeros(full, dtype=self.dtype, device=self.device) for _ in range(self.layers)]
        values = [torch.zeros(full, dtype=self.dtype, device=self.device)
                  for _ in range(self.layers)]
        for new, old in zip(keys + values, old_k + old_v):
            new[: old.shape[0]] = old
        self.keys, self.values = keys, values
        self._free = list(range(target, self.pages_cap, -1)) + self._free
        if not live:
            self._free = list(range(target, 0, -1))
        self.pages_cap = target
        return True

    def ensure_table(self, rows: int, length: int) -> bool:
        """Room in the page table for ``rows`` rows of up to ``length`` tokens; True when the
        table was allocated anew (its live rows copied)."""
        cols = -(-length // LENGTH_STEP) * LENGTH_STEP // self.page_size
        cols = max(cols, -(-length // self.page_size))
        if rows <= self.rows_cap and cols <= self.table.shape[1]:
            return False
        new_rows, new_cols = max(rows, self.rows_cap), max(cols, int(self.table.shape[1]))
        table = torch.zeros(new_rows, new_cols, dtype=torch.int32, device=self.device)
        table[: self.rows_cap, : self.table.shape[1]] = self.table
        self.table = table
        return True

    def extend(self, rows: list[int], lengths: list[int]) -> None:
        """Give running rows ``rows`` the pages that hold ``lengths`` tokens each (one table
        write for all of them). Raises :class:`PoolExhausted`, taking no page, when the free
        pages are too few."""
        wanted = [(row, self.pages_for(n) - len(self.row_pages[row]))
                  for row, n in zip(rows, lengths)]
        wanted = [(row, k) for row, k in wanted if k > 0]
        if not wanted:
            return
        need = sum(k for _, k in wanted)
        if need > len(self._free):
            raise PoolExhausted(f"the running rows need {need} more KV pages; {len(self._free)} "
                                "are free")
        at_rows, at_cols, taken = [], [], []
        for row, k in wanted:
            pages = self.row_pages[row]
            for _ in range(k):
                at_rows.append(row)
                at_cols.append(len(pages))
                pages.append(self._free.pop())
                taken.append(pages[-1])
        self.table[torch.tensor(at_rows), torch.tensor(at_cols)] = torch.tensor(
            taken, dtype=torch.int32).to(self.device, non_blocking=True)

    def add_rows(self, lengths: list[int]) -> None:
        """Append rows after the running ones with the pages for ``lengths`` tokens."""
        start = len(self.row_pages)
        self.row_pages += [[] for _ in lengths]
        try:
            self.extend(list(range(start, start + len(lengths))), lengths)
        except PoolExhausted:
            del self.row_pages[start:]
            raise

    def slots(self, rows: range, lengths: list[int]) -> torch.Tensor:
        """The pool slots (``page * page_size + offset``) of tokens ``0..lengths[i]-1`` of
        running rows ``rows``, in order (long, on the device)."""
        size = self.page_size
        parts = []
        for row, n in zip(rows, lengths):
            t = torch.arange(n)
            parts.append(torch.tensor(self.row_pages[row], dtype=torch.long)[t // size] * size
                         + t % size)
        return torch.cat(parts).to(self.device, non_blocking=True)

    def write(self, start: int, kv, index: list[int]) -> None:
        """Put rows ``index`` of a prefill's K/V (a ``PrefillKV``, right-padded; repeats
        allowed) into running rows ``start..``, which hold their pages already. The K/V are
        gathered a chunk of at most :data:`WRITE_CHUNK_BYTES` per layer at a time: expanding a
        prefill of 300 sample rows to them at once held ~14 GB on the dense e2e shape (all
        layers), and ran the step out of memory beside a full pool."""
        width = kv.keys[0].shape[1]
        lengths = kv.lengths[index].tolist()
        dst = self.slots(range(start, start + len(index)), lengths)
        src = torch.cat([torch.arange(n) + i * width for i, n in zip(index, lengths)])
        src = src.to(self.device, non_blocking=True)
        chunk = max(1, WRITE_CHUNK_BYTES * 2 * self.layers // self.bytes_per_token)
        for pool, new in zip(self.keys + self.values, kv.keys + kv.values):
            flat, out = new.reshape(-1, *self.shape_tail), pool.view(-1, *self.shape_tail)
            for first in range(0, int(src.shape[0]), chunk):
                out[dst[first:first + chunk]] = flat[src[first:first + chunk]]

    def keep(self, index: list[int]) -> None:
        """Keep running rows ``index`` as rows ``0..len(index)-1``; the others' pages go back."""
        kept = set(index)
        for row, pages in enumerate(self.row_pages):
            if row not in kept:
                self._free += pages
        rows = len(self.row_pages)
        self.row_pages = [self.row_pages[i] for i in index]
        if index != list(range(len(index))):
            idx = torch.tensor(index, dtype=torch.long, device=self.device)
            self.table[: len(index)] = self.table.index_select(0, idx)
        self.table[len(index): rows] = 0

    def clear(self) -> None:
        """Drop every running row (the pools stay)."""
        self.keep([])

    def free(self) -> None:
        """Drop the pools and the table."""
        self.keys, self.values, self.row_pages, self._free = [], [], [], []
        self.table = torch.zeros(0, 0, dtype=torch.int32, device=self.device)
        self.pages_cap = 0


def activation_headroom(config, bytes_per_token: int, dtype_bytes: int, prefill_tokens: int,
                        rows: int, graphs: bool) -> int:
    """Bytes a decoder needs beside its KV pool at its peak: a prefill of ``prefill_tokens``
    (padded) tokens keeps every layer's K/V until they are written to pages, plus one layer's
    activations (the residual stream, attention and the widest MLP: a dense ``intermediate_size``
    or ``top-k x moe_intermediate_size``); and with ``graphs`` the decode graphs of every row
    bucket up to ``rows``, whose fp32 logits (and the sampler's copy) stay in the graphs' pool.
    On the dense e2e shape (16,384 prefill tokens, 512 rows): 2.9 GB of prefill and 2.1 GB of
    graphs."""
    hidden = int(config.hidden_size)
    mlp = max(int(getattr(config, "intermediate_size", 0) or 0),
              int(getattr(config, "num_experts_per_tok", 0) or 0)
              * int(getattr(config, "moe_intermediate_size", 0) or 0))
    prefill = prefill_tokens * (bytes_per_token + (6 * hidden + 3 * mlp) * dtype_bytes)
    buckets = [b for b in ROW_BUCKETS if b <= row_bucket(rows)] if graphs else []
    return prefill + sum(buckets) * int(config.vocab_size) * 4 * 2


def kv_slots(free_before_load: int, free_after_load: int, fraction: float,
             bytes_per_token: int) -> int:
    """SGLang's KV pool size (``ModelRunner.profile_max_num_token``, sglang 0.5.10): what is
    free after the weights loaded, less ``1 - mem_fraction_static`` of what was free before
    they did (the headroom for activations and graphs), in token slots. Memory other processes
    hold (a colocated actor's parameters) is never counted as the engine's."""
    rest = free_after_load - free_before_load * (1 - fraction)
    return int(rest // bytes_per_token)
