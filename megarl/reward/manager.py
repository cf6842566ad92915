"""Batched reward scoring: built-in rewards by ``data_source``, or the user's ``reward.function``.

:class:`RewardManager` scores a batch of :class:`RewardSample` in a pool of spawned worker
processes (``reward.num_workers``; 0 scores in the calling process, without timeouts, for
debugging). Every sample has ``reward.timeout_s`` seconds; a sample over it gets reward 0.0 and
is counted in ``reward/timeouts``, and a worker that hangs is replaced (see
:mod:`megarl.reward.pool`). A batched user function (``reward.batched``) is called once per
contiguous chunk of the batch (one chunk per worker) with ``timeout_s`` x chunk size seconds.

A reward that cannot be trusted stops the step with one :class:`RewardError` naming the sample
(index, data_source, first 200 characters of the response) and the fix, rather than becoming a
silent 0: the function raised, returned something other than a number (or a dict with a numeric
``"score"``), returned a non-finite number, or (batched) returned the wrong number of values.

Built-in rewards (no ``reward.function``): the synthetic tasks (:mod:`megarl.reward.synthetic`)
and math answers (:mod:`megarl.reward.math`) for the data sources in :data:`MATH_SOURCES`.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import numbers
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Self

from megarl.reward.function import absolute_spec, load_reward_function
from megarl.reward.pool import TIMED_OUT, TimedProcessPool, WorkerCrashed

logger = logging.getLogger(__name__)

MATH_SOURCES: frozenset[str] = frozenset({
    "math",
    "gsm8k",
    "openai/gsm8k",
    "lighteval/MATH",
    "DigitalLearningGmbH/MATH-lighteval",
    "HuggingFaceH4/MATH-500",
    "dapo",
    "math_dapo",
})
_RESPONSE_PREVIEW_CHARS = 200


class RewardError(RuntimeError):
    """A batch could not be scored; the message names the sample, the problem and the fix."""


@dataclass(frozen=True)
class RewardSample:
    """One response to score, with the prompt's ``data_source``, ground truth and extra info."""

    data_source: str
    response_text: str
    ground_truth: Any
    extra_info: dict[str, Any] = field(default_factory=dict)


@dataclass
class RewardResult:
    """Per-sample rewards (0.0 where timed out), extra values from dict rewards, and metrics."""

    scores: list[float]
    timed_out: list[bool]
    extras: list[dict[str, Any]]
    metrics: dict[str, float]


def builtin_sources() -> frozenset[str]:
    """Every ``data_source`` that has a built-in reward."""
    from megarl.reward import synthetic

    return MATH_SOURCES | frozenset(synthetic.SYNTHETIC_SOURCES)


def default_compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict[str, Any] | None = None,
    format_score: float = 0.0,
) -> float:
    """The built-in reward of one response, chosen by ``data_source`` (verl's signature)."""
    if data_source in MATH_SOURCES:
        from megarl.reward import math as math_reward

        return math_reward.compute_score(solution_str, ground_truth)
    from megarl.reward import synthetic

    return synthetic.score(data_source, solution_str, ground_truth, format_score=format_score)


@dataclass(frozen=True)
class _ScorerSpec:
    """What a worker needs to rebuild the reward function (a callable may not pickle)."""

    function: str | None
    batched: bool
    format_score: float

    def resolve(self) -> Callable[..., Any]:
        if self.function is None:
            return functools.partial(default_compute_score, format_score=self.format_score)
        return load_reward_function(self.function, batched=self.batched)


@dataclass(frozen=True)
class _Scored:
    scores: list[float]
    extras: list[dict[str, Any]]


@dataclass(frozen=True)
class _Failed:
    offset: int | None  # the sample within the task; None: the task's call as a whole
    problem: str
    trace: str = ""


def _check_value(value: Any) -> tuple[float, dict[str, Any]] | str:
    """The reward and extras in one returned value, or a description of what is wrong."""
    extras: dict[str, Any] = {}
    if isinstance(value, dict):
        if "score" not in value:
            return (f"returned a dict without a 'score' key (keys: {sorted(map(str, value))}); "
                    "put the reward under 'score'")
        extras = {key: item for key, item in value.items() if key != "score"}
        value = value["score"]
    if not isinstance(value, numbers.Real):
        return (f"returned {type(value).__name__} {repr(value)[:80]}; a reward must be a float "
                "(or a dict with a float 'score')")
    score = float(value)
    if not math.isfinite(score):
        return (f"returned the non-finite reward {score}; make the reward function return a "
                "finite number (look for 0/0, log(0) or an empty mean)")
    return score, extras


def _raised(offset: int | None, exc: Exception) -> _Failed:
    """The failure for an exception from the reward function, traceback from its own frame."""
    tb = exc.__traceback__.tb_next if exc.__traceback__ is not None else None
    trace = "".join(traceback.format_exception(type(exc), exc, tb))
    return _Failed(offset, f"raised {type(exc).__name__}: {exc}", trace)


def _call(
    fn: Callable[..., Any], batched: bool, samples: list[RewardSample]
) -> list[Any] | _Failed:
    """The raw values the reward function returns for ``samples``, or the failure."""
    if not batched:
        values = []
        for offset, sample in enumerate(samples):
            try:
                values.append(fn(data_source=sample.data_source, solution_str=sample.response_text,
                                 ground_truth=sample.ground_truth, extra_info=sample.extra_info))
            except Exception as exc:  # noqa: BLE001 - reported with the sample
                return _raised(offset, exc)
        return values
    try:
        values = fn(data_sources=[s.data_source for s in samples],
                    solution_strs=[s.response_text for s in samples],
                    ground_truths=[s.ground_truth for s in samples],
                    extra_infos=[s.extra_info for s in samples])
    except Exception as exc:  # noqa: BLE001 - reported with the samples
        return _raised(None, exc)
    if hasattr(values, "tolist"):
        values = values.tolist()
    if not isinstance(values, (list, tuple)):
        return _Failed(None, f"returned {type(values).__name__} instead of a list with one value "
                             f"per sample ({len(samples)} samples)")
    if len(values) != len(samples):
        return _Failed(None, f"returned {len(values)} values for {len(samples)} samples; a "
                             "batched reward function must return one value per sample, in order")
    return list(values)


def _score_samples(
    fn: Callable[..., Any], batched: bool, samples: list[RewardSample]
) -> _Scored | _Failed:
    """Call the reward function on ``samples`` and check every value it returns."""
    values = _call(fn, batched, samples)
    if isinstance(values, _Failed):
        return values
    scores, extras = [], []
    for offset, value in enumerate(values):
        checked = _check_value(value)
        if isinstance(checked, str):
            return _Failed(offset, checked)
        scores.append(checked[0])
        extras.append(checked[1])
    return _Scored(scores, extras)


_worker_fn: Callable[..., Any] | None = None
_worker_batched = False


def _init_worker(spec: _ScorerSpec) -> None:
    """Pool initializer: resolve the reward function once per worker, and preload math-verify."""
    global _worker_fn, _worker_batched
    _worker_fn, _worker_batched = spec.resolve(), spec.batched
    if spec.function is None:
        try:
            import megarl.reward.math  # noqa: F401 - import time must not count against timeouts
        except ImportError:
            pass


def _score_in_worker(samples: list[RewardSample]) -> _Scored | _Failed:
    assert _worker_fn is not None
    return _score_samples(_worker_fn, _worker_batched, samples)


def _describe(index: int, sample: RewardSample) -> str:
    preview = str(sample.response_text)[:_RESPONSE_PREVIEW_CHARS]
    limit = _RESPONSE_PREVIEW_CHARS
    return f"sample {index} (data_source={sample.data_source!r}, response[:{limit}]={preview!r})"


def _metrics(scores: list[float], num_timeouts: int) -> dict[str, float]:
    metrics = {"reward/timeouts": float(num_timeouts)}
    if scores:
        metrics["critic/score/mean"] = sum(scores) / len(scores)
        metrics["critic/score/max"] = max(scores)
        metrics["critic/score/min"] = min(scores)
    return metrics


class RewardManager:
    """Scores batches of responses with the built-in rewards or the user's ``reward.function``."""

    def __init__(
        self,
        function: str | None = None,
        *,
        batched: bool = False,
        num_workers: int = 4,
        timeout_s: float = 10.0,
        format_score: float = 0.0,
    ) -> None:
        if num_workers < 0:
            raise ValueError(
                f"reward.num_workers={num_workers}: must be >= 0 (0 scores in-process)"
            )
        if not timeout_s > 0:
            raise ValueError(f"reward.timeout_s={timeout_s}: must be > 0 seconds")
        if batched and function is None:
            raise ValueError("reward.batched=true needs reward.function (the built-in rewards "
                             "are per sample); set reward.function or reward.batched=false")
        if function is not None:
            function = absolute_spec(function)
            load_reward_function(function, batched=batched)
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self._spec = _ScorerSpec(function, batched, format_score)
        self._label = "the built-in reward" if function is None else f"reward.function={function!r}"
        self._local_fn = self._spec.resolve() if num_workers == 0 else None
        self._pool = None if num_workers == 0 else TimedProcessPool(
            num_workers, initializer=_init_worker, initargs=(self._spec,)
        )

    def score(self, samples: Sequence[RewardSample]) -> RewardResult:
        """Score ``samples``; return rewards and metrics, or raise :class:`RewardError`."""
        samples = list(samples)
        self._check_samples(samples)
        spans = self._spans(len(samples))
        tasks = [(samples[start:stop],) for start, stop in spans]
        outcomes = self._run(samples, spans, tasks)
        scores, timed_out = [0.0] * len(samples), [False] * len(samples)
        extras: list[dict[str, Any]] = [{} for _ in samples]
        failures: list[tuple[int, int, _Failed]] = []
        for (start, stop), outcome in zip(spans, outcomes):
            if outcome is TIMED_OUT:
                timed_out[start:stop] = [True] * (stop - start)
            elif isinstance(outcome, _Failed):
                failures.append((start, stop, outcome))
            else:
                scores[start:stop], extras[start:stop] = outcome.scores, outcome.extras
        if failures:
            raise RewardError(self._failure_message(samples, failures))
        self._warn_timeouts(samples, timed_out)
        return RewardResult(scores, timed_out, extras, _metrics(scores, sum(timed_out)))

    def close(self) -> None:
        """Stop the worker processes."""
        if self._pool is not None:
            self._pool.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _check_samples(self, samples: list[RewardSample]) -> None:
        known = builtin_sources() if self._spec.function is None else None
        for index, sample in enumerate(samples):
            if not isinstance(sample.response_text, str):
                raise RewardError(f"{_describe(index, sample)}: response_text is a "
                                  f"{type(sample.response_text).__name__}; pass the decoded text")
            if known is not None and sample.data_source not in known:
                raise RewardError(
                    f"{_describe(index, sample)}: no built-in reward for this data_source "
                    f"(built-in: {', '.join(sorted(known))}); to score it with your own function "
                    "set reward.function='module:callable' (or 'path/to/file.py:callable')"
                )
        if known is not None and any(s.data_source in MATH_SOURCES for s in samples):
            try:
                import megarl.reward.math  # noqa: F401 - fail here, not in every worker
            except ImportError as exc:
                raise RewardError(str(exc)) from exc

    def _spans(self, num_samples: int) -> list[tuple[int, int]]:
        """The [start, stop) ranges of samples scored together: one sample each, or (batched)
        one contiguous chunk per worker."""
        if not self._spec.batched:
            return [(index, index + 1) for index in range(num_samples)]
        num_chunks = min(num_samples, max(1, self.num_workers))
        bounds = [round(k * num_samples / num_chunks) for k in range(num_chunks + 1)]
        return list(itertools.pairwise(bounds))

    def _run(
        self, samples: list[RewardSample], spans: list[tuple[int, int]], tasks: list[tuple]
    ) -> list[Any]:
        if self._pool is None:
            assert self._local_fn is not None
            return [_score_samples(self._local_fn, self._spec.batched, *task) for task in tasks]
        timeouts = [self.timeout_s * (stop - start) for start, stop in spans]
        try:
            return self._pool.run(_score_in_worker, tasks, timeouts)
        except WorkerCrashed as exc:
            suspects = [index for task in exc.task_indices for index in range(*spans[task])]
            described = "; ".join(_describe(index, samples[index]) for index in suspects[:4])
            raise RewardError(
                f"a reward worker process died (crash, os._exit or out of memory) while scoring "
                f"{len(suspects)} sample(s) with {self._label}: {described}; run with "
                "reward.num_workers=0 to see the failure in the calling process"
            ) from exc

    def _failure_message(
        self, samples: list[RewardSample], failures: list[tuple[int, int, _Failed]]
    ) -> str:
        start, stop, failure = failures[0]
        if failure.offset is None:
            where = f"samples {start}..{stop - 1} (first: {_describe(start, samples[start])})"
        else:
            where = _describe(start + failure.offset, samples[start + failure.offset])
        message = f"{self._label} failed on {where}: {failure.problem}"
        if len(failures) > 1:
            others = len(failures) - 1
            message += f" [and {others} more failing call(s) in this batch of {len(samples)}]"
        if failure.trace:
            message += f"\nTraceback in the reward worker:\n{failure.trace.rstrip()}"
        return message

    def _warn_timeouts(self, samples: list[RewardSample], timed_out: list[bool]) -> None:
        if any(timed_out):
            first = timed_out.index(True)
            logger.warning(
                "%d of %d reward samples timed out after reward.timeout_s=%s s and got reward 0.0; "
                "first: %s", sum(timed_out), len(samples), self.timeout_s,
                _describe(first, samples[first]),
            )
