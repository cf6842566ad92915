"""Weight updates into a running embedded server: broadcast over gloo, tensors, disk, checker.

The server serves model A (seed 0, no tokenizer files); the updates carry model B (seed 1).
The test process plays the trainer: it is rank 0 of the weight-update group and broadcasts B's
tensors (by checkpoint name, per-expert) while the client's update call is in flight.
"""

from __future__ import annotations

import asyncio
import base64
import pickle
from pathlib import Path

import httpx
import pytest
import torch
import torch.distributed as dist

from megarl.data.tiny_model import make_tiny_model
from megarl.rollout.interface import SamplingParams
from megarl.rollout.local.launch import launch_local_engines
from megarl.rollout.local.weights import iter_safetensors
from megarl.rollout.process import free_port
from megarl.rollout.sglang.client import EngineError, SGLangClient
from megarl.rollout.weight_group import close_weight_update_group, open_weight_update_group
from megarl.weights.flattened import FLATTENED_BUCKET, flatten_bucket, serialize

GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
EXPERT = "model.layers.1.mlp.experts.2.gate_proj.weight"


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("weights")
    a = make_tiny_model(root / "a", arch="qwen3_moe", seed=0, with_tokenizer=False)
    b = make_tiny_model(root / "b", arch="qwen3_moe", seed=1, with_tokenizer=False)
    return a, b


@pytest.fixture(scope="module")
def url(dirs, tmp_path_factory):
    (server,) = launch_local_engines(str(dirs[0]), 1, num_threads=1,
                                     log_dir=tmp_path_factory.mktemp("logs"),
                                     ready_timeout_s=120)
    yield server.url
    server.stop()


def hf_greedy(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return [model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False,
                           eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
            for p in prompts]


async def broadcast_update(client: SGLangClient, tensors: list[tuple[str, torch.Tensor]],
                           version: str) -> None:
    """Rank 0 joins a gloo group with the engine and sends ``tensors`` in two buckets: the
    first one tensor per broadcast, the second as one flattened buffer."""
    port = free_port()
    group, _ = await asyncio.gather(
        asyncio.to_thread(open_weight_update_group, "127.0.0.1", port, 0, 2, "wug", "gloo"),
        client.init_weights_update_group("127.0.0.1", port, 2, "wug", "gloo"))
    try:
        half = len(tensors) // 2
        for bucket, flat in ((tensors[:half], False), (tensors[half:], True)):
            def send(bucket=bucket, flat=flat) -> None:
                if flat:
                    dist.broadcast(flatten_bucket(bucket)["flattened_tensor"], src=0, group=group)
                    return
                for _, tensor in bucket:
                    dist.broadcast(tensor, src=0, group=group)

            await asyncio.gather(asyncio.to_thread(send), client.update_weights_from_distributed(
                [n for n, _ in bucket], [str(t.dtype) for _, t in bucket],
                [list(t.shape) for _, t in bucket], group_name="wug", weight_version=version,
                load_format=FLATTENED_BUCKET if flat else None))
        # an unknown name fails the call, but the sender is not left hanging
        bogus = torch.ones(3)
        with pytest.raises(EngineError, match="unknown weight names"):
            await asyncio.gather(
                asyncio.to_thread(dist.broadcast, bogus, 0, group),
                client.update_weights_from_distributed(["bogus.weight"], ["float32"], [[3]],
                                                       group_name="wug"))
    finally:
        await client.destroy_weights_update_group("wug")
        close_weight_update_group(group)


def test_broadcast_update_changes_weights_and_generations(url, dirs):
    a_dir, b_dir = dirs
    prompts = [[5, 9, 30], [70, 71, 72, 73, 74, 75]]
    ref_a, ref_b = hf_greedy(a_dir, prompts), hf_greedy(b_dir, prompts)
    assert ref_a != ref_b
    b_tensors = list(iter_safetensors(b_dir))

    async def scenario():
        client = SGLangClient([url])
        try:
            before = await client.generate(prompts, GREEDY)
            await broadcast_update(client, b_tensors, "v1")
            after = await client.generate(prompts, GREEDY)
            weights = await client.get_weights_by_name(EXPERT, truncate_size=4)
            return before, after, weights, await client.get_weight_version()
        finally:
            await client.close()

    before, after, weights, versions = asyncio.run(scenario())
    assert [s.response_ids for s in before] == ref_a
    assert [s.response_ids for s in after] == ref_b
    assert all(s.weight_version == "v1" for s in after) and versions == ["v1"]
    assert torch.equal(torch.tensor(weights[0]), dict(b_tensors)[EXPERT][:4])


def test_checker_disk_and_tensor_updates(url, dirs):
    a_dir, b_dir = dirs
    a_tensors = list(iter_safetensors(a_dir))

    async def scenario():
        client = SGLangClient([url])
        try:
            await client.update_weights_from_disk(str(b_dir), weight_version="disk")
            steps = [await client.check_weights("snapshot"),
                     await client.check_weights("reset_tensors"),
                     await client.check_weights("compare")]
            await client.update_weights_from_disk(str(b_dir), weight_version="disk")
            steps.append(await client.check_weights("compare"))
            # a plain pickle names torch's storage loader (torch.load inside): refused
            plain = base64.b64encode(pickle.dumps(a_tensors)).decode()
            with pytest.raises(EngineError, match="refusing to unpickle"):
                await client.update_weights_from_tensor([[plain]])
            payload = serialize(flatten_bucket(a_tensors))
            await client.update_weights_from_tensor([[payload]], weight_version="tensor",
                                                    load_format=FLATTENED_BUCKET)
            weights = await client.get_weights_by_name(EXPERT, truncate_size=2)
            samples = await client.generate([[5, 9, 30]], GREEDY)
            return steps, weights, samples
        finally:
            await client.close()

    steps, weights, samples = asyncio.run(scenario())
    (snap,), (reset,), (mismatch,), (match,) = steps
    assert snap[0] and reset[0]
    assert not mismatch[0] and "differ" in mismatch[1]
    assert match[0], match[1]
    assert torch.equal(torch.tensor(weights[0]), dict(a_tensors)[EXPERT][:2])
    assert samples[0].response_ids == hf_greedy(a_dir, [[5, 9, 30]])[0]
    assert samples[0].weight_version == "tensor"


def test_token_ids_only_model_and_memory_release(url, dirs):
    """Released weights are dropped (the server runs without --enable-weights-cpu-backup, as
    SGLang does by default): after the resume /generate is refused, naming what no update has
    rewritten, until every tensor is written again; then it generates as the model does."""
    a_dir, _ = dirs
    greedy = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    with httpx.Client(base_url=url, timeout=30) as http:
        r = http.post("/generate", json={"text": "hi"})
        assert r.status_code == 400 and "no tokenizer" in r.json()["error"]["message"]
        r = http.post("/generate", json={"input_ids": [5], "sampling_params": {
            "max_new_tokens": 2}})
        assert r.status_code == 200 and "text" not in r.json()  # as SGLang's skip_tokenizer_init
        released = http.post("/release_memory_occupation", json={})
        assert released.status_code == 200 and released.json() is None
        r = http.post("/generate", json={"input_ids": [5]})
        assert r.status_code == 400 and "resume_memory_occupation" in r.json()["error"]["message"]
        resumed = http.post("/resume_memory_occupation", json={})
        assert resumed.status_code == 200 and resumed.json() is None
        a_tensors = list(iter_safetensors(a_dir))
        r = http.post("/generate", json={"input_ids": [5]})
        message = r.json()["error"]["message"]
        assert r.status_code == 400 and "--enable-weights-cpu-backup" in message
        assert f"{len(a_tensors)} tensors have not been written" in message, message
        # one tensor written: one fewer missing
        one = {"serialized_named_tensors": [serialize(flatten_bucket(a_tensors[:1]))],
               "load_format": FLATTENED_BUCKET}
        assert http.post("/update_weights_from_tensor", json=one).json()["success"]
        message = http.post("/generate", json={"input_ids": [5]}).json()["error"]["message"]
        assert f"{len(a_tensors) - 1} tensors have not been written" in message, message
        assert a_tensors[0][0] not in message
        r = http.post("/update_weights_from_disk", json={"model_path": str(a_dir)})
        assert r.json()["success"], r.json()
        r = http.post("/generate", json={"input_ids": [5, 9, 30], "sampling_params": greedy})
        assert r.status_code == 200
        assert r.json()["output_ids"] == hf_greedy(a_dir, [[5, 9, 30]])[0]
