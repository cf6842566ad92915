"""Multi-turn episodes: model turns and environment turns, kept as token ids throughout.

An episode starts from the prompt's token ids. Each model turn generates through the rollout
client (the same HTTP client for the embedded engine and for SGLang) from the episode so far;
its tokens are appended as the engine returned them, with the engine's log-probs, weight version
and routed experts (R3). The environment then answers the turn's text (tools run, or a user
environment steps); its observation, wrapped in the chat template's glue, is tokenized once by
itself and appended with loss mask 0. The text is never decoded and re-encoded to build the
sequence, so the tokens the trainer sees are exactly the tokens that were generated.

The episode ends when the environment says done (for tools: a turn without a tool call), a
turn or token budget runs out, or the engine aborts. It comes back as one
:class:`~megarl.rollout.interface.RolloutSample` whose ``response_ids`` hold every token after
the prompt (model and environment), ``response_mask`` which of them the model generated, and
``routed_experts`` one row per token fed to the model: the rows of each turn's own forward steps
(earlier turns' rows are not replaced by a later turn's prefill).
"""

from __future__ import annotations

import asyncio
import importlib
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch

from megarl.rollout.agent.tools import call_tool, parse_tool_calls
from megarl.rollout.interface import RolloutSample, SamplingParams

GenerateTurn = Callable[[list[int], SamplingParams], Awaitable[RolloutSample]]


@dataclass
class StepResult:
    """An environment's answer to one model turn."""

    observation: str | None
    """Text shown to the model next (None: nothing more to say)."""
    reward: float = 0.0
    done: bool = False
    info: dict[str, float] = field(default_factory=dict)
    """Counts for the metrics: ``tool_calls``, ``tool_errors``, ``tool_latency_s``."""


class Environment(Protocol):
    """What a user implements: ``step`` receives the text of a model turn."""

    async def step(self, action: str) -> StepResult: ...


def load_object(path: str) -> Any:
    """The object at ``"package.module:attribute"`` (or ``package.module.attribute``)."""
    module, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not module or not attr:
        raise ValueError(f"{path!r}: expected 'package.module:name'")
    return getattr(importlib.import_module(module), attr)


class ToolEnvironment:
    """Runs the ``<tool_call>``s of each turn; done on a turn without one."""

    def __init__(self, tools: Sequence[Callable], max_tool_response_length: int = 256) -> None:
        self.tools = {fn.tool_schema["name"] if hasattr(fn, "tool_schema") else fn.__name__: fn
                      for fn in tools}
        self.max_chars = max_tool_response_length

    async def step(self, action: str) -> StepResult:
        """Observation: one ``<tool_response>`` per call, errors included."""
        calls = parse_tool_calls(action)
        if not calls:
            return StepResult(None, done=True)
        responses, errors, start = [], 0, time.perf_counter()
        for call in calls:
            if call.error is None and call.name not in self.tools:
                text, failed = (f"error: unknown tool {call.name!r}; tools: "
                                f"{', '.join(sorted(self.tools))}"), True
            elif call.error is not None:
                text, failed = f"error: {call.error}", True
            else:
                text, failed = await call_tool(self.tools[call.name], call.arguments)
            errors += failed
            responses.append(f"<tool_response>\n{text[:self.max_chars]}\n</tool_response>")
        return StepResult("\n".join(responses), info={
            "tool_calls": float(len(calls)), "tool_errors": float(errors),
            "tool_latency_s": time.perf_counter() - start})


class Codec:
    """Environment text -> token ids, tokenized by itself (no special tokens added), and a
    model turn's ids -> its text for the environment (never used to rebuild the sequence)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        """The ids of environment text."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        """The text of a model turn."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


@dataclass(frozen=True)
class AgentSettings:
    """The limits and format of episodes (``rollout.multi_turn``)."""

    max_assistant_turns: int | None = 5
    max_user_turns: int | None = None
    max_tokens_per_turn: int | None = None
    max_response_length: int = 256
    """Token budget of everything after the prompt (model and environment tokens)."""
    format: str = "hermes"


def hermes_glue(observation: str, model_ended_turn: bool) -> str:
    """The chat-template text between a model turn and the next one (Qwen / Hermes): the
    observation as a user turn, then the assistant header."""
    close = "" if model_ended_turn else "<|im_end|>"
    return f"{close}\n<|im_start|>user\n{observation}<|im_end|>\n<|im_start|>assistant\n"


@dataclass
class Episode:
    """One episode's tokens and per-token data as it grows."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)
    routes: torch.Tensor | None = None
    last: RolloutSample | None = None
    stats: dict[str, float] = field(default_factory=lambda: {
        "turns": 0.0, "tool_calls": 0.0, "tool_errors": 0.0, "tool_latency_s": 0.0,
        "env_s": 0.0, "env_reward": 0.0, "budget_turns": 0.0, "budget_tokens": 0.0})

    def context(self) -> list[int]:
        """The token ids the next model turn continues."""
        return self.prompt_ids + self.response_ids

    def add_model_turn(self, piece: RolloutSample) -> None:
        """Append a model turn's tokens as generated, with its log-probs, versions and routes."""
        if list(piece.prompt_ids) != self.context():
            raise ValueError("a model turn's prompt is not the episode so far")
        r = len(piece.response_ids)
        self.routes = stitch_turn_routes(self.routes, piece)
        self.response_ids += piece.response_ids
        self.log_probs += list(piece.log_probs) if piece.log_probs is not None else [0.0] * r
        self.mask += [1] * r
        self.versions += (list(piece.token_weight_versions) if piece.token_weight_versions
                          else [str(piece.weight_version)] * r)
        self.last = piece
        self.stats["turns"] += 1

    def add_env_tokens(self, ids: list[int]) -> None:
        """Append environment tokens: masked out, log-prob 0, the last turn's version."""
        self.response_ids += ids
        self.log_probs += [0.0] * len(ids)
        self.mask += [0] * len(ids)
        self.versions += [self.versions[-1] if self.versions else ""] * len(ids)

    def sample(self) -> RolloutSample:
        """The episode as one sample (see the module docstring)."""
        assert self.last is not None
        version = str(self.last.weight_version)
        uniform = all(v == version for v, m in zip(self.versions, self.mask) if m)
        return replace(
            self.last, prompt_ids=list(self.prompt_ids), response_ids=list(self.response_ids),
            log_probs=list(self.log_probs) if self.last.log_probs is not None else None,
            routed_experts=self.routes, response_mask=list(self.mask),
            token_weight_versions=None if uniform else list(self.versions),
            extra={**self.last.extra, "agent": dict(self.stats)})


def stitch_turn_routes(routes: torch.Tensor | None, piece: RolloutSample) -> torch.Tensor | None:
    """The episode's routes (one row per token fed so far) extended by a model turn's: the
    turn's rows from the first token not yet fed (the previous turn's last token, then the
    environment tokens, then the turn's own forward steps). Rows the engine skipped at the
    front of its prompt are -1."""
    new = piece.routed_experts
    if new is None:
        return None
    fed = len(piece.prompt_ids) + len(piece.response_ids) - 1
    if len(new) < fed:
        new = torch.cat([new.new_full((fed - len(new), *new.shape[1:]), -1), new])
    if routes is None:
        return new
    return torch.cat([routes, new[len(routes):]])


async def run_episode(generate_turn: GenerateTurn, env: Environment, prompt_ids: list[int],
                      params: SamplingParams, settings: AgentSettings,
                      codec: Codec, eos_ids: Sequence[int]) -> RolloutSample:
    """One episode (see the module docstring); ``params`` are one sample's (n = 1, its seed).
    ``codec`` decodes a model turn for the environment and encodes the environment's text."""
    episode = Episode(list(prompt_ids))
    user_turns = 0
    while True:
        room = settings.max_response_length - len(episode.response_ids)
        per_turn = min(room, settings.max_tokens_per_turn or room)
        seed = None if params.seed is None else (params.seed + 7919 * user_turns) % 2**31
        piece = await generate_turn(episode.context(),
                                    replace(params, n=1, max_new_tokens=per_turn, seed=seed))
        episode.add_model_turn(piece)
        if piece.finish_reason == "abort":
            break
        start = time.perf_counter()
        result = await env.step(codec.decode(piece.response_ids))
        episode.stats["env_s"] += time.perf_counter() - start
        episode.stats["env_reward"] += float(result.reward)
        for key in ("tool_calls", "tool_errors", "tool_latency_s"):
            episode.stats[key] += float(result.info.get(key, 0.0))
        if result.done or result.observation is None:
            break
        if (settings.max_assistant_turns is not None
                and episode.stats["turns"] >= settings.max_assistant_turns) or (
                settings.max_user_turns is not None and user_turns >= settings.max_user_turns):
            episode.stats["budget_turns"] = 1.0
            break
        ended = bool(piece.response_ids) and piece.response_ids[-1] in eos_ids
        ids = codec.encode(hermes_glue(result.observation, ended))
        if len(episode.response_ids) + len(ids) >= settings.max_response_length:
            episode.stats["budget_tokens"] = 1.0  # no room for the observation and a token
            break
        episode.add_env_tokens(ids)
        user_turns += 1
    if len(episode.response_ids) >= settings.max_response_length:
        episode.stats["budget_tokens"] = 1.0
    return episode.sample()


def agent_metrics(samples: Sequence[RolloutSample]) -> dict[str, float]:
    """``agent/*`` metrics and ``timing/env`` of a batch of episodes (empty if none)."""
    stats = [s.extra["agent"] for s in samples if "agent" in s.extra]
    if not stats:
        return {}
    total = {k: sum(s[k] for s in stats) for k in stats[0]}
    n = len(stats)
    calls = total["tool_calls"]
    return {
        "agent/num_turns/mean": total["turns"] / n,
        "agent/num_turns/max": max(s["turns"] for s in stats),
        "agent/tool_calls/mean": calls / n,
        "agent/tool_error_rate": total["tool_errors"] / calls if calls else 0.0,
        "agent/tool_latency_s": total["tool_latency_s"] / calls if calls else 0.0,
        "agent/env_reward/mean": total["env_reward"] / n,
        "agent/budget_hit/turns": total["budget_turns"],
        "agent/budget_hit/tokens": total["budget_tokens"],
        "timing/env": total["env_s"],
    }


class AgentLoop:
    """Episodes for a step's prompts: the tools or environment of ``rollout.multi_turn``."""

    def __init__(self, settings: AgentSettings, tokenizer: Any,
                 tools: Sequence[str | Callable] = (),
                 env: str | Callable[[dict[str, Any]], Environment] | None = None,
                 max_tool_response_length: int = 256) -> None:
        """``tools`` and ``env`` (a factory called with the prompt row) are objects or their
        import paths."""
        self.settings, self.tokenizer = settings, tokenizer
        self.tools = [load_object(t) if isinstance(t, str) else t for t in tools]
        self.env_factory = load_object(env) if isinstance(env, str) else env
        self.max_tool_response_length = max_tool_response_length
        self.eos_ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        self.codec = Codec(tokenizer)

    def new_env(self, row: dict[str, Any]) -> Environment:
        """A fresh environment for one episode of prompt ``row``."""
        if self.env_factory is not None:
            return self.env_factory(row)
        return ToolEnvironment(self.tools, self.max_tool_response_length)

    async def episode(self, generate_turn: GenerateTurn, row: dict[str, Any],
                      params: SamplingParams) -> RolloutSample:
        """One episode of prompt ``row`` whose model turns ``generate_turn`` generates."""
        return await run_episode(generate_turn, self.new_env(row), list(row["input_ids"]),
                                 params, self.settings, self.codec, self.eos_ids)

    async def rollout(self, client: Any, prompts: Sequence[dict[str, Any]],
                      params: SamplingParams, seeds: Sequence[int],
                      options: dict[str, bool]) -> list[RolloutSample]:
        """``params.n`` episodes per prompt, prompt-major, all running concurrently."""
        async def one(i: int, j: int) -> RolloutSample:
            key = tuple(prompts[i]["input_ids"])

            async def turn(ids: list[int], p: SamplingParams) -> RolloutSample:
                return (await client.generate_one(ids, p, group_key=key, **options))[0]
            sample = await self.episode(turn, prompts[i], replace(params, n=1,
                                                                  seed=seeds[i] + j))
            return replace(sample, prompt_index=i, sample_index=j)
        return list(await asyncio.gather(*(one(i, j) for i in range(len(prompts))
                                           for j in range(params.n))))


