"""Partial rollouts against a real embedded engine whose weights change under them.

The fully_async producer (:class:`Rollouter`) generates into the queue while the test swaps the
engine's weights between two different tiny MoE models (A, B, A) the way a weight sync does:
pause, load, resume. Every token of every sample must carry the version of the weights that
sampled it: its engine log-prob equals the log-prob that model (HF transformers, teacher-forced
over prompt + all earlier tokens) gives it, and differs from the other model's; so do its routed
experts (R3), which the continuation's prefill would otherwise recompute under the new weights.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from megarl.data.tiny_model import make_tiny_model
from megarl.faults import ENGINE_DELAY_ENV
from megarl.rollout.agent import AgentLoop, AgentSettings, StepResult
from megarl.rollout.interface import SamplingParams
from megarl.rollout.local.launch import launch_local_engines
from megarl.rollout.sglang.client import SGLangClient
from megarl.scheduler.background import BusyClock, RolloutLoop
from megarl.scheduler.queue import SampleGroup, SampleQueue
from megarl.scheduler.rollouter import PromptJob, RolloutCounters, Rollouter, StalenessBudget
from megarl.scheduler.staleness import token_versions

PROMPTS = [[5, 17, 33], [9, 9, 40, 41, 42, 7, 8], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70]]
TEMPERATURE = 0.8
STEP_DELAY_S = 0.005


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("partial")
    return {"A": make_tiny_model(root / "a", arch="qwen3_moe", seed=0),
            "B": make_tiny_model(root / "b", arch="qwen3_moe", seed=1)}


@pytest.fixture(scope="module")
def url(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    # a slow device: every generation step takes at least STEP_DELAY_S, so a sync issued
    # within a tenth of a second of the first decode pauses requests mid-way on any machine
    with pytest.MonkeyPatch.context() as env:
        env.setenv(ENGINE_DELAY_ENV, str(STEP_DELAY_S))
        servers = launch_local_engines(str(models["A"]), 1, num_threads=1,
                                       log_dir=tmp_path_factory.mktemp("logs"),
                                       seed=0, extra_args=["--weight-version", "0"],
                                       ready_timeout_s=120)
    try:
        yield servers[0].url
    finally:
        servers[0].stop()


@pytest.fixture(scope="module")
def hf(models: dict[str, Path]) -> dict[str, torch.nn.Module]:
    from transformers import AutoModelForCausalLM

    return {k: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval()
            for k, p in models.items()}


def jobs() -> Iterator[PromptJob]:
    for ordinal in itertools.count():
        yield PromptJob(ordinal, {"input_ids": PROMPTS[ordinal % len(PROMPTS)]}, 100 + 7 * ordinal)


def wait_until_running(url: str, timeout_s: float = 60.0) -> None:
    """Block until the engine decodes at least one request."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = httpx.get(url + "/get_server_info", timeout=10).json()["internal_states"][0]
        if state["num_running_reqs"] > 0:
            return
        time.sleep(0.02)
    raise TimeoutError("the engine never started decoding")


def generate_across_syncs(url: str, *, partial: bool, max_new_tokens: int, start: int,
                          syncs: list[tuple[Path, int]], delay_s: float, take: int,
                          routes: bool = False, agent: AgentLoop | None = None,
                          ) -> tuple[list[SampleGroup], RolloutCounters]:
    """Run the producer from weight version ``start``; ``delay_s`` after the engine starts
    decoding, swap its weights as a sync does (per entry of ``syncs``); return the first
    ``take`` finished groups."""
    loop = RolloutLoop(lambda: SGLangClient([url]))
    queue = SampleQueue(10_000)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=TEMPERATURE, n=2,
                            ignore_eos=True)
    rollouter = Rollouter(loop.client, jobs(), params, queue, StalenessBudget(3, 0.0),
                          version=start, partial_rollout=partial,
                          options={"return_logprob": True, "return_routed_experts": routes},
                          clock=BusyClock(), agent=agent)
    queue.on_space = lambda: loop.call_soon(rollouter.wake)
    try:
        loop.run(loop.client.update_weight_version(str(start)), 60)
        loop.submit(rollouter.run())
        for path, version in syncs:
            wait_until_running(url)
            time.sleep(delay_s)
            loop.run(rollouter.pause_for_sync(), 120)
            loop.run(loop.client.update_weights_from_disk(str(path), weight_version=str(version)),
                     120)
            loop.run(rollouter.resume_after_sync(version), 120)
        groups = queue.take(take, timeout_s=300)
    finally:
        loop.run(rollouter.stop(), 120)
        loop.close()
    return groups, rollouter.counters


def engine_vs_model(model: torch.nn.Module, prompt: list[int], response: list[int],
                    engine: list[float]) -> torch.Tensor:
    """|engine log-prob - model log-prob| per response token (the model teacher-forced)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0].float()
    log_probs = torch.log_softmax(logits[len(prompt) - 1:-1] / TEMPERATURE, dim=-1)
    expected = log_probs.gather(1, torch.tensor(response)[:, None]).squeeze(1)
    return (torch.tensor(engine) - expected).abs()


def check_attribution(groups: list[SampleGroup], weights_of: dict[int, str],
                      hf: dict[str, torch.nn.Module]) -> int:
    """Assert every token's log-prob matches the model of its version (and not the other
    one); return how many tokens were checked against a model switch."""
    switched = 0
    for s in (s for g in groups for s in g.samples):
        versions = torch.tensor(token_versions(s))
        assert torch.all(versions[1:] >= versions[:-1]), "versions go back in time"
        diffs = {k: engine_vs_model(m, s.prompt_ids, s.response_ids, s.log_probs)
                 for k, m in hf.items()}
        for version in versions.unique().tolist():
            mine = weights_of[version]
            other = "B" if mine == "A" else "A"
            at = versions == version
            assert diffs[mine][at].max() < 1e-4, (s.rid, version, diffs[mine][at].max())
            assert diffs[other][at].max() > 1e-3, (s.rid, version)
        switched += int(len(versions.unique()) > 1) * len(versions)
    return switched


def test_paused_samples_resume_under_new_weights_with_per_token_versions(url, models, hf):
    max_new = 400
    groups, counters = generate_across_syncs(
        url, partial=True, max_new_tokens=max_new, start=0,
        syncs=[(models["B"], 1), (models["A"], 2)], delay_s=0.3, take=6)
    samples = [s for g in groups for s in g.samples]
    assert counters.resumed > 0 and any(g.num_partial for g in groups)
    # the prefix is kept: every sample has exactly max_new tokens (EOS ignored) in one piece
    assert all(len(s.response_ids) == max_new and s.finish_reason == "length" for s in samples)
    resumed = [s for s in samples if s.token_weight_versions is not None]
    assert all(s.extra["resumed"] >= 1 for s in resumed)
    assert check_attribution(groups, {0: "A", 1: "B", 2: "A"}, hf) > 0
    # groups were started within the budget: 3 per version
    assert counters.started <= 9


def test_without_partial_rollout_a_sync_waits_for_requests_in_flight(url, models, hf):
    groups, counters = generate_across_syncs(
        url, partial=False, max_new_tokens=60, start=10, syncs=[(models["B"], 11)],
        delay_s=0.2, take=6)
    samples = [s for g in groups for s in g.samples]
    assert counters.resumed == 0
    assert all(s.token_weight_versions is None and s.finish_reason == "length" for s in samples)
    # the three groups started before the sync finished under version 10, the next under 11
    assert [s.weight_version for g in groups[:3] for s in g.samples] == ["10"] * 6
    assert [s.weight_version for g in groups[3:] for s in g.samples] == ["11"] * 6
    check_attribution(groups, {10: "A", 11: "B"}, hf)


def hf_routes(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """``[len(tokens), layers, top_k]``: every layer's router top-k, by HF."""
    with torch.no_grad():
        out = model(torch.tensor([tokens]), output_router_logits=True)
    k = model.config.num_experts_per_tok
    return torch.stack([logits.topk(k, dim=-1).indices for logits in out.router_logits], dim=1)


def test_resumed_samples_keep_the_routes_their_tokens_were_generated_with(url, models, hf):
    loaded = httpx.post(url + "/update_weights_from_disk", timeout=120,
                        json={"model_path": str(models["A"])})  # an earlier test left B loaded
    assert loaded.json()["success"], loaded.text
    groups, counters = generate_across_syncs(
        url, partial=True, max_new_tokens=120, start=20, syncs=[(models["B"], 21)],
        delay_s=0.1, take=3, routes=True)
    weights_of = {20: "A", 21: "B"}
    resumed = [s for g in groups for s in g.samples if s.token_weight_versions is not None]
    assert counters.resumed > 0 and resumed
    for s in resumed:
        fed = s.prompt_ids + s.response_ids[:-1]
        versions = token_versions(s)
        # row len(prompt) - 1 + i produced response token i; the prompt's other rows were
        # recorded by the first segment
        row_versions = [versions[0]] * (len(s.prompt_ids) - 1) + versions
        assert s.routed_experts.shape[0] == len(fed) == len(row_versions)
        by_model = {k: hf_routes(m, fed).to(torch.int16) for k, m in hf.items()}
        expected = torch.stack([by_model[weights_of[v]][t] for t, v in enumerate(row_versions)])
        assert torch.equal(s.routed_experts, expected), s.rid
        # the continuation's prefill (the newest weights over every earlier token) differs
        assert not torch.equal(s.routed_experts, by_model[weights_of[versions[-1]]]), s.rid
    check_attribution(groups, weights_of, hf)


class AlwaysAnswers:
    """An environment that answers every model turn and never ends the episode."""

    async def step(self, action: str) -> StepResult:
        return StepResult("<tool_response>\n7\n</tool_response>")


def test_multi_turn_episodes_resume_at_their_turn_with_per_token_versions(url, models, hf):
    """fully_async with an agent loop: a sync pauses episodes inside a model turn; the turn is
    continued under the new weights and the episode goes on. Every model token keeps the
    version that sampled it (its log-prob is that model's over the whole episode, its route
    row that model's router choice); environment tokens stay masked."""
    from transformers import AutoTokenizer

    loaded = httpx.post(url + "/update_weights_from_disk", timeout=120,
                        json={"model_path": str(models["A"])})
    assert loaded.json()["success"], loaded.text
    agent = AgentLoop(AgentSettings(max_assistant_turns=3, max_tokens_per_turn=40,
                                    max_response_length=400),
                      AutoTokenizer.from_pretrained(models["A"]), env=lambda row: AlwaysAnswers())
    groups, counters = generate_across_syncs(
        url, partial=True, max_new_tokens=40, start=30, syncs=[(models["B"], 31)],
        delay_s=0.1, take=3, routes=True, agent=agent)
    weights_of = {30: "A", 31: "B"}
    samples = [s for g in groups for s in g.samples]
    assert counters.resumed > 0
    switched = 0
    for s in samples:
        assert s.extra["agent"]["turns"] == 3 and s.extra["agent"]["budget_turns"] == 1
        assert sum(s.response_mask) == 3 * 40  # every turn got all its tokens, EOS ignored
        tokens = s.prompt_ids + s.response_ids
        versions = token_versions(s)
        model_at = [i for i, m in enumerate(s.response_mask) if m]
        model_versions = [versions[i] for i in model_at]
        assert model_versions == sorted(model_versions)
        switched += len(set(model_versions)) > 1
        by_model = {k: hf_routes(m, tokens[:-1]).to(torch.int16) for k, m in hf.items()}
        diffs = {k: engine_vs_model(m, s.prompt_ids, s.response_ids, s.log_probs)
                 for k, m in hf.items()}
        p = len(s.prompt_ids)
        for i in model_at:
            mine = weights_of[versions[i]]
            assert diffs[mine][i] < 1e-4, (s.rid, i)
            assert torch.equal(s.routed_experts[p + i - 1], by_model[mine][p + i - 1]), (s.rid, i)
    assert switched > 0
