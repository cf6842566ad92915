"""Multi-turn episodes on the real embedded engine, through the SGLang HTTP client.

The episode the trainer receives must be exactly the engine's tokens of every model turn plus
the environment's tokens, each tokenized once by themselves, never a decode and re-encode of
the conversation (which, on this tokenizer, loses the ids the model sampled beyond the
tokenizer's alphabet and so would differ). Model tokens carry the engine's log-probs (equal to
HF transformers teacher-forced over the whole episode) and routed experts (R3: one row per fed
token, equal to HF's router top-k over the whole episode); environment tokens are masked out of
every loss term the trainer computes.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from megarl.algo import aggregate_loss, get_policy_loss, kl_penalty
from megarl.batch import StepBatch
from megarl.rollout.agent import AgentLoop, AgentSettings, StepResult, agent_metrics
from megarl.rollout.agent.loop import hermes_glue
from megarl.rollout.interface import RolloutSample, SamplingParams
from megarl.rollout.sglang.client import SGLangClient

TEMPERATURE = 0.9
OBSERVATION = "<tool_response>\n42\n</tool_response>"


class CountingEnv:
    """Answers every turn with the same observation; done after ``turns`` turns; reward 0.5
    per turn."""

    def __init__(self, turns: int) -> None:
        self.turns, self.seen = turns, 0

    async def step(self, action: str) -> StepResult:
        self.seen += 1
        return StepResult(OBSERVATION, reward=0.5, done=self.seen >= self.turns,
                          info={"tool_calls": 1.0, "tool_errors": float(self.seen == 1)})


def run_episodes(url: str, tokenizer, *, turns: int, settings: AgentSettings,
                 prompts: list[list[int]], n: int) -> tuple[list[RolloutSample], list[list]]:
    """Episodes of ``prompts`` (n each) and, per episode, the model turns the engine returned."""
    recorded: dict[tuple[int, ...], list[RolloutSample]] = {}

    class RecordingClient(SGLangClient):
        async def generate_one(self, prompt_ids, params, **kw):
            out = await super().generate_one(prompt_ids, params, **kw)
            recorded.setdefault((params.seed,), []).append(out[0])
            return out

    agent = AgentLoop(settings, tokenizer, env=lambda row: CountingEnv(turns))
    params = SamplingParams(max_new_tokens=1, temperature=TEMPERATURE, n=n, ignore_eos=True)

    async def go() -> list[RolloutSample]:
        client = RecordingClient([url])
        try:
            return await agent.rollout(client, [{"input_ids": p} for p in prompts], params,
                                       seeds=[1000 * i for i in range(len(prompts))],
                                       options={"return_logprob": True,
                                                "return_routed_experts": True})
        finally:
            await client.close()
    samples = asyncio.run(go())
    turns_of = []
    for i, s in enumerate(samples):
        first_seed = 1000 * s.prompt_index + s.sample_index
        pieces = [recorded[((first_seed + 7919 * k) % 2**31,)][0] for k in range(turns)
                  if ((first_seed + 7919 * k) % 2**31,) in recorded]
        turns_of.append(pieces)
    return samples, turns_of


@pytest.fixture(scope="module")
def tokenizer(moe_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(moe_dir)


@pytest.fixture(scope="module")
def episodes(server, tokenizer, prompts):
    settings = AgentSettings(max_assistant_turns=5, max_tokens_per_turn=6,
                             max_response_length=200)
    return run_episodes(server.url, tokenizer, turns=3, settings=settings, prompts=prompts[:2],
                        n=2)


def test_episode_is_the_engine_tokens_plus_env_tokens_exactly(episodes, tokenizer):
    samples, turns_of = episodes
    env_ids = tokenizer.encode(hermes_glue(OBSERVATION, False), add_special_tokens=False)
    drifted = 0
    for s, pieces in zip(samples, turns_of):
        assert len(pieces) == 3  # three model turns: the env is done after its third step
        expected, mask, log_probs = list(s.prompt_ids), [], []
        for k, piece in enumerate(pieces):
            assert piece.prompt_ids == expected  # each turn continued the exact episode so far
            expected += piece.response_ids
            mask += [1] * len(piece.response_ids)
            log_probs += piece.log_probs
            if k < 2:
                expected += env_ids
                mask += [0] * len(env_ids)
                log_probs += [0.0] * len(env_ids)
        assert list(s.prompt_ids) + s.response_ids == expected
        assert s.response_mask == mask and s.log_probs == log_probs
        # what re-tokenizing the conversation would have trained on instead
        retokenized = tokenizer.encode(tokenizer.decode(expected), add_special_tokens=False)
        drifted += retokenized != expected
        record = StepBatch(samples=[s], prompts=[{}], n=1)
        assert record.sequences() == [expected]
        assert record.response_mask()[0].tolist() == [float(m) for m in mask]
        assert s.extra["agent"]["turns"] == 3 and s.extra["agent"]["env_reward"] == 1.5
    assert drifted == len(samples)
    metrics = agent_metrics(samples)
    assert metrics["agent/num_turns/mean"] == 3 and metrics["agent/tool_calls/mean"] == 3
    assert metrics["agent/tool_error_rate"] == pytest.approx(1 / 3)
    assert metrics["agent/budget_hit/turns"] == 0 and metrics["agent/budget_hit/tokens"] == 0


def hf_forward(model, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-softmax at temperature ``[L, V]`` and router top-k ``[L, layers, k]`` of HF."""
    with torch.no_grad():
        out = model(torch.tensor([tokens]), output_router_logits=True)
    k = model.config.num_experts_per_tok
    routes = torch.stack([x.topk(k, dim=-1).indices for x in out.router_logits], dim=1)
    return torch.log_softmax(out.logits[0].float() / TEMPERATURE, -1), routes.to(torch.int16)


def test_model_tokens_carry_engine_log_probs_and_routes_of_every_turn(episodes, hf_model):
    samples, _ = episodes
    for s in samples:
        tokens = list(s.prompt_ids) + s.response_ids
        log_softmax, routes = hf_forward(hf_model, tokens)
        p = len(s.prompt_ids)
        model_pos = [p + i for i, m in enumerate(s.response_mask) if m]
        expected = log_softmax[torch.tensor(model_pos) - 1].gather(
            1, torch.tensor([tokens[t] for t in model_pos])[:, None]).squeeze(1)
        engine = torch.tensor([s.log_probs[t - p] for t in model_pos])
        assert (engine - expected).abs().max() < 1e-4
        # R3: a row per token fed to the model, over every turn, the router's choice there
        assert s.routed_experts.shape[0] == len(tokens) - 1
        assert torch.equal(s.routed_experts, routes[:-1])
        assert torch.equal(StepBatch([s], [{}], 1).engine_routes()[0], routes[:-1])


def test_env_tokens_never_reach_loss_entropy_or_kl(episodes):
    """The batch's mask is what every loss term is aggregated with: wild values on environment
    tokens change nothing; the same values on one model token do."""
    samples, _ = episodes
    batch = StepBatch(samples=samples, prompts=[{}, {}], n=2)
    mask = batch.response_mask()
    env = (mask == 0) & (torch.arange(mask.shape[1]) < torch.tensor(
        [len(s.response_ids) for s in samples])[:, None])
    assert env.any()
    gen = torch.Generator().manual_seed(0)
    lp, old, ref, adv, ent = (torch.randn(mask.shape, generator=gen) for _ in range(5))

    def terms(lp, old, ref, adv, ent):
        pg, _ = get_policy_loss("vanilla")(lp, old, adv, mask)
        return [aggregate_loss(x, loss_mask=mask, loss_agg_mode=mode).item()
                for x in (pg, ent, kl_penalty(lp, ref, "low_var_kl"))
                for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")]

    base = terms(lp, old, ref, adv, ent)
    wild = [torch.where(env, x + 1e3, x) for x in (lp, old, ref, adv, ent)]
    assert terms(*wild) == pytest.approx(base, rel=0, abs=1e-6)
    one_model = torch.zeros_like(mask, dtype=torch.bool)
    one_model[0, 0] = True
    touched = [torch.where(one_model, x + shift, x)
               for x, shift in zip((lp, old, ref, adv, ent), (0.3, -0.2, -2.0, 3.0, 3.0))]
    assert all(a != pytest.approx(b) for a, b in zip(terms(*touched)[::3], base[::3]))


def test_budgets_end_episodes_and_are_counted(server, tokenizer, prompts):
    turns = AgentSettings(max_assistant_turns=2, max_tokens_per_turn=4, max_response_length=200)
    samples, _ = run_episodes(server.url, tokenizer, turns=10, settings=turns,
                              prompts=prompts[:1], n=1)
    assert samples[0].extra["agent"]["turns"] == 2
    assert agent_metrics(samples)["agent/budget_hit/turns"] == 1
    env_len = len(tokenizer.encode(hermes_glue(OBSERVATION, False), add_special_tokens=False))
    budget = 4 + env_len + 4 + 3  # room for two turns and their observation, not a third
    tokens = AgentSettings(max_assistant_turns=None, max_tokens_per_turn=4,
                           max_response_length=budget)
    samples, _ = run_episodes(server.url, tokenizer, turns=10, settings=tokens,
                              prompts=prompts[:1], n=1)
    s = samples[0]
    assert len(s.response_ids) == 8 + env_len and s.extra["agent"]["turns"] == 2
    assert agent_metrics(samples)["agent/budget_hit/tokens"] == 1


def test_turn_routes_keep_each_turns_rows_and_pad_what_the_engine_skipped():
    """Turn 2's prefill recomputes rows of turn 1's tokens: the episode keeps turn 1's; rows an
    engine did not return (a skipped prompt prefix) are -1."""
    from megarl.rollout.agent.loop import stitch_turn_routes

    def turn(prompt: list[int], response: list[int], fill: int, rows: int) -> RolloutSample:
        return RolloutSample(0, 0, prompt, response, None, "stop", "0",
                             routed_experts=torch.full((rows, 1, 2), fill, dtype=torch.int16))

    first = turn([1, 2, 3], [4, 5], fill=1, rows=3)  # 4 fed tokens, the first one skipped
    routes = stitch_turn_routes(None, first)
    assert routes[:, 0, 0].tolist() == [-1, 1, 1, 1]
    second = turn([1, 2, 3, 4, 5, 9, 9], [6, 7], fill=2, rows=8)
    routes = stitch_turn_routes(routes, second)
    assert routes[:, 0, 0].tolist() == [-1, 1, 1, 1, 2, 2, 2, 2]
