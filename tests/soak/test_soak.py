"""Soak: thousands of requests at high concurrency against two embedded engines on 127.0.0.1
while the weights change every couple of seconds (``make test-soak``; marked slow).

The model's greedy output names its weight version (tests/reliability/versioned_model.py), so
every response proves which weights produced it. The updater follows the protocol that keeps
responses pure when requests are in flight: ``pause_generation(mode=abort)`` on every engine,
the buckets, ``continue_generation``; the client re-sends what the engines aborted
(``retry_aborted``). Checked: every request is answered (aborted ones retried), every response
is stamped with one version and every one of its tokens was produced by that version (a
forward between the two buckets would emit the MIXED token), and the run fits its time bound.
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import time
from collections import Counter
from collections.abc import Iterator

import pytest
from reliability.versioned_model import (
    EMBED,
    MIXED,
    WeightPusher,
    make_versioned_model,
    marker,
    version_tensors,
)

from megarl.rollout.interface import SamplingParams
from megarl.rollout.local.launch import launch_local_engines
from megarl.rollout.process import ManagedServer, stop_all
from megarl.rollout.sglang.client import SGLangClient

pytestmark = pytest.mark.slow

REQUESTS = int(os.environ.get("MEGARL_SOAK_REQUESTS", "3000"))
CONCURRENCY = 256
UPDATE_EVERY_S = 2.0
TIME_BOUND_S = 240.0


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[ManagedServer]]:
    """Two embedded engines on 127.0.0.1 serving the versioned model at version 0."""
    model = make_versioned_model(tmp_path_factory.mktemp("versioned") / "model")
    started = launch_local_engines(
        str(model), 2, num_threads=1, log_dir=tmp_path_factory.mktemp("engine_logs"),
        seed=0, extra_args=["--weight-version", "0", "--max-running-requests", "128"], ready_timeout_s=300)
    yield started
    stop_all(started)


async def half_update_is_visible(client: SGLangClient, pusher: WeightPusher) -> list[int]:
    """The detector works: only the first bucket of the next version makes the model emit
    MIXED; returns what it emitted."""
    import torch.distributed as dist

    tensor = version_tensors(pusher.version + 1)[EMBED]
    await asyncio.gather(
        asyncio.to_thread(dist.broadcast, tensor, 0, pusher.group),
        client.update_weights_from_distributed([EMBED], ["float32"], [list(tensor.shape)]))
    (sample,) = await client.generate([[40, 41]], SamplingParams(max_new_tokens=4,
                                                                  temperature=0.0,
                                                                  ignore_eos=True))
    await pusher.push(pusher.version + 1)
    return sample.response_ids


async def updater(client: SGLangClient, pusher: WeightPusher, stop: asyncio.Event,
                  pushed: list[int], seconds: list[tuple[float, float]]) -> None:
    """Every UPDATE_EVERY_S: abort in-flight work, push the next version, continue; records
    (seconds to pause, seconds to push and continue) of each update."""
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), UPDATE_EVERY_S)
        except TimeoutError:
            start = time.perf_counter()
            await client.pause("abort")
            paused = time.perf_counter()
            await pusher.push(pusher.version + 1)
            await client.resume()
            seconds.append((paused - start, time.perf_counter() - paused))
            pushed.append(pusher.version)


def test_soak_thousands_of_requests_during_weight_updates(servers):
    rng = random.Random(0)
    requests = [([rng.randrange(5, 120) for _ in range(rng.randrange(2, 24))],
                 rng.randrange(4, 24)) for _ in range(REQUESTS)]

    async def scenario() -> dict:
        client = SGLangClient([s.url for s in servers], max_concurrency_per_engine=128,
                              retry_aborted=20, timeout_s=120)
        pusher = WeightPusher(client)
        stop = asyncio.Event()
        pushed: list[int] = []
        update_s: list[tuple[float, float]] = []
        gate = asyncio.Semaphore(CONCURRENCY)
        latencies: list[float] = []

        async def one(prompt: list[int], budget: int):
            async with gate:
                start = time.perf_counter()
                (sample,) = await client.generate_one(
                    prompt, SamplingParams(max_new_tokens=budget, temperature=0.0,
                                           ignore_eos=True))
                latencies.append(time.perf_counter() - start)
                return sample

        try:
            await pusher.open()
            await pusher.push(1)
            pushed.append(1)
            mixed = await half_update_is_visible(client, pusher)
            pushed.append(pusher.version)
            start = time.perf_counter()
            task = asyncio.create_task(updater(client, pusher, stop, pushed, update_s))
            samples = await asyncio.gather(*(one(p, n) for p, n in requests))
            wall = time.perf_counter() - start
            stop.set()
            await task
            return {"samples": samples, "pushed": pushed, "wall": wall, "mixed": mixed,
                    "stats": client.stats, "latencies": latencies, "update_s": update_s}
        finally:
            pusher.close()
            await client.close()

    out = asyncio.run(scenario())
    samples, stats = out["samples"], out["stats"]
    assert out["mixed"] == [MIXED] * 4  # a half-updated model would be caught
    assert len(samples) == REQUESTS
    assert Counter(s.finish_reason for s in samples) == {"length": REQUESTS}
    pushed = set(out["pushed"])
    impure = [s for s in samples if s.weight_version is None or int(s.weight_version) not in pushed
              or s.response_ids != [marker(int(s.weight_version))] * len(s.response_ids)]
    assert not impure, f"{len(impure)} responses not produced by their stamped version"
    for sample, (_, budget) in zip(samples, requests):
        assert len(sample.response_ids) == budget
    versions = Counter(int(s.weight_version) for s in samples)
    updates = len(out["update_s"])
    pause_ms = statistics.median(p for p, _ in out["update_s"]) * 1000
    push_ms = statistics.median(q for _, q in out["update_s"]) * 1000
    print(f"\nsoak: {REQUESTS} requests in {out['wall']:.1f} s "
          f"({REQUESTS / out['wall']:.0f} req/s) at concurrency {CONCURRENCY} on 2 engines; "
          f"{updates} weight updates (p50: pause {pause_ms:.0f} ms, push+continue "
          f"{push_ms:.0f} ms); "
          f"{stats.resubmitted_aborts} aborted requests re-sent; "
          f"{len(versions)} versions served; latency p50 "
          f"{statistics.median(out['latencies']) * 1000:.0f} ms, p99 "
          f"{statistics.quantiles(out['latencies'], n=100)[98] * 1000:.0f} ms; "
          f"requests per engine {stats.requests}")
    assert updates >= 3 and len(versions) >= 3  # the weights really changed under load
    assert stats.resubmitted_aborts > 0  # in-flight requests really were aborted and re-sent
    assert out["wall"] < TIME_BOUND_S
