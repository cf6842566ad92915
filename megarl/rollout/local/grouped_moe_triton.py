"""The embedded engine's bf16 expert layer as grouped GEMMs in Triton (issue 30, decode).

The same plan as the block-FP8 experts of :mod:`megarl.rollout.local.fp8_moe_triton`, without
the scales: every (token, chosen expert) pair of a batch is sorted by expert into blocks of
``BLOCK_M`` rows (each block one expert's, padded; :func:`~.fp8_moe_triton.sort_by_expert`), and
one launch computes every block's rows against its expert's weight, accumulating in fp32.
gate_up, SwiGLU, then down, weighted by the router and summed over the chosen experts.

At decode a batch of a few hundred rows spreads over every expert with a few rows each. Running
every expert on every row (the native decoder's path up to ``ALL_EXPERTS_ROWS``) then costs
``rows x experts`` rows of GEMM, and transformers' ``grouped_mm`` path gathers, sorts and
scatters in a dozen kernels around cuBLAS's grouped GEMM; here each expert's weights are read
about once per block of its rows, in two launches and the sort. No step reads a tensor on the
host, so a CUDA graph captures it.

With ``TRITON_INTERPRET=1`` the kernel also takes CPU tensors (the tests' reference check)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megarl.rollout.local.fp8_moe_triton import sort_by_expert

BLOCK_M = 16
"""Rows (token, expert pairs) per block: tl.dot's smallest M; decode sends few rows per expert."""
LAUNCH = {"BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 4}
"""Output tile width, reduction tile and Triton launch settings
(``benchmarks/h200/fp8_gemm_micro.py --moe`` times the alternatives on a GPU)."""


@triton.jit(do_not_specialize=["pairs"])
def _grouped_gemm(a_ptr, b_ptr, c_ptr, row_ids_ptr, block_expert_ptr, total_ptr, pairs, n, k,
                  stride_am, stride_be, stride_bn, stride_cm, A_ROW_DIV: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``c[r] = a[r // A_ROW_DIV] @ b[e].T`` for every pair ``r`` of a block of expert ``e``;
    rows of a block past ``pairs`` are padding."""
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
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(tl.cdiv(k, BLOCK_K)):
        ks = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        ks_ok = ks < k
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + ks[None, :],
                    mask=valid[:, None] & ks_ok[None, :], other=0.0)
        b = tl.load(b_ptr + expert * stride_be + cols[None, :].to(tl.int64) * stride_bn
                    + ks[:, None], mask=cols_ok[None, :] & ks_ok[:, None], other=0.0)
        acc = tl.dot(a, b, acc, out_dtype=tl.float32)
    tl.store(c_ptr + rows[:, None].to(tl.int64) * stride_cm + cols[None, :],
             acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & cols_ok[None, :])


def grouped_gemm(acts: torch.Tensor, weight: torch.Tensor, out: torch.Tensor,
                 sorted_rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor], row_div: int,
                 launch: dict | None = None) -> None:
    """``out[r] = acts[r // row_div] @ weight[expert of r].T`` (``weight [E, N, K]``, rows of
    ``acts`` and ``weight`` contiguous along K)."""
    launch = LAUNCH if launch is None else launch
    if acts.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("grouped_gemm: activations and weights must be contiguous along K")
    row_ids, block_expert, total = sorted_rows
    n, k = weight.shape[1:]
    grid = (block_expert.numel(), triton.cdiv(n, launch["BLOCK_N"]))
    _grouped_gemm[grid](
        acts, weight, out, row_ids, block_expert, total, out.shape[0], n, k,
        acts.stride(0), weight.stride(0), weight.stride(1), out.stride(0),
        A_ROW_DIV=row_div, BLOCK_M=BLOCK_M, BLOCK_N=launch["BLOCK_N"],
        BLOCK_K=launch["BLOCK_K"], num_warps=launch["num_warps"],
        num_stages=launch["num_stages"])


def grouped_moe(hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                act_fn, launch: dict | None = None) -> torch.Tensor:
    """transformers' fused expert block on ``hidden_states [T, H]`` with ``gate_up [E, 2I, H]``
    and ``down [E, H, I]`` in the hidden states' dtype: for each token, the sum over its chosen
    experts of weight x down(act(gate) * up). Each GEMM's output rounds to the dtype as the
    reference's does; the weighted sum over the experts rounds once."""
    tokens, hidden = hidden_states.shape
    top_k = top_k_index.shape[1]
    experts, width = gate_up.shape[0], gate_up.shape[1] // 2
    pairs = tokens * top_k
    sorted_rows = sort_by_expert(top_k_index, experts, BLOCK_M)
    projected = hidden_states.new_empty(pairs, 2 * width)
    grouped_gemm(hidden_states, gate_up, projected, sorted_rows, top_k, launch)
    acts = act_fn(projected[:, :width]) * projected[:, width:]
    out = hidden_states.new_empty(pairs, hidden)
    grouped_gemm(acts, down, out, sorted_rows, 1, launch)
    weighted = out.float() * top_k_weights.reshape(pairs, 1).float()
    return weighted.view(tokens, top_k, hidden).sum(dim=1).to(hidden_states.dtype)
