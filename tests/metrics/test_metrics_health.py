"""The health monitor driven by synthetic metric streams, one per row of the health table."""

import math
import random

import pytest

from megarl.metrics.health import HealthMonitor, HealthThresholds

STEPS = 120
BAD_FROM = 50


def healthy(step: int, rng: random.Random) -> dict[str, float]:
    """Metrics of a healthy GRPO run: reward and length rising slowly, everything in range."""
    return {
        "critic/score/mean": 0.2 + 0.003 * step + rng.gauss(0, 0.02),
        "actor/kl_loss": 0.01 + rng.uniform(0, 0.02),
        "actor/entropy": 3.0 + rng.gauss(0, 0.1),
        "actor/grad_norm": 0.5 + rng.uniform(-0.2, 0.2),
        "actor/ppo_kl": rng.uniform(-0.01, 0.02),
        "actor/pg_clipfrac": 0.1 + rng.uniform(-0.03, 0.05),
        "response_length/mean": 200.0 + 0.5 * step + rng.gauss(0, 5),
        "throughput/gen_tokens_per_sec_per_gpu": 1000.0 + rng.gauss(0, 20),
        "training/rollout_probs_diff_mean": 0.002 + rng.uniform(0, 0.002),
    }


def run(monitor: HealthMonitor, bad: dict[str, float] | None = None,
        bad_steps: range = range(0)) -> dict[int, list[str]]:
    """Feed STEPS steps; from the steps in ``bad_steps`` on the metrics of ``bad`` are overridden."""
    rng = random.Random(0)
    warnings = {}
    for step in range(1, STEPS + 1):
        metrics = healthy(step, rng)
        if bad and step in bad_steps:
            metrics.update(bad)
        lines = monitor.check(metrics, step)
        if lines:
            warnings[step] = lines
    return warnings


def test_silent_on_a_healthy_stream():
    monitor = HealthMonitor(rate_limit_steps=10)
    assert run(monitor) == {}
    counts = monitor.metrics()
    assert counts["health/num_alarms"] == 0
    assert all(v == 0 for v in counts.values())
    assert set(counts) == {f"health/{n}" for n in (
        "reward_jump", "kl_high", "reward_kl_high", "entropy_low", "grad_norm_high", "ppo_kl_at_clip",
        "clipfrac_high", "response_length_jump", "gen_throughput_drop", "rollout_probs_diff",
        "non_finite")} | {"health/num_alarms"}


# (alarm, metric, bad value, pieces the warning must name: normal range and knob)
THRESHOLD_ROWS = [
    ("kl_high", "actor/kl_loss", 1.5, ["0.001 - 0.1", "actor.kl_loss_coef"]),
    ("reward_kl_high", "actor/reward_kl_penalty", 1.5, ["0.001 - 0.1", "algorithm.kl_ctrl.kl_coef"]),
    ("entropy_low", "actor/entropy", 0.4, ["2 - 6", "actor.entropy_coeff"]),
    ("grad_norm_high", "actor/grad_norm", 25.0, ["0.1 - 1", "actor.grad_clip"]),
    ("ppo_kl_at_clip", "actor/ppo_kl", 0.2, ["clip ratio 0.2", "actor.ppo_epochs"]),
    ("clipfrac_high", "actor/pg_clipfrac", 0.6, ["0.05 - 0.3", "actor.optim.lr"]),
    ("rollout_probs_diff", "training/rollout_probs_diff_mean", 0.05,
     ["< 0.01", "weight sync", "router replay"]),
]


@pytest.mark.parametrize("alarm,metric,value,pieces", THRESHOLD_ROWS)
def test_threshold_alarm_fires_is_rate_limited_and_counted(alarm, metric, value, pieces):
    monitor = HealthMonitor(rate_limit_steps=10)
    warnings = run(monitor, {metric: value}, range(BAD_FROM, BAD_FROM + 25))
    assert sorted(warnings) == [50, 60, 70]  # 25 bad steps, at most one warning per 10 steps
    line, = warnings[50]
    assert "\n" not in line
    assert line.startswith(f"[health] step 50 {alarm}: {metric} = {value:.4g}")
    for piece in pieces:
        assert piece in line, (piece, line)
    counts = monitor.metrics()
    assert counts[f"health/{alarm}"] == 25  # every detection counts, printed or not
    assert sum(v for k, v in counts.items() if k != "health/num_alarms") == 25
    assert counts["health/num_alarms"] == 0  # the last step was healthy again


def test_threshold_edges():
    monitor = HealthMonitor(thresholds=HealthThresholds(clip_ratio=0.28))
    assert monitor.check({"actor/ppo_kl": 0.27, "actor/kl_loss": 1.0, "actor/entropy": 1.0,
                          "actor/grad_norm": 10.0, "actor/pg_clipfrac": 0.5}, 1) == []
    lines = monitor.check({"actor/ppo_kl": -0.28, "actor/reward_kl_penalty": 1.01}, 2)
    assert [line.split()[3] for line in lines] == ["reward_kl_high:", "ppo_kl_at_clip:"]
    assert "actor/reward_kl_penalty = 1.01" in lines[0]
    assert monitor.metrics()["health/num_alarms"] == 2


# (alarm, metric, level after the jump, pieces)
SUDDEN_ROWS = [
    ("reward_jump", "critic/score/mean", 0.9, ["slowly rising", "reward function"]),
    ("response_length_jump", "response_length/mean", 600.0,
     ["stable or slowly rising", "token-mean"]),
    ("gen_throughput_drop", "throughput/gen_tokens_per_sec_per_gpu", 500.0,
     ["stable", "rollout engine"]),
]


@pytest.mark.parametrize("alarm,metric,level,pieces", SUDDEN_ROWS)
def test_sudden_change_fires_once_at_the_jump(alarm, metric, level, pieces):
    monitor = HealthMonitor(rate_limit_steps=1)
    warnings = run(monitor, {metric: level}, range(BAD_FROM, STEPS + 1))
    assert list(warnings) == [BAD_FROM]  # a lasting shift fires once, then is the new normal
    line, = warnings[BAD_FROM]
    assert line.startswith(f"[health] step {BAD_FROM} {alarm}: {metric} = {level:.4g}")
    assert "from a mean of" in line and "over the last 10 steps" in line
    for piece in pieces:
        assert piece in line
    assert monitor.metrics()[f"health/{alarm}"] == 1


@pytest.mark.parametrize("alarm,metric,level,pieces", SUDDEN_ROWS)
def test_sudden_change_silent_on_a_gradual_change_of_the_same_size(alarm, metric, level, pieces):
    monitor = HealthMonitor(rate_limit_steps=1)
    rng = random.Random(1)
    start = healthy(1, random.Random(1))[metric]
    for step in range(1, STEPS + 1):
        metrics = healthy(step, rng)
        metrics[metric] = start + (level - start) * step / STEPS
        assert monitor.check(metrics, step) == []


def test_sudden_change_waits_for_history_and_repeated_spikes_are_rate_limited():
    monitor = HealthMonitor(rate_limit_steps=10)
    for step in range(1, 5):  # fewer than min_history=5 earlier values: no judgement yet
        assert monitor.check({"critic/score/mean": 0.1 if step < 4 else 0.9}, step) == []
    monitor = HealthMonitor(rate_limit_steps=15)
    spikes = (11, 22, 33)  # each 11 steps apart: every spike's window holds only the 0.1 level
    printed = []
    for step in range(1, 36):
        value = 0.9 if step in spikes else 0.1
        printed += [step] * len(monitor.check({"critic/score/mean": value}, step))
    assert printed == [11, 33]  # 22 is detected but within 15 steps of the warning at 11
    assert monitor.metrics()["health/reward_jump"] == 3


def test_non_finite_metric_fires_its_own_alarm():
    monitor = HealthMonitor()
    lines = monitor.check({"actor/grad_norm": math.nan, "actor/pg_loss": math.inf}, 3)
    assert [line.split(":")[1].split("=")[0].strip() for line in lines] == [
        "actor/grad_norm", "actor/pg_loss"]
    assert all(" non_finite:" in line for line in lines)
    assert lines[0].startswith("[health] step 3 non_finite: actor/grad_norm = nan (normal: finite)")
    counts = monitor.metrics()
    assert counts["health/non_finite"] == 1 and counts["health/grad_norm_high"] == 0


def test_state_dict_round_trip_keeps_history_counts_and_rate_limit():
    monitor = HealthMonitor(rate_limit_steps=10)
    for step in range(1, 11):
        monitor.check({"critic/score/mean": 0.1, "actor/grad_norm": 50.0 if step == 10 else 0.5},
                      step)
    restored = HealthMonitor(rate_limit_steps=10)
    restored.load_state_dict(monitor.state_dict())
    lines = restored.check({"critic/score/mean": 0.9, "actor/grad_norm": 50.0}, 11)
    assert [line.split()[3] for line in lines] == ["reward_jump:"]  # grad_norm warned at step 10
    assert restored.metrics()["health/grad_norm_high"] == 2


def test_rate_limit_must_be_positive():
    with pytest.raises(ValueError, match="rate_limit_steps"):
        HealthMonitor(rate_limit_steps=0)
