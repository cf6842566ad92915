"""The scheduler's pure parts: staleness accounting, the staleness budget, the bounded queue,
partial-rollout merging, and the config rules for the overlapping schedulers."""

from __future__ import annotations

import threading
import time

import pytest

from megarl.config import validate_config
from megarl.config.schema import RunConfig, SchedulerConfig
from megarl.rollout.interface import RolloutSample, SamplingParams
from megarl.scheduler.fully_async import queue_capacity, zero_variance
from megarl.scheduler.partial import continuation, merge
from megarl.scheduler.queue import SampleGroup, SampleQueue
from megarl.scheduler.rollouter import StalenessBudget
from megarl.scheduler.staleness import (
    VersionError,
    newest_version,
    oldest_version,
    staleness,
    staleness_metrics,
    token_versions,
    within_bound,
)


def sample(response: list[int], version: str, *, versions: list[str] | None = None,
           reason: str = "length", prompt: list[int] | None = None) -> RolloutSample:
    return RolloutSample(prompt_index=0, sample_index=0, prompt_ids=prompt or [1, 2, 3],
                         response_ids=response, log_probs=[-0.5 - t / 100 for t in response],
                         finish_reason=reason, weight_version=version, rid="r",
                         token_weight_versions=versions)


def group(ordinal: int, size: int = 2, version: str = "0") -> SampleGroup:
    return SampleGroup(ordinal, {"input_ids": [1]}, [sample([5, 6], version)] * size)


def test_staleness_reports_the_oldest_token_and_bounds_the_newest_segment():
    fresh, resumed = sample([4, 5], "3"), sample([4, 5, 6], "4", versions=["2", "2", "4"])
    assert token_versions(resumed) == [2, 2, 4]
    assert oldest_version(resumed) == 2 and oldest_version(sample([], "3")) == 3
    assert newest_version(resumed) == 4 and newest_version(sample([], "3")) == 3
    assert staleness([fresh, resumed], 4) == [1, 2]
    # a resumed sample, and a group, is as fresh as its newest segment
    assert within_bound([resumed], 4, 0) and within_bound([fresh, resumed], 4, 0)
    assert not within_bound([fresh], 4, 0) and within_bound([fresh], 4, 1)
    assert not within_bound([fresh, resumed], 5, 0) and within_bound([], 9, 0)
    assert staleness_metrics([1, 2, 2, 0]) == {
        "staleness/mean": 1.25, "staleness/max": 2.0, "staleness/count_0": 1.0,
        "staleness/count_1": 1.0, "staleness/count_2": 2.0}
    assert staleness_metrics([1, 1])["staleness/count_0"] == 0.0
    with pytest.raises(VersionError, match="update_weight_version"):
        oldest_version(sample([1], "default"))


def test_budget_lets_generation_run_ahead_by_the_threshold():
    # threshold 0: exactly the groups consumed before the next push
    assert [StalenessBudget(8, 0.0).limit(u) for u in range(3)] == [8, 16, 24]
    # verl's fraction: 10% extra per push; integer thresholds run whole pushes ahead
    assert StalenessBudget(20, 0.1).limit(0) == 22 and StalenessBudget(20, 0.1).limit(2) == 62
    assert StalenessBudget(4, 1).limit(0) == 8
    assert StalenessBudget(3, 0.7).limit(1) == 8  # floor(2.7 * 3) = 8, no float surprise


def test_queue_capacity_follows_the_budget_unless_given():
    cfg = SchedulerConfig(mode="fully_async", staleness_threshold=0.5,
                          trigger_parameter_sync_step=2)
    assert queue_capacity(cfg, groups_per_step=4, n=8) == 12 * 8
    assert queue_capacity(cfg.model_copy(update={"max_queue_length": 40}), 4, 8) == 40


def test_queue_reserves_room_for_generation_in_flight():
    spaces = []
    queue = SampleQueue(6, on_space=lambda: spaces.append(1))
    assert queue.try_reserve(2) and queue.try_reserve(2) and queue.try_reserve(2)
    assert not queue.try_reserve(2)  # 6 reserved: full although nothing is queued
    queue.put(group(0))
    queue.put(group(1))
    assert (len(queue), queue.queued_samples, queue.reserved_samples) == (2, 4, 2)
    queue.release(2)
    assert queue.try_reserve(2)
    taken = queue.take(2, timeout_s=1)
    assert [g.ordinal for g in taken] == [0, 1] and queue.queued_samples == 0
    assert len(spaces) == 2 and queue.try_reserve(2)


def test_take_waits_for_the_producer_thread_and_times_out():
    queue = SampleQueue(10)
    queue.try_reserve(4)

    def produce() -> None:
        time.sleep(0.2)
        queue.put(group(7))
        queue.put(group(8))

    start = time.monotonic()  # before the producer's sleep can begin: waited >= 0.2 s
    threading.Thread(target=produce).start()
    assert [g.ordinal for g in queue.take(2, timeout_s=5)] == [7, 8]
    assert 0.15 < time.monotonic() - start < 4
    with pytest.raises(TimeoutError, match="trainer.phase_timeout_s"):
        queue.take(1, timeout_s=0.1)
    queue.fail(ValueError("engine gone"))
    with pytest.raises(RuntimeError, match="engine gone"):
        queue.take(1, timeout_s=5)


def test_continuation_and_merge_keep_the_prefix_and_attribute_tokens():
    params = SamplingParams(max_new_tokens=10, n=1, seed=5, min_new_tokens=4)
    first = sample([7, 8, 9], "1", reason="abort")
    prompt, follow = continuation(first, params)
    assert prompt == [1, 2, 3, 7, 8, 9]
    assert (follow.max_new_tokens, follow.min_new_tokens, follow.seed) == (7, 1, 5)
    second = sample([10, 11], "2", reason="abort", prompt=prompt)
    merged = merge(first, second)
    prompt2, follow2 = continuation(merged, params)
    third = sample([12], "3", reason="stop", prompt=prompt2)
    done = merge(merged, third)
    assert done.prompt_ids == [1, 2, 3] and done.response_ids == [7, 8, 9, 10, 11, 12]
    assert done.token_weight_versions == ["1", "1", "1", "2", "2", "3"]
    assert done.log_probs == first.log_probs + second.log_probs + third.log_probs
    assert (done.finish_reason, done.weight_version, done.extra["resumed"]) == ("stop", "3", 2)
    assert follow2.max_new_tokens == 5
    assert continuation(sample(list(range(10)), "1", reason="abort"), params) is None
    with pytest.raises(ValueError, match="continuation's prompt"):
        merge(first, sample([1], "2", prompt=[1, 2, 3]))


def test_merge_keeps_the_routes_recorded_before_the_abort():
    import torch

    def routed(response, version, prompt, fill):
        s = sample(response, version, reason="abort", prompt=prompt)
        s.routed_experts = torch.full((len(prompt) + len(response) - 1, 2, 2), fill,
                                      dtype=torch.int16)
        return s

    first = routed([7, 8], "1", [1, 2, 3], fill=1)  # rows of tokens 1 2 3 7
    second = routed([9, 10], "2", [1, 2, 3, 7, 8], fill=2)  # recomputed 1 2 3 7, then 8 9
    third = routed([11], "3", [1, 2, 3, 7, 8, 9, 10], fill=3)
    done = merge(merge(first, second), third)
    rows = done.routed_experts[:, 0, 0].tolist()
    assert rows == [1, 1, 1, 1, 2, 2, 3]  # one row per token fed: prompt + response - 1
    # each response token's row is that of the weights that sampled it
    assert done.response_routed_experts()[:, 0, 0].tolist() == [
        int(v) for v in done.token_weight_versions]
    empty = sample([], "2", reason="abort", prompt=[1, 2, 3, 7, 8])
    assert torch.equal(merge(first, empty).routed_experts, first.routed_experts)
    short = routed([9], "2", [1, 2, 3, 7, 8], fill=2)
    short.routed_experts = short.routed_experts[:2]
    with pytest.raises(ValueError, match="routed experts"):
        merge(first, short)


def test_zero_variance_groups():
    import torch

    assert zero_variance(torch.tensor([1.0, 1.0, 1.0]))
    assert not zero_variance(torch.tensor([0.0, 1.0, 0.0]))


def _problems(**sections) -> list[str]:
    base = {"model": {"path": "/nonexistent"}, "data": {"train_files": ["/nonexistent"],
            "train_batch_size": 4}, "actor": {"ppo_mini_batch_size": 4,
            "ppo_micro_batch_size_per_gpu": 4}, "rollout": {"n": 4, "colocate": False},
            "resources": {"rollout_pool": {"nnodes": 1, "gpus_per_node": 1}}}
    for key, value in sections.items():
        base[key] = {**base.get(key, {}), **value}
    cfg = RunConfig.model_validate(base)
    return [p.line() for p in validate_config(cfg, sources={}, allow_missing_files=True)
            if p.severity == "error"]


def test_config_rules_for_the_overlapping_schedulers():
    assert not [p for p in _problems(scheduler={"mode": "fully_async"}) if "scheduler" in p]
    naive = _problems(scheduler={"mode": "one_step_off"}, trainer={"worker_group": "naive"})
    assert any("trainer.worker_group=ray" in p for p in naive)
    small = _problems(scheduler={"mode": "fully_async", "max_queue_length": 15})
    assert any("scheduler.max_queue_length >= 16" in p for p in small)
