"""Loss aggregation: reduce a per-token loss matrix [B, T] to a scalar, split-invariantly.

Modes (verl's `actor.loss_agg_mode`), with m the mask, N the valid tokens, S the non-empty rows:
  token-mean               sum_it m l / N
  token-sum                sum_it m l
  seq-mean-token-sum       sum_i (sum_t m l) / S
  seq-mean-token-mean      sum_i (sum_t m l / n_i) / S        (n_i valid tokens of row i)
  seq-mean-token-sum-norm  sum_i (sum_t m l / norm_len) / S   (Dr. GRPO; norm_len a constant)
Rows with no valid token contribute nothing and are not counted in S.

Composing over micro-batches and data-parallel ranks: every mode is a sum over rows divided by a
count of the whole mini-batch. Sum `loss_counts(mask)` over all micro-batches and ranks (an
all-reduce), pass it as `global_counts` to each micro-batch's `aggregate_loss`, and the sum of the
partial losses equals the loss of the unsplit mini-batch, however it was split or padded. Where
the data-parallel gradient reduction averages over ranks, multiply each rank's loss by the
data-parallel size so that the average is that sum.

Note: verl's seq-mean-token-sum-norm divides by the constant only, not by the number of rows;
megarl follows the Dr. GRPO objective (and the mode's name) and takes the mean over rows.
"""

from __future__ import annotations

import torch

from megarl.algo.masked import masked_count, masked_sum

LOSS_AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


def loss_counts(loss_mask: torch.Tensor) -> torch.Tensor:
    """[2] float64: (valid tokens, rows with at least one valid token) of this shard.

    loss_mask [B, T]. Sum it over micro-batches and all-reduce it over data-parallel ranks to get
    the `global_counts` of a mini-batch.
    """
    tokens_per_row = loss_mask.to(torch.float64).sum(dim=-1)
    return torch.stack([tokens_per_row.sum(), (tokens_per_row > 0).to(torch.float64).sum()])


def _check_mode(loss_agg_mode: str, norm_len: float | None) -> None:
    """Reject unknown modes and a missing or non-positive norm_len."""
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(
            f"actor.loss_agg_mode: unknown mode {loss_agg_mode!r}; valid modes: "
            f"{', '.join(LOSS_AGG_MODES)}"
        )
    if loss_agg_mode == "seq-mean-token-sum-norm" and (norm_len is None or norm_len <= 0):
        raise ValueError(
            "loss_agg_mode='seq-mean-token-sum-norm' needs norm_len > 0: a constant such as the "
            f"maximum response length (got {norm_len}), so that the loss does not depend on padding"
        )


def aggregate_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    *,
    global_counts: torch.Tensor | None = None,
    norm_len: float | None = None,
) -> torch.Tensor:
    """Reduce loss_mat [B, T] over the valid tokens of loss_mask [B, T] to a scalar.

    global_counts: `loss_counts` summed over the whole mini-batch (all micro-batches and ranks);
    None uses this batch's own counts. norm_len: the constant of seq-mean-token-sum-norm.
    A zero count gives a zero loss (with zero gradient), never NaN. The result is at least fp32.
    """
    _check_mode(loss_agg_mode, norm_len)
    if loss_mat.shape != loss_mask.shape or loss_mat.dim() != 2:
        raise ValueError(
            f"loss_mask: shape {tuple(loss_mask.shape)} must equal loss_mat's "
            f"{tuple(loss_mat.shape)}, both [B, T]"
        )
    # Reduce in at least fp32: a bf16 token count of a large mini-batch is not exact.
    loss_mat = loss_mat.to(torch.promote_types(loss_mat.dtype, torch.float32))
    counts = loss_counts(loss_mask) if global_counts is None else global_counts
    counts = counts.to(device=loss_mat.device, dtype=loss_mat.dtype).clamp(min=1)
    num_tokens, num_rows = counts[0], counts[1]
    if loss_agg_mode == "token-sum":
        return masked_sum(loss_mat, loss_mask)
    if loss_agg_mode == "token-mean":
        return masked_sum(loss_mat, loss_mask) / num_tokens
    row_sums = masked_sum(loss_mat, loss_mask, dim=-1)
    if loss_agg_mode == "seq-mean-token-sum":
        return row_sums.sum() / num_rows
    if loss_agg_mode == "seq-mean-token-mean":
        row_lengths = masked_count(loss_mask, loss_mat, dim=-1).clamp(min=1)
        return (row_sums / row_lengths).sum() / num_rows
    return row_sums.sum() / (norm_len * num_rows)
