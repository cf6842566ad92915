"""Per-token KL estimators between the policy and a reference, from sampled-token log-probs.

With d = log_probs - ref_log_probs (tokens sampled from the policy):
  kl / k1           d                              unbiased, high variance, can be negative
  abs               |d|
  mse / k2          d^2 / 2
  low_var_kl / k3   exp(-d) + d - 1, with -d clamped to [-20, 20] and the result to [-10, 10]
A "+" suffix (k1+, k3+, low_var_kl+, ...) keeps the value of the named estimator and takes the
gradient of k2 (straight-through), whose gradient is an unbiased estimate of the KL's gradient.
Names follow verl's `actor.kl_loss_type`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_K3_LOG_RATIO_BOUND = 20.0
_K3_VALUE_BOUND = 10.0


def _k1(diff: torch.Tensor) -> torch.Tensor:
    """k1: the log-ratio itself."""
    return diff


def _abs(diff: torch.Tensor) -> torch.Tensor:
    """Absolute log-ratio."""
    return diff.abs()


def _k2(diff: torch.Tensor) -> torch.Tensor:
    """k2: half the squared log-ratio."""
    return 0.5 * diff.square()


def _k3(diff: torch.Tensor) -> torch.Tensor:
    """k3 (Schulman's low-variance estimator), clamped as verl does."""
    ref_minus_policy = (-diff).clamp(-_K3_LOG_RATIO_BOUND, _K3_LOG_RATIO_BOUND)
    value = torch.exp(ref_minus_policy) - ref_minus_policy - 1.0
    return value.clamp(-_K3_VALUE_BOUND, _K3_VALUE_BOUND)


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "kl": _k1,
    "k1": _k1,
    "abs": _abs,
    "mse": _k2,
    "k2": _k2,
    "low_var_kl": _k3,
    "k3": _k3,
}


def kl_penalty(
    log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kl_type: str
) -> torch.Tensor:
    """Per-token KL estimate between policy and reference; log_probs, ref_log_probs [...] -> [...].

    Mask and aggregate the result like any per-token loss. kl_type is one of KL_ESTIMATORS'
    names, optionally with a "+" suffix for straight-through k2 gradients.
    """
    straight_through = kl_type.endswith("+")
    base = kl_type[:-1] if straight_through else kl_type
    if base not in KL_ESTIMATORS:
        valid = ", ".join(sorted(KL_ESTIMATORS))
        raise ValueError(
            f"actor.kl_loss_type: unknown estimator {kl_type!r}; valid names: {valid} "
            f"(each optionally with a '+' suffix for k2 gradients)"
        )
    if log_probs.shape != ref_log_probs.shape:
        raise ValueError(
            f"ref_log_probs: shape {tuple(ref_log_probs.shape)} differs from log_probs "
            f"{tuple(log_probs.shape)}"
        )
    diff = log_probs - ref_log_probs
    value = KL_ESTIMATORS[base](diff)
    if not straight_through:
        return value
    surrogate = _k2(diff)
    return surrogate - surrogate.detach() + value.detach()
