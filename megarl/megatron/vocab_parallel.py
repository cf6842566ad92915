"""Log-probabilities and entropy over a vocabulary split across tensor-parallel ranks.

Each TP rank holds logits for a contiguous slice of the vocabulary. The softmax statistics
(max, sum of exponentials, target logit, sum of p*z) are reduced over the TP group, so no rank
ever holds full-vocabulary logits. One autograd function computes both outputs and their
gradient with respect to the local logits:

- log p_t = z_t - logZ,            d/dz_k = 1[k = t] - p_k
- H = logZ - sum_k p_k z_k,        d/dz_k = -p_k (log p_k + H)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# logit for vocabulary rows that pad the output layer beyond the tokenizer's vocabulary
_MASKED_LOGIT = -1e30


class _VocabParallelLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z, target, vocab_start, vocab_size, group):
        """(log_probs, entropy) from the local logits ``z`` (already divided by temperature)."""
        local_vocab = z.shape[-1]
        padded_cols = min(vocab_start + local_vocab - vocab_size, local_vocab)
        if padded_cols > 0:
            z = z.clone()
            z[..., local_vocab - padded_cols :] = _MASKED_LOGIT
        z_max = z.max(dim=-1).values
        _all_reduce(z_max, dist.ReduceOp.MAX, group)
        shifted_exp = torch.exp(z - z_max.unsqueeze(-1))
        sum_exp = shifted_exp.sum(dim=-1)
        _all_reduce(sum_exp, dist.ReduceOp.SUM, group)
        log_z = z_max + torch.log(sum_exp)

        local_index = target - vocab_start
        in_shard = (local_index >= 0) & (local_index < local_vocab)
        local_index = local_index.clamp(0, local_vocab - 1)
        target_logit = z.gather(-1, local_index.unsqueeze(-1)).squeeze(-1) * in_shard
        _all_reduce(target_logit, dist.ReduceOp.SUM, group)
        log_probs = target_logit - log_z

        probs = shifted_exp / sum_exp.unsqueeze(-1)
        expected_logit = (probs * z).sum(dim=-1)
        _all_reduce(expected_logit, dist.ReduceOp.SUM, group)
        entropy = log_z - expected_logit

        ctx.save_for_backward(z, log_z, entropy, local_index, in_shard)
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        """Gradient with respect to the local logits only (no communication)."""
        z, log_z, entropy, local_index, in_shard = ctx.saved_tensors
        log_p = z - log_z.unsqueeze(-1)
        probs = torch.exp(log_p)
        grad = torch.zeros_like(z)
        if grad_log_probs is not None:
            grad -= probs * grad_log_probs.unsqueeze(-1)
            grad.scatter_add_(
                -1, local_index.unsqueeze(-1), (grad_log_probs * in_shard).unsqueeze(-1)
            )
        if grad_entropy is not None:
            grad -= probs * (log_p + entropy.unsqueeze(-1)) * grad_entropy.unsqueeze(-1)
        return grad, None, None, None, None


def _all_reduce(t: torch.Tensor, op: dist.ReduceOp, group) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)


def vocab_parallel_log_probs(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    vocab_start: int = 0,
    vocab_size: int | None = None,
    temperature: float = 1.0,
    group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of ``target`` and entropy of ``softmax(logits / temperature)``, both ``[...]``.

    ``logits`` is ``[..., V_local]``: this rank's vocabulary slice starting at ``vocab_start``,
    reduced over ``group`` (None: a single rank holds the whole vocabulary). Columns at global
    index >= ``vocab_size`` (output-layer padding) are excluded. Computed in fp32;
    differentiable in ``logits``.
    """
    if temperature <= 0:
        raise ValueError(f"temperature={temperature}: must be > 0")
    total = vocab_start + logits.shape[-1]
    if group is not None:
        total = logits.shape[-1] * dist.get_world_size(group)
    z = logits.float() / temperature
    return _VocabParallelLogProbs.apply(
        z, target, vocab_start, total if vocab_size is None else vocab_size, group
    )
