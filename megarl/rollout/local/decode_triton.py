"""Fused Triton kernels for :class:`~megarl.rollout.local.static_kv.NativeDecoder`'s decode step:
the MoE router's softmax + top-k, and the attention input's q/k RMSNorm + RoPE + K/V cache write.

Each is one launch where the torch path takes several small kernels. Both follow HF transformers'
numerics: the router is ``Qwen3MoeTopKRouter.forward`` after its linear, the attention input is
``Qwen3RMSNorm`` then ``apply_rotary_pos_emb``, rounding where those round. On CUDA only (with
``TRITON_INTERPRET=1`` they also take CPU tensors, for tests); the ``*_supported`` predicates say
whether a call's tensors fit, and the kernels raise ``ValueError`` on tensors that do not.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
MAX_EXPERTS = 512
_FLOATS = (torch.bfloat16, torch.float16, torch.float32)
_HALVES = (torch.bfloat16, torch.float16)

if not _INTERPRET:
    from triton.language.extra import libdevice


@triton.jit
def _exp(x, PRECISE: tl.constexpr):
    """``expf`` as CUDA's libm computes it (torch's softmax), or ``tl.exp`` (interpreter)."""
    if PRECISE:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def _route_topk_kernel(logits_ptr, dense_ptr, idx_ptr, row_stride, experts, TOP_K: tl.constexpr,
                       NORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr, PRECISE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    real = e < experts
    x = tl.load(logits_ptr + row * row_stride + e, mask=real, other=float("-inf"))
    dtype = x.dtype
    x = x.to(tl.float32)
    ex = _exp(x - tl.max(x, axis=0), PRECISE)
    probs = tl.math.div_rn(ex, tl.zeros_like(ex) + tl.sum(ex, axis=0))
    # probs >= 0, so their bits order like their values: one max per pick finds the largest
    # probability and, among equal ones, the lowest expert (the low bits hold BLOCK_E-1-e)
    bits = probs.to(tl.int32, bitcast=True).to(tl.int64)
    key = tl.where(real, bits * BLOCK_E + (BLOCK_E - 1 - e), -2)
    total = 0.0
    for j in range(TOP_K):
        best = tl.max(key, axis=0)
        pick = BLOCK_E - 1 - best % BLOCK_E
        total += (best // BLOCK_E).to(tl.int32).to(tl.float32, bitcast=True)
        tl.store(idx_ptr + row * TOP_K + j, pick)
        key = tl.where(e == pick, -1, key)
    weights = probs
    if NORMALIZE:
        weights = tl.math.div_rn(probs, tl.zeros_like(probs) + total)
    dense = tl.where(key == -1, weights, 0.0).to(dtype)
    tl.store(dense_ptr + row * experts + e, dense, mask=real)


def route_topk_supported(logits: torch.Tensor, top_k: int) -> bool:
    """Whether :func:`route_topk` handles these router logits ``[n, E]`` and ``top_k``."""
    return _route_unsupported_reason(logits, top_k) is None


def _route_unsupported_reason(logits: torch.Tensor, top_k: int) -> str | None:
    if not (logits.is_cuda or _INTERPRET):
        return "logits not on CUDA"
    if logits.dim() != 2 or logits.dtype not in _FLOATS:
        return f"logits must be [n, E] bf16/fp16/fp32, got {tuple(logits.shape)} {logits.dtype}"
    experts = logits.shape[1]
    if not 1 <= experts <= MAX_EXPERTS:
        return f"{experts} experts (supported: 1..{MAX_EXPERTS})"
    if not 1 <= top_k <= experts:
        return f"top_k {top_k} with {experts} experts"
    if logits.stride(1) != 1 and experts > 1:
        return "logits' last dim is not contiguous"
    return None


def route_topk(router_logits: torch.Tensor, top_k: int, normalize: bool
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """HF ``Qwen3MoeTopKRouter.forward`` after its linear, in one launch (one program a row, one
    to four warps): ``probs = softmax(router_logits.float())``, its ``top_k`` largest (equal
    ones: lower expert first), divided by their fp32 sum if ``normalize``, cast to
    ``router_logits.dtype``.

    Returns ``dense_weights [n, E]`` in ``router_logits.dtype`` (those weights at the chosen
    experts, 0 elsewhere) and ``indices [n, top_k]`` int64 by descending probability.
    """
    reason = _route_unsupported_reason(router_logits, top_k)
    if reason is not None:
        raise ValueError(f"route_topk: {reason}")
    rows, experts = router_logits.shape
    dense = torch.empty(rows, experts, dtype=router_logits.dtype, device=router_logits.device)
    indices = torch.empty(rows, top_k, dtype=torch.long, device=router_logits.device)
    if rows:
        block = triton.next_power_of_2(experts)
        _route_topk_kernel[(rows,)](router_logits, dense, indices, router_logits.stride(0),
                                    experts, TOP_K=top_k, NORMALIZE=bool(normalize), BLOCK_E=block,
                                    PRECISE=not _INTERPRET,
                                    num_warps=1 if block <= 128 else block // 128)
    return dense, indices


@triton.jit
def _round(x, dtype: tl.constexpr):
    """``x`` rounded to ``dtype`` and back to fp32 (where a torch op in ``dtype`` rounds)."""
    return x.to(dtype).to(tl.float32)


@triton.jit
def _norm_rope_block(src, mask, w_ptr, eps, c1, c2, s1, s2, HAS_W: tl.constexpr,
                     HALF: tl.constexpr, dtype: tl.constexpr):
    """``rope(rmsnorm(x) * w)`` of a ``[heads, HALF]`` block pair at ``src`` / ``src + HALF``,
    rounded to ``dtype`` where HF rounds; returns the two halves."""
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    if HAS_W:
        d = tl.arange(0, HALF)[None, :]
        var = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF)
        rstd = tl.rsqrt(var + eps)[:, None]
        w1 = tl.load(w_ptr + d).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + d).to(tl.float32)
        x1 = _round(_round(x1 * rstd, dtype) * w1, dtype)
        x2 = _round(_round(x2 * rstd, dtype) * w2, dtype)
    # q * cos + rotate_half(q) * sin, each product and the sum rounded like HF's bf16 ops
    o1 = (_round(x1 * c1, dtype) - _round(x2 * s1, dtype)).to(dtype)
    o2 = (_round(x2 * c2, dtype) + _round(x1 * s2, dtype)).to(dtype)
    return o1, o2


@triton.jit
def _qk_kernel(q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr,
               slots_ptr, positions_ptr, q_out_ptr, q_row, q_head, k_row, k_head, v_row, v_head,
               cos_row, sin_row, cache_len, eps, HQ: tl.constexpr, HKV: tl.constexpr,
               HAS_QW: tl.constexpr, HAS_KW: tl.constexpr, HALF: tl.constexpr,
               BLOCK_H: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    q_blocks: tl.constexpr = (HQ + BLOCK_H - 1) // BLOCK_H
    kv_blocks: tl.constexpr = (HKV + BLOCK_H - 1) // BLOCK_H
    hb = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, HALF)[None, :]
    dtype = q_out_ptr.dtype.element_ty
    slot = tl.load(slots_ptr + row)
    pos = tl.load(positions_ptr + row)
    cache_at = (slot * cache_len + pos) * (HKV * 2 * HALF)
    if part >= q_blocks + kv_blocks:  # V: copy into the cache
        h = (part - q_blocks - kv_blocks) * BLOCK_H + hb
        mask = h < HKV
        src = v_ptr + row * v_row + h * v_head + d
        dst = v_cache_ptr + cache_at + h * (2 * HALF) + d
        tl.store(dst, tl.load(src, mask=mask), mask=mask)
        tl.store(dst + HALF, tl.load(src + HALF, mask=mask), mask=mask)
    else:
        c1 = tl.load(cos_ptr + row * cos_row + d).to(tl.float32)
        c2 = tl.load(cos_ptr + row * cos_row + HALF + d).to(tl.float32)
        s1 = tl.load(sin_ptr + row * sin_row + d).to(tl.float32)
        s2 = tl.load(sin_ptr + row * sin_row + HALF + d).to(tl.float32)
        if part < q_blocks:  # Q: into q_out
            h = part * BLOCK_H + hb
            mask = h < HQ
            o1, o2 = _norm_rope_block(q_ptr + row * q_row + h * q_head + d, mask, qw_ptr, eps,
                                      c1, c2, s1, s2, HAS_QW, HALF, dtype)
            dst = q_out_ptr + row * (HQ * 2 * HALF) + h * (2 * HALF) + d
        else:  # K: into the cache
            h = (part - q_blocks) * BLOCK_H + hb
            mask = h < HKV
            o1, o2 = _norm_rope_block(k_ptr + row * k_row + h * k_head + d, mask, kw_ptr, eps,
                                      c1, c2, s1, s2, HAS_KW, HALF, dtype)
            dst = k_cache_ptr + cache_at + h * (2 * HALF) + d
        tl.store(dst, o1, mask=mask)
        tl.store(dst + HALF, o2, mask=mask)


def qk_norm_rope_cache_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                 q_norm_weight: torch.Tensor | None,
                                 k_norm_weight: torch.Tensor | None, cos: torch.Tensor,
                                 sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                 slots: torch.Tensor, positions: torch.Tensor) -> bool:
    """Whether :func:`qk_norm_rope_cache` handles these tensors (same arguments, less ``eps``)."""
    return _qk_unsupported_reason(q, k, v, q_norm_weight, k_norm_weight, cos, sin, k_cache,
                                  v_cache, slots, positions) is None


def _qk_unsupported_reason(q, k, v, q_norm_weight, k_norm_weight, cos, sin, k_cache, v_cache,
                           slots, positions) -> str | None:
    tensors = [q, k, v, cos, sin, k_cache, v_cache, slots, positions]
    weights = [w for w in (q_norm_weight, k_norm_weight) if w is not None]
    if not all(t.is_cuda or _INTERPRET for t in tensors + weights):
        return "tensors not on CUDA"
    if len({t.device for t in tensors + weights}) != 1:
        return "tensors on different devices"
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape:
        return f"q [n, Hq, D], k and v [n, Hkv, D], got {q.shape}, {k.shape}, {v.shape}"
    rows, _, dim = q.shape
    if k.shape[0] != rows or k.shape[2] != dim:
        return f"q {tuple(q.shape)} and k {tuple(k.shape)} differ in rows or head dim"
    if dim not in (16, 32, 64, 128, 256):
        return f"head dim {dim} (supported: powers of two 16..256)"
    if q.dtype not in _HALVES:
        return f"dtype {q.dtype} (supported: bf16, fp16)"
    same = tensors[:-2] + weights
    if any(t.dtype != q.dtype for t in same):
        return "q, k, v, cos, sin, the caches and the norm weights must share q's dtype"
    if any(t.stride(-1) != 1 for t in (q, k, v, cos, sin)):
        return "q, k, v, cos, sin need a contiguous last dim"
    if cos.shape != (rows, dim) or sin.shape != (rows, dim):
        return f"cos / sin must be [n, D] = [{rows}, {dim}]"
    if any(w.shape != (dim,) or not w.is_contiguous() for w in weights):
        return f"norm weights must be contiguous [{dim}]"
    if (k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.shape[2:] != k.shape[1:]
            or not k_cache.is_contiguous() or not v_cache.is_contiguous()):
        return f"caches must be contiguous [R, L, {k.shape[1]}, {dim}]"
    if any(t.dtype != torch.long or t.shape != (rows,) for t in (slots, positions)):
        return f"slots and positions must be int64 [{rows}]"
    return None


def qk_norm_rope_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       q_norm_weight: torch.Tensor | None, k_norm_weight: torch.Tensor | None,
                       eps: float, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor
                       ) -> torch.Tensor:
    """A decode step's attention inputs in one launch: returns ``q_out [n, Hq, D]`` (new,
    contiguous) ``= rope(rmsnorm(q) * q_norm_weight)`` and writes
    ``k_cache[slots[i], positions[i]] = rope(rmsnorm(k[i]) * k_norm_weight)``,
    ``v_cache[slots[i], positions[i]] = v[i]``; nothing else in the caches changes.

    ``q [n, Hq, D]``, ``k`` / ``v [n, Hkv, D]`` (bf16 / fp16; any row and head strides, e.g.
    views of one fused projection); norm weights ``[D]`` or None (no norm: Llama, Qwen2);
    ``cos`` / ``sin [n, D]``, HF's tables at each row's position (halves layout,
    ``rotate_half``); caches ``[R, L, Hkv, D]`` contiguous; ``slots`` / ``positions [n]`` int64,
    not bounds-checked. Numerics are HF's: the norm in fp32, rounded to the input dtype before
    and after the weight; the rotation rounds each product and the sum to the input dtype like
    ``apply_rotary_pos_emb`` does in bf16 (compiled without FMA contraction, which would fuse
    a product into the sum), so it matches HF up to the norm's fp32 sum order.
    Grid: one program per row and block of at most ``1024 // D`` heads (Q blocks, K, V).
    """
    reason = _qk_unsupported_reason(q, k, v, q_norm_weight, k_norm_weight, cos, sin, k_cache,
                                    v_cache, slots, positions)
    if reason is not None:
        raise ValueError(f"qk_norm_rope_cache: {reason}")
    rows, q_heads, dim = q.shape
    kv_heads = k.shape[1]
    q_out = torch.empty(rows, q_heads, dim, dtype=q.dtype, device=q.device)
    if rows:
        block_h = max(1, min(triton.next_power_of_2(max(q_heads, kv_heads)), 1024 // dim))
        parts = triton.cdiv(q_heads, block_h) + 2 * triton.cdiv(kv_heads, block_h)
        _qk_kernel[(rows, parts)](
            q, k, v, q_norm_weight if q_norm_weight is not None else q,
            k_norm_weight if k_norm_weight is not None else k, cos, sin, k_cache, v_cache, slots,
            positions, q_out, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0),
            v.stride(1), cos.stride(0), sin.stride(0), k_cache.shape[1], float(eps),
            HQ=q_heads, HKV=kv_heads, HAS_QW=q_norm_weight is not None,
            HAS_KW=k_norm_weight is not None, HALF=dim // 2, BLOCK_H=block_h, num_warps=4,
            enable_fp_fusion=False)
    return q_out
