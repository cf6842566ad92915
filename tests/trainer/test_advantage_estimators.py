"""Every ``algorithm.adv_estimator`` the trainer runs: the advantage step feeds each estimator
its inputs (outcome scores per group, or token-level rewards for reinforce_plus_plus)."""

from __future__ import annotations

import pytest
import torch

from megarl.algo import compute_advantages, kl_penalty, outcome_to_token_rewards
from tests.trainer.test_kl_in_reward import KL_ON, fake_batch, trainer_with


@pytest.mark.parametrize("estimator", ["grpo_passk", "opo", "gpg",
                                       "reinforce_plus_plus_baseline"])
def test_outcome_estimators_get_the_group_scores(estimator: str) -> None:
    trainer = trainer_with(f"algorithm.adv_estimator={estimator}")
    batch = fake_batch()
    trainer.compute_advantages(batch, None, {})
    mask = batch.response_mask()
    inputs = {"scores": batch.scores, "response_mask": mask, "index": batch.group_index()}
    if estimator == "grpo_passk":
        inputs["norm_adv_by_std_in_grpo"] = True
    expected, _ = compute_advantages(estimator, **inputs)
    assert torch.allclose(batch.advantages, expected, atol=1e-6)
    assert batch.advantages.abs().sum() > 0


def test_reinforce_plus_plus_takes_the_token_level_rewards() -> None:
    trainer = trainer_with(*KL_ON, "algorithm.adv_estimator=reinforce_plus_plus",
                           "algorithm.gamma=0.9")
    batch = fake_batch()
    trainer.compute_advantages(batch, None, {})
    mask = batch.response_mask()
    kl = kl_penalty(batch.padded(batch.old_log_probs), batch.padded(batch.ref_log_probs),
                    "low_var_kl") * mask
    rewards = outcome_to_token_rewards(batch.scores, mask) - 0.5 * kl
    expected, _ = compute_advantages("reinforce_plus_plus", token_level_rewards=rewards,
                                     response_mask=mask, gamma=0.9)
    assert torch.allclose(batch.advantages, expected, atol=1e-5)


def test_remax_is_refused_with_the_reason() -> None:
    trainer = trainer_with("algorithm.adv_estimator=remax")
    with pytest.raises(ValueError, match="greedy baseline rollout"):
        trainer.compute_advantages(fake_batch(), None, {})
