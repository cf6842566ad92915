"""The real stack end to end: Ray pools, Megatron actor workers (EP=2), an embedded rollout
engine over HTTP, SGLang-protocol weight sync, GRPO. Slow-ish (a Ray start and a few steps)."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

from megarl.config import load_config
from megarl.demo import DEMO_CONFIG, prepare_demo_assets
from megarl.trainer import Trainer

REQUIRED = [
    "critic/score/mean", "response_length/mean", "actor/pg_loss", "actor/pg_clipfrac",
    "actor/ppo_kl", "actor/entropy", "actor/grad_norm", "actor/lr", "timing/gen",
    "timing/old_log_prob", "timing/adv", "timing/update_actor", "timing/sync_weights",
    "timing/step", "throughput/total_tokens_per_sec", "throughput/gen_tokens_per_sec_per_gpu",
    "throughput/train_tokens_per_sec_per_gpu", "training/rollout_probs_diff_mean",
    "training/rollout_probs_diff_max",
]


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tiny")
    prepare_demo_assets(root)
    return root


def make_trainer(root: Path, out: Path, *overrides: str) -> Trainer:
    base = [f"model.path={root / 'model'}", f"data.train_files=[{root / 'data/train.parquet'}]",
            f"data.val_files=[{root / 'data/val.parquet'}]", f"trainer.output_dir={out}",
            "trainer.loggers=[jsonl]"]
    cfg, sources = load_config(str(DEMO_CONFIG), base + list(overrides))
    return Trainer(cfg, sources)


def engine_weights(trainer: Trainer, names: list[str]) -> dict[str, torch.Tensor]:
    client = trainer.workers.client
    out = {}
    for name in names:
        per_engine = trainer.run(client.get_weights_by_name(name, truncate_size=10**9))
        out[name] = torch.tensor(per_engine[0], dtype=torch.float32)
    return out


def test_three_steps_sync_weights_and_report_every_metric(assets, tmp_path):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    trainer = make_trainer(assets, tmp_path / "run", "trainer.total_steps=3",
                           "data.train_batch_size=8", "rollout.n=4",
                           "actor.ppo_mini_batch_size=4", "trainer.val_every=1",
                           f"ray.timeline_file={tmp_path / 'timeline.json'}")
    try:
        trainer.setup()
        for step in range(1, 4):
            metrics = trainer.step(trainer.loader.next_batch())
            missing = [k for k in REQUIRED if k not in metrics]
            assert not missing, missing
            bad = {k: v for k, v in metrics.items() if not math.isfinite(v)}
            assert not bad, bad
            assert metrics["training/rollout_probs_diff_mean"] < 1e-3
            assert metrics["rollout/weight_version"] == step
            # after the sync, every tensor on the engine equals the trainer's export
            actor = trainer.workers.actor.execute_all("hf_state_dict")[0]
            names = list(actor)
            on_engine = engine_weights(trainer, names)
            for name in names:
                assert torch.equal(on_engine[name].reshape(-1),
                                   actor[name].float().reshape(-1)[: on_engine[name].numel()]), name
            assert trainer.run(trainer.workers.client.get_weight_version()) == [str(step)]
        # two mini-batches per step: the second one is off-policy, so ppo_kl is not exactly 0
        assert metrics["actor/ppo_kl"] != 0.0
        val = trainer.validate()
        assert 0.0 <= val["val/score/mean"] <= 1.0
        assert val["val/synthetic/copy_digit/score/mean"] == val["val/score/mean"]
        trainer.finish()
        assert (tmp_path / "timeline.json").stat().st_size > 0
    finally:
        trainer.close()


def test_grpo_reward_climbs_on_the_demo_task(assets, tmp_path):
    """A shorter demo run (same config): the reward of the last 20% of steps clearly exceeds the
    first 20%'s."""
    steps = 45
    trainer = make_trainer(assets, tmp_path / "learn", f"trainer.total_steps={steps}")
    try:
        trainer.setup()
        history = trainer.fit()
    finally:
        trainer.close()
    scores = [m["critic/score/mean"] for m in history]
    k = steps // 5
    first, last = sum(scores[:k]) / k, sum(scores[-k:]) / k
    assert last > first + 0.15, (first, last, scores)
    assert (tmp_path / "learn" / "run.png").stat().st_size > 10_000


def test_settings_the_trainer_does_not_run_yet_are_refused(assets, tmp_path, capsys):
    from megarl.trainer import train_main

    base = [f"model.path={assets / 'model'}", f"data.train_files=[{assets / 'data/train.parquet'}]",
            f"data.val_files=[{assets / 'data/val.parquet'}]", f"trainer.output_dir={tmp_path}"]
    assert train_main(["--config", str(DEMO_CONFIG), *base, "trainer.save_every=5"]) == 2
    assert "trainer.save_every: checkpoint saving is not built" in capsys.readouterr().err


def test_invalid_config_exits_2_with_the_field(tmp_path, capsys):
    from megarl.trainer import train_main

    assert train_main(["--config", str(DEMO_CONFIG), "data.train_batch_size=3",
                       f"model.path={tmp_path}"]) == 2
    assert "data.train_batch_size" in capsys.readouterr().err
