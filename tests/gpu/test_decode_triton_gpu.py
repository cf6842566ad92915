"""The decode step's fused Triton kernels on CUDA against HF transformers' modules on the same
inputs: router softmax + top-k (Qwen3MoeTopKRouter) and q/k RMSNorm + RoPE + K/V cache write
(Qwen3RMSNorm, apply_rotary_pos_emb), eagerly and inside a captured CUDA graph.

The ``check_*`` helpers take the device, so the same checks also run on CPU tensors under
``TRITON_INTERPRET=1`` (whose own fp32 -> bf16 cast truncates: bf16 checks there need it patched
to round to nearest even, as the GPU does)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    apply_rotary_pos_emb,
)
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

pytest.importorskip("triton")  # CPU machines (CI) may not have it

from megarl.rollout.local.decode_triton import (
    qk_norm_rope_cache,
    qk_norm_rope_cache_supported,
    route_topk,
    route_topk_supported,
)

EPS = 1e-6


def ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance between ``a`` and ``b`` (same 16-bit float dtype) in units in the last
    place: the bits read as integers ordered like the values."""
    def ordered(t):
        bits = t.contiguous().view(torch.int16).to(torch.int32)
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)
    assert a.dtype == b.dtype and a.dtype in (torch.bfloat16, torch.float16)
    return int((ordered(a) - ordered(b)).abs().max()) if a.numel() else 0


def head_ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest ``|a - b|`` over each head vector (last dim) in units in the last place of the
    vector's largest ``|b|``: a flipped rounding inside the norm, carried through the rotation,
    stays within a few of these where cancelling terms make plain ulps large."""
    mantissa = 7 if b.dtype == torch.bfloat16 else 10
    top = b.float().abs().amax(-1, keepdim=True).clamp(min=1e-30)
    unit = torch.exp2(torch.floor(torch.log2(top)) - mantissa)
    return float(((a.float() - b.float()).abs() / unit).max()) if a.numel() else 0.0


def close(a: torch.Tensor, b: torch.Tensor) -> int:
    """ulps for 16-bit floats; for fp32, the same on the values rounded to bf16 after checking
    they agree to 1e-6 relative."""
    if a.dtype == torch.float32:
        assert torch.allclose(a, b, rtol=2e-6, atol=1e-12)
        return ulps(a.bfloat16(), b.bfloat16())
    return ulps(a, b)


# ----- router -----
def hf_router(hidden: torch.Tensor, weight: torch.Tensor, top_k: int, normalize: bool):
    """HF's Qwen3MoeTopKRouter with ``weight [E, H]``: (logits, top values, indices)."""
    cfg = SimpleNamespace(num_experts_per_tok=top_k, num_experts=weight.shape[0],
                          norm_topk_prob=normalize, hidden_size=weight.shape[1])
    router = Qwen3MoeTopKRouter(cfg).to(device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        router.weight.copy_(weight)
        return router(hidden)


def check_route(logits: torch.Tensor, top_k: int, normalize: bool, ref_values: torch.Tensor,
                ref_indices: torch.Tensor | None = None) -> int:
    """route_topk on ``logits`` against HF's top values (and ``ref_indices`` in the rows whose
    probabilities are all distinct); the indices must be the lower-index-first top-k of torch's
    probabilities. Returns the weights' largest difference in ulps."""
    dense, indices = route_topk(logits, top_k, normalize)
    assert dense.shape == logits.shape and dense.dtype == logits.dtype
    assert indices.shape == (logits.shape[0], top_k) and indices.dtype == torch.long
    probs = torch.softmax(logits.float(), dim=-1)
    order = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :top_k]
    assert torch.equal(indices, order)
    if ref_indices is not None:
        distinct = (probs[:, :, None] == probs[:, None, :]).sum((1, 2)) == probs.shape[1]
        assert torch.equal(indices[distinct], ref_indices[distinct])
    assert not dense.scatter(1, indices, 0).any(), "weight outside the chosen experts"
    return close(dense.gather(1, indices), ref_values)


def check_route_vs_hf(device: str, rows: int, experts: int, hidden: int, top_k: int,
                      normalize: bool, dtype: torch.dtype, seed: int = 0) -> int:
    """Random hidden states through HF's router and through route_topk on its logits."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, hidden, generator=g).to(device, dtype)
    w = (torch.randn(experts, hidden, generator=g) / hidden ** 0.5).to(device, dtype)
    logits, values, indices = hf_router(h, w, top_k, normalize)
    return check_route(logits, top_k, normalize, values, indices)


def check_route_ties(device: str, dtype: torch.dtype) -> None:
    """Exactly equal probabilities go to the lower expert, also at the top-k boundary."""
    experts = 60  # not a power of two
    logits = torch.zeros(6, experts)
    logits[1, [5, 17, 40]] = 2.0  # three equal leaders, the rest tied
    logits[2, [3, 9]] = 1.0
    logits[2, [20, 30, 50]] = 0.5  # boundary of top-4 falls inside the tie
    logits[3] = torch.arange(experts) % 3  # many ties
    logits[4] = -200.0
    logits[4, 59] = 50.0  # the rest underflow to probability 0 (fp32)
    logits[5] = torch.linspace(-3, 3, experts).flip(0)
    logits = logits.to(device, dtype)
    for top_k, normalize in ((1, True), (2, True), (4, True), (4, False), (8, True)):
        probs = torch.softmax(logits.float(), dim=-1)
        values = probs.sort(dim=-1, descending=True).values[:, :top_k]
        if normalize:
            values = values / values.sum(-1, keepdim=True)
        assert check_route(logits, top_k, normalize, values.to(dtype)) <= 1
    _, indices = route_topk(logits, 4, False)
    assert indices[0].tolist() == [0, 1, 2, 3]
    assert indices[1].tolist() == [5, 17, 40, 0]
    assert indices[2].tolist() == [3, 9, 20, 30]
    assert indices[4].tolist() == [59, 0, 1, 2]


# ----- q/k norm, RoPE, cache write -----
def hf_attention_inputs(q, k, positions, q_norm_weight, k_norm_weight):
    """HF's Qwen3RMSNorm (or none) and apply_rotary_pos_emb with Qwen3RotaryEmbedding's
    tables at ``positions``: (q_embed, k_embed, cos, sin)."""
    heads, dim = q.shape[1], q.shape[2]
    cfg = Qwen3Config(hidden_size=heads * dim, num_attention_heads=heads, head_dim=dim,
                      num_key_value_heads=k.shape[1], max_position_embeddings=1 << 16)
    rotary = Qwen3RotaryEmbedding(cfg).to(q.device)
    cos, sin = rotary(q, positions[None])
    cos, sin = cos[0], sin[0]
    with torch.no_grad():
        for weight, name in ((q_norm_weight, "q"), (k_norm_weight, "k")):
            if weight is not None:
                norm = Qwen3RMSNorm(dim, eps=EPS).to(q.device, q.dtype)
                norm.weight.copy_(weight)
                if name == "q":
                    q = norm(q)
                else:
                    k = norm(k)
        q_embed, k_embed = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
    return q_embed, k_embed, cos, sin


def make_qkv(device, rows, q_heads, kv_heads, dim, dtype, layout, g):
    """q, k, v as the engine might hand them (q and k scaled by 3, which the norm undoes):
    ``fused`` slices one projection output ``[n, (Hq + 2 Hkv) * D]``, ``strided`` takes the
    first half of ``[n, H, 2D]`` blocks, ``separate`` is three contiguous tensors."""
    heads = (q_heads, kv_heads, kv_heads)
    scales = (3.0, 3.0, 1.0)
    if layout == "fused":
        qkv = torch.cat([torch.randn(rows, h * dim, generator=g) * s
                         for h, s in zip(heads, scales)], dim=1).to(device, dtype)
        cuts = (0, q_heads * dim, (q_heads + kv_heads) * dim, qkv.shape[1])
        return tuple(qkv[:, a:b].view(rows, h, dim) for a, b, h in zip(cuts, cuts[1:], heads))
    width = 2 * dim if layout == "strided" else dim
    return tuple((torch.randn(rows, h, width, generator=g) * s).to(device, dtype)[..., :dim]
                 for h, s in zip(heads, scales))


def check_qk(device: str, rows: int, q_heads: int, kv_heads: int, dim: int, cache_rows: int,
             cache_len: int, dtype: torch.dtype = torch.bfloat16, norm: bool = True,
             layout: str = "fused", seed: int = 0) -> tuple[float, float]:
    """qk_norm_rope_cache against HF's modules; the poisoned caches change only at
    ``[slots, positions]``. Returns (largest :func:`head_ulps`, fraction of bitwise-equal
    values) over q and the cached k."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = make_qkv(device, rows, q_heads, kv_heads, dim, dtype, layout, g)
    assert q.is_contiguous() == (layout == "separate")
    wq = wk = None
    if norm:
        wq, wk = ((1 + 0.5 * torch.randn(dim, generator=g)).to(device, dtype) for _ in range(2))
    slots = torch.randperm(cache_rows, generator=g)[:rows].to(device)
    positions = torch.randint(0, cache_len, (rows,), generator=g).to(device)
    poison = torch.Generator(device=device).manual_seed(seed)
    k_cache, v_cache = (torch.randn(cache_rows, cache_len, kv_heads, dim, generator=poison,
                                    device=device, dtype=dtype) for _ in range(2))
    k_before, v_before = k_cache.clone(), v_cache.clone()
    q_ref, k_ref, cos, sin = hf_attention_inputs(q, k, positions, wq, wk)
    assert qk_norm_rope_cache_supported(q, k, v, wq, wk, cos, sin, k_cache, v_cache, slots,
                                        positions)
    q_out = qk_norm_rope_cache(q, k, v, wq, wk, EPS, cos, sin, k_cache, v_cache, slots,
                               positions)
    assert q_out.shape == q.shape and q_out.is_contiguous() and q_out.dtype == dtype
    written = torch.zeros(cache_rows, cache_len, dtype=torch.bool, device=device)
    written[slots, positions] = True
    assert torch.equal(k_cache[~written], k_before[~written]), "k cache changed elsewhere"
    assert torch.equal(v_cache[~written], v_before[~written]), "v cache changed elsewhere"
    assert torch.equal(v_cache[slots, positions], v)
    k_out = k_cache[slots, positions]
    same = int((q_out == q_ref).sum() + (k_out == k_ref).sum()) / (q_ref.numel() + k_ref.numel())
    return max(head_ulps(q_out, q_ref), head_ulps(k_out, k_ref)), same


def check_unsupported(device: str) -> None:
    """The predicates refuse what the kernels do not handle, and the kernels raise."""
    logits = torch.randn(4, 600, device=device)
    assert not route_topk_supported(logits, 4)
    assert not route_topk_supported(logits[:, :60], 61)
    assert not route_topk_supported(logits[:, :60].to(torch.int32), 4)
    assert route_topk_supported(logits[:, :60], 4)
    with pytest.raises(ValueError):
        route_topk(logits, 4, True)
    rows, dim = 3, 96
    bf = {"device": device, "dtype": torch.bfloat16}
    q, k, v = (torch.randn(rows, heads, dim, **bf) for heads in (4, 2, 2))
    cos = sin = torch.randn(rows, dim, **bf)
    cache = torch.zeros(rows, 8, 2, dim, **bf)
    slots = positions = torch.arange(rows, device=device)
    args = (q, k, v, None, None, cos, sin, cache, cache.clone(), slots, positions)
    assert not qk_norm_rope_cache_supported(*args)  # head dim 96
    with pytest.raises(ValueError):
        qk_norm_rope_cache(*args[:5], EPS, *args[5:])
    q, k, v, cos = q[..., :64], k[..., :64], v[..., :64], cos[:, :64].contiguous()
    cache = torch.zeros(rows, 8, 2, 64, **bf)
    good = [q, k, v, None, None, cos, cos, cache, cache.clone(), slots, positions]
    assert qk_norm_rope_cache_supported(*good)
    for i, bad in ((0, q.float()), (5, cos.half()), (7, cache.transpose(1, 2)),
                   (9, slots.int()), (0, q.transpose(1, 2).contiguous().transpose(1, 2))):
        assert not qk_norm_rope_cache_supported(*good[:i], bad, *good[i + 1:]), i


# ----- the GPU tests -----
def test_route_topk_matches_hf_router():
    worst = 0
    for experts, top_k, normalize, dtype in ((32, 4, True, torch.bfloat16),
                                             (32, 4, False, torch.bfloat16),
                                             (60, 1, True, torch.bfloat16),
                                             (60, 2, False, torch.float32),
                                             (128, 8, True, torch.bfloat16),
                                             (512, 8, True, torch.float16)):
        worst = max(worst, check_route_vs_hf("cuda", 64, experts, 1024, top_k, normalize, dtype))
    assert worst <= 1


def test_route_topk_ties_lower_expert_first():
    check_route_ties("cuda", torch.bfloat16)


@pytest.mark.parametrize("q_heads,kv_heads,dim,norm,layout,dtype,length", [
    (16, 8, 128, True, "fused", torch.bfloat16, 1024),  # Qwen3-MoE decode shape
    (16, 8, 128, False, "separate", torch.bfloat16, 256),  # Llama / Qwen2: no q/k norm
    (6, 2, 64, True, "strided", torch.float16, 256),
    (8, 8, 256, True, "fused", torch.bfloat16, 256),
])
def test_qk_norm_rope_cache_matches_hf(q_heads, kv_heads, dim, norm, layout, dtype, length):
    worst, same = check_qk("cuda", 64, q_heads, kv_heads, dim, 64, length, dtype, norm, layout)
    # the rotation is bitwise HF's; the norm's fp32 sum order differs, which flips a rounding
    # of the normed value now and then
    assert worst <= (0 if not norm else 2) and same >= (1.0 if not norm else 0.998)


def test_unsupported_inputs_refused():
    check_unsupported("cuda")
    assert not route_topk_supported(torch.randn(4, 32), 4)  # CPU tensor


def test_kernels_in_cuda_graph_replay_eager_results():
    rows, experts, q_heads, kv_heads, dim, length = 64, 32, 16, 8, 128, 1024
    g = torch.Generator(device="cuda").manual_seed(0)
    bf = {"device": "cuda", "dtype": torch.bfloat16}
    logits = torch.randn(rows, experts, generator=g, **bf)
    qkv = torch.randn(rows, (q_heads + 2 * kv_heads) * dim, generator=g, **bf)
    q = qkv[:, : q_heads * dim].view(rows, q_heads, dim)
    k = qkv[:, q_heads * dim: (q_heads + kv_heads) * dim].view(rows, kv_heads, dim)
    v = qkv[:, (q_heads + kv_heads) * dim:].view(rows, kv_heads, dim)
    wq, wk = (1 + 0.1 * torch.randn(dim, generator=g, **bf) for _ in range(2))
    cos, sin = torch.randn(rows, dim, generator=g, **bf), torch.randn(rows, dim, generator=g, **bf)
    k_cache = torch.zeros(rows, length, kv_heads, dim, **bf)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.arange(rows, device="cuda")
    positions = torch.zeros(rows, dtype=torch.long, device="cuda")

    def step():
        dense, indices = route_topk(logits, 4, True)
        q_out = qk_norm_rope_cache(q, k, v, wq, wk, EPS, cos, sin, k_cache, v_cache, slots,
                                   positions)
        return dense, indices, q_out

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    k_cache.zero_(), v_cache.zero_()  # the warm-up wrote at position 0
    for trial in range(3):
        logits.copy_(torch.randn(rows, experts, generator=g, **bf))
        qkv.copy_(torch.randn(qkv.shape, generator=g, **bf))
        positions.copy_(torch.randint(0, length, (rows,), generator=g, device="cuda"))
        graph.replay()
        replayed = [t.clone() for t in outs]
        k_graph, v_graph = k_cache.clone(), v_cache.clone()
        k_cache.zero_(), v_cache.zero_()
        eager = step()
        for a, b in zip(replayed, eager):
            assert torch.equal(a, b), trial
        assert torch.equal(k_graph, k_cache) and torch.equal(v_graph, v_cache), trial
        # the cache holds this trial's writes only
        assert int((k_cache != 0).any(-1).any(-1).sum()) == rows
        k_cache.zero_(), v_cache.zero_()
