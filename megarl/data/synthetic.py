"""Synthetic verifiable tasks for tests and the tiny-model demo, written in verl's schema.

Every task draws ``(question, answer)`` pairs from a seeded ``random.Random``, so the same
``(task, n, seed)`` gives the same rows on any machine. Prompts use only characters of the tiny
tokenizer (:data:`megarl.data.tiny_model.ALPHABET`) and stay under 64 tokens with its chat
template; answers are at most 5 characters, so ``"Answer: X"`` fits in 16 response tokens.

Tasks (``data_source`` is ``"synthetic/<task>"``, scored by :mod:`megarl.reward.synthetic`):

- ``arithmetic``: ``a+b`` or ``a-b`` with ``0 <= a, b <= 20`` and a non-negative result.
- ``counting``: how many times a letter occurs in a string of 4-8 letters from ``abc``.
- ``sorting``: the digits of a 3-5 digit string in ascending order, e.g. ``52813 -> 12358``.
- ``copy_digit``: the very easy one, for RL demos that start from a random model: the prompt is
  ``Copy `` and one digit written 16 times (no format hint), the answer is that digit, and the
  reward takes the first digit anywhere in the response. A random 2-layer tiny model scores ~5%;
  with plain GRPO (16 prompts x 8 samples, 12 new tokens, lr 3e-3) it reaches 0.6-0.75 by step 50.
  (With the digit written once among the template tokens it did not learn within 50 steps: the
  repetition lets near-uniform attention at initialisation already carry the digit.)
- ``copy_number``: the GPU demo's harder sibling: the prompt is ``Copy `` and a 3-digit number
  written 6 times, the answer is the number, and the reward is the fraction of its digits that
  the first three digits of the response get right, position by position (partial credit, so
  a model learning from scratch is rewarded for the first digit before it orders the others).
- ``tool_multiply``: the multi-turn tools demo's task (``configs/tiny-moe-tools.yaml``): the
  product of two 2-digit numbers (``Compute 38*47``), too hard for the tiny model to compute
  but a calculator call away; the reward reads the final answer, the last integer after the
  last tool response (so a tool's result never scores by itself).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

FORMAT_HINT = "Reply 'Answer: N'."


# Each task maps a seeded rng to (user message, ground truth).
def _arithmetic(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(0, 20), rng.randint(0, 20)
    if rng.random() < 0.5:
        return f"What is {a}+{b}? {FORMAT_HINT}", str(a + b)
    a, b = max(a, b), min(a, b)
    return f"What is {a}-{b}? {FORMAT_HINT}", str(a - b)


def _counting(rng: random.Random) -> tuple[str, str]:
    text = "".join(rng.choice("abc") for _ in range(rng.randint(4, 8)))
    letter = rng.choice("abc")
    return f"Count {letter} in {text}. {FORMAT_HINT}", str(text.count(letter))


def _sorting(rng: random.Random) -> tuple[str, str]:
    digits = [rng.choice("0123456789") for _ in range(rng.randint(3, 5))]
    return f"Sort digits {''.join(digits)}. {FORMAT_HINT}", "".join(sorted(digits))


def _copy_digit(rng: random.Random) -> tuple[str, str]:
    digit = str(rng.randint(0, 9))
    return f"Copy {digit * 16}", digit


def _copy_number(rng: random.Random) -> tuple[str, str]:
    number = f"{rng.randint(100, 999)}"
    return f"Copy {number * 6}", number


def _tool_multiply(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    return f"Compute {a}*{b}", str(a * b)


TASKS: dict[str, Callable[[random.Random], tuple[str, str]]] = {
    "arithmetic": _arithmetic,
    "counting": _counting,
    "sorting": _sorting,
    "copy_digit": _copy_digit,
    "copy_number": _copy_number,
    "tool_multiply": _tool_multiply,
}


def data_source_of(task: str) -> str:
    """The ``data_source`` value of a synthetic task's rows."""
    return f"synthetic/{task}"


def generate_rows(task: str, n: int, seed: int = 0, split: str = "train") -> list[dict[str, Any]]:
    """``n`` rows of ``task`` in verl's schema; the same arguments give the same rows."""
    if task not in TASKS:
        raise ValueError(f"unknown synthetic task {task!r}; known tasks: {', '.join(TASKS)}")
    if n <= 0:
        raise ValueError(f"n must be > 0, got {n}")
    rng = random.Random(f"{task}:{seed}")
    rows = []
    for index in range(n):
        content, answer = TASKS[task](rng)
        rows.append({
            "data_source": data_source_of(task),
            "prompt": [{"role": "user", "content": content}],
            "ability": task,
            "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"split": split, "index": index},
        })
    return rows


def write_rows(path: str | Path, rows: list[dict[str, Any]]) -> Path:
    """Write rows to ``path`` as parquet or JSONL, chosen by the extension."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    elif path.suffix == ".jsonl":
        with path.open("w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    else:
        raise ValueError(f"{path}: unsupported extension {path.suffix!r}; use .parquet or .jsonl")
    return path


def write_synthetic_dataset(
    path: str | Path, task: str, n: int, seed: int = 0, split: str = "train"
) -> Path:
    """Generate ``n`` rows of ``task`` with ``seed`` and write them to a .parquet/.jsonl file."""
    return write_rows(path, generate_rows(task, n, seed, split))
