"""An engine that cannot take its memory back says why (PITFALLS T1): a real embedded server with
an out-of-memory error injected into ``/resume_memory_occupation`` (``MEGARL_OOM_AT``, the way
megarl injects faults into real processes) answers 500 with the reason, and megarl's client
turns that answer into the out-of-memory error of phase ``resume_rollout``, with its knobs."""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest

from megarl.memory import PHASE_KNOBS, PhaseOutOfMemory
from megarl.rollout.sglang.client import SGLangClient
from megarl.trainer import Trainer


def test_the_engine_answers_with_the_reason(resume_oom_server, hf_model):
    """500 with SGLang's error body: out of memory, the bytes asked (at least the weights'), the
    bytes free on the device, who holds the rest; the weights stay released."""
    url = resume_oom_server.url
    assert httpx.post(url + "/release_memory_occupation", json={}).status_code == 200
    answer = httpx.post(url + "/resume_memory_occupation", json={"tags": ["weights"]})
    assert answer.status_code == 500
    message = answer.json()["error"]["message"]
    assert message.startswith("out of memory resuming ['weights']: asked ")
    asked = int(re.search(r"asked (\d+) bytes", message).group(1))
    assert asked >= sum(p.numel() * p.element_size() for p in hf_model.parameters())
    free, total = map(int, re.search(r"(\d+) bytes \([\d.]+ GB\) free of (\d+) on cpu",
                                     message).groups())
    assert 0 < free <= total
    assert "held by: n/a (not a CUDA device)" in message
    assert "OutOfMemoryError: CUDA out of memory (MEGARL_OOM_AT=resume_rollout)" in message
    info = httpx.get(url + "/get_server_info").json()["internal_states"][0]
    assert "weights" in info["released"]
    assert httpx.post(url + "/resume_memory_occupation",
                      json={"tags": ["kv_cache"]}).status_code == 200  # nothing to allocate


def test_the_trainer_reports_the_phase_and_its_knobs(resume_oom_server):
    """The client raises PhaseOutOfMemory('resume_rollout') naming the engine and the knobs;
    the trainer's reporting passes it on as it is (not as "HTTP 500")."""
    url = resume_oom_server.url

    async def resume() -> None:
        client = SGLangClient([url])
        try:
            await client.release_memory(["kv_cache", "weights"])
            await client.resume_memory(["weights"])
        finally:
            await client.close()

    with pytest.raises(PhaseOutOfMemory) as caught:
        Trainer.reporting_oom(lambda: asyncio.run(resume()))
    err = caught.value
    assert err.phase == "resume_rollout" and err.where == f"rollout engine {url}"
    text = str(err)
    assert "\n" not in text and "HTTP 500" not in text
    assert text.startswith("out of memory in phase 'resume_rollout' on rollout engine ")
    assert "out of memory resuming ['weights']: asked " in err.detail
    assert "rollout.gpu_memory_utilization" in text
    for knob in PHASE_KNOBS["resume_rollout"]:
        assert knob in text
