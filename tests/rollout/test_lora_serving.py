"""LoRA adapters served by the embedded engine (``--enable-lora``, SGLang's LoRA endpoints;
issue 33), against HF ``peft``: a prompt generated with ``lora_path`` gets the tokens and
log-probs of ``merge_and_unload`` of the same adapter served as a plain model, a prompt
without it those of the base model, in the same batch; the adapter loads from a PEFT directory
or from tensors; unknown, duplicate and in-use names are refused with the reason."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch
from safetensors.torch import load_file

from megarl.data.tiny_model import make_tiny_model
from megarl.rollout.local.launch import launch_local_engines
from megarl.weights.flattened import FLATTENED_BUCKET, flatten_bucket, serialize

PROMPTS = [[3, 5, 7, 9], [11, 13, 17], [19, 23, 29, 31, 37]]


@pytest.fixture(scope="module")
def adapter(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny dense Qwen3, a random PEFT adapter on q, v and down projections (rank 4, alpha 8,
    rsLoRA off), and PEFT's merge of it saved as a plain model."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("lora_serving")
    base_dir = make_tiny_model(root / "base", arch="qwen3", seed=0)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0,
        target_modules=["q_proj", "v_proj", "down_proj"]))
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:  # B starts at zero: both random, so the adapter matters
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    peft_model.save_pretrained(root / "adapter")
    merged = peft_model.merge_and_unload()
    merged.save_pretrained(root / "merged", safe_serialization=True)
    for item in base_dir.iterdir():
        if not (root / "merged" / item.name).exists():
            shutil.copy(item, root / "merged" / item.name)
    return {"base": base_dir, "adapter": root / "adapter", "merged": root / "merged"}


@pytest.fixture(scope="module")
def servers(adapter, tmp_path_factory):
    logs = tmp_path_factory.mktemp("lora_logs")
    lora, second = launch_local_engines(str(adapter["base"]), 2, num_threads=1, log_dir=logs,
                                        extra_args=["--enable-lora"], ready_timeout_s=120)
    merged = launch_local_engines(str(adapter["merged"]), 1, num_threads=1, log_dir=logs,
                                  ready_timeout_s=120)[0]
    yield lora, merged, second
    for server in (lora, second, merged):
        server.stop()


def generate(url: str, lora_path=None, prompts=PROMPTS) -> list[dict]:
    body = {"input_ids": prompts, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}
    if lora_path is not None:
        body["lora_path"] = lora_path
    response = httpx.post(f"{url}/generate", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=60)


def assert_same(got: dict, want: dict) -> None:
    assert got["output_ids"] == want["output_ids"]
    lp = [x[0] for x in got["meta_info"]["output_token_logprobs"]]
    ref = [x[0] for x in want["meta_info"]["output_token_logprobs"]]
    assert torch.allclose(torch.tensor(lp), torch.tensor(ref), atol=1e-4), (lp, ref)


def test_an_adapter_serves_peft_merge_and_leaves_other_rows_alone(adapter, servers):
    lora, merged, _ = servers
    base_out = generate(lora.url)
    merged_out = generate(merged.url)
    assert [o["output_ids"] for o in base_out] != [o["output_ids"] for o in merged_out]
    loaded = post(lora.url, "/load_lora_adapter", {"lora_name": "policy",
                                                   "lora_path": str(adapter["adapter"])})
    assert loaded.status_code == 200, loaded.text
    assert loaded.json()["success"] and "policy" in loaded.json()["loaded_adapters"]
    for got, want in zip(generate(lora.url, "policy"), merged_out):
        assert_same(got, want)
    # one batch: the adapter on the first and last prompt, the base model on the middle one
    mixed = generate(lora.url, ["policy", None, "policy"])
    for got, want in zip(mixed, [merged_out[0], base_out[1], merged_out[2]]):
        assert_same(got, want)
    # the same adapter as tensors (what a trainer sends), under a second name
    config = json.loads((adapter["adapter"] / "adapter_config.json").read_text())
    tensors = load_file(str(adapter["adapter"] / "adapter_model.safetensors"))
    sent = post(lora.url, "/load_lora_adapter_from_tensors", {
        "lora_name": "policy-v2", "config_dict": config, "load_format": FLATTENED_BUCKET,
        "serialized_tensors": serialize(flatten_bucket(list(tensors.items())))})
    assert sent.status_code == 200, sent.text
    for got, want in zip(generate(lora.url, "policy-v2"), merged_out):
        assert_same(got, want)
    unloaded = post(lora.url, "/unload_lora_adapter", {"lora_name": "policy"})
    assert unloaded.status_code == 200 and set(unloaded.json()["loaded_adapters"]) == {
        "policy-v2"}
    assert post(lora.url, "/unload_lora_adapter", {"lora_name": "policy-v2"}).status_code == 200
    for got, want in zip(generate(lora.url), base_out):  # no hook left behind
        assert_same(got, want)


def test_names_and_tensors_that_do_not_fit_are_refused(adapter, servers):
    lora, _, _ = servers
    missing = post(lora.url, "/generate", {"input_ids": [1, 2], "lora_path": "nope"})
    assert missing.status_code == 400 and "not a loaded LoRA adapter" in missing.text
    path = str(adapter["adapter"])
    assert post(lora.url, "/load_lora_adapter", {"lora_name": "x", "lora_path": path}).is_success
    twice = post(lora.url, "/load_lora_adapter", {"lora_name": "x", "lora_path": path})
    assert twice.status_code == 400 and "already loaded" in twice.json()["error_message"]
    assert post(lora.url, "/unload_lora_adapter", {"lora_name": "x"}).is_success
    gone = post(lora.url, "/unload_lora_adapter", {"lora_name": "x"})
    assert gone.status_code == 400 and "is not loaded" in gone.json()["error_message"]
    config = json.loads((adapter["adapter"] / "adapter_config.json").read_text())
    tensors = load_file(str(adapter["adapter"] / "adapter_model.safetensors"))
    name = next(k for k in tensors if k.endswith("q_proj.lora_A.weight"))
    tensors[name] = tensors[name][:, :-1]  # one input feature short
    bad = post(lora.url, "/load_lora_adapter_from_tensors", {
        "lora_name": "bad", "config_dict": config, "load_format": FLATTENED_BUCKET,
        "serialized_tensors": serialize(flatten_bucket(list(tensors.items())))})
    assert bad.status_code == 400 and "do not fit a layer of 64 -> 64" in bad.text
    nodir = post(lora.url, "/load_lora_adapter", {"lora_name": "y", "lora_path": "/nonexistent"})
    assert nodir.status_code == 400 and "adapter_config.json" in nodir.text
    assert post(lora.url, "/load_lora_adapter", {"lora_name": "x"}).status_code == 400


def test_a_server_without_enable_lora_says_so(server):
    """The shared MoE server was started without ``--enable-lora``: SGLang's message."""
    load = post(server.url, "/load_lora_adapter", {"lora_name": "a", "lora_path": "/x"})
    assert load.status_code == 400 and "--enable-lora" in load.json()["error_message"]
    gen = post(server.url, "/generate", {"input_ids": [1, 2], "lora_path": "a"})
    assert gen.status_code == 400 and "--enable-lora" in gen.text


def test_the_adapter_sync_leaves_one_adapter_on_every_engine_across_a_restart(adapter, servers):
    """The trainer's per-step adapter sync (``actor.lora.sync: adapter``) on two engines: after
    each sync every engine serves the new version only, also when one engine was restarted in
    that sync (it never had the previous version; the engine that kept running must drop it).
    The actor is a stand-in that hands over the PEFT adapter, as rank 0's ``lora_adapter``
    does."""
    from megarl.config import load_config
    from megarl.demo import DEMO_CONFIG
    from megarl.rollout.sglang.client import SGLangClient
    from megarl.trainer.workers import _adapter_sync, _LocalServers

    lora, merged, second = servers
    config = json.loads((adapter["adapter"] / "adapter_config.json").read_text())
    tensors = load_file(str(adapter["adapter"] / "adapter_model.safetensors"))
    actor = SimpleNamespace(execute_all=lambda method: [(config, tensors)])
    cfg, _ = load_config(str(DEMO_CONFIG), [f"model.path={adapter['base']}"])
    urls = [lora.url, second.url]
    client = SGLangClient(urls)
    sync = _adapter_sync(cfg, actor, _LocalServers([lora, second]), client, urls, True)
    merged_out = generate(merged.url)

    def loaded(url: str) -> set[str]:
        # the embedded engine answers an unknown name with the names it holds
        answer = post(url, "/unload_lora_adapter", {"lora_name": "?"})
        assert answer.status_code == 400, answer.text
        return set(re.findall(r"policy-v\d+", answer.json()["error_message"]))

    try:
        sync("1")
        assert client.lora_path == "policy-v1"
        assert loaded(lora.url) == loaded(second.url) == {"policy-v1"}
        sync("2")
        assert loaded(lora.url) == loaded(second.url) == {"policy-v2"}
        second.process.kill()  # the engine dies between steps; the next sync restarts it
        second.process.wait(timeout=30)
        sync("3", restart=[1])
        assert loaded(lora.url) == loaded(second.url) == {"policy-v3"}
        for url in urls:
            for got, want in zip(generate(url, "policy-v3"), merged_out):
                assert_same(got, want)
    finally:
        for url in urls:
            for name in loaded(url):
                post(url, "/unload_lora_adapter", {"lora_name": name})
