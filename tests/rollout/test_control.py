"""Abort, pause/continue, health and bad input against a real embedded server.

The tests that act on a request they saw running use ``slow_server`` (each generation step takes
at least ``SLOW_STEP_S``): the request is still in progress when the abort or pause arrives on a
machine of any speed, where the plain server might finish 120 tokens first."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from megarl.rollout.interface import SamplingParams
from megarl.rollout.sglang.client import EngineError, SGLangClient

CONTEXT_LENGTH = 512  # max_position_embeddings of the tiny models

LONG = SamplingParams(max_new_tokens=400, temperature=0.0, ignore_eos=True)


async def _steps(url: str) -> int:
    """The generation steps the server has run so far."""
    async with httpx.AsyncClient() as http:
        info = (await http.get(url + "/get_server_info")).json()
    return info["internal_states"][0]["generation_steps"]


async def _running(url: str, count: int = 1, timeout_s: float = 10.0) -> None:
    """Wait until the server reports ``count`` running samples."""
    async with httpx.AsyncClient() as http:
        for _ in range(int(timeout_s / 0.02)):
            info = (await http.get(url + "/get_server_info")).json()
            if info["internal_states"][0]["num_running_reqs"] >= count:
                return
            await asyncio.sleep(0.02)
    raise AssertionError("the request never started running")


def test_abort_of_a_running_request(slow_server, prompts):
    async def scenario():
        client = SGLangClient([slow_server.url])
        try:
            task = asyncio.create_task(client.generate([prompts[0]], LONG, rids=["long-1"]))
            await _running(slow_server.url)
            await client.abort("long-1")
            (sample,) = await asyncio.wait_for(task, 10)
            return sample
        finally:
            await client.close()

    sample = asyncio.run(scenario())
    assert sample.finish_reason == "abort"
    assert 0 < len(sample.response_ids) < 400
    assert len(sample.log_probs) == len(sample.response_ids)


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_pause_then_continue_finishes_the_same_tokens(slow_server, prompts, mode):
    params = SamplingParams(max_new_tokens=120, temperature=0.0, ignore_eos=True)

    async def scenario():
        client = SGLangClient([slow_server.url])
        try:
            (reference,) = await client.generate([prompts[2]], params)
            task = asyncio.create_task(client.generate([prompts[2]], params))
            await _running(slow_server.url)
            await client.pause(mode)
            late = asyncio.create_task(client.generate([prompts[3]], params))
            steps = await _steps(slow_server.url)
            await asyncio.sleep(0.5)
            assert not task.done() and not late.done()  # nothing advances while paused
            assert await _steps(slow_server.url) == steps  # not one generation step
            await client.resume()
            (sample,) = await asyncio.wait_for(task, 30)
            await asyncio.wait_for(late, 30)
            return reference, sample
        finally:
            await client.close()

    reference, sample = asyncio.run(scenario())
    assert sample.finish_reason == "length"
    assert sample.response_ids == reference.response_ids


def test_pause_with_abort_mode_returns_partial_samples(slow_server, prompts):
    async def scenario():
        client = SGLangClient([slow_server.url])
        try:
            task = asyncio.create_task(client.generate([prompts[0]], LONG))
            await _running(slow_server.url)
            await client.pause("abort")
            (sample,) = await asyncio.wait_for(task, 10)
            await client.resume()
            return sample
        finally:
            await client.close()

    sample = asyncio.run(scenario())
    assert sample.finish_reason == "abort" and len(sample.response_ids) < 400


BAD_BODIES = {
    "prompt longer than the context": ({"input_ids": [5] * CONTEXT_LENGTH}, "context length"),
    "empty prompt": ({"input_ids": []}, "empty"),
    "token id >= vocab": ({"input_ids": [5, 128]}, "outside the vocabulary"),
    "negative token id": ({"input_ids": [-1]}, "outside the vocabulary"),
    "max_new_tokens = 0": ({"input_ids": [5], "sampling_params": {"max_new_tokens": 0}},
                           "max_new_tokens"),
    "max_new_tokens < 0": ({"input_ids": [5], "sampling_params": {"max_new_tokens": -3}},
                           "max_new_tokens"),
    "unknown sampling field": ({"input_ids": [5], "sampling_params": {"temprature": 1}},
                               "temprature"),
    "top_p out of range": ({"input_ids": [5], "sampling_params": {"top_p": 0}}, "top_p"),
    "float token ids": ({"input_ids": [5.5]}, "integer"),
    "no prompt": ({"sampling_params": {}}, "input_ids"),
    "stop strings": ({"input_ids": [5], "sampling_params": {"stop": ["x"]}}, "stop"),
    "streaming": ({"input_ids": [5], "stream": True}, "stream"),
}


def test_bad_inputs_get_400_and_the_server_keeps_serving(server):
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for label, (body, needle) in BAD_BODIES.items():
            r = http.post("/generate", json=body)
            assert r.status_code == 400, label
            assert needle in r.json()["error"]["message"], (label, r.json())  # SGLang's shape
        for raw in (b"{not json", b"[1, 2]", b""):
            r = http.post("/generate", content=raw)
            assert r.status_code == 400 and r.json()["object"] == "error", raw
            assert r.json()["message"] and r.json()["code"] == 400, raw
        assert http.post("/abort_request", json={}).status_code == 400
        assert http.post("/pause_generation", json={"mode": "sideways"}).status_code == 400
        assert http.post("/get_weights_by_name", json={"name": "nope"}).status_code == 400
        r = http.post("/weights_checker", json={"action": "explode"})
        assert r.status_code == 400 and r.json()["success"] is False
        ok = http.post("/generate", json={"input_ids": [5, 6],
                                          "sampling_params": {"max_new_tokens": 3}})
        assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 3
        assert http.get("/health").status_code == 200
        assert http.get("/health_generate").status_code == 200


def test_client_raises_engine_errors_with_the_server_message(server):
    async def scenario():
        client = SGLangClient([server.url])
        try:
            await client.generate([[5] * CONTEXT_LENGTH], SamplingParams(max_new_tokens=2))
        finally:
            await client.close()

    with pytest.raises(EngineError, match="context length"):
        asyncio.run(scenario())


def test_text_prompts_info_and_flush(server):
    with httpx.Client(base_url=server.url, timeout=30) as http:
        r = http.post("/generate", json={"text": "12+3=", "sampling_params": {
            "max_new_tokens": 4, "temperature": 0}})
        assert r.status_code == 200 and isinstance(r.json()["text"], str)
        assert r.json()["meta_info"]["prompt_tokens"] == 5
        info = http.get("/model_info").json()
        assert info["is_generation"] and info["weight_version"] == "default"
        assert http.get("/get_model_info").json() == info
        assert http.post("/flush_cache").status_code == 200


def test_a_proxy_of_the_environment_does_not_carry_engine_traffic(server, prompts, monkeypatch):
    """PITFALLS M5: a user's HTTP_PROXY (a cluster's way to the internet) must not carry the
    calls to the engines. Here it points at a port where nothing listens: a client that used it
    could not reach the engine at all."""
    from megarl.net import free_port
    from megarl.weights.links import HttpLink

    dead = f"http://127.0.0.1:{free_port()}"
    for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.setenv(name, dead)
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    with httpx.Client(timeout=10) as proxied, pytest.raises(httpx.ConnectError):
        proxied.get(server.url + "/health")  # httpx by default goes through the dead proxy

    async def scenario() -> tuple[list, list]:
        client = SGLangClient([server.url], max_retries=0)
        try:  # (not /health: its one-token probe has 1 s here, which a loaded machine misses)
            return await client.get_weight_version(), await client.generate(
                prompts[:1], SamplingParams(max_new_tokens=2, temperature=0.0))
        finally:
            await client.close()

    versions, samples = asyncio.run(scenario())
    assert len(versions) == 1 and versions[0] is not None and len(samples[0].response_ids) == 2
    link = HttpLink([server.url], timeout_s=10)
    try:
        reply, = link.post([{"op": "no_such_op"}])()
    finally:
        link.close()
    print(reply)
    assert "answered HTTP" in reply["error"] or "no_such_op" in reply["error"], reply
    assert "ProxyError" not in reply["error"]
