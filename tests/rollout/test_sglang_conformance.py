"""Issue 17: the client and the embedded server follow SGLang on ``sampling_seed``, the rids of
n > 1 requests, and batches asking for different ``n``."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx

from megarl.rollout.interface import SamplingParams
from megarl.rollout.local.protocol import MIXED_N_MESSAGE
from megarl.rollout.sglang.client import SGLangClient

SAMPLED = SamplingParams(max_new_tokens=12, temperature=1.0, ignore_eos=True)


class FakeEngine:
    """An SGLang stand-in recording what the client sends (one entry per request item: a
    batch's items are listed one by one); ``hold`` rids wait for an abort."""

    def __init__(self, hold: bool = False) -> None:
        self.generated: list[dict[str, Any]] = []
        self.calls = 0
        self.aborted: list[str] = []
        self.hold = hold
        self._released: dict[str, asyncio.Event] = {}

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        """Answer ``/generate`` (a single request or a batch) and ``/abort_request``."""
        body = json.loads(request.content or b"{}")
        if request.url.path == "/abort_request":
            self.aborted.append(body["rid"])
            self._released.setdefault(body["rid"], asyncio.Event()).set()
            return httpx.Response(200)
        self.calls += 1
        batch = isinstance(body["rid"], list)
        rids = body["rid"] if batch else [body["rid"]]
        params = body["sampling_params"] if batch else [body["sampling_params"]]
        out = []
        for rid, sampling in zip(rids, params):
            self.generated.append({"rid": rid, "sampling_params": sampling})
            reason = {"type": "length", "length": 1}
            if self.hold:
                await self._released.setdefault(rid, asyncio.Event()).wait()
                reason = {"type": "abort", "message": "aborted"}
            token = (sampling.get("sampling_seed") or 0) % 100
            out += [{"output_ids": [token], "meta_info": {
                "id": rid, "finish_reason": reason,
                "output_token_logprobs": [[-0.5, token, None]]}}] * sampling.get("n", 1)
        return httpx.Response(200, json=out if batch or len(out) > 1 else out[0])


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
    assert engine.calls == 4  # one call per prompt: its samples go as one batch
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
            for _ in range(500):
                if len(engine.generated) >= 2:
                    break
                await asyncio.sleep(0.01)
            await client.abort("p")
            return await asyncio.wait_for(task, 10)
        finally:
            await client.close()

    samples = asyncio.run(scenario())
    assert sorted(engine.aborted) == ["p-0", "p-1"]
    assert [s.finish_reason for s in samples] == ["abort", "abort"]
    assert len(engine.generated) == 2  # aborted by the caller: not re-sent


def _post(url: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + "/generate", json=body, timeout=60)


def test_sampling_seed_is_ignored_without_deterministic_inference(unseeded_server, prompts):
    body = {"input_ids": prompts[1], "sampling_params": {
        **SAMPLED.to_sglang(), "sampling_seed": 5}}
    first, again = (_post(unseeded_server.url, body).json() for _ in range(2))
    assert first["output_ids"] != again["output_ids"]


def test_samples_of_one_seeded_request_are_identical_with_deterministic_inference(
        server, prompts):
    sampling = {**SAMPLED.to_sglang(), "sampling_seed": 5}
    many = _post(server.url, {"input_ids": prompts[1],
                              "sampling_params": {**sampling, "n": 3}}).json()
    assert len(many) == 3 and all(m["output_ids"] == many[0]["output_ids"] for m in many)
    one = _post(server.url, {"input_ids": prompts[1], "sampling_params": sampling}).json()
    assert one["output_ids"] == many[0]["output_ids"]
    client_samples = asyncio.run(_client_generate(server.url, prompts[1]))
    assert client_samples[0].response_ids == one["output_ids"]
    assert len({tuple(s.response_ids) for s in client_samples}) == 3


async def _client_generate(url: str, prompt: list[int]) -> list:
    client = SGLangClient([url])
    try:
        return await client.generate([prompt], SamplingParams(
            max_new_tokens=12, temperature=1.0, ignore_eos=True, n=3), seeds=[5])
    finally:
        await client.close()


def test_n_samples_get_fresh_rids_and_aborting_the_parent_rid_does_nothing(slow_server,
                                                                           prompts):
    # the slow server: both samples are still running when the abort arrives
    body = {"input_ids": prompts[0], "rid": "parent", "sampling_params": {
        "max_new_tokens": 150, "temperature": 0.0, "ignore_eos": True, "n": 2}}

    async def scenario():
        async with httpx.AsyncClient(base_url=slow_server.url, timeout=60) as http:
            task = asyncio.create_task(http.post("/generate", json=body))
            running = 0
            for _ in range(500):
                info = (await http.get("/get_server_info")).json()["internal_states"][0]
                running = info["num_running_reqs"]
                if running >= 2:
                    break
                await asyncio.sleep(0.02)
            aborted = await http.post("/abort_request", json={"rid": "parent"})
            return running, aborted, (await task).json()

    running, aborted, answer = asyncio.run(scenario())
    assert running == 2, "the two samples were not seen running before the abort"
    assert aborted.status_code == 200
    ids = [a["meta_info"]["id"] for a in answer]
    assert len(set(ids)) == 2 and "parent" not in ids
    assert all(a["meta_info"]["finish_reason"]["type"] == "length" for a in answer)


def test_a_batch_with_different_n_gets_sglangs_400(server):
    r = _post(server.url, {"input_ids": [[5, 6], [7]],
                           "sampling_params": [{"max_new_tokens": 2}, {"max_new_tokens": 2,
                                                                       "n": 2}]})
    assert r.status_code == 400 and r.json() == {"error": {"message": MIXED_N_MESSAGE}}
