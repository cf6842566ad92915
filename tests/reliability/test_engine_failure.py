"""Rollout engine failure inside a generate call: real embedded engines, killed for real.

Two engines serve a model whose greedy output names its weight version (versioned_model.py);
the test process plays the trainer's weight sender. One engine is SIGKILLed (or SIGSTOPped)
while it generates: its unfinished requests must go to the other engine, the generate call must
return every sample from the current weights, and the dead engine must be restarted, re-synced
to the current weight_version and only then take requests again.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from megarl.faults import ENGINE_DELAY_ENV
from megarl.rollout.interface import SamplingParams
from megarl.rollout.local.launch import launch_local_engines
from megarl.rollout.process import ManagedServer, stop_all
from megarl.rollout.recovery import EngineRecovery, restart_servers
from megarl.rollout.sglang.client import EngineError, SGLangClient

from .versioned_model import WeightPusher, make_versioned_model, marker

LONG = SamplingParams(max_new_tokens=120, temperature=0.0, ignore_eos=True, n=2)
STEP_DELAY_S = 0.01  # LONG: >= 1.2 s of generation
SHORT = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True, n=2)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[ManagedServer]]:
    """Two embedded engines on 127.0.0.1 serving the versioned model at version 0, on a slow
    device: each generation step takes at least STEP_DELAY_S, so a LONG request seen running
    is still running when the test kills or stops its engine, whatever the machine's speed."""
    model = make_versioned_model(tmp_path_factory.mktemp("versioned") / "model")
    with pytest.MonkeyPatch.context() as env:
        env.setenv(ENGINE_DELAY_ENV, str(STEP_DELAY_S))
        started = launch_local_engines(str(model), 2, num_threads=1,
                                       log_dir=tmp_path_factory.mktemp("engine_logs"),
                                       seed=0, extra_args=["--weight-version", "0"],
                                       ready_timeout_s=300)
    yield started
    stop_all(started)


def prompts(count: int, offset: int = 0) -> list[list[int]]:
    """``count`` distinct prompts (each its own prompt group)."""
    return [[20 + (offset + i) % 90, 5 + i % 7, 30 + i % 11] for i in range(count)]


async def running_requests(url: str, at_least: int = 1, timeout_s: float = 30.0) -> None:
    """Wait until the engine at ``url`` is decoding ``at_least`` rows."""
    async with httpx.AsyncClient() as http:
        for _ in range(int(timeout_s / 0.02)):
            state = (await http.get(url + "/get_server_info")).json()["internal_states"][0]
            if state["num_running_reqs"] >= at_least:
                return
            await asyncio.sleep(0.02)
    raise AssertionError(f"{url} never started decoding")


def assert_version(samples: list, version: int, count: int) -> None:
    """Every sample complete, stamped ``version`` and made by version ``version``'s weights."""
    assert len(samples) == count
    assert {s.finish_reason for s in samples} == {"length"}
    assert {s.weight_version for s in samples} == {str(version)}
    assert all(s.response_ids == [marker(version)] * len(s.response_ids) for s in samples)


def test_sigkilled_engine_fails_over_restarts_resyncs_and_rejoins(servers):
    async def scenario() -> dict:
        client = SGLangClient([s.url for s in servers], failover_timeout_s=120,
                              retry_backoff_s=0.1)
        pusher = WeightPusher(client)
        sent_when_down: dict[int, int] = {}
        sent_at_resync: dict[int, int] = {}
        client.on_engine_down = lambda i, why: sent_when_down.setdefault(
            i, client.stats.requests[i])

        async def resync(engines: list[int]) -> str:
            sent_at_resync.update({i: client.stats.requests[i] for i in engines})
            for i in engines:  # restarted from disk: it must not be let back as it is
                with pytest.raises(EngineError, match="serves weight_version '0', expected '3'"):
                    await client.readmit(i, "3")
            return await pusher.regroup_and_push(engines)

        recovery = EngineRecovery(client, restart_servers(servers, 300), resync)
        watcher = asyncio.create_task(recovery.watch(poll_s=0.1))
        try:
            await pusher.open()
            for version in (1, 2, 3):
                await pusher.push(version)
            old_pid = servers[0].process.pid
            task = asyncio.create_task(client.generate(prompts(24), LONG))
            await running_requests(servers[0].url)
            os.kill(old_pid, signal.SIGKILL)
            during = await asyncio.wait_for(task, 300)
            failovers = client.stats.failovers
            for _ in range(3000):  # the restart and re-sync run in the background
                if recovery.history:
                    break
                await asyncio.sleep(0.1)
            assert recovery.history, "engine 0 was not recovered within 300 s"
            before = list(client.stats.requests)
            after_recovery = await client.generate(prompts(24, offset=40), SHORT)
            await pusher.push(4)  # the re-formed group serves the next regular update
            after_push = await client.generate(prompts(24, offset=70), SHORT)
            return {"during": during, "after_recovery": after_recovery, "after_push": after_push,
                    "failovers": failovers, "stats": client.stats, "before": before,
                    "sent_when_down": sent_when_down, "sent_at_resync": sent_at_resync,
                    "history": recovery.history, "old_pid": old_pid,
                    "versions": await client.get_weight_version()}
        finally:
            watcher.cancel()
            pusher.close()
            await client.close()

    out = asyncio.run(scenario())
    assert_version(out["during"], 3, 48)  # the generate call finished on the surviving engine
    assert out["failovers"] >= 1 and out["stats"].engine_failures == 1
    # engine 0 received no request between being marked down and its re-sync
    assert out["sent_when_down"][0] == out["sent_at_resync"][0]
    (event,) = out["history"]
    assert event.engine == 0 and event.weight_version == "3"
    assert servers[0].restarts == 1 and servers[0].process.pid != out["old_pid"]
    assert_version(out["after_recovery"], 3, 48)
    assert out["stats"].requests[0] > out["before"][0]  # back in service
    assert_version(out["after_push"], 4, 48)
    assert out["versions"] == ["4", "4"]


def test_hung_engine_is_caught_by_health_checks_and_readmitted(servers):
    async def scenario() -> tuple[list, SGLangClient]:
        client = SGLangClient([s.url for s in servers], health_timeout_s=0.5, unhealthy_after=2,
                              retry_backoff_s=0.1)
        monitor = asyncio.create_task(client.monitor(interval_s=0.2))
        pid = servers[1].process.pid
        try:
            version = (await client.get_weight_version())[0]
            task = asyncio.create_task(client.generate(prompts(16, offset=5), LONG))
            await running_requests(servers[1].url)
            os.kill(pid, signal.SIGSTOP)  # alive, but answers nothing
            try:
                samples = await asyncio.wait_for(task, 60)
                assert 1 in client.down and "health checks" in client.down[1]
            finally:
                os.kill(pid, signal.SIGCONT)
            await client.readmit(1, version)  # it kept its weights: readmitted as it is
            assert not client.down
            return samples, version, client
        finally:
            monitor.cancel()
            await client.close()

    samples, version, client = asyncio.run(scenario())
    assert_version(samples, int(version), 32)
    assert client.stats.failovers >= 1 and client.stats.engine_failures == 1


def test_all_engines_down_is_one_clear_error(tmp_path: Path):
    from megarl.rollout.process import free_port

    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there

    async def scenario() -> None:
        client = SGLangClient([url], retry_backoff_s=0.05, failover_timeout_s=0.3)
        try:
            await client.generate([[5, 6, 7]], SamplingParams(max_new_tokens=4))
        finally:
            await client.close()

    with pytest.raises(EngineError, match=r"no rollout engine can take requests.*engine 0: "
                                          r"/generate failed \(ConnectError"):
        asyncio.run(scenario())


def test_rollout_server_worker_restarts_its_dead_server(model_dir, tmp_path):
    """The restart hook of the Ray rollout role (``RolloutServerWorker.restart``)."""
    from megarl.rollout.server_worker import EngineSpec, RolloutServerWorker

    key = "sk-restart-test"
    worker = RolloutServerWorker(EngineSpec(model_path=str(model_dir), backend="local",
                                            dtype="float32", log_dir=str(tmp_path),
                                            api_key=key))
    try:
        url = worker.wait_ready(300)
        first = worker.server.process.pid
        os.kill(first, signal.SIGKILL)
        worker.server.process.wait(10)
        assert not worker.alive()
        assert worker.restart(["http://127.0.0.1:1"]) is False and not worker.alive()
        assert worker.restart([url], timeout_s=300) is True
        assert worker.alive() and worker.server.process.pid != first
        assert worker.server.healthy()  # with the key: the fresh server requires it too
        assert httpx.get(url + "/health", timeout=5).status_code == 401
    finally:
        worker.stop()
