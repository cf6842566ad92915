"""Memory per phase: the peak of each phase, and out-of-memory errors that say which knobs help.

:func:`phase_memory` wraps one phase of one process (``gen``, ``old_log_prob``, ``ref``,
``update_actor``, ``sync_weights``, ...). It resets the device's peak statistics, records the
phase's peak allocated and reserved memory (CUDA: ``torch.cuda.max_memory_allocated`` and
``max_memory_reserved``; CPU: the process's resident set size at the end of the phase in both,
since CPU allocations have no peak counter that can be reset) and the device memory in use as
the driver sees it, by every process on the device (CUDA: ``torch.cuda.mem_get_info``'s total -
free, the larger of the readings at the phase's start and end; CPU: the resident set size, as
for the peaks), and turns an out-of-memory error
into :class:`PhaseOutOfMemory`, one line that names the phase, the process (role and rank) and
the config fields that lower that phase's memory (PITFALLS T1). The error pickles, so it
crosses Ray; :func:`find_out_of_memory` finds it again in a worker group's error on the driver.

Metrics (:func:`memory_metrics`): ``perf/max_memory_allocated_gb``,
``perf/max_memory_reserved_gb`` and ``perf/device_used_gb`` (the step's largest phase reading
over every rank), and the same per phase with the phase's name appended
(``perf/max_memory_allocated_gb/update_actor``, ``perf/device_used_gb/sync_weights``).

Between phases, :func:`free_cached_memory` hands the caching allocator's unused blocks back to
the driver (colocated engines resume into them; its collection scans only what was made since
:func:`settle_long_lived_objects` at the end of the worker's setup), and
:func:`device_memory_report` says who holds a device's memory when an allocation failed.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import re
import subprocess
from collections.abc import Iterator

import torch

from megarl.faults import oom_point

logger = logging.getLogger(__name__)

GB = 1024**3

PHASE_KNOBS: dict[str, tuple[str, ...]] = {
    "gen": ("rollout.gpu_memory_utilization", "rollout.max_num_seqs",
            "data.max_response_length", "actor.offload.optimizer_offload",
            "actor.offload.grad_offload", "actor.offload.param_offload"),
    "old_log_prob": ("actor.log_prob_micro_batch_size_per_gpu",
                     "actor.log_prob_max_token_len_per_gpu",
                     "actor.ppo_max_token_len_per_gpu", "actor.parallel.tp",
                     "actor.parallel.cp"),
    "ref": ("ref.log_prob_micro_batch_size_per_gpu", "ref.log_prob_max_token_len_per_gpu",
            "actor.ppo_max_token_len_per_gpu",
            "ref.offload.param_offload", "ref.parallel"),
    "values": ("critic.ppo_micro_batch_size_per_gpu", "critic.offload.param_offload"),
    "update_actor": ("actor.ppo_micro_batch_size_per_gpu", "actor.ppo_max_token_len_per_gpu",
                     "actor.recompute.granularity", "actor.offload.optimizer_offload",
                     "actor.offload.grad_offload", "actor.parallel.tp", "actor.parallel.pp"),
    "update_critic": ("critic.ppo_micro_batch_size_per_gpu", "critic.offload.optimizer_offload",
                      "critic.offload.grad_offload"),
    "sync_weights": ("checkpoint_engine.bucket_size_mb", "actor.offload.optimizer_offload",
                     "actor.offload.grad_offload", "rollout.gpu_memory_utilization"),
    "resume_rollout": ("actor.offload.optimizer_offload", "actor.offload.grad_offload",
                       "actor.offload.param_offload", "rollout.gpu_memory_utilization",
                       "checkpoint_engine.bucket_size_mb", "critic.offload"),
}
"""Per phase, the config fields that lower its memory, the most effective first."""

_MARKER = "PhaseOutOfMemory: "


class PhaseOutOfMemory(RuntimeError):
    """An out-of-memory error in one phase of one process, with the knobs that lower it."""

    def __init__(self, phase: str, where: str, detail: str) -> None:
        self.phase, self.where, self.detail = phase, where, detail
        knobs = PHASE_KNOBS.get(phase, ())
        fix = (f"lower this phase's memory with {', '.join(knobs)}" if knobs else
               "lower the batch sizes of this phase")
        super().__init__(f"out of memory in phase {phase!r} on {where}: {detail} — {fix}")

    def __reduce__(self):
        return (type(self), (self.phase, self.where, self.detail))


def is_out_of_memory(err: BaseException) -> bool:
    """Whether ``err`` is a device (or host) allocation failure."""
    if isinstance(err, torch.OutOfMemoryError):
        return True
    text = str(err)
    return "out of memory" in text.lower() or "can't allocate memory" in text


def _first_line(err: BaseException) -> str:
    lines = [line for line in str(err).splitlines() if line.strip()]
    return (lines[0] if lines else type(err).__name__)[:300]


Peaks = dict[str, tuple[float, float, float]]
"""Per phase: peak allocated, peak reserved and device memory in use, in GB."""


@contextlib.contextmanager
def phase_memory(phase: str, where: str, peaks: Peaks | None = None) -> Iterator[None]:
    """Run one phase: record its peak memory and the device memory in use (GB) into
    ``peaks[phase]`` and report an out-of-memory error in it as :class:`PhaseOutOfMemory`
    (``where``: role and rank)."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    used_at_start = 0.0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        used_at_start = _device_used_gb(cuda)
    try:
        oom_point(phase)
        yield
    except PhaseOutOfMemory:
        raise
    except Exception as err:
        if not is_out_of_memory(err):
            raise
        raise PhaseOutOfMemory(phase, where, _first_line(err)) from err
    finally:
        if peaks is not None:
            now = (*_peak(cuda), max(used_at_start, _device_used_gb(cuda)))
            old = peaks.get(phase, (0.0, 0.0, 0.0))
            peaks[phase] = (max(old[0], now[0]), max(old[1], now[1]), max(old[2], now[2]))


def _rss_gb() -> float:
    """This process's resident set size in GB (0 where /proc is not readable)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / GB
    except (OSError, ValueError, IndexError):
        return 0.0


def _peak(cuda: bool) -> tuple[float, float]:
    """(allocated, reserved) peak GB of this phase; on CPU, the resident set size twice."""
    if cuda:
        return torch.cuda.max_memory_allocated() / GB, torch.cuda.max_memory_reserved() / GB
    rss = _rss_gb()
    return rss, rss


def _device_used_gb(cuda: bool) -> float:
    """GB in use on this process's device by every process (total - free); on CPU, the
    resident set size, as for the peaks."""
    if cuda:
        free, total = torch.cuda.mem_get_info()
        return (total - free) / GB
    return _rss_gb()


_METRIC_NAMES = ("perf/max_memory_allocated_gb", "perf/max_memory_reserved_gb",
                 "perf/device_used_gb")


def memory_metrics(per_rank: list[dict[str, tuple[float, ...]]]) -> dict[str, float]:
    """``perf/max_memory_{allocated,reserved}_gb`` and ``perf/device_used_gb``, overall and per
    phase, max over ranks (entries of two values carry no device reading)."""
    out: dict[str, float] = {}
    for peaks in per_rank:
        for phase, values in peaks.items():
            for name, value in zip(_METRIC_NAMES, values):
                for key in (name, f"{name}/{phase}"):
                    out[key] = max(out.get(key, 0.0), float(value))
    return out


def settle_long_lived_objects() -> int:
    """At the end of a worker's setup: collect once, then set every object that exists aside
    (``gc.freeze``), so that a full collection afterwards scans only what was made since.

    A train rank holds half a million objects that live as long as it does (torch, megatron-core,
    Ray, the model's modules and parameters); a full ``gc.collect()`` over them costs ~0.25 s of
    CPU, and :func:`free_cached_memory` runs one at every colocated hand-off (several a step),
    megatron's optimizer at every checkpoint save. Cycles made after setup, which are what holds
    a phase's tensors, are still collected; only a cycle that existed at setup and becomes
    garbage later would stay. Returns the number of objects set aside."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def free_cached_memory() -> dict[str, int]:
    """Collect garbage and hand the caching allocator's unused blocks back to the driver, so
    another process on the device (a colocated engine) can take them. Returns the bytes this
    process held (CUDA: reserved by its allocator; CPU: resident) ``before`` and ``after``."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    before = torch.cuda.memory_reserved() if cuda else int(_rss_gb() * GB)
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    after = torch.cuda.memory_reserved() if cuda else int(_rss_gb() * GB)
    return {"before": int(before), "after": int(after)}


def device_memory_report(device: torch.device | str) -> tuple[int, int, str]:
    """(free bytes, total bytes, who holds the memory) of ``device``, best effort: on CUDA
    ``torch.cuda.mem_get_info`` and the processes NVML (or ``nvidia-smi``) lists on it; on the
    CPU the host's available and total memory, with no list of processes."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return *_host_memory(), "n/a (not a CUDA device)"
    index = device.index if device.index is not None else torch.cuda.current_device()
    free, total = torch.cuda.mem_get_info(index)
    return free, total, _gpu_processes(index)


def _host_memory() -> tuple[int, int]:
    """(available, total) bytes of host memory from /proc/meminfo ((0, 0) without it)."""
    fields: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                name, _, rest = line.partition(":")
                fields[name] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return 0, 0
    return fields.get("MemAvailable", 0), fields.get("MemTotal", 0)


def _gpu_processes(index: int) -> str:
    """The processes on GPU ``index`` and the memory each uses, on one line."""
    try:
        text = torch.cuda.list_gpu_processes(index)
    except Exception as err:  # noqa: BLE001 - NVML's own errors; nvidia-smi is asked next
        text = f"pynvml: {err}"
    lines = [line.strip() for line in text.splitlines()[1:] if line.strip()]
    if lines and "pynvml" not in text:
        return "; ".join(lines)
    uuid = str(getattr(torch.cuda.get_device_properties(index), "uuid", ""))
    try:
        query = "--query-compute-apps=gpu_uuid,pid,process_name,used_memory"
        out = subprocess.run(["nvidia-smi", query, "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError) as err:
        return f"unknown ({type(err).__name__} from nvidia-smi; {text.strip()})"
    apps = [row.split(", ", 1)[1] for row in out.splitlines()
            if ", " in row and (not uuid or uuid in row.split(", ", 1)[0])]
    return "; ".join(apps) or "no compute processes listed"


def find_out_of_memory(err: BaseException) -> PhaseOutOfMemory | None:
    """The :class:`PhaseOutOfMemory` behind ``err``: itself, a cause, or one a worker group's
    error carries as a rank's traceback text (the first rank's); None if there is none."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, PhaseOutOfMemory):
            return seen
        seen = seen.__cause__ or seen.__context__
    for failure in getattr(err, "failures", ()):
        found = _parse(failure.traceback)
        if found is None and "OutOfMemoryError" in failure.traceback:  # outside a phase
            found = PhaseOutOfMemory(getattr(err, "method", "?"), f"{err.role} rank "
                                     f"{failure.rank} (host {failure.host})",
                                     failure.traceback.strip().splitlines()[-1][:300])
        if found is not None:
            return found
    return None


def _parse(traceback_text: str) -> PhaseOutOfMemory | None:
    """The PhaseOutOfMemory whose message ends ``traceback_text`` (as a worker printed it)."""
    for line in reversed(traceback_text.splitlines()):
        if _MARKER in line:
            message = line.split(_MARKER, 1)[1]
            match = re.match(r"out of memory in phase '([^']+)' on (.+?): (.*) — ", message)
            if match:
                return PhaseOutOfMemory(*match.groups())
    return None


def log_held_device_memory(device: torch.device, threshold: int = 1 << 30) -> None:
    """After a full release: what this process still holds on ``device`` (allocated and
    reserved), and above ``threshold`` bytes the largest live tensors there (shape, dtype), so
    an engine that keeps memory while the actor trains says what it keeps."""
    allocated = torch.cuda.memory_allocated(device)
    reserved = torch.cuda.memory_reserved(device)
    held = ""
    if allocated > threshold:
        tensors = {}
        for obj in gc.get_objects():
            if isinstance(obj, torch.Tensor) and obj.device == device:
                storage = obj.untyped_storage()
                tensors[storage.data_ptr()] = (storage.nbytes(), tuple(obj.shape), obj.dtype)
        top = sorted(tensors.values(), key=lambda t: -t[0])[:8]
        held = "; largest live tensors: " + ", ".join(
            f"{shape} {dtype} {nbytes / 2**30:.2f} GiB" for nbytes, shape, dtype in top)
    logger.info("released: this process holds %.2f GiB allocated, %.2f GiB reserved on %s%s",
                allocated / 2**30, reserved / 2**30, device, held)
