"""Native modules against naive formulas, and sequence packing."""

from __future__ import annotations

import math

import pytest
import torch

from megarl.megatron.packing import pack_sequences, split_by_token_budget, split_further


def naive_experts(x, weights, splits):
    """Each block of rows times its own expert weight, one matmul at a time."""
    out, start = [], 0
    for w, n in zip(weights, splits):
        out.append(x[start : start + n] @ w.T)
        start += n
    return torch.cat(out)


@pytest.mark.parametrize(
    "in_f,out_f,splits",
    [(16, 32, [3, 0, 7, 2]), (6, 10, [4, 1, 0, 5])],  # aligned: grouped GEMM; unaligned: loop
)
def test_grouped_linear_values_and_gradients(in_f, out_f, splits):
    from megarl.megatron.native_modules import grouped_linear

    g = torch.Generator().manual_seed(0)
    x = torch.randn(sum(splits), in_f, generator=g, requires_grad=True)
    ws = [torch.randn(out_f, in_f, generator=g, requires_grad=True) for _ in splits]
    out = grouped_linear(x, ws, splits)
    # sum() hands back an expanded (stride-0) gradient, which the grouped GEMM cannot take raw
    out.sum().backward()
    x2 = x.detach().clone().requires_grad_()
    ws2 = [w.detach().clone().requires_grad_() for w in ws]
    ref = naive_experts(x2, ws2, splits)
    ref.sum().backward()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(x.grad, x2.grad, atol=1e-5, rtol=1e-5)
    for w, w2 in zip(ws, ws2):
        torch.testing.assert_close(w.grad, w2.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("frozen", [False, True])
def test_grouped_linear_keeps_no_stacked_copy_of_the_experts_for_backward(frozen):
    """What a forward leaves for backward is the input, the offsets and the expert weights
    themselves: never a stacked [E, out, in] copy (kept by every layer until its backward, that
    was a second copy of all the expert weights in an update without recompute). Frozen experts
    (LoRA's base) still pass the input's gradient, equal to the naive one."""
    from megarl.megatron.native_modules import grouped_linear

    g = torch.Generator().manual_seed(0)
    splits = [5, 0, 9, 2]
    x = torch.randn(sum(splits), 32, generator=g, requires_grad=True)
    ws = [torch.randn(64, 32, generator=g, requires_grad=not frozen) for _ in splits]
    owned = {w.untyped_storage().data_ptr() for w in ws}
    kept: list[torch.Tensor] = []

    def pack(t):
        if t.untyped_storage().data_ptr() not in owned:
            kept.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = grouped_linear(x, ws, torch.tensor(splits))
    assert sum(t.untyped_storage().nbytes() for t in kept) <= x.numel() * 4 + 64
    grad = torch.randn(out.shape, generator=g)
    got = torch.autograd.grad(out, [x, *(ws if not frozen else [])], grad)
    x2 = x.detach().clone().requires_grad_()
    ws2 = [w.detach().clone().requires_grad_(not frozen) for w in ws]
    want = torch.autograd.grad(naive_experts(x2, ws2, splits), [x2, *(ws2 if not frozen else [])],
                               grad)
    assert len(got) == len(want) == (1 if frozen else 1 + len(ws))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_grouped_linear_under_a_recompute_keeps_its_stack_for_the_backward_that_follows():
    """Under a reentrant activation checkpoint (megatron's full recompute) the forward runs again
    inside the backward; that forward keeps its stacked weights (this layer's backward follows
    at once, so they live no longer) instead of stacking them a second time. Gradients equal
    the naive ones either way."""
    from torch.utils.checkpoint import checkpoint

    from megarl.megatron.native_modules import grouped_linear

    g = torch.Generator().manual_seed(1)
    splits = [3, 6, 0, 7]
    x = torch.randn(sum(splits), 32, generator=g, requires_grad=True)
    ws = [torch.randn(64, 32, generator=g, requires_grad=True) for _ in splits]
    shapes: list[tuple[int, ...]] = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = checkpoint(lambda a: grouped_linear(a, ws, torch.tensor(splits)), x,
                         use_reentrant=True)
        assert (len(splits), 64, 32) not in shapes  # the first forward keeps nothing
        grad = torch.randn(out.shape, generator=g)
        out.backward(grad)  # a reentrant checkpoint takes no torch.autograd.grad
    assert (len(splits), 64, 32) in shapes  # the recompute kept its stack
    got = [x.grad, *(w.grad for w in ws)]
    x2 = x.detach().clone().requires_grad_()
    ws2 = [w.detach().clone().requires_grad_() for w in ws]
    want = torch.autograd.grad(naive_experts(x2, ws2, splits), [x2, *ws2], grad)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def naive_causal_attention(q, k, v):
    """softmax(q k^T / sqrt(d) + causal mask) v for [heads, s, d], kv heads repeated."""
    rep = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    s = q.shape[1]
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(scores, -1) @ v


def tiny_config(**kw):
    """A TransformerConfig small enough to construct modules by hand."""
    from megatron.core.transformer import TransformerConfig

    base = {
        "num_layers": 1,
        "hidden_size": 32,
        "num_attention_heads": 4,
        "num_query_groups": 2,
        "use_cpu_initialization": True,
        "normalization": "RMSNorm",
        "layernorm_epsilon": 1e-6,
        "attention_dropout": 0.0,
        "hidden_dropout": 0.0,
    }
    base.update(kw)
    return TransformerConfig(**base)


def test_sdpa_attention_packed_and_padded_layouts():
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from megarl.megatron.native_modules import SDPAttention

    attn = SDPAttention(tiny_config(), layer_number=1, attn_mask_type=AttnMaskType.causal)
    g = torch.Generator().manual_seed(0)
    lengths, heads, kv_heads, dim = [5, 3, 4], 4, 2, 8
    q = torch.randn(sum(lengths), heads, dim, generator=g)
    k = torch.randn(sum(lengths), kv_heads, dim, generator=g)
    v = torch.randn(sum(lengths), kv_heads, dim, generator=g)
    cu = torch.tensor([0, 5, 8, 12], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    packed = attn(q, k, v, None, packed_seq_params=params)
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        ref = naive_causal_attention(*(t[start:end].transpose(0, 1) for t in (q, k, v)))
        torch.testing.assert_close(packed[start:end], ref.transpose(0, 1), atol=1e-5, rtol=1e-5)
    # sbhd with batch 1: [s, b, h, d] -> [s, b, h*d]
    s0 = lengths[0]
    sbhd = attn(q[:s0, None], k[:s0, None], v[:s0, None], None)
    ref0 = naive_causal_attention(
        q[:s0].transpose(0, 1), k[:s0].transpose(0, 1), v[:s0].transpose(0, 1)
    )
    torch.testing.assert_close(
        sbhd[:, 0], ref0.transpose(0, 1).reshape(s0, -1), atol=1e-5, rtol=1e-5
    )


def test_rms_norm_matches_formula_and_marks_sequence_parallel():
    from megarl.megatron.native_modules import NativeNorm

    norm = NativeNorm(tiny_config(sequence_parallel=False), hidden_size=32, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, 32))
    x = torch.randn(3, 2, 32)
    ref = norm.weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(norm(x), ref, atol=1e-6, rtol=1e-5)
    assert norm.weight.sequence_parallel is False


def test_pack_and_unpack_round_trip():
    seqs = [torch.tensor([5, 6, 7]), torch.tensor([8, 9]), torch.tensor([1, 2, 3, 4])]
    batch = pack_sequences(seqs, align=2)
    assert batch.input_ids.tolist() == [[5, 6, 7, 0, 8, 9, 1, 2, 3, 4]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 0, 1, 2, 3]]
    assert batch.targets.tolist() == [[6, 7, 0, 0, 9, 0, 2, 3, 4, 0]]
    assert batch.cu_seqlens.tolist() == [0, 3, 5, 9]
    assert batch.cu_seqlens_padded.tolist() == [0, 4, 6, 10]
    assert [t.tolist() for t in batch.unpack(batch.input_ids[0])] == [s.tolist() for s in seqs]
    # a value computed at position p belongs to the token at p + 1
    shifted = batch.unpack_shifted(batch.targets[0])
    assert [t.tolist() for t in shifted] == [[0, 6, 7], [0, 9], [0, 2, 3, 4]]
    params = batch.packed_seq_params()
    assert params.qkv_format == "thd" and params.max_seqlen_q == 4


def test_split_by_token_budget_keeps_order_and_budget():
    assert split_by_token_budget([3, 4, 2, 9, 1], max_tokens=7) == [[0, 1], [2], [3], [4]]
    assert split_by_token_budget([2, 2, 2], max_tokens=100) == [[0, 1, 2]]
    with pytest.raises(ValueError, match="max_tokens"):
        split_by_token_budget([1], max_tokens=0)


def test_split_further_cuts_the_largest_group_where_its_tokens_are_even():
    lengths = [3, 4, 2, 9, 1, 1]
    assert split_further(lengths, [[0, 1, 2], [3, 4, 5]], 2) == [[0, 1, 2], [3, 4, 5]]
    # [3, 4, 5] (11 tokens) first, as 9 | 1+1; then [0, 1, 2] (9 tokens, the first of the
    # largest with two sequences or more) as 3 | 4+2 (gap 3, where 3+4 | 2 has gap 5)
    assert split_further(lengths, [[0, 1, 2], [3, 4, 5]], 3) == [[0, 1, 2], [3], [4, 5]]
    assert split_further(lengths, [[0, 1, 2], [3, 4, 5]], 4) == [[0], [1, 2], [3], [4, 5]]
    assert split_further(lengths, [[0, 1, 2, 3, 4, 5]], 6) == [[i] for i in range(6)]
    with pytest.raises(ValueError, match="7 micro-batches of 6 sequences"):
        split_further(lengths, [[0, 1, 2, 3, 4, 5]], 7)
