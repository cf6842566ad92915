"""Fused Gumbel-max sampling of one token per row, in two Triton launches with no host
synchronisation, so a decode step can run it inside a CUDA graph.

Per row ``i`` with ``x = logits[i].float() / Te`` (``Te`` = the temperature, 1 for greedy rows,
whose temperature is <= 0): greedy rows take ``argmax(x)``; sampled rows take
``argmax(x_j + g_j)`` with Gumbel noise ``g_j = -log(-log(u_j))``, which draws exactly from
``softmax(x)``. ``u_j`` comes from Philox-4x32 keyed by a mix of the row's seed and position,
at counter ``j``, so a (seed, position) pair gives the same token for the same logits
whatever the batch. The reported log-prob is ``log_softmax(x)`` at the token, as in
:func:`megarl.rollout.local.sampling.sample_next`.

The first kernel scans vocabulary chunks (grid ``(rows, chunks)``) and writes per chunk the
running max, the sum of exponentials relative to it, the best score, its index and its ``x``;
the second combines a row's chunks. Imported only on CUDA machines with Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOGPROB_FLOOR = torch.finfo(torch.float32).min
BLOCK = 1024
"""Vocabulary elements one program handles per loop iteration."""
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _scan(row_ptr, col0, vocab, te, seed, FLOOR: tl.constexpr, CHUNK: tl.constexpr,
          BLOCK: tl.constexpr, SAMPLE: tl.constexpr):
    """One chunk's (max, sum of exp relative to it, best score, its index, its x)."""
    lanes = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_x = tl.full([BLOCK], float("-inf"), tl.float32)
    idx = tl.zeros([BLOCK], tl.int32)
    for start in range(0, CHUNK, BLOCK):
        col = col0 + start + lanes
        x = tl.load(row_ptr + col, mask=col < vocab, other=float("-inf")).to(tl.float32) / te
        # online softmax per lane with one exp: exp(-|x - m|) rescales whichever is smaller
        # (the floor keeps -inf - -inf from making a NaN: it gives exp(-inf) = 0)
        e = tl.exp(tl.minimum(x, m) - tl.maximum(tl.maximum(x, m), FLOOR))
        s = tl.where(x > m, s * e + 1.0, s + e)
        m = tl.maximum(m, x)
        if SAMPLE:
            bits = tl.randint(seed, col).to(tl.uint32, bitcast=True)
            u = ((bits >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)  # 23 bits, inside (0, 1)
            score = x - tl.log(-tl.log(u))
        else:
            score = x
        take = score > best  # strict: the lowest index wins ties within a lane
        best = tl.where(take, score, best)
        best_x = tl.where(take, x, best_x)
        idx = tl.where(take, col, idx)
    top = tl.max(m, 0)
    total = tl.sum(s * tl.exp(m - tl.maximum(top, FLOOR)), 0)
    win = tl.max(best, 0)
    win_idx = tl.min(tl.where(best == win, idx, 2147483647), 0)
    win_x = tl.max(tl.where((best == win) & (idx == win_idx), best_x, float("-inf")), 0)
    return top, total, win, win_idx, win_x


@triton.jit
def _partials_kernel(logits_ptr, row_stride, temps_ptr, seeds_ptr, positions_ptr, part_ptr,
                     idx_ptr, vocab, chunks, FLOOR: tl.constexpr, CHUNK: tl.constexpr,
                     BLOCK: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    temp = tl.load(temps_ptr + row)
    position = tl.load(positions_ptr + row)
    # one 64-bit Philox-4x32 key per (seed, position), the vocabulary index as the counter
    seed = tl.load(seeds_ptr + row) ^ (position * -7046029254386353131)
    row_ptr = logits_ptr + row.to(tl.int64) * row_stride
    col0 = chunk * CHUNK
    if temp > 0:
        top, total, win, win_idx, win_x = _scan(row_ptr, col0, vocab, temp, seed, FLOOR,
                                                CHUNK, BLOCK, True)
    else:
        top, total, win, win_idx, win_x = _scan(row_ptr, col0, vocab, 1.0, seed, FLOOR,
                                                CHUNK, BLOCK, False)
    at = row * chunks + chunk
    plane = tl.num_programs(0) * chunks
    tl.store(part_ptr + at, top)
    tl.store(part_ptr + plane + at, total)
    tl.store(part_ptr + 2 * plane + at, win)
    tl.store(part_ptr + 3 * plane + at, win_x)
    tl.store(idx_ptr + at, win_idx)


@triton.jit
def _combine_kernel(part_ptr, idx_ptr, tokens_ptr, logprobs_ptr, rows, chunks,
                    FLOOR: tl.constexpr, CHUNKS: tl.constexpr):
    row = tl.program_id(0)
    c = tl.arange(0, CHUNKS)
    mask = c < chunks
    at = row * chunks + c
    plane = rows * chunks
    m = tl.load(part_ptr + at, mask=mask, other=float("-inf"))
    s = tl.load(part_ptr + plane + at, mask=mask, other=0.0)
    best = tl.load(part_ptr + 2 * plane + at, mask=mask, other=float("-inf"))
    best_x = tl.load(part_ptr + 3 * plane + at, mask=mask, other=float("-inf"))
    idx = tl.load(idx_ptr + at, mask=mask, other=2147483647)
    top = tl.max(m, 0)
    total = tl.sum(s * tl.exp(m - tl.maximum(top, FLOOR)), 0)
    win = tl.max(best, 0)
    win_idx = tl.min(tl.where(best == win, idx, 2147483647), 0)
    win_x = tl.max(tl.where((best == win) & (idx == win_idx), best_x, float("-inf")), 0)
    tl.store(tokens_ptr + row, win_idx.to(tl.int64))
    tl.store(logprobs_ptr + row, tl.maximum(win_x - (top + tl.log(total)), FLOOR))


def gumbel_supported(logits: torch.Tensor) -> bool:
    """Whether :func:`gumbel_sample` takes ``logits``: a 2-D CUDA tensor in bf16, fp16 or fp32
    with a contiguous last dimension."""
    return (logits.is_cuda and logits.dim() == 2 and logits.dtype in _DTYPES
            and (logits.stride(-1) == 1 or logits.shape[-1] == 1))


def chunk_size(rows: int, vocab: int) -> int:
    """Vocabulary elements per program of the first kernel: the largest of 8192, 4096 and 2048
    that still gives about a thousand programs, so small batches keep the GPU busy (a small
    vocabulary's power of two above it when that is less)."""
    chunk = next((c for c in (8192, 4096) if rows * triton.cdiv(vocab, c) >= 1024), 2048)
    return min(chunk, triton.next_power_of_2(vocab))


def gumbel_sample(logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor,
                  positions: torch.Tensor, *, chunk: int | None = None,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of ``logits [n, V]`` (bf16, fp16 or fp32, last dim contiguous) with
    ``temperatures [n]`` fp32 (<= 0: greedy), ``seeds [n]`` and ``positions [n]`` int64 (the
    random stream of a row); returns (tokens [n] int64, log-probs [n]
    fp32) on the logits' device. Every row needs a finite logit. ``chunk`` (a multiple of
    ``BLOCK`` or a power of two below it) overrides :func:`chunk_size`; results do not depend
    on it beyond fp32 rounding of the log-probs."""
    rows, vocab = logits.shape
    assert temperatures.shape == seeds.shape == positions.shape == (rows,), "one value per row"
    assert logits.stride(-1) == 1 or vocab == 1, "logits' last dimension must be contiguous"
    chunk = chunk or chunk_size(rows, vocab)
    block = min(BLOCK, chunk)
    assert chunk % block == 0 and block & (block - 1) == 0, f"chunk {chunk} vs block {BLOCK}"
    chunks = triton.cdiv(vocab, chunk)
    device = logits.device
    tokens = torch.empty(rows, dtype=torch.int64, device=device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=device)
    if rows == 0:
        return tokens, logprobs
    partials = torch.empty((4, rows, chunks), dtype=torch.float32, device=device)
    indices = torch.empty((rows, chunks), dtype=torch.int32, device=device)
    _partials_kernel[(rows, chunks)](
        logits, logits.stride(0), temperatures.float().contiguous(),
        seeds.long().contiguous(), positions.long().contiguous(), partials, indices, vocab,
        chunks, FLOOR=LOGPROB_FLOOR, CHUNK=chunk, BLOCK=block, num_warps=4)
    _combine_kernel[(rows,)](partials, indices, tokens, logprobs, rows, chunks,
                             FLOOR=LOGPROB_FLOOR, CHUNKS=triton.next_power_of_2(chunks),
                             num_warps=1)
    return tokens, logprobs
