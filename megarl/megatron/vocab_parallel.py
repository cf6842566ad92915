"""Log-probabilities and entropy over a vocabulary split across tensor-parallel ranks.

Each TP rank holds logits for a contiguous slice of the vocabulary. The softmax statistics
(max, sum of exponentials, target logit, sum of exp * z) are reduced over the TP group, so no rank
ever holds full-vocabulary logits. One autograd function computes both outputs and their
gradient with respect to the local logits:

- log p_t = z_t - logZ,            d/dz_k = 1[k = t] - p_k
- H = logZ - sum_k p_k z_k,        d/dz_k = -p_k (log p_k + H)

The logits stay in their own dtype (bf16 on GPU): fp32 copies exist only for a chunk of rows at a
time (:data:`CHUNK_ELEMENTS`), in the forward and again in the backward, which recomputes them
from the saved logits. Two all-reduces per call (the max, then the three sums together).
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.distributed as dist

from megarl.kernels import triton_vocab_kernels

CHUNK_ELEMENTS = 1 << 26
"""fp32 elements (256 MiB) of one chunk of rows processed at a time."""


def _row_chunks(rows: int, cols: int) -> list[tuple[int, int]]:
    step = max(1, CHUNK_ELEMENTS // max(cols, 1))
    return [(start, min(start + step, rows)) for start in range(0, rows, step)]


class _VocabParallelLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_start, valid_cols, temperature, group):
        """(log_probs, entropy) ``[N]`` of ``logits [N, V_local] / temperature``; columns from
        ``valid_cols`` on are output-layer padding."""
        rows = logits.shape[0]
        z = logits[:, :valid_cols]
        if valid_cols > 0:
            z_max = z.amax(dim=-1).float() / temperature
        else:
            z_max = logits.new_full((rows,), float("-inf"), dtype=torch.float32)
        _all_reduce(z_max, dist.ReduceOp.MAX, group)

        sums = torch.zeros(3, rows, dtype=torch.float32, device=logits.device)
        for start, end in _row_chunks(rows, valid_cols) if valid_cols > 0 else []:
            zf = z[start:end].float() / temperature
            shifted_exp = torch.exp(zf - z_max[start:end, None])
            sums[0, start:end] = shifted_exp.sum(dim=-1)
            sums[2, start:end] = (shifted_exp * zf).sum(dim=-1)
        local_index = target - vocab_start
        in_shard = (local_index >= 0) & (local_index < valid_cols)
        local_index = local_index.clamp(0, max(valid_cols - 1, 0))
        target_logit = logits.gather(-1, local_index.unsqueeze(-1)).squeeze(-1).float()
        sums[1] = target_logit / temperature * in_shard
        _all_reduce(sums, dist.ReduceOp.SUM, group)

        log_z = z_max + torch.log(sums[0])
        log_probs = sums[1] - log_z
        entropy = log_z - sums[2] / sums[0]
        ctx.save_for_backward(logits, log_z, entropy, local_index, in_shard)
        ctx.valid_cols, ctx.temperature = valid_cols, temperature
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        """Gradient with respect to the local logits only (no communication), chunk by chunk."""
        logits, log_z, entropy, local_index, in_shard = ctx.saved_tensors
        valid_cols, temperature = ctx.valid_cols, ctx.temperature
        grad_logits = torch.zeros_like(logits)
        for start, end in _row_chunks(logits.shape[0], valid_cols) if valid_cols > 0 else []:
            rows = slice(start, end)
            grad_logits[rows, :valid_cols] = logits_grad(
                logits[rows, :valid_cols], rows, log_z, entropy, local_index, in_shard,
                grad_log_probs, grad_entropy, temperature)
        return grad_logits, None, None, None, None, None


def logits_grad(z: torch.Tensor, rows: slice, log_z: torch.Tensor, entropy: torch.Tensor,
                local_index: torch.Tensor, in_shard: torch.Tensor,
                grad_log_probs: torch.Tensor | None, grad_entropy: torch.Tensor | None,
                temperature: float) -> torch.Tensor:
    """fp32 gradient of the loss with respect to the chunk ``z`` (rows ``rows`` of the local,
    valid logit columns) from the gradients of its log-probs and entropies."""
    log_p = (z.float() / temperature).sub_(log_z[rows, None])
    probs = torch.exp(log_p)
    # -dL/dz = p * (g_lp + g_ent * (log p + H)), then the target column gets + g_lp
    if grad_entropy is not None:
        coef = log_p.add_(entropy[rows, None]).mul_(grad_entropy[rows, None])
        if grad_log_probs is not None:
            coef.add_(grad_log_probs[rows, None])
    else:
        coef = grad_log_probs[rows, None]
    grad = probs.mul_(coef).neg_()
    if grad_log_probs is not None:
        g = grad_log_probs[rows] * in_shard[rows]
        grad.scatter_add_(-1, local_index[rows].unsqueeze(-1), g.unsqueeze(-1))
    return grad.div_(temperature)


def _vocab_kernels(z: torch.Tensor) -> ModuleType | None:
    """The Triton kernels (:mod:`megarl.kernels.triton_vocab`) for the chunk ``z``, or None."""
    if not (z.is_cuda and z.shape[1] > 0 and z.stride(1) == 1):
        return None
    return triton_vocab_kernels()


def local_stats(z: torch.Tensor, local_index: torch.Tensor, temperature: float) -> torch.Tensor:
    """``[4, rows]`` fp32 of this rank's columns ``z / temperature``: the row max ``m``,
    ``sum exp(x - m)``, ``sum exp(x - m) x`` and the logit at ``local_index`` (torch)."""
    out = torch.zeros(4, z.shape[0], dtype=torch.float32, device=z.device)
    if z.shape[1] == 0:
        out[0] = float("-inf")
        return out
    out[0] = z.amax(dim=-1).float() / temperature
    zf = z.float() / temperature
    shifted_exp = torch.exp(zf - out[0, :, None])
    out[1] = shifted_exp.sum(dim=-1)
    out[2] = (shifted_exp * zf).sum(dim=-1)
    out[3] = z.gather(-1, local_index.unsqueeze(-1)).squeeze(-1).float() / temperature
    return out


def chunk_log_probs(z: torch.Tensor, local_index: torch.Tensor, in_shard: torch.Tensor,
                    temperature: float, group) -> tuple[torch.Tensor, ...]:
    """(log_probs, entropy, log_z) ``[rows]`` of one chunk of rows of the local, valid logit
    columns ``z`` (two all-reduces over ``group``: the max, then the three sums, each rank's
    rescaled from its own max). On CUDA the local statistics are one Triton pass over ``z``."""
    tri = _vocab_kernels(z)
    if tri is not None and tri.checked("vocab_stats",
                                   lambda: tri.chunk_stats(z, local_index, temperature),
                                   lambda: local_stats(z, local_index, temperature)):
        stats = tri.chunk_stats(z, local_index, temperature)
    else:
        stats = local_stats(z, local_index, temperature)
    z_max = stats[0].clone()
    _all_reduce(z_max, dist.ReduceOp.MAX, group)
    # 1 where this rank holds the max (always on one rank); 0 for a rank without columns
    scale = torch.where(stats[0] > float("-inf"), torch.exp(stats[0] - z_max), 0.0)
    sums = torch.stack([stats[1] * scale, stats[3] * in_shard, stats[2] * scale])
    _all_reduce(sums, dist.ReduceOp.SUM, group)
    log_z = z_max + torch.log(sums[0])
    return sums[1] - log_z, log_z - sums[2] / sums[0], log_z


def chunk_logits_grad(z: torch.Tensor, rows: slice, log_z: torch.Tensor, entropy: torch.Tensor,
                      local_index: torch.Tensor, in_shard: torch.Tensor,
                      grad_log_probs: torch.Tensor | None, grad_entropy: torch.Tensor | None,
                      temperature: float) -> torch.Tensor:
    """:func:`logits_grad` in ``z``'s dtype; on CUDA one Triton pass over ``z``."""
    tri = _vocab_kernels(z)

    def fast() -> torch.Tensor:
        return tri.chunk_grad(
            z, log_z[rows], entropy[rows], local_index[rows], in_shard[rows],
            None if grad_log_probs is None else grad_log_probs[rows],
            None if grad_entropy is None else grad_entropy[rows], temperature)

    def reference() -> torch.Tensor:
        return logits_grad(z, rows, log_z, entropy, local_index, in_shard, grad_log_probs,
                           grad_entropy, temperature).to(z.dtype)

    if tri is not None and tri.checked("vocab_grad", fast, reference):
        return fast()
    return reference()


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
    index >= ``vocab_size`` (output-layer padding) are excluded. Computed in fp32 chunk by chunk;
    differentiable in ``logits`` (the gradient has ``logits``' dtype).
    """
    if temperature <= 0:
        raise ValueError(f"temperature={temperature}: must be > 0")
    local_vocab = logits.shape[-1]
    total = vocab_start + local_vocab
    if group is not None:
        total = local_vocab * dist.get_world_size(group)
    vocab_size = total if vocab_size is None else vocab_size
    valid_cols = max(0, min(local_vocab, vocab_size - vocab_start))
    lead = target.shape
    log_probs, entropy = _VocabParallelLogProbs.apply(
        logits.reshape(-1, local_vocab), target.reshape(-1), vocab_start, valid_cols,
        float(temperature), group,
    )
    return log_probs.view(lead), entropy.view(lead)
