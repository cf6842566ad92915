"""RewardManager: built-in dispatch, user functions in the process pool, timeouts, hung and
crashing workers, and the errors for reward functions that return what cannot be trusted."""

import math
import random
import sys
import time
from pathlib import Path

import pytest

from megarl.reward.function import RewardFunctionError
from megarl.reward.manager import RewardError, RewardManager, RewardSample
from megarl.reward.pool import HARD_DEADLINE_GRACE_S

HERE = Path(__file__).resolve().parent
TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def builtin_pool():
    with RewardManager(num_workers=2, timeout_s=10.0) as manager:
        yield manager


@pytest.fixture(scope="module")
def misbehaving_pool():
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(HERE))  # spawned workers start with the driver's sys.path
        with RewardManager("reward_fns:misbehaving", num_workers=2, timeout_s=TIMEOUT_S) as manager:
            yield manager
        sys.modules.pop("reward_fns", None)


def _labelled_samples(count: int, seed: int = 0) -> tuple[list[RewardSample], list[float]]:
    """Samples of the built-in tasks whose reward is known by construction."""
    rng = random.Random(seed)
    samples, labels = [], []
    for _ in range(count):
        correct = rng.random() < 0.5
        kind = rng.choice(["arithmetic", "sorting", "math", "gsm8k"])
        if kind == "arithmetic":
            a, b = rng.randint(0, 20), rng.randint(0, 20)
            given = a + b if correct else a + b + 1
            sample = RewardSample("synthetic/arithmetic", f"Answer: {given}", str(a + b))
        elif kind == "sorting":
            digits = rng.sample("123456789", 4)
            given = sorted(digits) if correct else sorted(digits, reverse=True)
            sample = RewardSample("synthetic/sorting", f"Answer: {', '.join(given)}",
                                  "".join(sorted(digits)))
        elif kind == "math":
            numerator, denominator = rng.randint(1, 9), rng.choice([2, 4, 5, 8])
            value = numerator / denominator if correct else numerator / denominator + 1
            form = rng.choice([f"\\boxed{{{value}}}", f"The answer is: {value}"])
            sample = RewardSample("lighteval/MATH", form, f"\\frac{{{numerator}}}{{{denominator}}}")
        else:
            total = rng.randint(10, 999)
            given = total if correct else total - 3
            sample = RewardSample("openai/gsm8k", f"so {given} in all.\n#### {given}", str(total))
        samples.append(sample)
        labels.append(1.0 if correct else 0.0)
    return samples, labels


def test_pool_equals_serial_equals_labels_for_200_samples(builtin_pool):
    samples, labels = _labelled_samples(200)
    pooled = builtin_pool.score(samples)
    with RewardManager(num_workers=0) as serial_manager:
        serial = serial_manager.score(samples)
    assert pooled.scores == serial.scores == labels
    assert pooled.metrics == serial.metrics
    assert pooled.metrics["critic/score/mean"] == pytest.approx(sum(labels) / 200)
    assert pooled.metrics["critic/score/max"] == 1.0 and pooled.metrics["critic/score/min"] == 0.0
    assert pooled.metrics["reward/timeouts"] == 0.0


def test_unknown_data_source_names_the_sample_and_the_field():
    expected = r"sample 1 \(data_source='my/task'.*reward.function="
    with RewardManager(num_workers=0) as manager, pytest.raises(RewardError, match=expected):
        manager.score([RewardSample("synthetic/arithmetic", "Answer: 1", "1"),
                       RewardSample("my/task", "hello", "1")])


def test_user_function_by_module_path_with_dict_extras(misbehaving_pool):
    samples = [RewardSample("plain", "42", "42"), RewardSample("plain", "41", "42"),
               RewardSample("extras", "abc", "abc", {"tag": "t1"})]
    result = misbehaving_pool.score(samples)
    assert result.scores == [1.0, 0.0, 1.0]
    assert result.extras == [{}, {}, {"length": 3, "tag": "t1"}]
    assert result.metrics["critic/score/mean"] == pytest.approx(2 / 3)


def test_sleeping_sample_times_out_with_reward_zero(misbehaving_pool):
    samples = [RewardSample("plain", "1", "1"), RewardSample("sleep", "1", "1"),
               RewardSample("plain", "2", "2"), RewardSample("plain", "3", "4")]
    restarts = misbehaving_pool._pool.restarts
    start = time.perf_counter()
    result = misbehaving_pool.score(samples)
    elapsed = time.perf_counter() - start
    assert result.scores == [1.0, 0.0, 1.0, 0.0]
    assert result.timed_out == [False, True, False, False]
    assert result.metrics["reward/timeouts"] == 1.0
    assert TIMEOUT_S * 0.9 < elapsed < TIMEOUT_S + HARD_DEADLINE_GRACE_S
    assert misbehaving_pool._pool.restarts == restarts  # interrupted in place, no new workers


def test_hung_worker_is_replaced_and_the_pool_keeps_working(misbehaving_pool):
    # While worker 1 hangs, worker 2 scores the 0.3 s samples one after another; when the hung
    # worker's hard deadline passes (~2 s) both are killed and the one in flight is run again.
    samples = [RewardSample("hang", "1", "1")]
    samples += [RewardSample("slow", str(i), "3") for i in range(8)]
    restarts = misbehaving_pool._pool.restarts
    result = misbehaving_pool.score(samples)
    assert result.scores == [0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert result.timed_out == [True] + [False] * 8
    assert result.metrics["reward/timeouts"] == 1.0
    assert misbehaving_pool._pool.restarts == restarts + 1
    again = misbehaving_pool.score([RewardSample("plain", "5", "5")] * 4)
    assert again.scores == [1.0] * 4 and again.metrics["reward/timeouts"] == 0.0


@pytest.mark.parametrize("data_source, problem", [
    ("raise", "raised ZeroDivisionError: my reward divided by zero"),
    ("nan", "returned the non-finite reward nan"),
    ("text", "returned str '1.0'; a reward must be a float"),
    ("no_score", "returned a dict without a 'score' key"),
])
def test_untrustworthy_rewards_raise_naming_the_sample(misbehaving_pool, data_source, problem):
    response = "x" * 199 + "Y" + "Z" * 100
    samples = [RewardSample("plain", "1", "1"), RewardSample("plain", "1", "1"),
               RewardSample(data_source, response, "1"), RewardSample("plain", "1", "1")]
    with pytest.raises(RewardError) as info:
        misbehaving_pool.score(samples)
    message = str(info.value)
    assert message.startswith("reward.function='reward_fns:misbehaving' failed on sample 2 "
                              f"(data_source={data_source!r}, response[:200]={response[:200]!r})")
    assert problem in message
    assert "Z" not in message.split("\n")[0].split("response[:200]=")[1].split(")")[0]


def test_several_failures_report_the_first_and_count_the_rest(misbehaving_pool):
    samples = [RewardSample("plain", "1", "1"), RewardSample("nan", "a", "1"),
               RewardSample("raise", "b", "1"), RewardSample("nan", "c", "1")]
    with pytest.raises(RewardError, match=r"failed on sample 1 .*non-finite.*\[and 2 more failing"):
        misbehaving_pool.score(samples)


def test_crashing_worker_is_reported_with_its_samples(misbehaving_pool):
    samples = [RewardSample("plain", "1", "1"), RewardSample("exit", "boom", "1")]
    with pytest.raises(RewardError, match=r"worker process died .*data_source='exit'"):
        misbehaving_pool.score(samples)
    assert misbehaving_pool.score(samples[:1]).scores == [1.0]


def test_batched_function_by_file_path_and_wrong_count():
    spec = f"{HERE / 'reward_fns.py'}:batch_exact_match"
    samples = [RewardSample("plain", str(i % 3), "1") for i in range(7)]
    with RewardManager(spec, batched=True, num_workers=2, timeout_s=TIMEOUT_S) as manager:
        result = manager.score(samples)
        assert result.scores == [float(i % 3 == 1) for i in range(7)]
        bad = samples[:5] + [RewardSample("drop_one", "1", "1")] + samples[6:]
        with pytest.raises(RewardError) as info:
            manager.score(bad)
    message = str(info.value)
    assert ("batch_exact_match' failed on samples 4..6 "
            "(first: sample 4 (data_source='plain'") in message
    assert "returned 2 values for 3 samples" in message


def test_bad_import_path_fails_at_construction_naming_the_field():
    expected = "reward.function='no_such_module_xyz:fn': no module"
    with pytest.raises(RewardFunctionError, match=expected):
        RewardManager("no_such_module_xyz:fn", num_workers=2)
    with pytest.raises(RewardFunctionError, match="reward.function='megarl.reward.math:nope'"):
        RewardManager("megarl.reward.math:nope", num_workers=2)


@pytest.mark.parametrize("kwargs, field", [
    ({"num_workers": -1}, "reward.num_workers"),
    ({"timeout_s": 0}, "reward.timeout_s"),
    ({"batched": True}, "reward.batched"),
])
def test_invalid_settings_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        RewardManager(**kwargs)


def test_metrics_of_an_empty_batch_are_finite():
    with RewardManager(num_workers=0) as manager:
        result = manager.score([])
    assert result.scores == [] and all(math.isfinite(v) for v in result.metrics.values())
