"""``algorithm.rollout_correction`` as verl users write it reaches the correction: an IcePop
band, batch normalisation, several rejection criteria with one threshold each."""

from __future__ import annotations

import torch

from megarl.algo import compute_rollout_correction
from tests.trainer.test_kl_in_reward import fake_batch, trainer_with

RC = "algorithm.rollout_correction."


def test_band_normalisation_and_several_criteria_reach_the_correction() -> None:
    trainer = trainer_with(RC + "rollout_is=token", RC + "rollout_is_threshold='0.3_1.5'",
                           RC + "rollout_is_batch_normalize=true",
                           RC + "rollout_rs=token_k1,seq_max_k3",
                           RC + "rollout_rs_threshold='0.5_2.0,0.3'")
    batch = fake_batch()
    metrics = trainer._rollout_correction(batch)
    weights, keep, _ = compute_rollout_correction(
        batch.padded(batch.old_log_probs), batch.rollout_log_probs(), batch.response_mask(),
        rollout_is="token", rollout_is_threshold=1.5, rollout_is_threshold_lower=0.3,
        rollout_is_batch_normalize=True, rollout_rs=["token_k1", "seq_max_k3"],
        rollout_rs_threshold=[(0.5, 2.0), (None, 0.3)])
    torch.testing.assert_close(batch.rollout_is_weights, weights)
    torch.testing.assert_close(batch.loss_mask, keep)
    assert 0 < metrics["rollout_corr/rollout_rs_masked_fraction"] < 1
    assert metrics["rollout_corr/rollout_is_batch_norm_factor"] != 1.0
    assert {"rollout_corr/rollout_is_eff_sample_size", "rollout_corr/ppl_ratio",
            "rollout_corr/chi2_seq", "rollout_corr/rollout_rs_seq_max_k3_masked_fraction"} \
        <= set(metrics)
