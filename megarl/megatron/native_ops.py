"""Fused tensor operations behind megarl's native spec: fewer kernels, no host synchronisation.

Each function computes exactly what megatron's unfused torch path computes (the same operations
in the same order, so CPU results are bitwise unchanged); the gain is in kernel count and in
hand-written backward passes that skip autograd's slice / cat / zero-fill bookkeeping:

- :func:`rotary` applies RoPE (non-interleaved halves) in 4 kernels forward and 4 backward,
  from cos / sin tables built once per micro-batch by :class:`RotaryTables` (for packed THD
  batches the positions come from ``cu_seqlens`` on the device, never through ``.tolist()``);
- :func:`swiglu` is ``silu(a) * b`` on the two halves of the fc1 output, optionally scaled by
  per-row router probabilities, with its gradient written into one buffer;
- :func:`rms_norm` uses the fused ``F.rms_norm`` kernel on CUDA (one kernel forward and
  backward instead of ~20) and HF's fp32 formula elsewhere;
- :func:`flash_varlen_attention` runs causal attention over all sequences of a packed batch in
  one FlashAttention call (CUDA, bf16/fp16); :func:`flash_varlen_segments` is the same call with
  key segments longer than their query segments (context parallelism).
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn.functional as F

from megarl.kernels import triton_kernels


def rms_norm(x: torch.Tensor, gamma: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension: fused kernel on CUDA, HF's fp32 formula on the CPU
    (normalise in fp32, cast, then scale in the input dtype)."""
    if x.is_cuda and gamma.dtype == x.dtype:
        return F.rms_norm(x, (x.shape[-1],), gamma, eps)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return gamma * h.to(x.dtype)


def _rotate(t: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """``t * cos + flip_halves(t) * sin_signed`` on ``[..., d]`` viewed as ``[..., 2, d/2]``."""
    shape = t.shape
    halves = t.reshape(*shape[:-1], 2, shape[-1] // 2)
    out = halves * cos + halves.flip(-2) * sin_signed
    return out.reshape(shape)


class _Rotary(torch.autograd.Function):
    """RoPE as an orthogonal map: the gradient is the rotation by the opposite angle."""

    @staticmethod
    def forward(ctx, t, cos, sin_signed):
        """Rotate ``t`` by the tables."""
        ctx.save_for_backward(cos, sin_signed)
        return _rotate(t, cos, sin_signed)

    @staticmethod
    def backward(ctx, grad):
        """Rotate the gradient back (opposite angle)."""
        cos, sin_signed = ctx.saved_tensors
        shape = grad.shape
        halves = grad.reshape(*shape[:-1], 2, shape[-1] // 2)
        out = halves * cos + (halves * sin_signed).flip(-2)
        return out.reshape(shape), None, None


def _fwd_bwd(fn, inputs: list[torch.Tensor | None]) -> torch.Tensor:
    """Output and input gradients of ``fn(*inputs)`` (None inputs passed through) for a fixed
    random output gradient, flattened: what a kernel check compares."""
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in inputs]
    with torch.enable_grad():
        out = fn(*leaves)
        gen = torch.Generator(device=out.device).manual_seed(0)
        grad = torch.randn(out.shape, generator=gen, device=out.device, dtype=out.dtype)
        grads = torch.autograd.grad(out, [t for t in leaves if t is not None], grad)
    return torch.cat([out.reshape(-1).float()] + [g.reshape(-1).float() for g in grads]).detach()


def rotary(q: torch.Tensor, k: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate queries and keys ``[tokens, ..., heads, d]`` (the whole head dim rotated, halves
    layout) by ``tables`` from :meth:`RotaryTables.get`; the same values as megatron's unfused
    ``apply_rotary_pos_emb`` (on CUDA one Triton kernel for both, within one bf16 rounding)."""
    cos, sin_signed = tables
    tri = triton_kernels() if q.is_cuda else None
    if tri is not None and tri.rope_supported(q) and tri.checked(
            "rope", lambda: _fwd_bwd(lambda a, b: _cat(tri.RotaryPair.apply(a, b, cos, sin_signed)),
                                     [q, k]),
            lambda: _fwd_bwd(lambda a, b: _cat((_Rotary.apply(a, cos, sin_signed),
                                                _Rotary.apply(b, cos, sin_signed))), [q, k])):
        return tri.RotaryPair.apply(q, k, cos, sin_signed)
    return _Rotary.apply(q, cos, sin_signed), _Rotary.apply(k, cos, sin_signed)


def _cat(pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return torch.cat([pair[0].reshape(-1), pair[1].reshape(-1)])


class RotaryTables:
    """cos / signed-sin tables per (rotary frequencies, packing), computed once and reused by
    every layer of a micro-batch (megatron hands all layers the same frequency tensor).

    Tables are ``[rows, 1, 1, 2, d/2]`` in the activation dtype; rows are sequence positions
    (sbhd) or packed tokens (thd). A few recent entries are kept; each holds its key tensors, so
    their ids cannot be reused while cached.
    """

    def __init__(self, capacity: int = 8) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[tuple, tuple] = OrderedDict()

    def get(self, freqs: torch.Tensor, dtype: torch.dtype, rows: int,
            cu_seqlens: torch.Tensor | None = None, positions: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tables for ``rows`` positions (sbhd), for the packed tokens of ``cu_seqlens``, or
        for the given ``[rows]`` in-sequence ``positions`` (a context-parallel rank's chunks)."""
        layout = cu_seqlens if positions is None else positions
        key = (id(freqs), id(layout), rows, dtype)
        hit = self._entries.get(key)
        if hit is not None:
            self._entries.move_to_end(key)
            return hit[0]
        if positions is not None:
            angles = freqs[positions]
        elif cu_seqlens is None:
            angles = freqs[:rows]
        else:
            angles = freqs[packed_positions(cu_seqlens, rows)]
        tables = _tables(angles, dtype)
        self._entries[key] = (tables, freqs, layout)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
        return tables

    def clear(self) -> None:
        """Drop every cached table."""
        self._entries.clear()


def _tables(angles: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``[rows, 1, 1, d]`` angles (``cat(f, f)``) -> (cos, signed sin), ``[rows, 1, 1, 2, d/2]``."""
    half = angles.shape[-1] // 2
    angles = angles.reshape(angles.shape[0], 1, 1, 2, half)
    cos = torch.cos(angles).to(dtype)
    sin = torch.sin(angles).to(dtype)
    # the first half rotates with -sin (negation is exact; no host-made sign tensor, which a
    # CUDA graph capture could not copy to the device)
    return cos, torch.cat([-sin[..., :1, :], sin[..., 1:, :]], dim=-2)


def packed_positions(cu_seqlens: torch.Tensor, rows: int) -> torch.Tensor:
    """Position of each of ``rows`` packed tokens inside its sequence (0 at each ``cu_seqlens``
    offset), computed on the device."""
    index = torch.arange(rows, device=cu_seqlens.device)
    cu = cu_seqlens.to(index.dtype)
    seq = torch.searchsorted(cu[1:], index, right=True).clamp(max=cu.numel() - 2)
    return index - cu[seq]


class _SwiGLU(torch.autograd.Function):
    """``silu(a) * b`` (then ``* probs`` in fp32, cast back) with a one-buffer backward."""

    @staticmethod
    def forward(ctx, x, probs):
        """``silu(a) * b`` (scaled by ``probs`` when given)."""
        a, b = x.chunk(2, dim=-1)
        act = F.silu(a)
        out = act * b
        ctx.save_for_backward(x, probs)
        if probs is None:
            return out
        return (out * probs).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        """Gradients of ``x`` (one buffer) and of ``probs``."""
        x, probs = ctx.saved_tensors
        a, b = x.chunk(2, dim=-1)
        act = F.silu(a)
        grad_probs = None
        if probs is not None:
            if ctx.needs_input_grad[1]:
                grad_probs = (grad.to(probs.dtype) * (act * b)).sum(-1, keepdim=True)
            grad = (grad * probs).to(x.dtype)
        grad_x = torch.empty_like(x)
        half = a.shape[-1]
        torch.ops.aten.silu_backward.grad_input(grad * b, a, grad_input=grad_x[..., :half])
        torch.mul(grad, act, out=grad_x[..., half:])
        return grad_x, grad_probs


def swiglu(x: torch.Tensor, probs: torch.Tensor | None = None) -> torch.Tensor:
    """SwiGLU on ``x = cat(gate, up)``: ``silu(gate) * up`` (``[..., 2n] -> [..., n]``); with
    ``probs [..., 1]`` the result is scaled by them in their dtype and cast back to ``x``'s
    (megatron's weighted expert activation). On CUDA one Triton kernel each way."""
    tri = triton_kernels() if x.is_cuda and x.is_contiguous() else None
    if tri is not None and tri.checked(
            "swiglu" if probs is None else "weighted_swiglu",
            lambda: _fwd_bwd(tri.SwiGLU.apply, [x, probs]),
            lambda: _fwd_bwd(_SwiGLU.apply, [x, probs])):
        return tri.SwiGLU.apply(x, probs)
    return _SwiGLU.apply(x, probs)


class _FlashVarlen(torch.autograd.Function):
    """Causal FlashAttention of packed query segments to their key segments through the ATen
    flash ops. A key segment may be longer than its query segment: FlashAttention-2 then aligns
    the causal mask to the bottom right (query ``i`` of ``n`` sees keys ``0 .. m - n + i`` of
    ``m``), as ``torch.nn.attention.bias.causal_lower_right`` relies on."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, scale):
        """Causal attention over the packed segments."""
        out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, rng, unused)
        ctx.max_q, ctx.max_k, ctx.scale = max_q, max_k, scale
        return out

    @staticmethod
    def backward(ctx, grad):
        """FlashAttention's backward for q, k, v."""
        q, k, v, out, lse, cu_q, cu_k, rng, unused = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad.contiguous(), q, k, v, out, lse, cu_q, cu_k, ctx.max_q, ctx.max_k, 0.0, True,
            rng, unused, scale=ctx.scale)
        return dq, dk, dv, None, None, None, None, None


def flash_varlen_supported(q: torch.Tensor, dropout_p: float) -> bool:
    """Whether :func:`flash_varlen_attention` runs for these queries."""
    head_dim = q.shape[-1]
    return (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and dropout_p == 0.0
            and head_dim % 8 == 0 and head_dim <= 256)


def flash_varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           cu_seqlens: torch.Tensor, max_len: int,
                           scale: float | None) -> torch.Tensor:
    """Causal attention inside each packed sequence: ``[T, heads, d]`` (kv may have fewer
    heads) with int32 ``cu_seqlens`` ending at T; returns ``[T, heads, d]``."""
    cu_seqlens = cu_seqlens.to(torch.int32)
    return flash_varlen_segments(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, scale)


def flash_varlen_segments(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                          max_seqlen_q: int, max_seqlen_k: int,
                          scale: float | None) -> torch.Tensor:
    """Causal attention of each packed query segment ``[Tq, heads, d]`` to its key segment
    ``[Tk, kv_heads, d]`` (int32 offsets ``cu_seqlens_q`` / ``cu_seqlens_k``, one entry more
    than segments, ending at Tq / Tk), in one FlashAttention call. A key segment may be longer
    than its query segment: the queries are then its last tokens (bottom-right causal mask).
    Returns ``[Tq, heads, d]``."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q, k, v = (t.contiguous() for t in (q, k, v))
    return _FlashVarlen.apply(q, k, v, cu_seqlens_q.to(torch.int32),
                              cu_seqlens_k.to(torch.int32), int(max_seqlen_q),
                              int(max_seqlen_k), float(scale))
