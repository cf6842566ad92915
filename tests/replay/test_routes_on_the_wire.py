"""R3 against SGLang's wire format (issue 17, point 4): ``routed_experts`` has a row for EVERY
layer (dense ones 0) and ``/model_info`` says nothing about MoE; the trainer's client takes the
layout from config.json and hands router replay the MoE layers' rows, as before."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from megarl.batch import StepBatch
from megarl.config import load_config
from megarl.data.tiny_model import make_tiny_model
from megarl.demo import DEMO_CONFIG
from megarl.rollout.interface import SamplingParams
from megarl.rollout.local.launch import launch_local_engines
from megarl.rollout.process import ManagedServer
from megarl.trainer.workers import rollout_client

PROMPTS = [[5, 9, 30, 41], [7, 8, 9, 10, 11, 12, 13]]


@pytest.fixture(scope="module")
def mixed_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3-MoE of 3 layers whose middle layer is dense (``mlp_only_layers``)."""
    return make_tiny_model(tmp_path_factory.mktemp("mixed") / "model", "qwen3_moe", seed=0,
                           num_hidden_layers=3, mlp_only_layers=[1])


@pytest.fixture(scope="module")
def mixed_server(mixed_dir: Path,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedServer]:
    """An embedded server on ``mixed_dir``."""
    servers = launch_local_engines(str(mixed_dir), 1, num_threads=1,
                                   log_dir=tmp_path_factory.mktemp("mixed_logs"),
                                   extra_args=["--random-seed", "0"], ready_timeout_s=120)
    try:
        yield servers[0]
    finally:
        servers[0].stop()


def hf_moe_routes(model_dir: Path, tokens: list[int]) -> torch.Tensor:
    """``[len(tokens), moe_layers, top_k]``: HF's router top-k of the MoE layers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(torch.tensor([tokens]), output_router_logits=True)
    k = model.config.num_experts_per_tok
    return torch.stack([logits.topk(k, dim=-1).indices for logits in out.router_logits], dim=1)


def test_wire_has_every_layer_and_model_info_no_moe_fields(mixed_dir, mixed_server):
    body = {"input_ids": PROMPTS[0], "return_routed_experts": True,
            "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}}
    with httpx.Client(base_url=mixed_server.url, timeout=30) as http:
        answer = http.post("/generate", json=body).json()
        info = http.get("/model_info").json()
    assert not {"num_moe_layers", "moe_top_k"} & set(info)
    fed = PROMPTS[0] + answer["output_ids"][:-1]
    raw = np.frombuffer(base64.b64decode(answer["meta_info"]["routed_experts"]), np.int32)
    wire = torch.from_numpy(raw.copy()).view(len(fed), 3, 2).long()
    assert not wire[:, 1].any()  # the dense layer: never written, 0 as in SGLang
    assert torch.equal(wire[:, [0, 2]], hf_moe_routes(mixed_dir, fed))


def test_trainer_client_keeps_the_moe_layers_for_router_replay(mixed_dir, mixed_server):
    cfg, _ = load_config(str(DEMO_CONFIG), [f"model.path={mixed_dir}",
                                            "actor.router_replay.mode=R3"])
    params = SamplingParams(max_new_tokens=6, temperature=1.0, ignore_eos=True)

    async def scenario():
        client = rollout_client(cfg, [mixed_server.url])
        try:
            return await client.generate(PROMPTS, params, return_routed_experts=True,
                                         seeds=[1, 2])
        finally:
            await client.close()

    samples = asyncio.run(scenario())
    for s in samples:
        fed = s.prompt_ids + s.response_ids[:-1]
        assert s.routed_experts.shape == (len(fed), 2, 2)
        assert torch.equal(s.routed_experts.long(), hf_moe_routes(mixed_dir, fed))
    routes = StepBatch(samples=samples, prompts=[{"input_ids": p} for p in PROMPTS],
                       n=1).engine_routes()
    assert [tuple(r.shape) for r in routes] == [tuple(s.routed_experts.shape) for s in samples]
