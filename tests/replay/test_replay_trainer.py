"""The real stack with router replay R3 and rollout correction: Ray pools, Megatron actor
workers in fp32 (EP=2), an embedded rollout engine in bf16 returning log-probs and routed
experts, weight sync, GRPO steps. Each step compares the trainer's forward without replay with
the replayed one on the same weights and samples."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

from megarl.batch import StepBatch
from megarl.config import load_config
from megarl.data.tiny_model import make_tiny_model
from megarl.demo import DEMO_CONFIG, prepare_demo_assets
from megarl.rollout.interface import RolloutSample
from megarl.trainer import Trainer, load_run_config

R3_RUN = [
    "actor.router_replay.mode=R3", "actor.router_replay.diagnose_no_replay=true",
    "rollout.dtype=bfloat16", "model.dtype=float32",
    "trainer.total_steps=2", "data.train_batch_size=4", "rollout.n=4",
    "actor.ppo_mini_batch_size=2",  # two updates per step: the second is off-policy
    "algorithm.rollout_correction.rollout_is=token",
    "algorithm.rollout_correction.rollout_rs=token_k1",
    "algorithm.rollout_correction.rollout_rs_threshold=2.0",
]


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> tuple[Path, Path, Path]:
    """The demo's data, and its tiny Qwen3-MoE with 3 layers instead of 2: bf16 then flips
    near-tied routes in a layer whose output later tokens attend to, in every prompt (with 2
    layers the few flips sit in the last layer at prompt tokens, which no response log-prob
    depends on)."""
    root = tmp_path_factory.mktemp("tiny")
    make_tiny_model(root / "model", "qwen3_moe", seed=0, num_hidden_layers=3)
    return prepare_demo_assets(root)


def overrides(assets: tuple[Path, Path, Path], out: Path) -> list[str]:
    model, train, val = assets
    return [f"model.path={model}", f"data.train_files=[{train}]", f"data.val_files=[{val}]",
            f"trainer.output_dir={out}", "trainer.loggers=[jsonl]",
            "ray.address=local"]  # a private Ray: other jobs on this machine may run one


def test_r3_steps_route_like_the_engine(assets, tmp_path, record_property):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    cfg, sources = load_config(str(DEMO_CONFIG), overrides(assets, tmp_path) + R3_RUN)
    trainer = Trainer(cfg, sources)
    try:
        trainer.setup()
        history = [trainer.step(trainer.loader.next_batch()) for _ in range(2)]
    finally:
        trainer.close()
    numbers = []
    for metrics in history:
        bad = {k: v for k, v in metrics.items() if not math.isfinite(v)}
        assert not bad, bad
        assert metrics["rollout/moe/router_agreement"] == 1.0
        assert metrics["rollout/moe/router_agreement_no_replay"] < 1.0
        assert (metrics["training/rollout_probs_diff_mean"]
                < metrics["training/rollout_probs_diff_no_replay_mean"])
        for key in ("rollout_is_mean", "rollout_is_truncated_fraction",
                    "rollout_rs_masked_fraction", "kl", "k3_kl", "chi2_token"):
            assert f"rollout_corr/{key}" in metrics, key
        assert 0.5 < metrics["rollout_corr/rollout_is_mean"] < 1.5
        numbers.append({k: metrics[k] for k in (
            "rollout/moe/router_agreement", "rollout/moe/router_agreement_no_replay",
            "training/rollout_probs_diff_mean", "training/rollout_probs_diff_no_replay_mean",
            "training/rollout_probs_diff_max", "training/rollout_probs_diff_no_replay_max",
            "timing/old_log_prob", "timing/update_actor")})
    record_property("numbers", numbers)


@pytest.mark.parametrize("setting, message", [
    (["algorithm.rollout_correction.bypass_mode=true",
      "algorithm.rollout_correction.rollout_is=token"],
     ("algorithm.rollout_correction.bypass_mode: not built in this version of megarl — "
      "bypass_mode makes the rollout log-probs")),
    (["algorithm.rollout_correction.bypass_mode=true", "actor.router_replay.mode=R2"],
     ("actor.router_replay.mode: not built in this version of megarl — R2 records routes in "
      "the old-log-prob forward")),
])
def test_combinations_that_are_not_built_are_refused(assets, tmp_path, setting, message):
    lines: list[str] = []
    assert load_run_config(str(DEMO_CONFIG), overrides(assets, tmp_path) + setting,
                           echo=lines.append) is None
    assert any(line.startswith(message) for line in lines), lines


def test_bypass_mode_trains_on_the_engine_log_probs(assets, tmp_path):
    """Bypass: no old-log-prob forward (no workers are started here); the engine's log-probs
    are the PPO anchor and, with R3, the engine's routes go to the update as they are."""
    cfg, sources = load_config(str(DEMO_CONFIG), overrides(assets, tmp_path) + [
        "algorithm.rollout_correction.bypass_mode=true", "actor.router_replay.mode=R3"])
    trainer = Trainer(cfg, sources)
    gen = torch.Generator().manual_seed(0)
    samples = [RolloutSample(
        prompt_index=0, sample_index=j, prompt_ids=[5, 6, 7], response_ids=[8, 9, 10][:2 + j],
        log_probs=[-0.5, -1.0, -2.0][:2 + j], finish_reason="stop", weight_version="0",
        routed_experts=torch.randint(0, 4, (4 + j, 3, 2), generator=gen, dtype=torch.int16))
        for j in range(2)]
    batch = StepBatch(samples=samples, prompts=[{"input_ids": [5, 6, 7]}], n=2)
    try:
        assert trainer.compute_old_log_probs(batch) == {}
    finally:
        trainer.loop.close()
    assert batch.old_log_probs == [[-0.5, -1.0], [-0.5, -1.0, -2.0]]
    assert torch.equal(batch.loss_mask, batch.response_mask())
    assert batch.rollout_is_weights is None
    batch.advantages = torch.ones(2, 3)
    record = batch.train_record(1)
    assert record["old_log_probs"] == [0.0, 0.0, 0.0, -0.5, -1.0, -2.0]
    assert torch.equal(record["routes"], samples[1].routed_experts)
    samples[0].routed_experts = None
    with pytest.raises(ValueError, match="rollout.enable_return_routed_experts=true"):
        batch.engine_routes()
