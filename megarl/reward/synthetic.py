"""Exact-match rewards of the synthetic tasks in :mod:`megarl.data.synthetic`.

:func:`score` dispatches on ``data_source``. The answer is extracted from the response, normalised
and compared with the ground truth: 1.0 when equal, else 0.0. The extraction:

- ``synthetic/arithmetic``, ``synthetic/counting``: the text after the last ``Answer:`` up to the
  end of its line (or a special token such as ``<|im_end|>``), read as an integer.
- ``synthetic/sorting``: the same text with spaces and commas removed (``1, 2, 3`` == ``123``).
- ``synthetic/copy_digit``: the first digit anywhere in the response (lenient on purpose, so a
  model learning from scratch gets a signal before it has learned the format).
- ``synthetic/tool_multiply``: the last integer of the final answer: the text after the last
  ``</tool_response>`` (the whole response when no tool was called), so the calculator's
  result counts only when the model states it.
- ``synthetic/copy_number``: partial credit: the fraction of the number's digits that the first
  digits of the response match position by position (``123`` for ``129``: 2/3).

Format reward (off by default): with ``format_score > 0``, a wrong answer still earns
``format_score`` when the response contains ``Answer:``; a correct answer always earns 1.0.
"""

from __future__ import annotations

import re
from collections.abc import Callable

_ANSWER = re.compile(r"Answer:[ \t]*([^\n<]*)")
_INTEGER = re.compile(r"[+-]?\d+")


def extract_answer(response_text: str) -> str | None:
    """The text after the last ``Answer:`` up to the line end or a special token, stripped."""
    matches = _ANSWER.findall(response_text)
    if not matches:
        return None
    return matches[-1].strip().rstrip(".").strip()


def _integer_match(response_text: str, ground_truth: str) -> bool:
    answer = extract_answer(response_text)
    if answer is None or not _INTEGER.fullmatch(answer):
        return False
    return int(answer) == int(str(ground_truth).strip())


def _digits_match(response_text: str, ground_truth: str) -> bool:
    answer = extract_answer(response_text)
    if answer is None:
        return False
    return re.sub(r"[\s,]", "", answer) == re.sub(r"[\s,]", "", str(ground_truth))


def _first_digit_match(response_text: str, ground_truth: str) -> bool:
    digit = re.search(r"\d", response_text)
    return digit is not None and digit.group() == str(ground_truth).strip()


def _digit_fraction(response_text: str, ground_truth: str) -> float:
    truth = str(ground_truth).strip()
    digits = re.findall(r"\d", response_text)[:len(truth)]
    return sum(a == b for a, b in zip(digits, truth)) / len(truth)


def _final_integer_match(response_text: str, ground_truth: str) -> bool:
    final = response_text.rpartition("</tool_response>")[2]
    numbers = _INTEGER.findall(final)
    return bool(numbers) and int(numbers[-1]) == int(str(ground_truth).strip())


_MATCHERS: dict[str, Callable[[str, str], bool | float]] = {
    "synthetic/arithmetic": _integer_match,
    "synthetic/counting": _integer_match,
    "synthetic/sorting": _digits_match,
    "synthetic/copy_digit": _first_digit_match,
    "synthetic/copy_number": _digit_fraction,
    "synthetic/tool_multiply": _final_integer_match,
}

SYNTHETIC_SOURCES: tuple[str, ...] = tuple(_MATCHERS)


def score(
    data_source: str, response_text: str, ground_truth: str, format_score: float = 0.0
) -> float:
    """Reward of one response to a synthetic task: 1.0 if correct (or the partial credit of a
    task that gives it), else ``format_score`` or 0.0."""
    matcher = _MATCHERS.get(data_source)
    if matcher is None:
        raise ValueError(
            f"no synthetic reward for data_source {data_source!r}; known sources: "
            f"{', '.join(SYNTHETIC_SOURCES)}"
        )
    matched = matcher(response_text, ground_truth)
    if not isinstance(matched, bool) and matched > 0:
        return float(matched)
    if matched is True:
        return 1.0
    if format_score and _ANSWER.search(response_text):
        return float(format_score)
    return 0.0
