"""Issue 17: the client and the embedded server follow SGLang on ``sampling_seed``, the rids of
n > 1 requests, and batches asking for different ``n``."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx

from megarl.rollout.interface import SamplingParams
from megarl.rollout.sglang.client import SGLangClient

SAMPLED = SamplingParams(max_new_tokens=12, temperature=1.0, ignore_eos=True)


class FakeEngine:
    """An SGLang stand-in recording what the client sends; ``hold`` rids wait for an abort."""

    def __init__(self, hold: bool = False) -> None:
        self.generated: list[dict[str, Any]] = []
        self.aborted: list[str] = []
        self.hold = hold
        self._released: dict[str, asyncio.Event] = {}

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        """Answer ``/generate`` (one sample per request) and ``/abort_request``."""
        body = json.loads(request.content or b"{}")
        if request.url.path == "/abort_request":
            self.aborted.append(body["rid"])
            self._released.setdefault(body["rid"], asyncio.Event()).set()
            return httpx.Response(200)
        self.generated.append(body)
        rid, n = body["rid"], body["sampling_params"].get("n", 1)
        reason = {"type": "length", "length": 1}
        if self.hold:
            await self._released.setdefault(rid, asyncio.Event()).wait()
            reason = {"type": "abort", "message": "aborted"}
        token = (body["sampling_params"].get("sampling_seed") or 0) % 100
        item = {"output_ids": [token], "meta_info": {
            "id": rid, "finish_reason": reason, "output_token_logprobs": [[-0.5, token, None]]}}
        return httpx.Response(200, json=item if n == 1 else [item] * n)


def _client(engine: FakeEngine, **kwargs: Any) -> SGLangClient:
    client = SGLangClient(["http://engine"], **kwargs)
    transport = httpx.MockTransport(engine)
    client._http = httpx.AsyncClient(transport=transport)
    client._generate_http = [httpx.AsyncClient(transport=transport)]
    return client


def test_client_sends_one_request_per_sample_with_seed_plus_j():
    engine = FakeEngine()

    async def scenario():
        client = _client(engine)
        try:
            seeded = await client.generate([[1, 2], [3]], SamplingParams(
                max_new_tokens=1, n=3), rids=["a", "b"], seeds=[10, 20])
            unseeded = await client.generate([[4]], SamplingParams(max_new_tokens=1, n=2))
            single = await client.generate([[5]], SamplingParams(max_new_tokens=1),
                                           rids=["c"], seeds=[7])
            return seeded, unseeded, single
        finally:
            await client.close()

    seeded, unseeded, single = asyncio.run(scenario())
    sent = {b["rid"]: b["sampling_params"] for b in engine.generated}
    assert all(p["n"] == 1 for p in sent.values())
    assert {r: sent[r]["sampling_seed"] for r in ("a-0", "a-1", "a-2", "b-0", "b-1", "b-2")} == {
        "a-0": 10, "a-1": 11, "a-2": 12, "b-0": 20, "b-1": 21, "b-2": 22}
    assert [(s.prompt_index, s.sample_index, s.rid) for s in seeded] == [
        (i, j, f"{r}-{j}") for i, r in enumerate("ab") for j in range(3)]
    assert [s.response_ids[0] for s in seeded] == [10, 11, 12, 20, 21, 22]
    seeds = [sent[s.rid]["sampling_seed"] for s in unseeded]
    assert all(isinstance(x, int) for x in seeds) and seeds[0] != seeds[1]
    assert single[0].rid == "c" and sent["c"]["sampling_seed"] == 7


def test_aborting_a_prompt_aborts_the_requests_of_its_samples():
    engine = FakeEngine(hold=True)

    async def scenario():
        client = _client(engine, retry_aborted=2)
        try:
            task = asyncio.create_task(client.generate([[1, 2]], SamplingParams(
                max_new_tokens=5, n=2), rids=["p"], seeds=[3]))
            while len(engine.generated) < 2:
                await asyncio.sleep(0.01)
            await client.abort("p")
            return await asyncio.wait_for(task, 10)
        finally:
            await client.close()

    samples = asyncio.run(scenario())
    assert sorted(engine.aborted) == ["p-0", "p-1"]
    assert [s.finish_reason for s in samples] == ["abort", "abort"]
    assert len(engine.generated) == 2  # aborted by the caller: not re-sent
