"""Math answers checked for equivalence with ``math-verify``: 1.0 when right, else 0.0.

The final answer is taken from the response in this order: the last complete ``\\boxed{...}``
(or ``\\fbox{...}``), else the last ``Answer: ...`` line, else the last ``#### ...`` line (the
GSM8K format). The ground truth may be a bare answer (``72``, ``\\frac{1}{2}``) or hold one of the
same markers. Both are parsed by ``math-verify`` as LaTeX, so ``1/2``, ``0.5`` and ``\\frac{1}{2}``
are equal, as are ``\\{1,2\\}`` and ``\\{2,1\\}``. A response without an answer, or one that
cannot be parsed, scores 0.0: nothing in a model's output makes :func:`compute_score` raise.

``math-verify`` bounds its own parsing and comparison time with ``SIGALRM``, which works only in
a process's main thread; elsewhere it runs unbounded, and the caller (the reward manager's
process pool) provides the timeout.
"""

from __future__ import annotations

import re
import threading
from functools import lru_cache

try:
    from math_verify import parse, verify
except ImportError as exc:  # pragma: no cover - exercised only without the optional dependency
    raise ImportError(
        "math rewards need math-verify: pip install 'megarl[math]' (or pip install math-verify)"
    ) from exc

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_ANSWER_LINE = re.compile(r"answer\s*(?:is)?\s*[:：]\s*([^\n]*)", re.IGNORECASE)
_HASH_LINE = re.compile(r"####\s*([^\n]*)")
_SPECIAL_TOKEN = re.compile(r"<\|.*$", re.DOTALL)
_MAX_ANSWER_CHARS = 1000
_MATH_VERIFY_TIMEOUT_S = 5


def _braced(text: str, open_at: int) -> str | None:
    """The text inside the brace group opening at ``text[open_at] == '{'``, or None if unclosed."""
    depth = 0
    for pos in range(open_at, len(text)):
        if text[pos] == "{":
            depth += 1
        elif text[pos] == "}":
            depth -= 1
            if depth == 0:
                return text[open_at + 1 : pos]
    return None


def _last_boxed(text: str) -> str | None:
    """The content of the last complete ``\\boxed{...}``/``\\fbox{...}`` (or ``\\boxed x``)."""
    starts = sorted(
        (match.start(), match.end())
        for command in _BOX_COMMANDS
        for match in re.finditer(re.escape(command), text)
    )
    for _, end in reversed(starts):
        rest = text[end:]
        stripped = rest.lstrip()
        if stripped.startswith("{"):
            content = _braced(text, end + len(rest) - len(stripped))
            if content is not None:
                return content
        elif rest[:1] == " " and stripped:
            return re.split(r"[\s$]", stripped, maxsplit=1)[0]
    return None


def _clean(answer: str) -> str:
    """Strip markdown emphasis, math delimiters, a trailing full stop and special tokens."""
    answer = _SPECIAL_TOKEN.sub("", answer).strip().strip("*").strip().rstrip(".").strip()
    if len(answer) >= 2 and answer.startswith("$") and answer.endswith("$"):
        answer = answer.strip("$").strip()
    return answer


def extract_answer(text: str) -> str | None:
    """The final answer in ``text`` (boxed, then ``Answer:`` line, then ``####``), or None."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip() or None
    for pattern in (_ANSWER_LINE, _HASH_LINE):
        matches = pattern.findall(text)
        if matches:
            answer = _clean(matches[-1])
            if answer:
                return answer
    return None


def _timeout_s() -> int | None:
    """math-verify's own time bound: only usable in the main thread (it relies on SIGALRM)."""
    if threading.current_thread() is threading.main_thread():
        return _MATH_VERIFY_TIMEOUT_S
    return None


@lru_cache(maxsize=4096)
def _parse_gold(ground_truth: str, timeout_s: int | None) -> tuple:
    """The parsed ground truth, cached: the n responses of a GRPO group share one."""
    return tuple(parse(f"\\boxed{{{ground_truth}}}", parsing_timeout=timeout_s))


def is_equivalent(answer: str, ground_truth: str) -> bool:
    """Whether two bare answers are mathematically equal according to ``math-verify``."""
    if answer.strip() == ground_truth.strip():
        return True
    if len(answer) > _MAX_ANSWER_CHARS:
        return False
    timeout_s = _timeout_s()
    gold = list(_parse_gold(ground_truth, timeout_s))
    if not gold:
        return False
    predicted = parse(f"\\boxed{{{answer}}}", parsing_timeout=timeout_s)
    if not predicted:
        return False
    return bool(verify(gold, predicted, timeout_seconds=timeout_s))


def compute_score(solution_str: str, ground_truth: str) -> float:
    """1.0 if the final answer in ``solution_str`` equals ``ground_truth``, else 0.0 (no raise)."""
    try:
        if not isinstance(solution_str, str):
            return 0.0
        answer = extract_answer(solution_str)
        if answer is None:
            return 0.0
        gold_text = str(ground_truth)
        gold = extract_answer(gold_text) or gold_text.strip()
        return 1.0 if is_equivalent(answer, gold) else 0.0
    except Exception:  # noqa: BLE001 - a malformed response is a wrong answer, not a crash
        return 0.0
