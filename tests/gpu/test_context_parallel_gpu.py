"""Context-parallel attention through FlashAttention varlen on one GPU, in bf16: two and three CP
ranks emulated without a process group (each rank's queries attend to the whole row's keys and
values, as after the all-gather) give the cp=1 FlashAttention varlen call's output and
gradients, and the flash path is the one taken (its causal-alignment check passed)."""

from __future__ import annotations

import itertools

import pytest
import torch

LENGTHS = (100, 37, 300, 11, 64)
HEADS, KV_HEADS, DIM = 8, 2, 64


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in fp64."""
    return float((a.double() - b.double()).norm() / b.double().norm())


def padded_bounds(cp_size: int) -> list[int]:
    """Offsets of LENGTHS, each padded to a multiple of 2 x cp (megarl's packing)."""
    align = 2 * cp_size
    bounds = [0]
    for n in LENGTHS:
        bounds.append(bounds[-1] + -(-n // align) * align)
    return bounds


@pytest.mark.parametrize("cp_size", [2, 3])
def test_cp_flash_segments_equal_cp1_flash_varlen(monkeypatch, cp_size):
    from megarl.megatron import context_parallel
    from megarl.megatron.context_parallel import attend_gathered, segments_error
    from megarl.megatron.native_ops import flash_varlen_attention, flash_varlen_segments
    from megarl.megatron.packing import context_parallel_positions

    bounds = padded_bounds(cp_size)
    cu = torch.tensor(bounds, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(cp_size)
    q, k, v = (torch.randn(bounds[-1], h, DIM, device="cuda", generator=g, dtype=torch.bfloat16)
               for h in (HEADS, KV_HEADS, KV_HEADS))
    grad = torch.randn(bounds[-1], HEADS, DIM, device="cuda", generator=g, dtype=torch.bfloat16)

    # FlashAttention's causal mask for key segments longer than their queries is bottom-right
    error = segments_error(flash_varlen_segments, q, k, v)
    assert error < 2e-2, f"flash segments vs the SDPA-mask path: relative error {error:.2e}"

    q1, k1, v1 = (t.clone().requires_grad_() for t in (q, k, v))
    longest = max(b - a for a, b in itertools.pairwise(bounds))
    expected = flash_varlen_attention(q1, k1, v1, cu, longest, None)  # cp=1, the whole row
    expected.backward(grad)

    calls: list[int] = []

    def flash_spy(*args):
        calls.append(args[3].numel())
        return flash_varlen_segments(*args)

    monkeypatch.setattr(context_parallel, "flash_varlen_segments", flash_spy)
    qc, kc, vc = (t.clone().requires_grad_() for t in (q, k, v))
    mine = [context_parallel_positions(bounds, cp_size, r).cuda() for r in range(cp_size)]
    outs = [attend_gathered(qc[m], kc, vc, cu, cp_size, r, scale=None, dropout_p=0.0)
            for r, m in enumerate(mine)]
    out = torch.cat(outs)[torch.argsort(torch.cat(mine))]  # back to row order
    out.backward(grad)

    # one flash call per rank, each over two segments per sequence (the check's own calls, if
    # it ran here, have other segment counts)
    segment_offsets = 2 * len(LENGTHS) + 1
    assert calls.count(segment_offsets) == cp_size, calls
    assert context_parallel._FLASH_CHECKS[(q.device, q.dtype)] is True
    assert rel_error(out.detach(), expected.detach()) < 1e-2
    for name, ours, theirs in (("dq", qc.grad, q1.grad), ("dk", kc.grad, k1.grad),
                               ("dv", vc.grad, v1.grad)):
        assert rel_error(ours, theirs) < 2e-2, name
