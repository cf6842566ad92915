"""Split-K decode attention over :class:`~megarl.rollout.local.kv_cache.PagedKVCache`'s page
pools (or ``[rows, length, kv_heads, head_dim]`` buffers), for
:class:`~megarl.rollout.local.static_kv.NativeDecoder`'s decode step.

A decode step reads every running row's whole K/V cache for one query token per head: it is
bound by memory bandwidth. FlashAttention's varlen kernel gives each query head its own pass over
the keys and pads its one query row to a tile of 128; on an H100 it read the cache at ~1 TB/s
(a third of HBM; benchmarks/RESULTS.md). Here one program reads one (row, KV head, split) chunk
of keys and values once for all the query heads that share that KV head (GQA), and long rows are
split over several programs (FlashDecoding) whose partial softmaxes a second kernel combines.
Each row reads its own ``used`` tokens only, so the padded rows of a decode graph bucket cost
nothing. The grid depends on the cache's capacity, never on the rows' lengths, so the step stays
one CUDA graph.

Numerics follow FlashAttention's: scores and the online softmax in fp32, the probabilities
rounded to the value dtype before they multiply V, the output rounded once. On CUDA only (with
``TRITON_INTERPRET=1`` it also takes CPU tensors, for tests).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

BLOCK_N = 64
"""Keys per inner step."""
MIN_CHUNK = 256
"""A split reads at least this many keys: fewer would cost more in partials than it spreads."""


@triton.jit
def _partial_kernel(q_ptr, k_ptr, v_ptr, used_ptr, pages_ptr, o_ptr, lse_ptr, out_ptr, scale,
                    chunk, q_row, q_head, k_row, k_tok, k_head, v_row, v_tok, v_head, pages_row,
                    o_row, o_head, o_split, lse_row, lse_head, out_row, out_head,
                    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK: tl.constexpr, SPLITS: tl.constexpr,
                    PAGE: tl.constexpr, F32_DOT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    used = tl.load(used_ptr + row)
    start = split * chunk
    end = tl.minimum(start + chunk, used)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + row * q_row + heads[:, None] * q_head + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for first in range(start, end, BLOCK):
        t = first + tl.arange(0, BLOCK)
        t_ok = t < end
        kv_ok = t_ok[:, None] & d_ok[None, :]
        if PAGE > 0 and PAGE % BLOCK == 0:  # the tile lies in one page: one page id
            page = tl.load(pages_ptr + row * pages_row + first // PAGE).to(tl.int64)
            k_at = page * k_row + (t % PAGE).to(tl.int64) * k_tok
            v_at = page * v_row + (t % PAGE).to(tl.int64) * v_tok
        elif PAGE > 0:  # token t of the row is at slot t % PAGE of page pages[row, t // PAGE]
            page = tl.load(pages_ptr + row * pages_row + t // PAGE, mask=t_ok, other=0)
            page = page.to(tl.int64)
            k_at = page * k_row + (t % PAGE).to(tl.int64) * k_tok
            v_at = page * v_row + (t % PAGE).to(tl.int64) * v_tok
        else:
            k_at = row * k_row + t.to(tl.int64) * k_tok
            v_at = row * v_row + t.to(tl.int64) * v_tok
        k = tl.load(k_ptr + kv_head * k_head + k_at[:, None] + d[None, :], mask=kv_ok, other=0.0)
        if F32_DOT:  # Triton's interpreter multiplies half floats' bits: the same numbers in fp32
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32))) * scale
        else:
            s = tl.dot(q, tl.trans(k)) * scale
        s = tl.where(t_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + kv_head * v_head + v_at[:, None] + d[None, :], mask=kv_ok, other=0.0)
        if F32_DOT:
            pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32))
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m = m_new
    has = l > 0.0
    o = acc / tl.where(has, l, 1.0)[:, None]
    mask = g_ok[:, None] & d_ok[None, :]
    if SPLITS == 1:
        tl.store(out_ptr + row * out_row + heads[:, None] * out_head + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(o_ptr + row * o_row + heads[:, None] * o_head + split * o_split + d[None, :],
                 o, mask=mask)
        lse = tl.where(has, m + tl.log(tl.where(has, l, 1.0)), float("-inf"))
        tl.store(lse_ptr + row * lse_row + heads * lse_head + split, lse, mask=g_ok)


@triton.jit
def _combine_kernel(o_ptr, lse_ptr, out_ptr, o_row, o_head, o_split, lse_row, lse_head, out_row,
                    out_head, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS: tl.constexpr,
                    BLOCK_S: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_ok = s < SPLITS
    base = row * o_row + head * o_head
    lse = tl.load(lse_ptr + row * lse_row + head * lse_head + s, mask=s_ok, other=float("-inf"))
    weight = tl.exp(lse - tl.max(lse, axis=0))
    weight = weight / tl.sum(weight, axis=0)
    o = tl.load(o_ptr + base + s[:, None] * o_split + d[None, :],
                mask=s_ok[:, None] & (d < HEAD_DIM)[None, :], other=0.0)
    out = tl.sum(o * weight[:, None], axis=0)
    tl.store(out_ptr + row * out_row + head * out_head + d, out.to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)


def num_splits(rows: int, kv_heads: int, length: int, programs: int) -> int:
    """Splits per (row, KV head) so that about ``programs`` programs run, each over at least
    :data:`MIN_CHUNK` of the ``length`` cache columns."""
    most = max(1, -(-length // MIN_CHUNK))
    return max(1, min(most, -(-programs // max(1, rows * kv_heads))))


def _programs(device: torch.device) -> int:
    """Programs that fill the device about twice."""
    if device.type != "cuda":
        return 1
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count


def decode_attention_supported(q: torch.Tensor, cache: torch.Tensor) -> bool:
    """Whether :func:`decode_attention` takes these tensors."""
    return (q.dim() == 3 and cache.dim() == 4 and q.dtype == cache.dtype
            and q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] == cache.shape[-1]
            and q.shape[1] % cache.shape[2] == 0 and q.stride(-1) == 1
            and cache.stride(-1) == 1 and q.device == cache.device)


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     used: torch.Tensor, scale: float, splits: int | None = None,
                     tiling: tuple[int, int, int] = (BLOCK_N, 4, 2),
                     pages: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention of one query token per row over that row's first ``used[r]`` cached
    tokens.

    ``q``: ``[rows, heads, head_dim]``; ``keys``/``values``: ``[rows_cap, length, kv_heads,
    head_dim]`` (row ``r`` of ``q`` reads row ``r`` of the cache), or with ``pages`` (a page
    table ``[rows_cap, columns]`` int32, :class:`~megarl.rollout.local.kv_cache.PagedKVCache`'s)
    page pools ``[pages, page_size, kv_heads, head_dim]``: row ``r``'s token ``t`` is at
    ``keys[pages[r, t // page_size], t % page_size]`` and rows hold ``columns * page_size``
    tokens at most. ``used``: ``[rows]`` int32, each at least 1. Returns ``[rows, heads,
    head_dim]`` in ``q``'s dtype. ``splits``: key splits per row (default: :func:`num_splits`
    for the device); ``tiling``: keys per inner step, warps and pipeline stages of the main
    kernel (benchmarks/decode_attention.py).
    """
    paged = pages is not None and (pages.dim() == 2 and pages.dtype == torch.int32
                                   and pages.device == q.device and pages.shape[0] >= q.shape[0]
                                   and pages.stride(1) == 1)
    if not decode_attention_supported(q, keys) or keys.shape != values.shape or (
            pages is not None and not paged):
        raise ValueError(f"decode_attention: q {tuple(q.shape)} {q.dtype}, cache "
                         f"{tuple(keys.shape)} {keys.dtype}, pages "
                         f"{None if pages is None else (tuple(pages.shape), pages.dtype)}: needs "
                         "[rows, heads, dim] and [rows, length, kv_heads, dim] (or page pools "
                         "and an int32 [rows, columns] page table on q's device) of one "
                         "half-precision dtype, heads a multiple of kv_heads")
    rows, heads, dim = q.shape
    page = keys.shape[1] if paged else 0
    length = pages.shape[1] * page if paged else keys.shape[1]
    kv_heads = keys.shape[2]
    group = heads // kv_heads
    if splits is None:
        splits = num_splits(rows, kv_heads, length, _programs(q.device))
    block_n, warps, stages = tiling
    chunk = -(-length // splits)
    chunk = -(-chunk // block_n) * block_n
    splits = -(-length // chunk)
    out = torch.empty_like(q)
    block_d = triton.next_power_of_2(dim)
    block_g = max(16, triton.next_power_of_2(group))
    if splits == 1:
        partial = lse = out  # unused
        o_strides, lse_strides = (0, 0, 0), (0, 0)
    else:
        partial = torch.empty(rows, heads, splits, dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(rows, heads, splits, dtype=torch.float32, device=q.device)
        o_strides, lse_strides = partial.stride()[:3], lse.stride()[:2]
    _partial_kernel[(rows, kv_heads, splits)](
        q, keys, values, used, pages if paged else used, partial, lse, out, scale, chunk,
        q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2), pages.stride(0) if paged else 0,
        *o_strides, *lse_strides, out.stride(0), out.stride(1), GROUP=group, BLOCK_G=block_g,
        HEAD_DIM=dim, BLOCK_D=block_d, BLOCK=block_n, SPLITS=splits, PAGE=page,
        F32_DOT=_INTERPRET, num_warps=warps, num_stages=stages)
    if splits > 1:
        _combine_kernel[(rows, heads)](
            partial, lse, out, *o_strides, *lse_strides, out.stride(0), out.stride(1), HEAD_DIM=dim,
            BLOCK_D=block_d, SPLITS=splits, BLOCK_S=triton.next_power_of_2(splits),
            num_warps=4)
    return out


def reference_decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                               used: torch.Tensor, scale: float,
                               pages: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 attention of :func:`decode_attention`'s inputs, one row at a time (for tests)."""
    rows, heads, dim = q.shape
    group = heads // keys.shape[2]
    out = torch.empty(rows, heads, dim, dtype=torch.float32, device=q.device)
    for r in range(rows):
        n = int(used[r])
        row_k, row_v = keys[r], values[r]
        if pages is not None:  # the row's pages in order, as one [tokens, kv_heads, dim]
            row_k, row_v = (t[pages[r].long()].flatten(0, 1) for t in (keys, values))
        k = row_k[:n].float().repeat_interleave(group, dim=1)  # [n, heads, dim]
        v = row_v[:n].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[r].float(), k) * scale
        out[r] = torch.einsum("hn,nhd->hd", scores.softmax(dim=-1), v)
    return out
