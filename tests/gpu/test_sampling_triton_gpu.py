"""The fused Gumbel-max sampler on CUDA against torch: greedy arg-max, log-probs, reproducible
draws, the sampled distribution, masked tokens, and a CUDA-graph replay."""

from __future__ import annotations

import pytest
import torch

DEVICE = "cuda"
ROWS, VOCAB = 64, 151936
"""A decode batch of Qwen's vocabulary."""
DRAWS = 20000
"""Copies of one row in the distribution checks."""


def make_inputs(rows: int, vocab: int, dtype: torch.dtype, temperatures: list[float],
                seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Random logits [rows, vocab], temperatures cycled over the rows, per-row seeds and
    positions."""
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=gen) * 3).to(dtype)
    temps = torch.tensor(temperatures).repeat(rows // len(temperatures) + 1)[:rows]
    seeds = torch.randint(0, 2**62, (rows,), generator=gen)
    positions = torch.randint(0, 10**6, (rows,), generator=gen)
    return tuple(t.to(DEVICE) for t in (logits, temps, seeds, positions))


def reference_logprobs(logits: torch.Tensor, temps: torch.Tensor,
                       tokens: torch.Tensor) -> torch.Tensor:
    """log_softmax(z / Te) at ``tokens``, Te = 1 for greedy rows."""
    te = torch.where(temps > 0, temps, 1.0).unsqueeze(1)
    chosen = torch.log_softmax(logits.float() / te, dim=-1).gather(1, tokens.unsqueeze(1))
    return chosen.squeeze(1).clamp(min=torch.finfo(torch.float32).min)


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of Pearson's chi-square test of ``counts`` against ``probs``."""
    expected = probs.double() * counts.sum()
    stat = ((counts.double() - expected) ** 2 / expected).sum()
    chi2 = torch.distributions.Chi2(torch.tensor(float(len(probs) - 1), dtype=torch.float64))
    return float(1 - chi2.cdf(stat))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_greedy_and_sampled_rows_match_torch(dtype):
    from megarl.rollout.local.sampling_triton import gumbel_sample, gumbel_supported

    logits, temps, seeds, positions = make_inputs(ROWS, VOCAB, dtype, [0.0, 1.0, 0.5, 1.7])
    logits[0, 5] = logits[0, 9] = logits[0].max() + 1  # a tie: the lower index wins
    assert gumbel_supported(logits)
    tokens, logprobs = gumbel_sample(logits, temps, seeds, positions)
    assert tokens.dtype == torch.int64 and logprobs.dtype == torch.float32
    greedy = temps == 0
    assert torch.equal(tokens[greedy], logits[greedy].float().argmax(-1))
    assert int(tokens[0]) == 5
    assert ((tokens >= 0) & (tokens < VOCAB)).all()
    torch.testing.assert_close(logprobs, reference_logprobs(logits, temps, tokens),
                               atol=1e-5, rtol=0)
    # the draws are spread like softmax: the sampled rows rarely take the arg-max
    assert (tokens[~greedy] != logits[~greedy].float().argmax(-1)).any()


def test_draws_are_reproducible_and_independent_of_the_batch():
    from megarl.rollout.local.sampling_triton import gumbel_sample

    logits, temps, seeds, positions = make_inputs(ROWS, VOCAB, torch.bfloat16, [1.0, 0.0, 0.7])
    tokens, logprobs = gumbel_sample(logits, temps, seeds, positions)
    again, _ = gumbel_sample(logits, temps, seeds, positions)
    assert torch.equal(tokens, again)
    order = torch.randperm(ROWS, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    permuted, permuted_lp = gumbel_sample(logits[order], temps[order], seeds[order],
                                          positions[order])
    assert torch.equal(permuted, tokens[order])
    torch.testing.assert_close(permuted_lp, logprobs[order], atol=1e-6, rtol=0)
    alone, _ = gumbel_sample(logits[3:5], temps[3:5], seeds[3:5], positions[3:5])
    assert torch.equal(alone, tokens[3:5])
    for chunk in (1024, 2048):  # the chunking changes the launch, not the draws
        chunked, chunked_lp = gumbel_sample(logits, temps, seeds, positions, chunk=chunk)
        assert torch.equal(chunked, tokens)
        torch.testing.assert_close(chunked_lp, logprobs, atol=1e-5, rtol=0)
    # flat logits: other positions (or seeds) draw other tokens
    flat = torch.zeros_like(logits)
    ones = torch.ones_like(temps)
    base, _ = gumbel_sample(flat, ones, seeds, positions)
    moved, _ = gumbel_sample(flat, ones, seeds, positions + 1)
    reseeded, _ = gumbel_sample(flat, ones, seeds + 1, positions)
    assert (base != moved).float().mean() > 0.9 and (base != reseeded).float().mean() > 0.9


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_sampled_frequencies_follow_softmax(temperature):
    from megarl.rollout.local.sampling_triton import gumbel_sample

    z = torch.tensor([1.0, 0.2, -0.5, 2.0, float("-inf"), 0.0, -1.5])
    logits = z.repeat(DRAWS, 1).to(DEVICE)
    temps = torch.full((DRAWS,), temperature, device=DEVICE)
    seeds = torch.full((DRAWS,), 1234, dtype=torch.int64, device=DEVICE)
    positions = torch.arange(DRAWS, device=DEVICE)
    tokens, _ = gumbel_sample(logits, temps, seeds, positions)
    counts = torch.bincount(tokens.cpu(), minlength=len(z)).double()
    probs = torch.softmax(z / temperature, dim=-1)
    assert counts[4] == 0
    finite = probs > 0
    assert chi_square_p(counts[finite], probs[finite]) > 1e-3
    assert (counts / DRAWS - probs).abs().max() < 0.01


def test_frequencies_across_chunks_of_a_masked_vocabulary():
    """A few live tokens in different chunks of a long row, the rest -inf."""
    from megarl.rollout.local.sampling_triton import gumbel_sample

    vocab, chunk = 3 * 1024 + 77, 1024
    live = torch.tensor([3, 1500, 2047, 2048, vocab - 1])
    z = torch.full((vocab,), float("-inf"))
    z[live] = torch.tensor([0.5, 1.0, -0.3, 1.0, 0.0]).bfloat16().float()
    logits = z.bfloat16().repeat(DRAWS, 1).to(DEVICE)
    ones = torch.ones(DRAWS, device=DEVICE)
    seeds = torch.arange(DRAWS, device=DEVICE) * 7919
    tokens, logprobs = gumbel_sample(logits, ones, seeds, torch.zeros_like(seeds), chunk=chunk)
    assert torch.isin(tokens.cpu(), live).all()
    probs = torch.softmax(z[live], dim=-1)
    counts = (tokens.cpu().unsqueeze(1) == live).sum(0).double()
    assert chi_square_p(counts, probs) > 1e-3
    table = torch.full((vocab,), float("-inf"))
    table[live] = probs.log()
    torch.testing.assert_close(logprobs.cpu(), table[tokens.cpu()], atol=1e-5, rtol=0)


def test_masked_tokens_are_never_taken():
    from megarl.rollout.local.sampling_triton import gumbel_sample

    logits, temps, seeds, positions = make_inputs(ROWS, VOCAB, torch.bfloat16, [1.0, 2.0, 0.0])
    mask = torch.rand(ROWS, VOCAB, generator=torch.Generator().manual_seed(2)) < 0.5
    mask[:, 0] = False
    mask[0, :] = True
    mask[0, 77] = False  # one live token: taken with log-prob 0
    mask = mask.to(DEVICE)
    logits.masked_fill_(mask, float("-inf"))
    logits[0, 77] = 0.0
    tokens, logprobs = gumbel_sample(logits, temps, seeds, positions)
    assert not mask.gather(1, tokens.unsqueeze(1)).any()
    assert int(tokens[0]) == 77 and float(logprobs[0]) == 0.0
    torch.testing.assert_close(logprobs, reference_logprobs(logits, temps, tokens),
                               atol=1e-5, rtol=0)


def test_vocab_smaller_than_and_not_a_multiple_of_the_chunk():
    from megarl.rollout.local.sampling_triton import gumbel_sample

    for vocab, chunk in ((1000, 256), (5000, 1024), (33, 8)):
        logits, temps, seeds, positions = make_inputs(6, vocab, torch.float32, [0.0, 1.0, 0.3])
        tokens, logprobs = gumbel_sample(logits, temps, seeds, positions, chunk=chunk)
        greedy = temps == 0
        assert torch.equal(tokens[greedy], logits[greedy].argmax(-1))
        assert ((tokens >= 0) & (tokens < vocab)).all()
        torch.testing.assert_close(logprobs, reference_logprobs(logits, temps, tokens),
                                   atol=1e-5, rtol=0)


def test_replays_in_a_cuda_graph():
    from megarl.rollout.local.sampling_triton import gumbel_sample

    logits, temps, seeds, positions = make_inputs(ROWS, VOCAB, torch.bfloat16, [1.0, 0.0, 0.8])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile the kernels before the capture
        gumbel_sample(logits, temps, seeds, positions)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tokens, logprobs = gumbel_sample(logits, temps, seeds, positions)
    for step in range(3):
        positions.add_(1)
        logits.add_(torch.randn_like(logits))
        graph.replay()
        want, want_lp = gumbel_sample(logits, temps, seeds, positions)
        assert torch.equal(tokens, want), step
        torch.testing.assert_close(logprobs, want_lp, atol=0, rtol=0)
