"""Step timing, throughput, model FLOPs utilisation, and reduction of per-rank metrics.

Names written here (all per step):
- ``timing/<phase>``: wall seconds of a phase (``gen``, ``old_log_prob``, ``ref``, ``adv``,
  ``update_actor``, ``sync_weights``, ``step``), from the ``timer`` context manager.
- ``throughput/total_tokens_per_sec``: prompt + response tokens of the step / ``timing/step``,
  for the whole job (not per device).
- ``throughput/gen_tokens_per_sec_per_gpu``: generated tokens / ``timing/gen`` / rollout devices.
- ``throughput/train_tokens_per_sec_per_gpu``: prompt + response tokens trained on (times the
  PPO epochs) / ``timing/update_actor`` / train devices.
- ``perf/mfu/actor``: achieved FLOP/s of the actor update / peak FLOP/s of the train devices;
  omitted when the device's peak is unknown (CPU, unlisted GPUs).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

from megarl.faults import crash_point

# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------


@contextmanager
def timer(name: str, metrics: dict[str, float]) -> Iterator[None]:
    """Add the seconds spent in the block to ``metrics["timing/<name>"]``.

    Time adds up when a phase is timed several times in one step (e.g. one block per
    mini-batch); the value is written even when the block raises. A phase is also a point where
    the recovery tests can crash the process (:mod:`megarl.faults`).
    """
    crash_point(name)
    start = time.perf_counter()
    try:
        yield
    finally:
        key = f"timing/{name}"
        metrics[key] = metrics.get(key, 0.0) + (time.perf_counter() - start)


# ---------------------------------------------------------------------------------------------
# Throughput
# ---------------------------------------------------------------------------------------------


def _rate(tokens: float, seconds: float | None, devices: int = 1) -> float | None:
    """tokens / seconds / devices, or None when there is no positive time."""
    if seconds is None or not seconds > 0 or devices < 1:
        return None
    return tokens / seconds / devices


def throughput_metrics(timings: Mapping[str, float], *, prompt_tokens: int, response_tokens: int,
                       num_train_gpus: int, num_rollout_gpus: int,
                       ppo_epochs: int = 1) -> dict[str, float]:
    """The ``throughput/*`` metrics of a step from its ``timing/*`` values and token counts.

    ``prompt_tokens`` and ``response_tokens`` count the valid (unpadded) tokens of the batch;
    a device is a GPU, or a rank on CPU. A metric whose phase was not timed is omitted.
    """
    total = prompt_tokens + response_tokens
    rates = {
        "throughput/total_tokens_per_sec": _rate(total, timings.get("timing/step")),
        "throughput/gen_tokens_per_sec_per_gpu": _rate(
            response_tokens, timings.get("timing/gen"), num_rollout_gpus),
        "throughput/train_tokens_per_sec_per_gpu": _rate(
            total * ppo_epochs, timings.get("timing/update_actor"), num_train_gpus),
    }
    return {name: value for name, value in rates.items() if value is not None}


# ---------------------------------------------------------------------------------------------
# FLOPs and MFU
# ---------------------------------------------------------------------------------------------


def flops_per_token(num_layers: int, hidden: int, active_params: float, seq_len: float, *,
                    attention_dim: int | None = None, training: bool = True) -> float:
    """Model FLOPs to process one token of a sequence of ``seq_len`` tokens.

    Training (forward + backward) = 6 * active_params + 12 * num_layers * attention_dim * seq_len
    (the PaLM appendix-B count: the first term covers every matmul with weights, the second the
    QK^T and attention-times-V products, counted without causal masking). Forward only is a third
    of it. ``active_params``: parameters used per token (for MoE only the routed top-k and shared
    experts), including the output layer, excluding the embedding lookup. ``attention_dim`` is
    num_heads * head_dim, ``hidden`` when not given.
    """
    attention_dim = hidden if attention_dim is None else attention_dim
    train_flops = 6.0 * active_params + 12.0 * num_layers * attention_dim * seq_len
    return train_flops if training else train_flops / 3.0


def batch_flops(seq_lens: Sequence[int], num_layers: int, hidden: int, active_params: float, *,
                attention_dim: int | None = None, training: bool = True) -> float:
    """Model FLOPs of a batch of sequences: each token costs ``flops_per_token`` at its length."""
    return sum(n * flops_per_token(num_layers, hidden, active_params, n,
                                   attention_dim=attention_dim, training=training)
               for n in seq_lens)


# Dense (no sparsity) bf16 tensor-core peak FLOP/s per device, from the vendors' data sheets.
# Keyed by the words of the device name; the entry matching the most words wins, so
# "NVIDIA H100 PCIe" finds the PCIe figure, not the SXM one, whatever the order of the table.
PEAK_BF16_FLOPS: dict[tuple[str, ...], float] = {
    ("A100",): 312e12,
    ("A800",): 312e12,
    ("H100",): 989e12,
    ("H100", "PCIE"): 756e12,
    ("H100", "NVL"): 835e12,
    ("H800",): 989e12,
    ("H200",): 989e12,
    ("H200", "NVL"): 835e12,
    ("H20",): 148e12,
    ("B200",): 2250e12,
}


def peak_flops(device_name: str | None) -> float | None:
    """Peak dense bf16 FLOP/s of a device by its name (``torch.cuda.get_device_name()``).

    None for CPUs, unknown devices and None.
    """
    if not device_name:
        return None
    words = set(device_name.upper().replace("-", " ").replace("_", " ").split())
    matches = [(len(key), value) for key, value in PEAK_BF16_FLOPS.items() if words.issuperset(key)]
    return max(matches)[1] if matches else None


def current_device_peak_flops() -> float | None:
    """Peak FLOP/s of this process's CUDA device, None without CUDA or for an unlisted GPU."""
    import torch

    if not torch.cuda.is_available():
        return None
    return peak_flops(torch.cuda.get_device_name(torch.cuda.current_device()))


def mfu(flops: float, seconds: float, num_devices: int, peak_flops_per_device: float | None
        ) -> float | None:
    """Model FLOPs utilisation: flops / (seconds * num_devices * peak); None if peak unknown."""
    if peak_flops_per_device is None or not seconds > 0 or num_devices < 1:
        return None
    return flops / (seconds * num_devices * peak_flops_per_device)


def actor_mfu_metrics(seq_lens: Sequence[int], update_seconds: float, *, num_layers: int,
                      hidden: int, active_params: float, num_devices: int,
                      peak_flops_per_device: float | None, attention_dim: int | None = None,
                      ppo_epochs: int = 1) -> dict[str, float]:
    """``{"perf/mfu/actor": ...}`` for an actor update over ``seq_lens``; empty if peak unknown."""
    flops = ppo_epochs * batch_flops(seq_lens, num_layers, hidden, active_params,
                                     attention_dim=attention_dim)
    value = mfu(flops, update_seconds, num_devices, peak_flops_per_device)
    return {} if value is None else {"perf/mfu/actor": value}


# ---------------------------------------------------------------------------------------------
# Reduction of per-rank / per-micro-batch metrics
# ---------------------------------------------------------------------------------------------


def reduction_for(name: str) -> str:
    """How values of a metric combine: ``max``/``min`` for names ending in max/min, else mean."""
    last = name.replace("/", "_").rsplit("_", 1)[-1]
    return last if last in ("max", "min") else "mean"


def _reduce(name: str, values: Sequence[float]) -> float:
    how = reduction_for(name)
    if how == "max":
        return max(values)
    if how == "min":
        return min(values)
    return math.fsum(values) / len(values)


def reduce_metric_lists(lists: Mapping[str, Sequence[float]]) -> dict[str, float]:
    """One value per metric from lists of values (per micro-batch or rank).

    Mean by default; names ending in ``max``/``min`` (``response_length/max``,
    ``training/rollout_probs_diff_max``) take the max/min. Empty lists are dropped.
    """
    return {name: _reduce(name, [float(v) for v in values])
            for name, values in lists.items() if len(values) > 0}


def reduce_metrics(dicts: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Combine per-rank or per-micro-batch metric dicts into one (rule of reduce_metric_lists).

    A metric missing from some dicts is reduced over the dicts that have it.
    """
    lists: dict[str, list[float]] = {}
    for metrics in dicts:
        for name, value in metrics.items():
            lists.setdefault(name, []).append(float(value))
    return reduce_metric_lists(lists)
