"""Generation through the SGLang client against a real embedded server, checked against HF."""

from __future__ import annotations

import asyncio
from asyncio import run

import pytest
import torch

from megarl.rollout.interface import SamplingParams
from megarl.rollout.sglang.client import SGLangClient


def hf_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Plain ``generate`` greedy continuation of one prompt (EOS ignored)."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                         do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def hf_logits(model: torch.nn.Module, prompt: list[int], response: list[int]) -> torch.Tensor:
    """Logits that predicted each response token, ``[len(response), V]``, by one forward."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0].float()
    return logits[len(prompt) - 1:-1]


async def _generate(url: str, prompts: list[list[int]], params: SamplingParams,
                    **kwargs: object) -> list:
    client = SGLangClient([url])
    try:
        return await client.generate(prompts, params, **kwargs)
    finally:
        await client.close()


def test_greedy_equals_hf_generate(server, hf_model, prompts):
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    samples = run(_generate(server.url, prompts, params))
    assert [s.prompt_index for s in samples] == [0, 1, 2, 3]
    for prompt, sample in zip(prompts, samples):
        assert sample.response_ids == hf_greedy(hf_model, prompt, 24)
        assert sample.finish_reason == "length" and sample.weight_version == "default"


def test_sampled_logprobs_equal_hf_forward(server, hf_model, prompts):
    temperature, top_p, top_k = 0.7, 0.9, 20
    params = SamplingParams(max_new_tokens=16, temperature=temperature, top_p=top_p,
                            top_k=top_k, n=2, seed=3, ignore_eos=True)
    samples = run(_generate(server.url, prompts[:2], params))
    assert len(samples) == 4
    for s in samples:
        logits = hf_logits(hf_model, s.prompt_ids, s.response_ids)
        log_probs = torch.log_softmax(logits / temperature, dim=-1)
        expected = log_probs.gather(1, torch.tensor(s.response_ids)[:, None]).squeeze(1)
        assert torch.allclose(torch.tensor(s.log_probs), expected, atol=1e-4, rtol=0)
        # every sampled token lies inside the top-k and the top-p nucleus (naive definition)
        for row, token in zip(log_probs.exp(), s.response_ids):
            order = row.argsort(descending=True).tolist()
            rank = order.index(token)
            assert rank < top_k
            assert row[order[:rank]].sum() <= top_p + 1e-6


def test_greedy_logprobs_are_untempered(server, hf_model, prompts):
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    (s,) = run(_generate(server.url, prompts[:1], params))
    log_probs = torch.log_softmax(hf_logits(hf_model, s.prompt_ids, s.response_ids), dim=-1)
    expected = log_probs.gather(1, torch.tensor(s.response_ids)[:, None]).squeeze(1)
    assert torch.allclose(torch.tensor(s.log_probs), expected, atol=1e-4, rtol=0)


def test_n_samples_per_prompt_and_seeds(server, prompts):
    params = SamplingParams(max_new_tokens=12, temperature=1.0, n=4, seed=7, ignore_eos=True)
    first = run(_generate(server.url, prompts[:2], params))
    assert [(s.prompt_index, s.sample_index) for s in first] == [
        (i, j) for i in range(2) for j in range(4)]
    assert all(len(s.response_ids) == 12 == len(s.log_probs) for s in first)
    assert len({tuple(s.response_ids) for s in first[:4]}) == 4  # the samples differ
    again = run(_generate(server.url, prompts[:2], params))
    assert [s.response_ids for s in again] == [s.response_ids for s in first]
    other = run(_generate(server.url, prompts[:2],
                          SamplingParams(max_new_tokens=12, n=4, seed=8, ignore_eos=True)))
    assert [s.response_ids for s in other] != [s.response_ids for s in first]


def test_stop_token_ends_the_sample(server, hf_model, prompts):
    greedy = hf_greedy(hf_model, prompts[1], 20)
    stop = greedy[6]
    first = greedy.index(stop)
    params = SamplingParams(max_new_tokens=20, temperature=0.0, stop_token_ids=(stop,),
                            ignore_eos=True)
    (s,) = run(_generate(server.url, [prompts[1]], params))
    assert s.response_ids == greedy[:first + 1]
    assert s.finish_reason == "stop" and s.matched_stop == stop
    late = SamplingParams(max_new_tokens=20, temperature=0.0, stop_token_ids=(stop,),
                          ignore_eos=True, min_new_tokens=first + 1)
    (s,) = run(_generate(server.url, [prompts[1]], late))
    assert stop not in s.response_ids[:first + 1]


def test_64_concurrent_requests_complete_correctly(server, hf_model):
    gen = torch.Generator().manual_seed(5)
    lengths = torch.randint(2, 12, (64,), generator=gen).tolist()
    prompts = [torch.randint(5, 128, (n,), generator=gen).tolist() for n in lengths]
    budgets = [2 + i % 9 for i in range(64)]  # rows finish at different steps

    async def scenario():
        client = SGLangClient([server.url])
        try:
            return await asyncio.gather(*(
                client.generate_one(p, SamplingParams(max_new_tokens=n, temperature=0.0,
                                                      ignore_eos=True))
                for p, n in zip(prompts, budgets)))
        finally:
            await client.close()

    groups = run(scenario())
    # reference: one left-padded batched HF generate over the same prompts
    width = max(lengths)
    ids = torch.zeros(64, width, dtype=torch.long)
    mask = torch.zeros(64, width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    ref = hf_model.generate(ids, attention_mask=mask, max_new_tokens=max(budgets),
                            do_sample=False, eos_token_id=None, pad_token_id=0)[:, width:]
    for (sample,), expected, n in zip(groups, ref.tolist(), budgets):
        assert sample.response_ids == expected[:n] and sample.finish_reason == "length"


def test_two_engine_client_balances_and_returns_every_sample(server, prompts):
    async def scenario():
        client = SGLangClient([server.url, server.url], max_concurrency_per_engine=2)
        try:
            params = SamplingParams(max_new_tokens=4, temperature=0.0, n=2)
            samples = await client.generate(prompts * 2, params)
            versions = await client.get_weight_version()
            return samples, versions, list(client.balancer.outstanding)
        finally:
            await client.close()

    samples, versions, outstanding = run(scenario())
    assert len(samples) == 16 and outstanding == [0, 0] and versions == ["default", "default"]
    assert [s.response_ids for s in samples[:8]] == [s.response_ids for s in samples[8:]]


def test_connection_failures_are_retried_then_reported():
    import http.server
    import threading

    import httpx

    from megarl.rollout.process import free_port
    from megarl.rollout.sglang.client import EngineError

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    started: list[http.server.HTTPServer] = []

    def serve() -> None:  # the "engine" comes back: it listens from here on
        httpd = http.server.HTTPServer(("127.0.0.1", port), http.server.BaseHTTPRequestHandler)
        started.append(httpd)
        threading.Thread(target=httpd.serve_forever, daemon=True).start()

    class BackAfterFirstFailure(httpx.AsyncHTTPTransport):
        """Counts connection attempts; the first refused one brings the engine back, so the
        retry (not a lucky delay) is what reaches it, on a machine of any speed."""

        def __init__(self, comes_back: bool) -> None:
            super().__init__()
            self.attempts = 0
            self.comes_back = comes_back

        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            self.attempts += 1
            try:
                return await super().handle_async_request(request)
            except httpx.ConnectError:
                if self.comes_back and not started:
                    serve()
                raise

    async def scenario(retries: int, transport: BackAfterFirstFailure):
        client = SGLangClient([url], max_retries=retries, retry_backoff_s=0.2)
        await client._http.aclose()
        client._http = httpx.AsyncClient(transport=transport)
        try:
            return await client._request("GET", url + "/x")
        finally:
            await client.close()

    never = BackAfterFirstFailure(comes_back=False)
    with pytest.raises(EngineError, match="failed after 1 attempts"):
        run(scenario(0, never))
    assert never.attempts == 1
    back = BackAfterFirstFailure(comes_back=True)
    try:
        assert run(scenario(4, back)).status_code == 501
        assert back.attempts == 2  # refused once, then served on the first retry
    finally:
        for httpd in started:
            httpd.shutdown()
            httpd.server_close()
