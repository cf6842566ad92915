"""The FP8 engine's activation quantization as one Triton launch (issue 31).

:func:`megarl.weights.fp8.quantize_activations` in torch ops is nine kernels (cast, pad, abs,
amax, two divisions, where, clamp, cast); before cuBLAS's block-scaled GEMM the scales also need
a transposed copy and M a padding to a multiple of 4. In a decode step that costs more than the
GEMM: on the H100, 19 us of a 31 us FP8 projection at 64 rows, where the bf16 one takes 6 us
(``benchmarks/h200/fp8_gemm_micro.py``). :func:`quantize_activations_triton` does it in one
launch, as SGLang's ``per_token_group_quant_fp8`` does: one program per (row, group of 128)
writes the group's e4m3 values and its fp32 scale ``amax / 448`` (1 for an all-zero group),
with the output rows padded and the scales in whichever layout the GEMM reads. It is bit for bit
what the torch ops give on any device: the scale and the values are IEEE quotients
(``div_rn``; Triton's ``/`` is an approximate division), as :mod:`megarl.weights.fp8` computes
them on the CPU and on CUDA alike.

With ``TRITON_INTERPRET=1`` the kernel also takes CPU tensors; Triton 3.8's interpreter rounds
some values to e4m3 wrongly where the rounding carries into the exponent (31.6 to 16, not 32),
so the CPU tests check it on values e4m3 holds exactly, and the rounding on the GPU (the
engine's probe at load, tests/gpu)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megarl.weights.fp8 import FP8_DTYPE, FP8_MAX, GROUP


# ``rows`` changes with the batch: one compiled kernel for every batch size
@triton.jit(do_not_specialize=["rows"])
def _quantize_groups(x_ptr, q_ptr, s_ptr, rows, k, stride_xm, stride_qm, stride_sm, stride_sg,
                     GROUP: tl.constexpr, FP8_MAX: tl.constexpr):
    """Row ``program_id(0)``'s group ``program_id(1)``: e4m3 values and fp32 scale; rows past
    ``rows`` (the padding) get zeros and scale 1."""
    row = tl.program_id(0)
    group = tl.program_id(1)
    cols = group * GROUP + tl.arange(0, GROUP)
    in_k = cols < k
    x = tl.load(x_ptr + row.to(tl.int64) * stride_xm + cols, mask=in_k & (row < rows),
                other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=0)
    scale = tl.where(amax > 0, tl.math.div_rn(amax, tl.full(amax.shape, FP8_MAX, tl.float32)),
                     1.0)
    q = tl.clamp(tl.math.div_rn(x, scale), -FP8_MAX, FP8_MAX)
    tl.store(q_ptr + row.to(tl.int64) * stride_qm + cols, q.to(q_ptr.dtype.element_ty),
             mask=in_k)
    tl.store(s_ptr + row.to(tl.int64) * stride_sm + group * stride_sg, scale)


def quantize_activations_triton(x: torch.Tensor, row_multiple: int = 1,
                                scales_outer_major: bool = False
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~megarl.weights.fp8.quantize_activations` of ``x [M, K]`` in one launch: (e4m3
    ``[M', K]``, fp32 scales ``[M', ceil(K/128)]``) with ``M'`` = M rounded up to
    ``row_multiple`` (padding rows zero, scale 1). ``scales_outer_major``: the scales' storage
    is ``[ceil(K/128), M']`` (strides ``(1, M')`` of the returned view), what cuBLAS's 1x128
    block recipe reads."""
    rows, k = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    padded = -(-rows // row_multiple) * row_multiple
    groups = -(-k // GROUP)
    quantized = torch.empty(padded, k, dtype=FP8_DTYPE, device=x.device)
    if scales_outer_major:
        scales = torch.empty(groups, padded, dtype=torch.float32, device=x.device).t()
    else:
        scales = torch.empty(padded, groups, dtype=torch.float32, device=x.device)
    if padded and groups:
        _quantize_groups[(padded, groups)](
            x, quantized, scales, rows, k, x.stride(0), quantized.stride(0), scales.stride(0),
            scales.stride(1), GROUP=GROUP, FP8_MAX=FP8_MAX)
    return quantized, scales


LINEAR_LAUNCH = {"BLOCK_M": 16, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
"""Tiles and launch settings of :func:`fp8_linear_triton` (``benchmarks/h200/fp8_gemm_micro.py``
times the alternatives)."""


@triton.jit(do_not_specialize=["m"])
def _w8a8_linear(a_ptr, b_ptr, b_scale_ptr, c_ptr, m, n, k, stride_am, stride_bn, stride_bsn,
                 stride_cm, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr,
                 FP8_MAX: tl.constexpr):
    """``c = a @ b.T`` for a block-FP8 ``b [N, K]``, w8a8: each 1x128 group of ``a``'s rows is
    quantized here (as :func:`_quantize_groups` does) before its FP8 product."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_ok = rows < m
    cols_ok = cols < n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(tl.cdiv(k, GROUP)):
        ks = kb * GROUP + tl.arange(0, GROUP)
        ks_ok = ks < k
        a = tl.load(a_ptr + rows[:, None].to(tl.int64) * stride_am + ks[None, :],
                    mask=rows_ok[:, None] & ks_ok[None, :], other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(a), axis=1)
        a_scale = tl.where(amax > 0, tl.math.div_rn(amax, tl.full(amax.shape, FP8_MAX,
                                                                   tl.float32)), 1.0)
        quantized = tl.clamp(tl.math.div_rn(a, a_scale[:, None]), -FP8_MAX, FP8_MAX)
        b = tl.load(b_ptr + cols[None, :].to(tl.int64) * stride_bn + ks[:, None],
                    mask=cols_ok[None, :] & ks_ok[:, None], other=0.0)
        b_scale = tl.load(b_scale_ptr + (cols // GROUP) * stride_bsn + kb, mask=cols_ok,
                          other=0.0)
        acc += tl.dot(quantized.to(b.dtype), b, out_dtype=tl.float32) * a_scale[:, None] \
            * b_scale[None, :]
    tl.store(c_ptr + rows[:, None].to(tl.int64) * stride_cm + cols[None, :],
             acc.to(c_ptr.dtype.element_ty), mask=rows_ok[:, None] & cols_ok[None, :])


def fp8_linear_triton(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor
                      ) -> torch.Tensor:
    """``x [M, K] @ weight.T`` for a block-FP8 ``weight [N, K]`` with ``scale_inv [N/128,
    K/128]``, w8a8 in one launch: the activations are quantized inside the GEMM, per 1x128
    group as :func:`quantize_activations_triton` does, so no quantized copy of them is written.
    Not used by the engine yet: it is timed against cuBLAS's block-scaled GEMM first
    (``benchmarks/h200/fp8_gemm_micro.py``)."""
    m, k = x.shape
    n = weight.shape[0]
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    launch = LINEAR_LAUNCH
    grid = (triton.cdiv(m, launch["BLOCK_M"]), triton.cdiv(n, launch["BLOCK_N"]))
    _w8a8_linear[grid](x, weight, scale_inv, out, m, n, k, x.stride(0), weight.stride(0),
                       scale_inv.stride(0), out.stride(0), BLOCK_M=launch["BLOCK_M"],
                       BLOCK_N=launch["BLOCK_N"], GROUP=GROUP, FP8_MAX=FP8_MAX,
                       num_warps=launch["num_warps"],
                       num_stages=launch["num_stages"])
    return out
