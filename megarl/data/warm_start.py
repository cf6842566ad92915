"""A short supervised warm start that teaches a tiny random model the tool-call format.

RL cannot discover a 60-token ``<tool_call>{json}</tool_call>`` from a random model; real runs
start from an instruct model that already knows its tools' format and calls them sometimes. The
tools demo stands that model in with this warm start: a few hundred steps of supervised
fine-tuning (HF transformers, CPU) on episodes of the ``tool_multiply`` task where a fraction
``call_fraction`` of the answers call the calculator and state its result, and the rest guess a
number directly (almost always wrong). Afterwards the model calls the tool in about that
fraction of its samples; RL is what raises it.

The demonstrations are built by the agent loop's own pieces (the chat template, the tool
environment, :func:`~megarl.rollout.agent.loop.hermes_glue` and the codec), so their tokens are
the tokens an episode of the trained model would have.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch


def tool_call_text(expression: str) -> str:
    """The model turn of a demonstration that calls the calculator."""
    return ('<tool_call>{"name": "calculator", "arguments": {"expression": "'
            f'{expression}"}}}}</tool_call>')


def demonstrations(rows: Sequence[dict[str, Any]], tokenizer: Any, call_fraction: float,
                   seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """(token ids, loss mask) of one demonstration per ``tool_multiply`` row: prompt and
    environment tokens carry mask 0, the model's tokens (its end-of-turn token included) 1."""
    from megarl.rollout.agent import calculator
    from megarl.rollout.agent.loop import Codec, ToolEnvironment, hermes_glue

    codec, env, rng = Codec(tokenizer), ToolEnvironment([calculator]), random.Random(seed)
    eos = tokenizer.eos_token_id
    out = []
    for row in rows:
        prompt = [int(i) for i in tokenizer.apply_chat_template(
            row["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False)]
        answer = row["reward_model"]["ground_truth"]
        ids, mask = list(prompt), [0] * len(prompt)

        def add(text: str, trained: bool, end_turn: bool,
                ids: list[int] = ids, mask: list[int] = mask) -> None:
            piece = codec.encode(text) + ([eos] if end_turn else [])
            ids.extend(piece)
            mask.extend([int(trained)] * len(piece))

        if rng.random() < call_fraction:
            call = tool_call_text(row["prompt"][0]["content"].split()[-1])
            add(call, trained=True, end_turn=True)
            observation = asyncio.run(env.step(call)).observation
            add(hermes_glue(observation, model_ended_turn=True), trained=False, end_turn=False)
            add(answer, trained=True, end_turn=True)
        else:
            add(str(rng.randint(1000, 9999)), trained=True, end_turn=True)
        out.append((ids, mask))
    return out


def sft(model_dir: str | Path, examples: Sequence[tuple[list[int], list[int]]], *,
        steps: int, batch_size: int = 32, lr: float = 3e-3, seed: int = 0,
        log_every: int = 50) -> list[float]:
    """Fine-tune the HF model in ``model_dir`` on ``examples`` (masked next-token loss, AdamW,
    fp32 on CPU) and save it back in place; returns the loss of every step."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))
    rng = random.Random(seed)
    pad = model.config.pad_token_id or 0
    losses = []
    for step in range(steps):
        batch = sorted((examples[rng.randrange(len(examples))] for _ in range(batch_size)),
                       key=lambda example: len(example[0]))
        targets = sum(sum(mask[1:]) for _, mask in batch)
        optimizer.zero_grad()
        total = 0.0
        # two micro-batches of similar lengths: short answers are not padded to long episodes
        for part in (batch[:batch_size // 2], batch[batch_size // 2:]):
            loss = _masked_nll(model, part, pad) / targets
            loss.backward()
            total += float(loss)
        optimizer.step()
        schedule.step()
        losses.append(total)
        if log_every and (step + 1) % log_every == 0:
            print(f"[warm start] step {step + 1}/{steps}: loss {total:.4f}", flush=True)
    model.save_pretrained(model_dir, safe_serialization=True)
    return losses


def _masked_nll(model: Any, batch: Sequence[tuple[list[int], list[int]]],
                pad: int) -> torch.Tensor:
    """Summed next-token loss over the masked positions of right-padded ``batch``."""
    width = max(len(ids) for ids, _ in batch)
    ids = torch.full((len(batch), width), pad, dtype=torch.long)
    mask = torch.zeros(len(batch), width)
    for i, (seq, seq_mask) in enumerate(batch):
        ids[i, :len(seq)] = torch.tensor(seq)
        mask[i, :len(seq)] = torch.tensor(seq_mask, dtype=torch.float32)
    logits = model(input_ids=ids).logits[:, :-1]
    nll = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none")
    return (nll * mask[:, 1:].reshape(-1)).sum()
