"""Routed experts (R3) of a tiny Qwen3-MoE: the engine's routes equal HF's router top-k."""

from __future__ import annotations

import asyncio
import base64

import httpx
import numpy as np
import torch

from megarl.rollout.interface import SamplingParams
from megarl.rollout.sglang.client import SGLangClient


def hf_routes(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """``[len(tokens), layers, top_k]``: top-k of every layer's router logits, by HF."""
    with torch.no_grad():
        out = model(torch.tensor([tokens]), output_router_logits=True)
    k = model.config.num_experts_per_tok
    return torch.stack([logits.topk(k, dim=-1).indices for logits in out.router_logits], dim=1)


def test_routed_experts_equal_hf_router_topk(server, hf_model, prompts):
    params = SamplingParams(max_new_tokens=10, temperature=1.0, n=2, seed=11, ignore_eos=True)

    async def scenario():
        client = SGLangClient([server.url])
        try:
            return await client.generate(prompts[1:3], params, return_routed_experts=True)
        finally:
            await client.close()

    samples = asyncio.run(scenario())
    assert len(samples) == 4
    for s in samples:
        fed = s.prompt_ids + s.response_ids[:-1]  # the last token never went through the model
        assert s.routed_experts.dtype == torch.int16
        assert s.routed_experts.shape == (len(fed), 2, 2)
        assert torch.equal(s.routed_experts.long(), hf_routes(hf_model, fed))
        assert s.response_routed_experts().shape == (len(s.response_ids), 2, 2)


def test_routed_experts_wire_format_and_start_len(server, hf_model, prompts):
    prompt = prompts[2]
    body = {"input_ids": prompt, "return_routed_experts": True, "routed_experts_start_len": 4,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}
    answer = httpx.post(server.url + "/generate", json=body, timeout=30).json()
    raw = np.frombuffer(base64.b64decode(answer["meta_info"]["routed_experts"]), dtype=np.int32)
    fed = prompt + answer["output_ids"][:-1]
    expected = hf_routes(hf_model, fed)[4:]
    assert torch.equal(torch.from_numpy(raw.copy()).view(-1, 2, 2).long(), expected)
