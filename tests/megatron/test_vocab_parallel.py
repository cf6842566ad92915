"""Vocabulary-parallel log-probs and entropy against torch.log_softmax, values and gradients."""

from __future__ import annotations

import torch

from megarl.megatron.vocab_parallel import vocab_parallel_log_probs

VOCAB, TOKENS, TEMPERATURE = 24, 10, 0.7


def reference(logits: torch.Tensor, target: torch.Tensor, vocab_size: int = VOCAB):
    """log p(target) and entropy with full-vocabulary autograd, padding columns dropped."""
    logp = torch.log_softmax(logits[..., :vocab_size].double() / TEMPERATURE, dim=-1)
    return logp.gather(-1, target[..., None])[..., 0], -(logp.exp() * logp).sum(-1)


def weighted_loss(log_probs: torch.Tensor, entropy: torch.Tensor) -> torch.Tensor:
    """A loss that uses both outputs with per-token weights (so both backward terms count)."""
    w = torch.linspace(-1.0, 2.0, log_probs.numel()).reshape(log_probs.shape)
    return (w * log_probs).sum() + (w.flip(-1) * entropy).sum() * 0.3


def inputs(seed: int = 0, vocab: int = VOCAB):
    """Random logits ``[TOKENS, vocab]`` and targets."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(TOKENS, vocab, generator=g) * 3, torch.randint(
        0, VOCAB, (TOKENS,), generator=g
    )


def test_single_rank_values_and_gradients():
    logits, target = inputs()
    ours_in = logits.clone().requires_grad_()
    ref_in = logits.double().clone().requires_grad_()
    lp, ent = vocab_parallel_log_probs(ours_in, target, temperature=TEMPERATURE)
    ref_lp, ref_ent = reference(ref_in, target)
    torch.testing.assert_close(lp.double(), ref_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent.double(), ref_ent, atol=1e-5, rtol=0)
    weighted_loss(lp, ent).backward()
    weighted_loss(ref_lp, ref_ent).backward()
    torch.testing.assert_close(ours_in.grad.double(), ref_in.grad, atol=1e-5, rtol=0)


def test_padded_vocabulary_columns_are_ignored():
    logits, target = inputs(seed=1, vocab=VOCAB + 8)
    logits[:, VOCAB:] = 50.0  # padding rows of the output layer must not count
    lp, ent = vocab_parallel_log_probs(logits, target, vocab_size=VOCAB, temperature=TEMPERATURE)
    ref_lp, ref_ent = reference(logits, target)
    torch.testing.assert_close(lp.double(), ref_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent.double(), ref_ent, atol=1e-5, rtol=0)


def two_rank_shard() -> dict:
    """Run on a rank of a 2-rank world: this rank's half of the vocabulary."""
    import torch.distributed as dist

    rank = dist.get_rank()
    logits, target = inputs(seed=2)
    half = VOCAB // 2
    local = logits[:, rank * half : (rank + 1) * half].clone().requires_grad_()
    lp, ent = vocab_parallel_log_probs(
        local, target, vocab_start=rank * half, temperature=TEMPERATURE, group=dist.group.WORLD
    )
    weighted_loss(lp, ent).backward()
    return {"lp": lp.detach(), "ent": ent.detach(), "grad": local.grad}


def test_two_ranks_match_full_vocabulary(pool2):
    rank0, rank1 = pool2.run(two_rank_shard)
    logits, target = inputs(seed=2)
    ref_in = logits.double().clone().requires_grad_()
    ref_lp, ref_ent = reference(ref_in, target)
    weighted_loss(ref_lp, ref_ent).backward()
    for r in (rank0, rank1):
        torch.testing.assert_close(r["lp"].double(), ref_lp.detach(), atol=1e-5, rtol=0)
        torch.testing.assert_close(r["ent"].double(), ref_ent.detach(), atol=1e-5, rtol=0)
    grad = torch.cat([rank0["grad"], rank1["grad"]], dim=-1)
    torch.testing.assert_close(grad.double(), ref_in.grad, atol=1e-5, rtol=0)
