"""The block-FP8 expert layer of the embedded engine as grouped GEMMs in Triton (issue 31).

:class:`~megarl.rollout.local.fp8_layers.Fp8Experts` on CUDA: every (token, chosen expert) pair
of a batch is sorted by expert into blocks of ``BLOCK_M`` rows (each block one expert's, padded),
and one kernel launch computes every block's rows against its expert's FP8 weight: w8a8 as in
SGLang's block-FP8 fused MoE (activations quantized per 1x128 group, weights in 128x128 blocks,
``sum_k a_q b_q`` scaled by both blocks' scales, accumulated in fp32). gate_up, SwiGLU, then
down scaled by the router weights, then the sum over the chosen experts.

The sort is torch ops with shapes fixed by the batch's shape, and no step reads a tensor on the
host, so a decode step with FP8 experts captures into a CUDA graph, where the reference path
(a Python loop over the experts a batch chose) cannot. Each expert's weights are read once per
block of its rows: at decode, about once per step, in FP8, half the bytes of bf16.

With ``TRITON_INTERPRET=1`` the kernel also takes CPU tensors (the tests' reference check)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megarl.rollout.local.fp8_quant_triton import quantize_activations_triton
from megarl.weights.fp8 import GROUP, quantize_activations

BLOCK_M = 16
"""Rows (token, expert pairs) per block: tl.dot's smallest M; decode sends few rows per expert."""
LAUNCH = {"BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
"""The grouped GEMM's output tile width and Triton launch settings
(``benchmarks/h200/fp8_gemm_micro.py --moe`` times the alternatives on a GPU)."""


# ``pairs`` changes with the batch: one compiled kernel for every batch size, none compiled
# while a CUDA graph captures a decode step (prefill, eager, compiles both A_ROW_DIV variants)
@triton.jit(do_not_specialize=["pairs"])
def _grouped_fp8_gemm(a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, c_ptr, row_ids_ptr,
                      block_expert_ptr, total_ptr, pairs, n, k, split, split_blocks,
                      stride_am, stride_as, stride_be, stride_bn, stride_bse, stride_bsn,
                      stride_cm, A_ROW_DIV: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``c[r] = a[r // A_ROW_DIV] @ b[e].T`` for every pair ``r`` of a block of expert ``e``,
    with the block scales of both operands; rows of a block past ``pairs`` are padding."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(total_ptr):
        return
    rows = tl.load(row_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = rows < pairs
    a_rows = (rows // A_ROW_DIV).to(tl.int64)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_ok = cols < n
    # gate_up is two weights on their own block grids: up's rows start a new block row
    scale_rows = tl.where(cols < split, cols // BLOCK_K, split_blocks + (cols - split) // BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(tl.cdiv(k, BLOCK_K)):
        ks = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        ks_ok = ks < k
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + ks[None, :],
                    mask=valid[:, None] & ks_ok[None, :], other=0.0)
        b = tl.load(b_ptr + expert * stride_be + cols[None, :].to(tl.int64) * stride_bn
                    + ks[:, None], mask=cols_ok[None, :] & ks_ok[:, None], other=0.0)
        a_scale = tl.load(a_scale_ptr + a_rows * stride_as + kb, mask=valid, other=0.0)
        b_scale = tl.load(b_scale_ptr + expert * stride_bse + scale_rows * stride_bsn + kb,
                          mask=cols_ok, other=0.0)
        acc += tl.dot(a, b, out_dtype=tl.float32) * a_scale[:, None] * b_scale[None, :]
    tl.store(c_ptr + rows[:, None].to(tl.int64) * stride_cm + cols[None, :],
             acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & cols_ok[None, :])


def sort_by_expert(top_k_index: torch.Tensor, num_experts: int, block: int = BLOCK_M
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pairs ``token * top_k + slot`` grouped by expert, each expert's run padded to a
    multiple of ``block`` with ``pairs`` (the padding mark): (row ids ``[L]``, the expert of
    each block ``[L / block]``, the padded length in use ``[1]``). ``L`` depends on the shapes
    only (``pairs + experts * (block - 1)`` rounded up), so nothing waits for the device."""
    flat = top_k_index.reshape(-1).long()
    pairs, device = flat.numel(), flat.device
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.long, device=device).scatter_add_(
        0, flat, torch.ones_like(flat))
    padded = (counts + block - 1) // block * block
    padded_end = torch.cumsum(padded, 0)
    start = torch.cumsum(counts, 0) - counts
    chosen = flat[order]
    position = padded_end[chosen] - padded[chosen] + torch.arange(pairs, device=device) - \
        start[chosen]
    length = -(-(pairs + num_experts * (block - 1)) // block) * block
    row_ids = torch.full((length,), pairs, dtype=torch.int32, device=device)
    row_ids.scatter_(0, position, order.to(torch.int32))
    firsts = torch.arange(0, length, block, device=device)
    block_expert = torch.searchsorted(padded_end, firsts, right=True).clamp_(max=num_experts - 1)
    return row_ids, block_expert.to(torch.int32), padded_end[-1:].to(torch.int32)


def _gemm(acts: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, out: torch.Tensor,
          sorted_rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor], row_div: int,
          split: int) -> None:
    """``out[r] = acts[r // row_div] @ weight[expert of r].T`` in block FP8 (``split``: the
    first output row of a second weight on its own block grid; the output width if none)."""
    # Triton's interpreter rounds some values to e4m3 wrongly (31.6 to 16): torch ops on CPU
    quantized, scales = (quantize_activations_triton(acts) if acts.is_cuda
                         else quantize_activations(acts))
    row_ids, block_expert, total = sorted_rows
    n, k = weight.shape[1:]
    block_n = LAUNCH["BLOCK_N"]
    grid = (block_expert.numel(), triton.cdiv(n, block_n))
    _grouped_fp8_gemm[grid](
        quantized, scales, weight, scale_inv, out, row_ids, block_expert, total, out.shape[0],
        n, k, split, -(-split // GROUP), quantized.stride(0), scales.stride(0), weight.stride(0),
        weight.stride(1), scale_inv.stride(0), scale_inv.stride(1), out.stride(0),
        A_ROW_DIV=row_div, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=GROUP,
        num_warps=LAUNCH["num_warps"], num_stages=LAUNCH["num_stages"])


def fp8_moe(hidden_states: torch.Tensor, top_k_index: torch.Tensor,
            top_k_weights: torch.Tensor, gate_up: torch.Tensor, gate_up_scale: torch.Tensor,
            down: torch.Tensor, down_scale: torch.Tensor, act_fn) -> torch.Tensor:
    """transformers' fused expert block on ``hidden_states [T, H]`` with block-FP8 weights
    ``gate_up [E, 2I, H]`` and ``down [E, H, I]`` (scales as :class:`Fp8Experts` keeps them):
    for each token, the sum over its chosen experts of weight x down(act(gate) * up), rounded
    where the reference path rounds (each GEMM's output in the hidden states' dtype) but for the
    sum over the experts, which rounds once where the reference adds expert by expert."""
    tokens, hidden = hidden_states.shape
    top_k = top_k_index.shape[1]
    experts, width = gate_up.shape[0], gate_up.shape[1] // 2
    pairs = tokens * top_k
    dtype = hidden_states.dtype
    sorted_rows = sort_by_expert(top_k_index, experts)
    projected = hidden_states.new_empty(pairs, 2 * width)
    _gemm(hidden_states, gate_up, gate_up_scale, projected, sorted_rows, top_k, width)
    gate, up = projected[:, :width], projected[:, width:]
    acts = act_fn(gate) * up
    out = hidden_states.new_empty(pairs, hidden)
    _gemm(acts, down, down_scale, out, sorted_rows, 1, hidden)
    weighted = (out * top_k_weights.reshape(pairs, 1)).to(dtype)
    return weighted.view(tokens, top_k, hidden).sum(dim=1)
