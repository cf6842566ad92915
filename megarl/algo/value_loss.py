"""The PPO value-function loss of the critic (GAE), as a pure tensor function.

Shapes: B sequences, T positions; every tensor is [B, T] and ``response_mask`` marks the tokens
the critic is trained on. The loss is verl's clipped value loss:

    v_clip = clamp(v, V_old - c, V_old + c)
    loss   = 0.5 * agg(max((v - R)^2, (v_clip - R)^2))

with ``agg`` the split-invariant aggregation of :mod:`megarl.algo.aggregation` (token-mean by
default), so micro-batch losses sum to the mini-batch loss when ``global_counts`` is given.
"""

from __future__ import annotations

import torch

from megarl.algo.aggregation import aggregate_loss
from megarl.algo.masked import masked_mean


def value_loss(
    vpreds: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    global_counts: torch.Tensor | None = None,
    norm_len: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss of predictions ``vpreds`` against ``returns``, clipped around
    ``old_values`` (the values GAE used); all [B, T].

    ``norm_len`` is the constant of ``seq-mean-token-sum-norm`` (the maximum response length).
    Returns the scalar loss and ``vf_clipfrac`` (fraction of valid tokens where the clipped
    error is the larger one) and ``vpred_mean`` (mean prediction over valid tokens), both
    over this batch's own tokens.
    """
    if cliprange_value <= 0:
        raise ValueError(f"critic.cliprange_value={cliprange_value}: must be > 0")
    for name, t in (("old_values", old_values), ("returns", returns),
                    ("response_mask", response_mask)):
        if t.shape != vpreds.shape:
            raise ValueError(f"value_loss: {name} has shape {tuple(t.shape)}, vpreds "
                             f"{tuple(vpreds.shape)}; give every tensor as [B, T]")
    old_values, returns = old_values.to(vpreds.dtype), returns.to(vpreds.dtype)
    clipped = torch.clamp(vpreds, old_values - cliprange_value, old_values + cliprange_value)
    unclipped_error = (vpreds - returns).square()
    clipped_error = (clipped - returns).square()
    loss_mat = torch.maximum(unclipped_error, clipped_error)
    loss = 0.5 * aggregate_loss(loss_mat, response_mask, loss_agg_mode,
                                global_counts=global_counts, norm_len=norm_len)
    metrics = {
        "vf_clipfrac": masked_mean((clipped_error > unclipped_error).to(vpreds.dtype),
                                   response_mask).detach(),
        "vpred_mean": masked_mean(vpreds, response_mask).detach(),
    }
    return loss, metrics
