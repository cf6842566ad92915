"""Context-parallel attention without a process group: every CP rank's queries attend to the whole
row's keys and values (as after the all-gather), through the segment path (one varlen call over
the rank's chunks, driven here by a plain-torch varlen kernel) and the SDPA-mask path; both must
equal causal attention over the unsplit sequences, values and gradients. The same kernel aligned
the wrong way (top-left) must be caught, by the tests and by the once-per-process check that
guards FlashAttention on GPUs.
"""

from __future__ import annotations

import itertools
import logging

import pytest
import torch
import torch.nn.functional as F

from megarl.megatron import context_parallel
from megarl.megatron.context_parallel import attend_gathered, chunk_segments, segments_error
from megarl.megatron.packing import context_parallel_positions

LENGTHS = (9, 13, 5, 11, 7)
HEADS, KV_HEADS, DIM = 4, 2, 8
SCALE = 0.3
TOLERANCE = 1e-6


def varlen_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor,
                     cu_k: torch.Tensor, max_q: int, max_k: int, scale: float | None,
                     *, bottom_right: bool = True) -> torch.Tensor:
    """A varlen kernel in plain torch: each query segment attends causally to its key segment,
    the mask aligned to the bottom right (FlashAttention-2's: query i of n sees keys up to
    m - n + i of m) or, to show the tests catch it, to the top left (keys up to i)."""
    outs = []
    for (q0, q1), (k0, k1) in zip(itertools.pairwise(cu_q.tolist()),
                                  itertools.pairwise(cu_k.tolist()), strict=True):
        n, m = q1 - q0, k1 - k0
        assert n <= max_q and m <= max_k and m >= n
        shift = m - n if bottom_right else 0
        mask = torch.arange(m)[None, :] <= torch.arange(n)[:, None] + shift
        qs, ks, vs = (t[a:b].transpose(0, 1)[None] for t, a, b in
                      ((q, q0, q1), (k, k0, k1), (v, k0, k1)))
        out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale,
                                             enable_gqa=True)
        outs.append(out[0].transpose(0, 1))
    return torch.cat(outs)


def varlen_top_left(*args) -> torch.Tensor:
    """:func:`varlen_reference` with the causal mask aligned to the top left (wrong here)."""
    return varlen_reference(*args, bottom_right=False)


def padded_bounds(cp_size: int) -> list[int]:
    """Offsets of LENGTHS, each padded to a multiple of 2 x cp (megarl's packing)."""
    align = 2 * cp_size
    bounds = [0]
    for n in LENGTHS:
        bounds.append(bounds[-1] + -(-n // align) * align)
    return bounds


def row_tensors(total: int, dtype: torch.dtype = torch.float32):
    """Random row-ordered q ``[T, heads, d]``, k and v ``[T, kv_heads, d]`` and an output
    gradient."""
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(total, h, DIM, generator=g, dtype=dtype)
               for h in (HEADS, KV_HEADS, KV_HEADS))
    return q, k, v, torch.randn(total, HEADS, DIM, generator=g, dtype=dtype)


def full_causal(q, k, v, grad, bounds):
    """Causal attention inside each unsplit padded sequence (cp=1), and the q/k/v gradients."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    outs = []
    for start, end in itertools.pairwise(bounds):
        qs, ks, vs = (t[start:end].transpose(0, 1)[None] for t in (q, k, v))
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=SCALE,
                                                   enable_gqa=True)[0].transpose(0, 1))
    out = torch.cat(outs)
    out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


def every_rank(q, k, v, grad, bounds, cp_size, varlen):
    """attend_gathered for every CP rank on its own queries and the whole row's keys/values,
    the outputs put back in row order; with the q/k/v gradients (k/v summed over ranks, as the
    reduce-scatter of the all-gather does)."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    cu = torch.tensor(bounds)
    mine = [context_parallel_positions(bounds, cp_size, r) for r in range(cp_size)]
    outs = [attend_gathered(q[m], k, v, cu, cp_size, r, scale=SCALE, dropout_p=0.0,
                            varlen=varlen) for r, m in enumerate(mine)]
    out = torch.cat(outs)[torch.argsort(torch.cat(mine))]
    out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


def test_chunk_segments_are_each_chunks_sequence_prefix():
    """cp=2 on sequences of 8 and 12 tokens (chunks of 2 and 3): rank 0 holds chunks 0 and 3,
    rank 1 chunks 1 and 2; each chunk's keys run from its sequence's start to the chunk's end."""
    rank1 = chunk_segments([0, 8, 20], 2, 1)
    assert rank1.cu_seqlens_q.tolist() == [0, 2, 4, 7, 10]
    assert rank1.cu_seqlens_k.tolist() == [0, 4, 10, 16, 25]
    assert rank1.key_index.tolist() == [*range(4), *range(6), *range(8, 14), *range(8, 17)]
    assert (rank1.max_seqlen_q, rank1.max_seqlen_k) == (3, 9)
    rank0 = chunk_segments([0, 8, 20], 2, 0)
    assert rank0.cu_seqlens_k.tolist() == [0, 2, 10, 13, 25]
    assert rank0.key_index.tolist() == [0, 1, *range(8), 8, 9, 10, *range(8, 20)]
    assert rank0.cu_seqlens_q.dtype == rank0.cu_seqlens_k.dtype == torch.int32


@pytest.mark.parametrize("cp_size", [2, 3])
def test_segments_and_mask_paths_equal_full_causal_attention(cp_size):
    """fp32, GQA, odd lengths padded per the layout: both paths give cp=1's output and q/k/v
    gradients to ~1e-6."""
    bounds = padded_bounds(cp_size)
    q, k, v, grad = row_tensors(bounds[-1])
    expected = full_causal(q, k, v, grad, bounds)
    for varlen in (varlen_reference, None):
        results = every_rank(q, k, v, grad, bounds, cp_size, varlen)
        for name, ours, ref in zip(("out", "dq", "dk", "dv"), results, expected):
            torch.testing.assert_close(ours, ref, atol=TOLERANCE, rtol=TOLERANCE,
                                       msg=f"cp={cp_size} {varlen and varlen.__name__}: {name}")
    # the comparison would see a kernel whose causal mask is aligned the wrong way
    wrong = every_rank(q, k, v, grad, bounds, cp_size, varlen_top_left)
    assert (wrong[0] - expected[0]).abs().max() > 1e-2


def test_alignment_check_passes_bottom_right_and_fails_top_left():
    """The check that guards FlashAttention compares the segment path with the mask path."""
    q, k, v, _ = row_tensors(4)
    assert segments_error(varlen_reference, q, k, v) < 1e-6
    assert segments_error(varlen_top_left, q, k, v) > 0.1


@pytest.mark.parametrize("kernel,used", [(varlen_reference, True), (varlen_top_left, False)])
def test_flash_path_is_taken_only_after_its_check_passes(monkeypatch, caplog, kernel, used):
    """With FlashAttention stood in for by ``kernel``: the check runs once; a kernel that
    passes is used for every call, one that fails is warned about once and the SDPA-mask path
    (same results as cp=1) runs instead."""
    calls = []

    def flash(*args):
        calls.append(args[3].numel())
        return kernel(*args)

    monkeypatch.setattr(context_parallel, "flash_varlen_supported", lambda q, dropout_p: True)
    monkeypatch.setattr(context_parallel, "flash_varlen_segments", flash)
    monkeypatch.setattr(context_parallel, "_FLASH_CHECKS", {})
    bounds = padded_bounds(2)
    q, k, v, grad = row_tensors(bounds[-1])
    expected = full_causal(q, k, v, grad, bounds)
    with caplog.at_level(logging.INFO, logger=context_parallel.__name__):
        for _ in range(2):
            before = len(calls)
            results = every_rank(q, k, v, grad, bounds, 2, None)
            for ours, ref in zip(results, expected):
                torch.testing.assert_close(ours, ref, atol=TOLERANCE, rtol=TOLERANCE)
            # one kernel call per rank on the flash path, none on the mask path
            assert len(calls) - before == (2 if used else 0) + (2 if before == 0 else 0)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == (0 if used else 1)
    if not used:
        assert "using SDPA with a mask" in warnings[0].getMessage()
    assert context_parallel._FLASH_CHECKS == {(q.device, q.dtype): used}


def test_varlen_kernel_refuses_dropout():
    bounds = padded_bounds(2)
    q, k, v, _ = row_tensors(bounds[-1])
    with pytest.raises(ValueError, match="dropout"):
        attend_gathered(q[: bounds[-1] // 2], k, v, torch.tensor(bounds), 2, 0, scale=None,
                        dropout_p=0.1, varlen=varlen_reference)
