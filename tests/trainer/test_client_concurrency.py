"""The trainer's rollout client keeps enough requests in flight for what each engine runs at once.
Each request carries one sample, and the client's default of 256 requests per engine capped
every engine at 256 sequences whatever ``rollout.max_num_seqs`` said (the e2e benchmark's engine,
configured for 512, never ran more than 256 rows)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest

from megarl.config import load_config
from megarl.demo import DEMO_CONFIG
from megarl.scheduler.factory import default_client_factory
from megarl.trainer.workers import client_concurrency, engine_max_num_seqs, rollout_client


def config(demo_assets: Path, *overrides: str):
    cfg, _ = load_config(str(DEMO_CONFIG), [
        f"model.path={demo_assets / 'model'}",
        f"data.train_files=[{demo_assets / 'data/train.parquet'}]",
        f"data.val_files=[{demo_assets / 'data/val.parquet'}]", *overrides])
    return cfg


@pytest.mark.parametrize("seqs, limit", [(600, 1200), (16, 256)])
def test_the_client_keeps_twice_the_engine_sequences_in_flight(demo_assets, seqs, limit):
    cfg = config(demo_assets, f"rollout.max_num_seqs={seqs}")
    assert engine_max_num_seqs(cfg) == seqs and client_concurrency(cfg) == limit
    client = rollout_client(cfg, ["http://127.0.0.1:9"])
    try:
        assert client.max_concurrency_per_engine == limit
        # the overlapping schedulers' clients (their own event loops) keep the same limit
        trainer = SimpleNamespace(cfg=cfg, workers=SimpleNamespace(client=client))
        other = default_client_factory(trainer)()
        assert other.max_concurrency_per_engine == limit
        asyncio.run(other.close())
    finally:
        asyncio.run(client.close())


def test_auto_follows_the_sequences_each_engine_receives(demo_assets):
    """``max_num_seqs: auto`` on one engine: every sample of a step (prompts x n)."""
    cfg = config(demo_assets, "data.train_batch_size=64", "rollout.n=8",
                 "actor.ppo_mini_batch_size=64")
    assert cfg.rollout.max_num_seqs == "auto"
    assert engine_max_num_seqs(cfg) == 512
    assert client_concurrency(cfg) == 1024
