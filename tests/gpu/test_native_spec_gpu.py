"""megarl's native spec on CUDA in bf16: fused ops against references, log-prob parity with HF
transformers on packed batches (one sequence: SDPA; several: FlashAttention varlen), and
gradients against the same model run sequence by sequence."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megarl.data.tiny_model import make_tiny_model

TEMPERATURE = 0.8
LENGTHS = (33, 64, 17, 48, 9)
# bf16 on both sides with different kernels: per-token log-probs (values around -5) of the tiny
# random models agree to a few hundredths at most
MAX_ABS, MEAN_ABS = 0.05, 0.005


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in fp64."""
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_flash_varlen_matches_sdpa_per_sequence_values_and_gradients():
    from megarl.megatron.native_ops import flash_varlen_attention

    g = torch.Generator(device="cuda").manual_seed(0)
    lens = [100, 37, 300, 11]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda")
    total, heads, kv, dim = sum(lens), 8, 2, 64
    q, k, v = (torch.randn(total, h, dim, device="cuda", generator=g, dtype=torch.bfloat16)
               .requires_grad_() for h in (heads, kv, kv))
    out = flash_varlen_attention(q, k, v, cu, max(lens), None)
    grad = torch.randn(out.shape, device="cuda", generator=g, dtype=torch.bfloat16)
    out.backward(grad)
    refs = []
    q2, k2, v2 = (t.detach().double().requires_grad_() for t in (q, k, v))
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qs, ks, vs = (t[a:b].transpose(0, 1)[None] for t in (q2, k2, v2))
        refs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
                    [0].transpose(0, 1))
    ref = torch.cat(refs)
    ref.backward(grad.double())
    assert rel_error(out, ref) < 1e-2
    for ours, theirs in ((q.grad, q2.grad), (k.grad, k2.grad), (v.grad, v2.grad)):
        assert rel_error(ours, theirs) < 2e-2


def test_triton_kernels_match_the_torch_path_values_and_gradients():
    from megarl.kernels import triton_ops as native_triton
    from megarl.megatron import native_ops

    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(96, 2 * 768, device="cuda", generator=g, dtype=torch.bfloat16)
    probs = torch.rand(96, 1, device="cuda", generator=g)
    for p in (None, probs):
        ours = native_ops._fwd_bwd(native_triton.SwiGLU.apply, [x, p])
        ref = native_ops._fwd_bwd(native_ops._SwiGLU.apply, [x, p])
        assert rel_error(ours, ref) < 1e-2
    freqs = torch.rand(40, 1, 1, 64, device="cuda").repeat(1, 1, 1, 2) * 10
    cos, sin = native_ops.RotaryTables().get(freqs, torch.bfloat16, rows=40)
    q = torch.randn(40, 1, 6, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    k = torch.randn(40, 1, 2, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    ours = native_ops._fwd_bwd(
        lambda a, b: native_ops._cat(native_triton.RotaryPair.apply(a, b, cos, sin)), [q, k])
    ref = native_ops._fwd_bwd(lambda a, b: native_ops._cat(
        (native_ops._Rotary.apply(a, cos, sin), native_ops._Rotary.apply(b, cos, sin))), [q, k])
    assert rel_error(ours, ref) < 1e-2


@pytest.mark.parametrize("frozen", [False, True])
def test_grouped_expert_gemm_in_bf16_keeps_no_stacked_copy_and_matches_fp32(frozen):
    """The experts' grouped GEMM on CUDA (torch._grouped_mm, bf16): the forward keeps no stacked
    copy of the expert weights for backward (peak memory of forward + backward at most one
    stacked copy above the inputs, outputs and gradients), and values and gradients are the fp32
    expert-by-expert product's within bf16 rounding."""
    from megarl.megatron.native_modules import grouped_linear

    g = torch.Generator(device="cuda").manual_seed(0)
    experts, out_f, in_f = 32, 768, 2048
    splits = torch.randint(0, 48, (experts,), generator=g, device="cuda")
    splits[3] = 0  # an expert that no row chose
    rows = int(splits.sum())
    ws = [(torch.randn(out_f, in_f, device="cuda", generator=g) * 0.02).bfloat16()
          .requires_grad_(not frozen) for _ in range(experts)]
    x = torch.randn(rows, in_f, device="cuda", generator=g).bfloat16().requires_grad_()
    grad = torch.randn(rows, out_f, device="cuda", generator=g).bfloat16()
    stacked_bytes = experts * out_f * in_f * 2
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = grouped_linear(x, ws, splits)
    kept = torch.cuda.memory_allocated() - base  # what the forward left: the output, no copy
    assert kept < out.numel() * 2 + 2**20, kept
    got = torch.autograd.grad(out, [x, *([] if frozen else ws)], grad)
    peak = torch.cuda.max_memory_allocated() - base
    grads = sum(t.numel() * 2 for t in got)
    assert peak < stacked_bytes + grads + out.numel() * 4 + 2**24, (peak, stacked_bytes)
    x32 = x.detach().float().requires_grad_()
    w32 = [w.detach().float().requires_grad_(not frozen) for w in ws]
    pieces = x32.split(splits.tolist())
    ref = torch.cat([p @ w.T for p, w in zip(pieces, w32)])
    want = torch.autograd.grad(ref, [x32, *([] if frozen else w32)], grad.float())
    assert rel_error(out, ref) < 1e-2
    empty = {1 + e for e in range(experts) if int(splits[e]) == 0} if not frozen else set()
    assert frozen or 1 + 3 in empty
    for i, (a, b) in enumerate(zip(got, want)):
        if i in empty:  # an expert no row chose (3, and any the draw left empty): exactly zero
            assert torch.equal(a, torch.zeros_like(a)), i
        else:
            assert rel_error(a, b) < 1e-2, i


def test_fused_rms_norm_close_to_hf_formula():
    from megarl.megatron.native_ops import rms_norm

    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    gamma = torch.rand(512, device="cuda", dtype=torch.bfloat16) + 0.5
    h = x.double()
    ref = gamma.double() * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert rel_error(rms_norm(x, gamma, 1e-6), ref) < 1e-2


def sequences(vocab: int) -> list[torch.Tensor]:
    """The token sequences scored on both sides."""
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (n,), generator=g) for n in LENGTHS]


def hf_reference(model_dir: str, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Target-aligned log-probs from HF transformers in bf16 on the GPU."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    out = []
    for seq in seqs:
        with torch.no_grad():
            logits = model(seq[None].cuda()).logits[0].float() / TEMPERATURE
        logp = torch.log_softmax(logits, dim=-1)[:-1].gather(-1, seq[1:, None].cuda())[:, 0]
        out.append(torch.cat([torch.zeros(1), logp.cpu()]))
    return out


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_packed_log_probs_match_hf_in_bf16(megatron_rank, tmp_path, arch):
    from megarl.megatron.logprobs import compute_log_probs
    from megarl.megatron.model import build_actor_model
    from megarl.megatron.parallel import ParallelSizes, destroy_parallel

    model_dir = str(make_tiny_model(tmp_path / arch, arch=arch, seed=0, head_dim=64,
                                    num_attention_heads=4, hidden_size=128,
                                    with_tokenizer=False))
    model = build_actor_model(model_dir, ParallelSizes(), torch.bfloat16, spec="native")
    try:
        seqs = sequences(model.vocab_size)
        reference = hf_reference(model_dir, seqs)
        for budget in (None, 64):  # all five packed in one row (varlen), then about one a row
            out = compute_log_probs(model, seqs, temperature=TEMPERATURE,
                                    max_tokens_per_micro_batch=budget)
            diffs = torch.cat([(a.cpu() - b).abs() for a, b in zip(out.log_probs, reference)])
            assert diffs.max() <= MAX_ABS and diffs.mean() <= MEAN_ABS, (budget, diffs.max())
    finally:
        destroy_parallel()
