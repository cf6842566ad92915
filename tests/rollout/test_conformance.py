"""The embedded server answers like SGLang 0.5.10 where megarl's client depends on it (issue 17):
``/health`` is a one-token generation that blocks while paused, memory release answers a JSON
null, ``/model_info`` replaces ``/get_weight_version``; and the client copes with each."""

from __future__ import annotations

import asyncio
import time

import httpx

from megarl.rollout.sglang.client import SGLangClient

HEALTH_CHECK_TIMEOUT_S = 1.0  # --health-check-timeout of the conftest's server


def test_health_blocks_while_paused_then_answers_503(server):
    with httpx.Client(base_url=server.url, timeout=30) as http:
        assert http.get("/health").status_code == 200
        assert http.post("/pause_generation", json={"mode": "retract"}).json()["status"] == "ok"
        try:
            for path in ("/health", "/health_generate"):
                start = time.monotonic()
                assert http.get(path).status_code == 503, path
                assert time.monotonic() - start >= HEALTH_CHECK_TIMEOUT_S * 0.9, path
        finally:
            assert http.post("/continue_generation").json()["status"] == "ok"
        assert http.get("/health").status_code == 200
        state = http.get("/get_server_info").json()["internal_states"][0]
        assert state["num_running_reqs"] == 0  # the timed-out probes were aborted


def test_client_keeps_engines_it_paused_or_released_in_service(server):
    async def scenario() -> tuple[list[list[bool]], dict[int, str]]:
        client = SGLangClient([server.url], unhealthy_after=1, health_timeout_s=15)
        states = []
        try:
            await client.pause("retract")
            states.append(await client.health())
            await client.resume()
            await client.release_memory(["kv_cache"])
            states.append(await client.health())
            await client.resume_memory(["kv_cache"])
            states.append(await client.health())
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:  # paused behind its back
                await http.post("/pause_generation", json={"mode": "retract"})
                try:
                    states.append(await client.health())
                finally:
                    await http.post("/continue_generation")
            return states, client.down
        finally:
            await client.close()

    states, down = asyncio.run(scenario())
    assert states == [[True], [True], [True], [False]]
    assert list(down) == [0] and "health checks" in down[0]


def test_memory_release_answers_null_and_errors_like_sglang(server, moe_dir):
    """Release and resume answer a JSON null; an unknown tag is refused. The released weights
    are dropped (no --enable-weights-cpu-backup, as SGLang by default), so generation waits for
    a weight update, here the server's own checkpoint from disk (the server is shared)."""
    with httpx.Client(base_url=server.url, timeout=30) as http:
        r = http.post("/release_memory_occupation", json={"tags": ["kv_cache"]})
        assert (r.status_code, r.content) == (200, b"null")
        r = http.post("/resume_memory_occupation", json={"tags": ["kv_cache"]})
        assert (r.status_code, r.content) == (200, b"null")
        r = http.post("/release_memory_occupation", json={"tags": ["gpu"]})
        assert r.status_code == 400 and "unknown" in r.json()["error"]["message"]

    async def scenario() -> str:
        client = SGLangClient([server.url])
        try:
            await client.release_memory(None)
            await client.resume_memory(None)
            try:
                await client.release_memory(["gpu"])
            except Exception as err:  # noqa: BLE001 - the message is what is checked
                message = str(err)
            else:
                message = "no error"
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
                refused = (await http.post("/generate", json={"input_ids": [5]})).json()
                await client.update_weights_from_disk(str(moe_dir))
                served = await http.post("/generate", json={"input_ids": [5]})
            return message, refused["error"]["message"], served.status_code
        finally:
            await client.close()

    message, refused, served = asyncio.run(scenario())
    assert "unknown ['gpu']" in message
    assert "--enable-weights-cpu-backup" in refused and served == 200


def test_model_info_replaces_get_weight_version(server):
    with httpx.Client(base_url=server.url, timeout=30) as http:
        info = http.get("/model_info").json()
        assert http.get("/get_model_info").json() == info
        assert http.get("/get_weight_version").status_code == 404
    assert not {"num_moe_layers", "moe_top_k"} & set(info)
    assert info["model_type"] == "qwen3_moe" and info["weight_version"] == "default"

    async def scenario() -> list[str | None]:
        client = SGLangClient([server.url])
        try:
            await client.readmit(0, "default")
            return await client.get_weight_version()
        finally:
            await client.close()

    assert asyncio.run(scenario()) == ["default"]
