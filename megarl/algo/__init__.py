"""RL algorithms as pure tensor functions: advantages, policy losses, KL, aggregation, corrections.

Nothing here knows about engines or configs; every function takes tensors and masks and says
its shapes in its docstring. Names follow verl's so that configs and habits carry over.
"""

from megarl.algo.advantages import (
    ADVANTAGE_ESTIMATORS,
    compute_advantages,
    discounted_returns,
    gae_advantages,
    get_advantage_estimator,
    grpo_advantages,
    outcome_to_token_rewards,
    reinforce_plus_plus_advantages,
    rloo_advantages,
)
from megarl.algo.aggregation import LOSS_AGG_MODES, aggregate_loss, loss_counts
from megarl.algo.entropy import entropy_from_logits
from megarl.algo.kl import KL_ESTIMATORS, kl_penalty
from megarl.algo.kl_reward import (
    AdaptiveKLController,
    FixedKLController,
    KLController,
    apply_kl_in_reward,
    kl_in_reward,
    make_kl_controller,
)
from megarl.algo.masked import masked_mean, masked_sum, masked_var, masked_whiten
from megarl.algo.policy_loss import (
    POLICY_LOSSES,
    SEQUENCE_LEVEL_LOSSES,
    cispo_policy_loss,
    clip_cov_policy_loss,
    dppo_kl_policy_loss,
    dppo_tv_policy_loss,
    geo_mean_policy_loss,
    get_policy_loss,
    gpg_policy_loss,
    gspo_policy_loss,
    kl_cov_policy_loss,
    policy_loss_options,
    ppo_policy_loss,
    sapo_policy_loss,
)
from megarl.algo.rollout_correction import (
    IS_LEVELS,
    RS_CRITERIA,
    compute_rollout_correction,
    off_policy_metrics,
    rollout_is_weights,
    rollout_probs_diff_metrics,
    rollout_rejection_mask,
    router_agreement,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "IS_LEVELS",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "RS_CRITERIA",
    "SEQUENCE_LEVEL_LOSSES",
    "AdaptiveKLController",
    "FixedKLController",
    "KLController",
    "aggregate_loss",
    "apply_kl_in_reward",
    "cispo_policy_loss",
    "clip_cov_policy_loss",
    "compute_advantages",
    "compute_rollout_correction",
    "discounted_returns",
    "dppo_kl_policy_loss",
    "dppo_tv_policy_loss",
    "entropy_from_logits",
    "gae_advantages",
    "geo_mean_policy_loss",
    "get_advantage_estimator",
    "get_policy_loss",
    "gpg_policy_loss",
    "grpo_advantages",
    "gspo_policy_loss",
    "kl_cov_policy_loss",
    "kl_in_reward",
    "kl_penalty",
    "loss_counts",
    "make_kl_controller",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "off_policy_metrics",
    "outcome_to_token_rewards",
    "policy_loss_options",
    "ppo_policy_loss",
    "reinforce_plus_plus_advantages",
    "rloo_advantages",
    "rollout_is_weights",
    "rollout_probs_diff_metrics",
    "rollout_rejection_mask",
    "router_agreement",
    "sapo_policy_loss",
]
