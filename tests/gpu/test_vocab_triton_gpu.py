"""The log-prob path's Triton kernels (megarl/kernels/triton_vocab.py) against the torch path
on the CPU: a chunk's softmax statistics, log-probs and entropies, and its logit gradient, with
a temperature, rows of a wider buffer (the padded vocabulary's layout) and targets outside this
rank's columns."""

from __future__ import annotations

import torch

ROWS, COLS = 300, 5003  # not a multiple of the kernels' block


def _inputs():
    g = torch.Generator().manual_seed(0)
    wide = (3 * torch.randn(ROWS, COLS + 61, generator=g)).bfloat16()
    z = wide[:, :COLS]  # rows of a wider buffer
    local_index = torch.randint(0, COLS, (ROWS,), generator=g)
    in_shard = torch.rand(ROWS, generator=g) > 0.2
    g_lp, g_ent = torch.randn(ROWS, generator=g), torch.randn(ROWS, generator=g)
    return z, local_index, in_shard, g_lp, g_ent


def test_the_statistics_and_log_probs_match_the_torch_path():
    from megarl.kernels import triton_vocab_kernels
    from megarl.kernels.triton_ops import verdicts
    from megarl.megatron.vocab_parallel import chunk_log_probs, local_stats

    tri = triton_vocab_kernels()
    assert tri is not None
    z, index, in_shard, _, _ = _inputs()
    stats = tri.chunk_stats(z.cuda(), index.cuda(), 0.7).cpu()
    torch.testing.assert_close(stats, local_stats(z, index, 0.7), rtol=1e-5, atol=1e-5)
    got = chunk_log_probs(z.cuda(), index.cuda(), in_shard.cuda(), 0.7, None)
    want = chunk_log_probs(z, index, in_shard, 0.7, None)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.cpu(), w, rtol=1e-5, atol=1e-5)
    assert verdicts()["vocab_stats"] is True  # the kernel ran, not the fallback


def test_the_logit_gradient_matches_the_torch_path():
    from megarl.kernels.triton_ops import verdicts
    from megarl.megatron.vocab_parallel import chunk_log_probs, chunk_logits_grad, logits_grad

    z, index, in_shard, g_lp, g_ent = _inputs()
    _, entropy, log_z = chunk_log_probs(z, index, in_shard, 0.7, None)
    rows = slice(0, ROWS)
    for lp, ent in ((g_lp, g_ent), (g_lp, None), (None, g_ent)):
        got = chunk_logits_grad(
            z.cuda(), rows, log_z.cuda(), entropy.cuda(), index.cuda(), in_shard.cuda(),
            None if lp is None else lp.cuda(), None if ent is None else ent.cuda(), 0.7)
        want = logits_grad(z, rows, log_z, entropy, index, in_shard, lp, ent, 0.7)
        assert got.dtype == torch.bfloat16 and got.shape == z.shape
        # one bf16 rounding of the fp32 gradient
        torch.testing.assert_close(got.cpu().float(), want, rtol=8e-3, atol=1e-6)
    assert verdicts()["vocab_grad"] is True
