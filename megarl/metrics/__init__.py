"""Metrics: trackers (console, jsonl, tensorboard, wandb), timing and throughput, the health
monitor, and the end-of-run plot (``megarl.metrics.plot``, imported on use: it loads matplotlib).
"""

from megarl.metrics.health import HealthMonitor, HealthThresholds
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
from megarl.metrics.trackers import (
    TRACKER_NAMES,
    ConsoleTracker,
    JsonlTracker,
    MultiTracker,
    TensorboardTracker,
    Tracker,
    TrackerSettings,
    WandbTracker,
    read_metrics_jsonl,
)

__all__ = [
    "TRACKER_NAMES", "ConsoleTracker", "HealthMonitor", "HealthThresholds", "JsonlTracker",
    "MultiTracker", "TensorboardTracker", "Tracker", "TrackerSettings", "WandbTracker",
    "actor_mfu_metrics", "batch_flops", "current_device_peak_flops", "flops_per_token", "mfu",
    "peak_flops", "read_metrics_jsonl", "reduce_metric_lists", "reduce_metrics",
    "throughput_metrics", "timer",
]
