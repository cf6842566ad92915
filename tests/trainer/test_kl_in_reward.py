"""``algorithm.use_kl_in_reward`` in the trainer: the advantage step takes token-level rewards
(score on the last token minus beta x KL(old || ref)), logs ``actor/reward_kl_penalty``, runs
after the old and reference log-probs, and the adaptive beta survives a checkpoint."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from megarl.algo import gae_advantages, grpo_advantages, kl_penalty, outcome_to_token_rewards
from megarl.batch import StepBatch
from megarl.config import load_config_dict
from megarl.rollout.interface import RolloutSample
from megarl.trainer import Trainer
from megarl.trainer.checkpoint import resume_run, save_run_checkpoint

BASE: dict[str, Any] = {
    "model": {"path": "/m"},
    "data": {"train_files": ["/t.parquet"], "train_batch_size": 2, "max_prompt_length": 8,
             "max_response_length": 6},
    "actor": {"ppo_mini_batch_size": 2, "ppo_micro_batch_size_per_gpu": 4},
    "rollout": {"n": 4},
    "resources": {"train_pool": {"nnodes": 1, "gpus_per_node": 1}},
}
LENGTHS = [3, 6, 1, 4, 5, 2, 6, 3]


def trainer_with(*overrides: str) -> Trainer:
    """A Trainer (not set up: no workers) of the base config with overrides."""
    cfg, sources = load_config_dict(BASE, list(overrides))
    return Trainer(cfg, sources)


def fake_batch() -> StepBatch:
    """2 prompts x 4 samples with scores and old/reference log-probs."""
    gen = torch.Generator().manual_seed(0)
    samples = [RolloutSample(prompt_index=i // 4, sample_index=i % 4, prompt_ids=[1, 2],
                             response_ids=list(range(3, 3 + n)), log_probs=[-1.0] * n,
                             finish_reason="stop", weight_version="0")
               for i, n in enumerate(LENGTHS)]
    batch = StepBatch(samples=samples, prompts=[{}, {}], n=4)
    batch.scores = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0])
    batch.old_log_probs = [(-torch.rand(n, generator=gen) * 2).tolist() for n in LENGTHS]
    batch.ref_log_probs = [(-torch.rand(n, generator=gen) * 2).tolist() for n in LENGTHS]
    return batch


KL_ON = ("algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.kl_coef=0.5",
         "algorithm.kl_penalty=low_var_kl")


def test_kl_in_reward_logs_the_penalty_and_changes_grpo_advantages() -> None:
    off, on = trainer_with(), trainer_with(*KL_ON)
    assert off.kl_ctrl is None and on.cfg.ref.enabled
    batch_off, batch_on = fake_batch(), fake_batch()
    m_off: dict[str, float] = {}
    m_on: dict[str, float] = {}
    off.compute_advantages(batch_off, None, m_off)
    on.compute_advantages(batch_on, None, m_on)
    assert "actor/reward_kl_penalty" not in m_off
    assert m_on["actor/reward_kl_penalty_coeff"] == 0.5
    mask = batch_on.response_mask()
    kl = kl_penalty(batch_on.padded(batch_on.old_log_probs),
                    batch_on.padded(batch_on.ref_log_probs), "low_var_kl") * mask
    per_seq = kl.sum(-1) / mask.sum(-1)
    assert m_on["actor/reward_kl_penalty"] == pytest.approx(float(per_seq.mean()), rel=1e-5)
    # verl's GRPO on token-level rewards: the outcome is their sum over the response
    expected, _ = grpo_advantages(batch_on.scores - 0.5 * kl.sum(-1), mask, batch_on.group_index())
    assert torch.allclose(batch_on.advantages, expected, atol=1e-5)
    assert not torch.allclose(batch_on.advantages, batch_off.advantages, atol=1e-3)


def test_gae_takes_the_token_level_rewards() -> None:
    on = trainer_with(*KL_ON, "algorithm.adv_estimator=gae", "algorithm.lam=0.9")
    batch = fake_batch()
    values = [[0.1 * t for t in range(n)] for n in LENGTHS]
    targets = on.compute_advantages(batch, values, {})
    mask = batch.response_mask()
    kl = kl_penalty(batch.padded(batch.old_log_probs), batch.padded(batch.ref_log_probs),
                    "low_var_kl") * mask
    rewards = outcome_to_token_rewards(batch.scores, mask) - 0.5 * kl
    expected, returns = gae_advantages(rewards, batch.padded(values), mask, gamma=1.0, lam=0.9)
    assert torch.allclose(batch.advantages, expected, atol=1e-5)
    assert targets is not None and torch.allclose(targets.returns, returns, atol=1e-5)


def test_train_on_computes_old_and_ref_log_probs_before_the_advantages(monkeypatch) -> None:
    trainer = trainer_with(*KL_ON, "algorithm.kl_ctrl.type=adaptive",
                           "algorithm.kl_ctrl.horizon=16")
    trainer.workers = SimpleNamespace(critic=None)
    batch, calls = fake_batch(), []
    old, ref = batch.old_log_probs, batch.ref_log_probs
    batch.old_log_probs, batch.ref_log_probs = [], None

    def old_log_probs(b: StepBatch) -> dict[str, float]:
        calls.append("old")
        b.old_log_probs = old
        return {}

    def log_probs(b: StepBatch, use_ref: bool = False) -> dict[str, list]:
        calls.append("ref" if use_ref else "policy")
        return {"log_probs": ref}

    monkeypatch.setattr(trainer, "compute_old_log_probs", old_log_probs)
    monkeypatch.setattr(trainer, "compute_log_probs", log_probs)
    monkeypatch.setattr(trainer, "update_actor", lambda b: calls.append("update") or {})
    monkeypatch.setattr(trainer, "offload_actor", lambda parts: None)
    metrics: dict[str, float] = {}
    trainer.train_on(batch, metrics)
    assert calls == ["old", "ref", "update"] and batch.advantages is not None
    assert metrics["actor/reward_kl_penalty"] > 0 and "timing/adv" in metrics
    error = max(-0.2, min(0.2, metrics["actor/reward_kl_penalty"] / 0.1 - 1))
    assert trainer.kl_ctrl.value == pytest.approx(0.5 * (1 + error * 8 / 16))


def test_the_adaptive_coefficient_survives_a_checkpoint(tmp_path) -> None:
    saved: dict[str, Any] = {}

    def save(method: str, path: str, step: int, extra: dict, keep: int,
             background: bool) -> Any:
        assert method == "save_checkpoint" and not background  # trainer.async_save defaults off
        saved.update(extra)
        return SimpleNamespace(get=lambda phase: [path])

    def fake_workers() -> Any:
        actor = SimpleNamespace(
            execute_all_async=save,
            execute_all=lambda name, path: [{"extra": saved, "step": 3, "path": path}])
        return SimpleNamespace(critic=None, actor=actor, weight_sync=lambda version: {})

    first = trainer_with(*KL_ON, "algorithm.kl_ctrl.type=adaptive",
                         f"trainer.output_dir={tmp_path}")
    first.kl_ctrl.value = 0.123
    first.workers, first.steps_done = fake_workers(), 3
    first.scheduler = SimpleNamespace(checkpoint_state=lambda: {"loader": {}, "unsynced": False})
    first.health = SimpleNamespace(state_dict=dict)
    save_run_checkpoint(first)
    second = trainer_with(*KL_ON, "algorithm.kl_ctrl.type=adaptive", "trainer.resume=/ckpt",
                          f"trainer.output_dir={tmp_path}")
    second.workers = fake_workers()
    second.loader = SimpleNamespace(load_state_dict=lambda state: None)
    second.health = SimpleNamespace(load_state_dict=lambda state: None)
    assert resume_run(second) == 3 and second.kl_ctrl.value == 0.123


def test_only_the_full_distribution_estimator_is_refused() -> None:
    from megarl.config.not_built import NOT_BUILT

    def refused(*overrides: str) -> list[str]:
        cfg, _ = load_config_dict(BASE, list(overrides))
        return [field for field, applies, _ in NOT_BUILT if applies(cfg)]

    assert refused(*KL_ON) == []
    assert refused(*KL_ON, "algorithm.kl_penalty=full") == ["algorithm.kl_penalty"]
