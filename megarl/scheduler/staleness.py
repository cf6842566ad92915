"""Weight versions of samples, and how stale a sample is when the trainer consumes it.

A weight version is the number of weight pushes the engines have received (the trainer's
``weight_version``); engines stamp it on every sample as a string. A sample's *staleness* at
consumption is the trainer's ``weight_version`` minus the version of its oldest token: 0 means
on-policy, 1 means generated with the weights from one push earlier. A partial rollout that was
resumed under newer weights reports by its oldest token (the ``staleness/*`` metrics).

The bound ``fully_async`` enforces (:func:`within_bound`) is on a group's *newest* segment,
the weights that finished its last sample: a group is as fresh as its newest segment. Its
earlier tokens (those of a partial rollout before the push that paused it, and the samples that
finished while a longer sibling went on) keep their own weight versions and engine log-probs,
so rollout correction (``algorithm.rollout_correction``, when on) weighs each token by the
weights that sampled it. Bounding the oldest
token instead drops precisely the groups with samples long enough to span weight pushes, and
trains on shorter responses than a synchronous run would (issue 20).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from megarl.rollout.interface import RolloutSample


class VersionError(ValueError):
    """A sample carries a weight version that is not a push count."""


def parse_version(value: str | None, where: str) -> int:
    """The integer push count of an engine's ``weight_version`` string."""
    try:
        return int(str(value))
    except ValueError:
        raise VersionError(
            f"{where}: weight_version {value!r} is not an integer push count; the scheduler "
            "stamps the engines with the trainer's weight_version when it starts, so another "
            "client changed it (update_weight_version) meanwhile") from None


def token_versions(sample: RolloutSample) -> list[int]:
    """The weight version of each response token of ``sample``."""
    where = f"sample {sample.rid or sample.prompt_index}"
    if sample.token_weight_versions is not None:
        return [parse_version(v, where) for v in sample.token_weight_versions]
    return [parse_version(sample.weight_version, where)] * len(sample.response_ids)


def oldest_version(sample: RolloutSample) -> int:
    """The version of the sample's oldest token (its only version when it has no tokens)."""
    versions = token_versions(sample)
    if not versions:
        return parse_version(sample.weight_version, f"sample {sample.rid or sample.prompt_index}")
    return min(versions)


def newest_version(sample: RolloutSample) -> int:
    """The version of the weights that generated the sample's last segment."""
    versions = token_versions(sample)
    if not versions:
        return parse_version(sample.weight_version, f"sample {sample.rid or sample.prompt_index}")
    return max(versions)


def staleness(samples: Sequence[RolloutSample], trainer_version: int) -> list[int]:
    """Staleness of each sample when consumed at ``trainer_version``."""
    return [trainer_version - oldest_version(s) for s in samples]


def within_bound(samples: Sequence[RolloutSample], trainer_version: int, max_lag: int) -> bool:
    """Whether the newest segment of a group's ``samples`` is at most ``max_lag`` versions
    old at ``trainer_version`` (see the module docstring)."""
    if not samples:
        return True
    return trainer_version - max(newest_version(s) for s in samples) <= max_lag


def staleness_metrics(values: Sequence[int]) -> dict[str, float]:
    """``staleness/{mean,max}`` and the histogram ``staleness/count_<k>`` (samples k versions
    old, for every k from 0 to the maximum)."""
    if not values:
        return {}
    counts = Counter(values)
    out = {"staleness/mean": sum(values) / len(values), "staleness/max": float(max(values))}
    for k in range(min(0, min(values)), max(values) + 1):
        out[f"staleness/count_{k}"] = float(counts.get(k, 0))
    return out
