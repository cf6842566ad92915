"""The KL penalty in the reward (verl's ``algorithm.use_kl_in_reward``) and its coefficient
controllers, as pure tensor functions and two small state objects.

Shapes: B sequences, T response positions; ``response_mask`` [B, T] marks response tokens.
  token_level_rewards = token_level_scores - beta * KL_t,   KL_t = kl_penalty(old, ref) * mask
where ``token_level_scores`` holds each sequence's score on its last response token
(:func:`megarl.algo.advantages.outcome_to_token_rewards`). The KL the controller sees, and the
metric ``actor/reward_kl_penalty``, is verl's: the mean over sequences of each sequence's mean
KL per response token (rows without response tokens are left out).
"""

from __future__ import annotations

from typing import Protocol

import torch

from megarl.algo.kl import kl_penalty
from megarl.algo.masked import masked_mean

PROPORTIONAL_ERROR_CLIP = 0.2  # verl's AdaptiveKLController clips (kl / target - 1) to +-0.2


class KLController(Protocol):
    """A coefficient ``value`` (beta) updated once per step from the step's KL."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> None:
        """Adjust ``value`` after a step whose batch had ``n_steps`` sequences."""

    def state_dict(self) -> dict[str, float]:
        """What a checkpoint keeps."""

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore from :meth:`state_dict`."""


class FixedKLController:
    """A constant coefficient."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """A fixed coefficient does not change."""

    def state_dict(self) -> dict[str, float]:
        """The coefficient."""
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore the coefficient."""
        self.value = float(state["value"])


class AdaptiveKLController:
    """Ziegler et al.'s proportional controller, as verl's: steers the KL towards ``target_kl``;
    beta *= 1 + clip(kl / target_kl - 1, -0.2, 0.2) * n_steps / horizon."""

    def __init__(self, kl_coef: float, target_kl: float, horizon: int) -> None:
        self.value, self.target_kl, self.horizon = float(kl_coef), float(target_kl), int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move beta by the clipped proportional error, scaled by ``n_steps / horizon``."""
        error = min(max(current_kl / self.target_kl - 1.0, -PROPORTIONAL_ERROR_CLIP),
                    PROPORTIONAL_ERROR_CLIP)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        """The current coefficient (target and horizon come from the config)."""
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore the coefficient."""
        self.value = float(state["value"])


def make_kl_controller(kind: str, kl_coef: float, target_kl: float,
                       horizon: int) -> KLController:
    """The controller ``kind`` (``fixed`` or ``adaptive``, ``algorithm.kl_ctrl.type``)."""
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if kind == "adaptive":
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"algorithm.kl_ctrl.type: unknown controller {kind!r}; use fixed or adaptive")


def kl_in_reward(token_level_scores: torch.Tensor, old_log_probs: torch.Tensor,
                 ref_log_probs: torch.Tensor, response_mask: torch.Tensor, *, kl_coef: float,
                 kl_type: str = "kl") -> tuple[torch.Tensor, float]:
    """Token-level rewards with the KL penalty subtracted, and the batch's KL.

    token_level_scores, old_log_probs, ref_log_probs, response_mask [B, T] ->
    (token_level_rewards [B, T], mean over sequences of the per-token KL mean).
    """
    mask = response_mask.to(token_level_scores.dtype)
    kld = kl_penalty(old_log_probs.to(mask.dtype), ref_log_probs.to(mask.dtype), kl_type) * mask
    rewards = token_level_scores - kl_coef * kld
    has_tokens = mask.sum(dim=-1) > 0
    per_sequence = masked_mean(kld, mask, dim=-1)[has_tokens]
    current_kl = float(per_sequence.mean()) if per_sequence.numel() else 0.0
    return rewards, current_kl


def apply_kl_in_reward(token_level_scores: torch.Tensor, old_log_probs: torch.Tensor,
                       ref_log_probs: torch.Tensor, response_mask: torch.Tensor,
                       controller: KLController,
                       kl_type: str = "kl") -> tuple[torch.Tensor, dict[str, float]]:
    """:func:`kl_in_reward` with the controller's beta, then the controller's update (verl's
    ``apply_kl_penalty``); returns the rewards and ``actor/reward_kl_penalty{,_coeff}``."""
    beta = controller.value
    rewards, current_kl = kl_in_reward(token_level_scores, old_log_probs, ref_log_probs,
                                       response_mask, kl_coef=beta, kl_type=kl_type)
    n_steps = int((response_mask.sum(dim=-1) > 0).sum())
    controller.update(current_kl, n_steps)
    return rewards, {"actor/reward_kl_penalty": current_kl,
                     "actor/reward_kl_penalty_coeff": beta}
