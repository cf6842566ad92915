"""Timing, throughput, FLOPs/MFU and metric reduction against hand-computed numbers."""

import pytest

from megarl.metrics import timing
from megarl.metrics.timing import (
    actor_mfu_metrics,
    batch_flops,
    current_device_peak_flops,
    flops_per_token,
    mfu,
    peak_flops,
    reduce_metric_lists,
    reduce_metrics,
    throughput_metrics,
    timer,
)


class _Clock:
    """A perf_counter that moves only when told: the timed blocks take exactly what they say,
    whatever the machine's load."""

    def __init__(self) -> None:
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_timer_writes_accumulates_and_survives_exceptions(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(timing, "time", clock)
    metrics: dict[str, float] = {}
    clock.sleep(0.5)  # time outside a block is not counted
    with timer("gen", metrics):
        clock.sleep(0.05)
    first = metrics["timing/gen"]
    assert first == pytest.approx(0.05)
    with pytest.raises(RuntimeError), timer("gen", metrics):
        clock.sleep(0.02)
        raise RuntimeError("boom")
    assert metrics["timing/gen"] == pytest.approx(first + 0.02)
    assert list(metrics) == ["timing/gen"]


def test_throughput_formulas():
    timings = {"timing/step": 10.0, "timing/gen": 4.0, "timing/update_actor": 2.0}
    out = throughput_metrics(timings, prompt_tokens=1000, response_tokens=3000,
                             num_train_gpus=2, num_rollout_gpus=4, ppo_epochs=2)
    assert out == {
        "throughput/total_tokens_per_sec": pytest.approx(4000 / 10),
        "throughput/gen_tokens_per_sec_per_gpu": pytest.approx(3000 / 4 / 4),
        "throughput/train_tokens_per_sec_per_gpu": pytest.approx(2 * 4000 / 2 / 2),
    }
    partial = throughput_metrics({"timing/step": 0.0, "timing/gen": 3.0}, prompt_tokens=10,
                                 response_tokens=30, num_train_gpus=1, num_rollout_gpus=1)
    assert partial == {"throughput/gen_tokens_per_sec_per_gpu": pytest.approx(10.0)}


def test_flops_per_token_by_hand():
    # 6 * 1e6 + 12 * 2 layers * 64 * 128 tokens = 6_000_000 + 196_608
    assert flops_per_token(2, 64, 1e6, 128) == pytest.approx(6_196_608)
    assert flops_per_token(2, 64, 1e6, 128, training=False) == pytest.approx(6_196_608 / 3)
    # Qwen3-30B-A3B-like shape: attention width 32 heads * 128 differs from hidden 2048
    assert flops_per_token(48, 2048, 3.3e9, 4096, attention_dim=4096) == pytest.approx(
        6 * 3.3e9 + 12 * 48 * 4096 * 4096)


def test_batch_flops_weights_attention_by_each_length():
    lengths = [10, 20]
    expected = 6 * 1e5 * 30 + 12 * 3 * 32 * (10 * 10 + 20 * 20)
    assert batch_flops(lengths, 3, 32, 1e5) == pytest.approx(expected)


@pytest.mark.parametrize("name,peak", [
    ("NVIDIA H100 80GB HBM3", 989e12),
    ("NVIDIA H100 PCIe", 756e12),
    ("NVIDIA H200", 989e12),
    ("NVIDIA H20", 148e12),
    ("NVIDIA A100-SXM4-80GB", 312e12),
    ("NVIDIA GeForce RTX 4090", None),
    ("cpu", None),
    (None, None),
])
def test_peak_flops_table(name, peak):
    assert peak_flops(name) == peak


def test_mfu_by_hand_and_omitted_without_peak():
    assert mfu(989e12 * 3 * 2 * 0.4, 3.0, 2, 989e12) == pytest.approx(0.4)
    assert mfu(1e12, 1.0, 1, None) is None
    lengths = [100, 300]
    flops = 6 * 2e6 * 400 + 12 * 4 * 128 * (100**2 + 300**2)
    out = actor_mfu_metrics(lengths, 0.5, num_layers=4, hidden=128, active_params=2e6,
                            num_devices=2, peak_flops_per_device=1e12, ppo_epochs=2)
    assert out == {"perf/mfu/actor": pytest.approx(2 * flops / (0.5 * 2 * 1e12))}
    assert current_device_peak_flops() is None  # this CPU machine: perf/mfu/actor is omitted
    assert actor_mfu_metrics(lengths, 0.5, num_layers=4, hidden=128, active_params=2e6,
                             num_devices=2, peak_flops_per_device=None) == {}


def test_reduce_metrics_mean_and_max_min_by_name():
    per_rank = [
        {"actor/pg_loss": 1.0, "training/rollout_probs_diff_max": 3.0, "response_length/min": 5.0},
        {"actor/pg_loss": 2.0, "training/rollout_probs_diff_max": 7.0, "response_length/min": 2.0,
         "actor/grad_norm": 4.0},
        {"actor/pg_loss": 6.0, "training/rollout_probs_diff_max": 1.0, "response_length/min": 9.0},
    ]
    assert reduce_metrics(per_rank) == {
        "actor/pg_loss": pytest.approx(3.0),
        "training/rollout_probs_diff_max": 7.0,
        "response_length/min": 2.0,
        "actor/grad_norm": 4.0,
    }
    assert reduce_metric_lists({"critic/score/max": [0.1, 0.9], "a": [1, 2, 6], "empty": []}) == {
        "critic/score/max": 0.9, "a": pytest.approx(3.0)}
