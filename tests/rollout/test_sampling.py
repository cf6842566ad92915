"""Top-k / top-p / min-p filtering and per-row sampling against naive formulas."""

from __future__ import annotations

import torch

from megarl.rollout.local.sampling import BatchSampling, RowSampling, filter_probs, sample_next

CPU = torch.device("cpu")


def naive_keep(p: list[float], top_k: int, top_p: float, min_p: float) -> set[int]:
    order = sorted(range(len(p)), key=lambda i: -p[i])
    keep, mass = set(), 0.0
    for rank, i in enumerate(order):
        if rank == 0 or (rank < (top_k if top_k > 0 else len(p)) and mass <= top_p
                         and p[i] >= min_p * p[order[0]]):
            keep.add(i)
        mass += p[i]
    return keep


def sample(logits: torch.Tensor, rows: list[RowSampling], seed: int = 0,
           banned: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    return sample_next(logits, BatchSampling.build(rows, CPU),
                       torch.Generator().manual_seed(seed), banned)


def test_filter_matches_the_naive_definition():
    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(6, 50, generator=gen) * 2, dim=-1)
    settings = [(-1, 1.0, 0.0), (5, 1.0, 0.0), (-1, 0.5, 0.0), (10, 0.8, 0.0),
                (-1, 1.0, 0.2), (1, 0.3, 0.5)]
    kept = filter_probs(probs, torch.tensor([s[0] for s in settings]),
                        torch.tensor([s[1] for s in settings]),
                        torch.tensor([s[2] for s in settings]))
    for row, (k, p, m) in enumerate(settings):
        expected = naive_keep(probs[row].tolist(), k, p, m)
        assert set(kept[row].nonzero().flatten().tolist()) == expected
        assert torch.equal(kept[row][list(expected)], probs[row][list(expected)])


def test_sampling_frequencies_and_reported_logprobs():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]]).repeat(4000, 1)
    tokens, logprobs = sample(logits, [RowSampling(0.5, 0.9, -1, 0.0)] * 4000, seed=1)
    probs = torch.softmax(logits[0] / 0.5, dim=-1)
    keep = filter_probs(probs[None], torch.tensor([-1]), torch.tensor([0.9]),
                        torch.tensor([0.0]))[0]
    freq = torch.bincount(tokens, minlength=4).double() / 4000
    assert torch.allclose(freq, keep.double() / keep.sum(), atol=0.03)
    assert torch.allclose(logprobs, torch.log(probs)[tokens], atol=1e-6)


def test_mixed_batch_seeded_rows_and_banned_tokens():
    logits = torch.zeros(3, 10)
    logits[1, 7] = 5.0
    rows = [RowSampling(1.0, 1.0, -1, 0.0, torch.Generator().manual_seed(5)),
            RowSampling(0.0, 1.0, -1, 0.0),
            RowSampling(1.0, 1.0, -1, 0.0, torch.Generator().manual_seed(5))]
    tokens, logprobs = sample(logits, rows, banned={0: (3,), 2: (3,)})
    assert tokens[0] == tokens[2] and tokens[1] == 7  # same seed, same draw; greedy row
    assert torch.allclose(logprobs[1], torch.log_softmax(logits[1], -1)[7])
    many = [RowSampling(1.0, 1.0, -1, 0.0)] * 500
    tokens, _ = sample(torch.zeros(500, 4), many, banned={i: (0, 1, 2) for i in range(500)})
    assert set(tokens.tolist()) == {3}
