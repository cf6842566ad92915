"""Triton kernels for :mod:`megarl.megatron.native_ops` and the embedded engine on CUDA: SwiGLU
and RoPE, forward and backward, each one pass over its tensors.

They compute in fp32 and round where torch's kernels round (the SwiGLU activation, its product,
the probability scaling), so results match the torch path to within one bf16 rounding. Imported
only on CUDA machines with Triton; :func:`checked` compares each kernel once with the torch path on
real inputs and turns it off if they disagree.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import triton
import triton.language as tl

logger = logging.getLogger(__name__)
_CHECKED: dict[str, bool] = {}


def checked(name: str, fast: Callable[[], torch.Tensor], reference: Callable[[], torch.Tensor],
            tolerance: float = 1e-2) -> bool:
    """Whether kernel ``name`` may be used: on its first call, run it and the torch reference on
    the same inputs and compare (relative L2 error); the verdict is kept for the process."""
    verdict = _CHECKED.get(name)
    if verdict is None:
        try:
            ours, ref = fast().double(), reference().double()
            error = float((ours - ref).norm() / ref.norm().clamp(min=1e-12))
            verdict = bool(error < tolerance)
        except (RuntimeError, ValueError, triton.CompilationError) as err:
            error, verdict = float("nan"), False
            logger.warning("Triton kernel %s failed (%s)", name, err)
        _CHECKED[name] = verdict
        logger.info("Triton %s: relative error %.2e vs torch (%s)", name, error,
                    "using it" if verdict else "using torch")
    return verdict


def verdicts() -> dict[str, bool]:
    """The kernels checked so far in this process, and whether each is in use."""
    return dict(_CHECKED)


@triton.jit
def _swiglu_fwd(x_ptr, p_ptr, out_ptr, cols: tl.constexpr, HAS_P: tl.constexpr,
                BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    dtype = out_ptr.dtype.element_ty
    x_row = x_ptr + row * 2 * cols
    out_row = out_ptr + row * cols
    if HAS_P:
        p = tl.load(p_ptr + row).to(tl.float32)
    for start in range(0, cols, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < cols
        a = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(x_row + cols + offs, mask=mask, other=0.0).to(tl.float32)
        act = (a * tl.sigmoid(a)).to(dtype).to(tl.float32)
        out = (act * b).to(dtype)
        if HAS_P:
            out = (out.to(tl.float32) * p).to(dtype)
        tl.store(out_row + offs, out, mask=mask)


@triton.jit
def _swiglu_bwd(g_ptr, x_ptr, p_ptr, dx_ptr, dp_ptr, cols: tl.constexpr, HAS_P: tl.constexpr,
                NEED_DP: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    dtype = dx_ptr.dtype.element_ty
    x_row = x_ptr + row * 2 * cols
    dx_row = dx_ptr + row * 2 * cols
    g_row = g_ptr + row * cols
    if HAS_P:
        p = tl.load(p_ptr + row).to(tl.float32)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, cols, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < cols
        a = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(x_row + cols + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_row + offs, mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(a)
        act = (a * sig).to(dtype).to(tl.float32)
        gm = g
        if HAS_P:
            if NEED_DP:
                acc += g * (act * b).to(dtype).to(tl.float32)
            gm = (g * p).to(dtype).to(tl.float32)
        d_act = (gm * b).to(dtype).to(tl.float32)
        d_a = d_act * sig * (1.0 + a * (1.0 - sig))
        tl.store(dx_row + offs, d_a.to(dtype), mask=mask)
        tl.store(dx_row + cols + offs, (gm * act).to(dtype), mask=mask)
    if NEED_DP:
        tl.store(dp_ptr + row, tl.sum(acc, axis=0))


def _block(cols: int) -> int:
    return min(2048, triton.next_power_of_2(cols))


class SwiGLU(torch.autograd.Function):
    """``silu(a) * b`` (optionally ``* probs`` per row) on rows of ``x = cat(a, b)``."""

    @staticmethod
    def forward(ctx, x, probs):
        """One kernel over the rows."""
        cols = x.shape[-1] // 2
        x2 = x.reshape(-1, 2 * cols)
        out = torch.empty(x2.shape[0], cols, dtype=x.dtype, device=x.device)
        p = probs.reshape(-1) if probs is not None else x2
        if x2.shape[0]:
            _swiglu_fwd[(x2.shape[0],)](x2, p, out, cols, HAS_P=probs is not None,
                                        BLOCK=_block(cols))
        ctx.save_for_backward(x2, probs)
        ctx.shape = (*x.shape[:-1], cols)
        return out.view(ctx.shape)

    @staticmethod
    def backward(ctx, grad):
        """One kernel: gradients of ``x`` and, if needed, of ``probs``."""
        x2, probs = ctx.saved_tensors
        cols = x2.shape[-1] // 2
        g = grad.reshape(-1, cols).contiguous()
        dx = torch.empty_like(x2)
        need_dp = probs is not None and ctx.needs_input_grad[1]
        dp = torch.empty(x2.shape[0], dtype=torch.float32, device=x2.device) if need_dp else dx
        p = probs.reshape(-1) if probs is not None else x2
        if x2.shape[0]:
            _swiglu_bwd[(x2.shape[0],)](g, x2, p, dx, dp, cols, HAS_P=probs is not None,
                                        NEED_DP=need_dp, BLOCK=_block(cols))
        grad_probs = dp.view(probs.shape).to(probs.dtype) if need_dp else None
        return dx.view(*ctx.shape[:-1], 2 * cols), grad_probs


@triton.jit
def _rotate_block(x_ptr, out_ptr, token, vectors, c, s, HALF: tl.constexpr,
                  BLOCK_V: tl.constexpr):
    d = tl.arange(0, HALF)
    v = tl.arange(0, BLOCK_V)
    mask = (v < vectors)[:, None]
    base = (token * vectors + v)[:, None] * (2 * HALF) + d[None, :]
    x1 = tl.load(x_ptr + base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + base + HALF, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + base, (x1 * c[None, :] - x2 * s[None, :]).to(dtype), mask=mask)
    tl.store(out_ptr + base + HALF, (x2 * c[None, :] + x1 * s[None, :]).to(dtype), mask=mask)


@triton.jit
def _rope_pair(q_ptr, k_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr, q_vectors, k_vectors,
               table_stride, sin_offset, SIGN: tl.constexpr, HALF: tl.constexpr,
               BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, HALF)
    c = tl.load(cos_ptr + token * table_stride + d).to(tl.float32)
    s = tl.load(sin_ptr + token * table_stride + sin_offset + d).to(tl.float32) * SIGN
    _rotate_block(q_ptr, q_out_ptr, token, q_vectors, c, s, HALF, BLOCK_Q)
    _rotate_block(k_ptr, k_out_ptr, token, k_vectors, c, s, HALF, BLOCK_K)


def rope_supported(t: torch.Tensor) -> bool:
    """Whether :func:`rope_pair` handles ``t [tokens, ..., d]`` (power-of-two half head dim)."""
    half = t.shape[-1] // 2
    return t.is_cuda and half >= 8 and (half & (half - 1)) == 0


def rope_pair(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              sin_offset: int, sign: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate every head vector of ``q`` and ``k`` (``[tokens, ..., d]``, same tokens) by its
    token's angles in one launch: ``cos`` / ``sin`` hold one row per token (``sin`` read from
    ``sin_offset`` within the row), halves layout."""
    q, k = q.contiguous(), k.contiguous()
    tokens, half = q.shape[0], q.shape[-1] // 2
    q_vectors, k_vectors = q.numel() // (tokens * 2 * half), k.numel() // (tokens * 2 * half)
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    if tokens:
        _rope_pair[(tokens,)](q, k, cos, sin, q_out, k_out, q_vectors, k_vectors, cos.stride(0),
                              sin_offset, SIGN=sign, HALF=half,
                              BLOCK_Q=triton.next_power_of_2(q_vectors),
                              BLOCK_K=triton.next_power_of_2(k_vectors))
    return q_out, k_out


class RotaryPair(torch.autograd.Function):
    """RoPE of queries and keys from :class:`~megarl.megatron.native_ops.RotaryTables` tables;
    the backward is the rotation by the opposite angle."""

    @staticmethod
    def forward(ctx, q, k, cos, sin_signed):
        """Rotate queries and keys in one launch."""
        ctx.save_for_backward(cos, sin_signed)
        return rope_pair(q, k, cos, sin_signed, q.shape[-1] // 2, 1.0)

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        """Rotate both gradients back (opposite angle)."""
        cos, sin_signed = ctx.saved_tensors
        half = grad_q.shape[-1] // 2
        return (*rope_pair(grad_q, grad_k, cos, sin_signed, half, -1.0), None, None)
