"""An embedded engine killed with SIGKILL in the middle of a step: its requests finish on the
other engine, the step trains on every sample, and the weight sync restarts the dead engine,
re-forms the weight-update group and readmits it at the new weight version; the next step
uses both engines again. Real stack: Ray, two Megatron ranks, two engine processes."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from megarl.batch import StepBatch
from megarl.config import load_config
from megarl.demo import DEMO_CONFIG
from megarl.faults import ENGINE_DELAY_ENV
from megarl.trainer import Trainer

SAMPLES = 8 * 4
STEP_DELAY_S = 0.01  # data.max_response_length=32: >= 0.32 s of generation a step


@pytest.fixture(scope="module")
def assets(demo_assets) -> Path:
    return demo_assets  # the session's (conftest.py)


def server_process(url: str) -> psutil.Process:
    """The embedded engine process serving ``url``."""
    port = url.rsplit(":", 1)[1]
    for proc in psutil.process_iter(["cmdline"]):
        cmd = proc.info["cmdline"] or []
        if "megarl.rollout.local.server" in cmd and port in cmd:
            return proc
    raise AssertionError(f"no engine process for {url}")


def kill_when_busy(url: str, killed: threading.Event, deadline_s: float = 120.0) -> None:
    """SIGKILL the engine at ``url`` as soon as it is generating."""
    proc, end = server_process(url), time.monotonic() + deadline_s
    while time.monotonic() < end:
        state = httpx.get(f"{url}/get_server_info", timeout=5).json()["internal_states"][0]
        if state["num_running_reqs"] > 0:
            proc.send_signal(signal.SIGKILL)
            killed.set()
            return
        time.sleep(0.005)


def test_engine_killed_mid_step_is_failed_over_restarted_and_resynced(assets, tmp_path,
                                                                       monkeypatch):
    if "OMP_NUM_THREADS" not in os.environ:  # for this test's Ray workers, not the session's
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
    # a slow device: each generation step takes >= STEP_DELAY_S, so an engine seen generating
    # still has requests to finish when it is killed, whatever the machine's speed (Ray's
    # workers and the engines they start inherit the environment)
    monkeypatch.setenv(ENGINE_DELAY_ENV, str(STEP_DELAY_S))
    overrides = [f"model.path={assets / 'model'}",
                 f"data.train_files=[{assets / 'data/train.parquet'}]",
                 f"trainer.output_dir={tmp_path / 'run'}", "trainer.loggers=[jsonl]",
                 "resources.rollout_pool.gpus_per_node=2", "ray.num_cpus=5",
                 "ray.address=local", "data.train_batch_size=8", "rollout.n=4",
                 "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size_per_gpu=8",
                 "data.max_response_length=32"]
    cfg, sources = load_config(str(DEMO_CONFIG), overrides)
    trainer = Trainer(cfg, sources)
    trained: list[StepBatch] = []
    real_train_on = trainer.train_on

    def train_on(batch: StepBatch, metrics: dict[str, float]) -> None:
        trained.append(batch)
        real_train_on(batch, metrics)

    trainer.train_on = train_on  # type: ignore[method-assign]
    try:
        trainer.setup()
        client = trainer.workers.client
        assert len(client.urls) == 2
        first = trainer.step(trainer.loader.next_batch())
        assert first["rollout/engine_restarts"] == 0
        victim = server_process(client.urls[0])

        killed = threading.Event()
        killer = threading.Thread(target=kill_when_busy, args=(client.urls[0], killed))
        killer.start()
        second = trainer.step(trainer.loader.next_batch())
        killer.join()
        assert killed.is_set() and not victim.is_running()
        # every sample of the step was generated (the dead engine's ones by the other engine)
        assert len(trained[-1]) == SAMPLES
        assert all(s.finish_reason != "abort" for s in trained[-1].samples)
        assert second["rollout/engine_failures"] >= 1 and second["rollout/failovers"] >= 1
        assert second["rollout/engine_restarts"] == 1
        # restarted, re-synced, readmitted at the step's version
        assert client.down == {}
        assert trainer.run(client.get_weight_version()) == ["2", "2"]
        assert server_process(client.urls[0]).pid != victim.pid

        before = list(client.stats.requests)
        third = trainer.step(trainer.loader.next_batch())
        after = client.stats.requests
        assert after[0] > before[0] and after[1] > before[1]  # both engines serve again
        assert third["rollout/engine_restarts"] == 0
        assert third["training/rollout_probs_diff_mean"] < 1e-3  # the restarted engine is current
        assert trainer.run(client.get_weight_version()) == ["3", "3"]
    finally:
        trainer.close()
