"""The trainer-side critic pieces that need no ranks: the spec from the config, the records the
update receives, and the naive-mode layout check."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from critic_ranks import PROMPT, make_batch

from megarl.config import load_config
from megarl.trainer.critic import CriticTargets, critic_record, critic_spec, start_critic

DEMO_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny-moe-cpu.yaml"
BASE = ["model.path=/nonexistent", "model.dtype=float32", "algorithm.adv_estimator=gae",
        "data.train_batch_size=4", "data.max_prompt_length=20", "data.max_response_length=10",
        "actor.ppo_mini_batch_size=2", "actor.ppo_epochs=1", "actor.use_dynamic_bsz=false",
        "actor.ppo_micro_batch_size_per_gpu=4", "actor.parallel.tp=1", "actor.parallel.pp=1",
        "actor.parallel.ep=2", "trainer.total_steps=5"]


def test_spec_follows_the_critic_section_and_the_actor_defaults():
    cfg, _ = load_config(str(DEMO_CONFIG), BASE + [
        "critic.optim.lr=2e-5", "critic.grad_clip=0.5", "critic.cliprange_value=0.3",
        "critic.ppo_micro_batch_size_per_gpu=2", "critic.ppo_epochs=3",
        "critic.model_path=/critic"])
    spec = critic_spec(cfg)
    assert spec.model_path == "/critic" and spec.dtype == "float32"
    assert (spec.sizes.tp, spec.sizes.pp, spec.sizes.ep) == (1, 1, 2)  # the actor's layout
    assert spec.optim.lr == 2e-5 and spec.optim.grad_clip == 0.5
    assert spec.optim.total_steps == 5 * 2 * 3  # steps x mini-batches x critic epochs
    assert spec.loss.cliprange_value == 0.3 and spec.loss.loss_agg_mode == "token-mean"
    assert spec.max_tokens_per_micro_batch == 2 * (20 + 10)


def test_actor_and_critic_specs_carry_recompute():
    from megarl.trainer.workers import actor_spec

    cfg, _ = load_config(str(DEMO_CONFIG), BASE + [
        "actor.recompute.granularity=full", "actor.recompute.method=block",
        "actor.recompute.num_layers=2"])
    wanted = {"recompute_granularity": "full", "recompute_method": "block",
              "recompute_num_layers": 2}
    assert critic_spec(cfg).recompute.config_overrides() == wanted
    assert actor_spec(cfg).recompute.config_overrides() == wanted
    cfg, _ = load_config(str(DEMO_CONFIG), BASE + [
        "actor.recompute.granularity=selective", "actor.recompute.modules=[moe]"])
    assert actor_spec(cfg).recompute.config_overrides() == {
        "recompute_granularity": "selective", "recompute_modules": ["moe"]}


def test_records_carry_full_length_values_and_returns():
    batch = make_batch([1.0, 0.0, 0.5, 1.0, 0.0, -1.0])
    mask = batch.response_mask()
    values = torch.arange(mask.numel(), dtype=torch.float32).view(mask.shape) * mask
    targets = CriticTargets(values=values, returns=values + 0.5 * mask)
    record = critic_record(batch, targets, 1)
    n = len(batch.samples[1].response_ids)
    assert record["tokens"] == batch.sequences()[1]
    assert record["loss_mask"] == [0.0] * PROMPT + [1.0] * n
    assert record["values"] == [0.0] * PROMPT + values[1, :n].tolist()
    assert record["returns"] == [0.0] * PROMPT + (values[1, :n] + 0.5).tolist()


def test_naive_mode_refuses_a_critic_layout_of_its_own():
    cfg, _ = load_config(str(DEMO_CONFIG), BASE + ["critic.parallel.tp=2",
                                                   "critic.parallel.ep=1"])
    with pytest.raises(ValueError, match="critic.parallel=null"):
        start_critic(cfg)
