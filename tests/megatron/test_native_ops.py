"""The native spec's fused operations against megatron's unfused torch code and naive formulas."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megarl.megatron.native_ops import (
    RotaryTables,
    packed_positions,
    rms_norm,
    rotary,
    swiglu,
)


def rope_freqs(positions: int, dim: int) -> torch.Tensor:
    """megatron's ``[s, 1, 1, d]`` rotary angles (``cat(f, f)``)."""
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    f = torch.outer(torch.arange(positions, dtype=torch.float32), inv)
    return torch.cat([f, f], dim=-1)[:, None, None, :]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_sbhd_equals_megatron_bitwise_with_gradient(dtype):
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    g = torch.Generator().manual_seed(0)
    t = torch.randn(7, 2, 3, 16, generator=g).to(dtype).requires_grad_()
    freqs = rope_freqs(9, 16)
    k = torch.randn(7, 2, 1, 16, generator=g).to(dtype).requires_grad_()
    ours, ours_k = rotary(t, k, RotaryTables().get(freqs, dtype, rows=7))
    t_ref, k_ref = (x.detach().clone().requires_grad_() for x in (t, k))
    ref = _apply_rotary_pos_emb_bshd(t_ref, freqs[:7])
    ref_k = _apply_rotary_pos_emb_bshd(k_ref, freqs[:7])
    assert torch.equal(ours, ref) and torch.equal(ours_k, ref_k)
    grad, grad_k = (torch.randn(x.shape, generator=g).to(dtype) for x in (ours, ours_k))
    (ours * grad).sum().add((ours_k * grad_k).sum()).backward()
    (ref * grad).sum().add((ref_k * grad_k).sum()).backward()
    assert torch.equal(t.grad, t_ref.grad) and torch.equal(k.grad, k_ref.grad)


def test_rotary_thd_restarts_positions_per_sequence():
    g = torch.Generator().manual_seed(1)
    cu = torch.tensor([0, 4, 9, 12], dtype=torch.int32)
    t = torch.randn(12, 1, 2, 8, generator=g)
    freqs = rope_freqs(6, 8)
    tables = RotaryTables().get(freqs, t.dtype, rows=12, cu_seqlens=cu)
    out, _ = rotary(t, t, tables)
    one = RotaryTables()
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        ref, _ = rotary(t[start:end], t[start:end], one.get(freqs, t.dtype, rows=end - start))
        torch.testing.assert_close(out[start:end], ref, rtol=0, atol=0)
    assert packed_positions(cu, 12).tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4, 0, 1, 2]


def test_rotary_tables_are_cached_per_frequency_tensor():
    tables = RotaryTables(capacity=2)
    freqs = rope_freqs(4, 8)
    first = tables.get(freqs, torch.float32, rows=4)
    assert tables.get(freqs, torch.float32, rows=4)[0] is first[0]
    tables.get(rope_freqs(4, 8), torch.float32, rows=4)
    tables.get(rope_freqs(4, 8), torch.float32, rows=4)
    assert tables.get(freqs, torch.float32, rows=4)[0] is not first[0]


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_equals_megatron_glu_bitwise_with_gradients(weighted, dtype):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 12, generator=g).to(dtype).requires_grad_()
    probs = torch.rand(5, 1, generator=g).requires_grad_() if weighted else None
    out = swiglu(x, probs)
    x_ref = x.detach().clone().requires_grad_()
    a, b = torch.chunk(x_ref, 2, dim=-1)
    ref = F.silu(a) * b
    p_ref = None
    if weighted:
        p_ref = probs.detach().clone().requires_grad_()
        ref = (ref * p_ref).to(dtype)
    assert torch.equal(out, ref)
    grad = torch.randn(out.shape, generator=g).to(dtype)
    out.backward(grad)
    ref.backward(grad)
    assert torch.equal(x.grad, x_ref.grad)
    if weighted:
        torch.testing.assert_close(probs.grad, p_ref.grad, rtol=1e-6, atol=1e-6)


def test_rms_norm_on_cpu_is_hf_formula():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 16, generator=g, dtype=torch.bfloat16)
    gamma = torch.rand(16, generator=g, dtype=torch.bfloat16) + 0.5
    h = x.float()
    ref = gamma * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
    assert torch.equal(rms_norm(x, gamma, 1e-6), ref)


def test_local_dispatcher_matches_megatron_permute_and_unpermute():
    from megatron.core.transformer.moe.moe_utils import permute, unpermute

    from megarl.megatron.native_layers import LocalTokenDispatcher

    g = torch.Generator().manual_seed(4)
    tokens, experts, top_k, hidden = 9, 5, 2, 6
    picks = torch.rand(tokens, experts, generator=g).topk(top_k, dim=-1).indices
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, picks, True)
    probs = torch.rand(tokens, experts, generator=g) * routing_map
    x = torch.randn(tokens, 1, hidden, generator=g)
    d = LocalTokenDispatcher(top_k)
    flat, _ = d.dispatch_preprocess(x, routing_map, probs)
    permuted, counts, permuted_probs = d.dispatch_postprocess(*d.token_dispatch(flat, probs))
    ref, _, mapping = permute(flat, routing_map, num_out_tokens=tokens * top_k)
    assert torch.equal(permuted, ref)
    assert counts.tolist() == routing_map.sum(0).tolist()
    ref_probs = probs.T.contiguous().masked_select(routing_map.T.contiguous())
    assert torch.equal(permuted_probs, ref_probs)
    y = torch.randn(permuted.shape, generator=g)
    out = d.combine_postprocess(d.token_combine(d.combine_preprocess(y)))
    ref_out = unpermute(y, mapping, restore_shape=flat.shape, routing_map=routing_map)
    torch.testing.assert_close(out, ref_out.view(x.shape), rtol=1e-6, atol=1e-6)


def test_local_dispatcher_gradients_match_megatron_permute_and_unpermute():
    """Both directions' backward (gathers, no atomic scatter) equals autograd through
    megatron's ``permute`` / ``unpermute`` (tokens with repeated experts, an unused expert)."""
    from megatron.core.transformer.moe.moe_utils import permute, unpermute

    from megarl.megatron.native_layers import LocalTokenDispatcher

    g = torch.Generator().manual_seed(5)
    tokens, experts, top_k, hidden = 11, 6, 3, 4
    picks = torch.rand(tokens, experts - 1, generator=g).topk(top_k, dim=-1).indices
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, picks, True)
    probs = torch.rand(tokens, experts, generator=g) * routing_map
    x = torch.randn(tokens, hidden, generator=g, dtype=torch.float64)
    w = torch.randn(tokens * top_k, hidden, generator=g, dtype=torch.float64)
    v = torch.randn(tokens, hidden, generator=g, dtype=torch.float64)

    def through(ours: bool) -> tuple[torch.Tensor, torch.Tensor]:
        leaf = x.clone().requires_grad_()
        if ours:
            d = LocalTokenDispatcher(top_k)
            flat, _ = d.dispatch_preprocess(leaf, routing_map, probs)
            rows, _, _ = d.dispatch_postprocess(flat, probs)
            out = d.combine_preprocess(rows * w)
        else:
            rows, _, mapping = permute(leaf, routing_map, num_out_tokens=tokens * top_k)
            out = unpermute(rows * w, mapping, restore_shape=leaf.shape, routing_map=routing_map)
        (out * v).sum().backward()
        return out.detach(), leaf.grad

    (ours, ours_grad), (ref, ref_grad) = through(True), through(False)
    torch.testing.assert_close(ours, ref)
    torch.testing.assert_close(ours_grad, ref_grad)
    assert not torch.equal(ours_grad, torch.zeros_like(ours_grad))
