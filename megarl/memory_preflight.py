"""The preflight of ``megarl train`` on GPUs: every phase's memory estimate against each GPU's
free memory, before any worker starts (PITFALLS T1).

``megarl config show`` estimates each phase's peak per GPU (:mod:`megarl.config.estimates`);
``resources.gpu_memory_gb`` says how large a GPU is, not what is free on it now (another job,
a stale process, or a display may hold part of it). :func:`preflight` holds the estimates
against the free memory of the GPU with the least of it and returns one line per phase that
cannot fit, with the knobs that lower it (:data:`megarl.memory.PHASE_KNOBS`); ``megarl train``
then exits with code 2. :func:`read_free_memory` reads the GPUs this process would use (those
of ``CUDA_VISIBLE_DEVICES``) through ``nvidia-smi`` (NVML: no CUDA context anywhere), else
``torch.cuda.mem_get_info`` in a child process, so the driver never holds a CUDA context
(memory the workers would miss).
A driver that sees no GPU (Ray on a cluster whose head has none) skips the check with one line.
``trainer.preflight=false`` turns it off.

:func:`host_preflight` does the same for host memory, per node of a Ray cluster: the host memory
the pools can place on a node (:mod:`megarl.config.host_estimates`: offloaded train state,
released engine weights, processes) against what the node has available, with the fields that
lower it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from megarl.config import RunConfig
from megarl.config.estimates import estimate, phase_estimates, resolve_sizes, size
from megarl.config.host_estimates import host_estimate, host_fixes
from megarl.config.model_info import ModelInfo
from megarl.memory import GB, PHASE_KNOBS

if TYPE_CHECKING:
    from megarl.cluster.preflight import HostMemory

MIB = 2**20
_SMI_QUERY = "--query-gpu=index,uuid,memory.free,memory.total"
_READ = ("import json, torch\n"
         "n = torch.cuda.device_count() if torch.cuda.is_available() else 0\n"
         "print(json.dumps([list(torch.cuda.mem_get_info(i)) for i in range(n)]))")

FreeMemory = dict[str, tuple[int, int]]
"""Per GPU label (``GPU 0``): (free, total) bytes."""


class PreflightSkipped(RuntimeError):
    """The GPUs' free memory could not be read; the message says why."""


def preflight(estimates_per_phase: Mapping[str, int],
              free_bytes_per_gpu: Mapping[str, int]) -> list[str]:
    """One line per phase whose estimate (bytes per GPU) exceeds the free bytes of the GPU
    with the least free memory, naming the phase, both sizes and the knobs; [] = all fit."""
    if not free_bytes_per_gpu:
        return []
    gpu, free = min(free_bytes_per_gpu.items(), key=lambda item: item[1])
    lines = []
    for phase, need in estimates_per_phase.items():
        if need > free:
            knobs = ", ".join(PHASE_KNOBS.get(phase, ())) or "this phase's batch sizes"
            lines.append(f"preflight: phase {phase!r} needs ~{need / GB:.1f} GB per GPU, {gpu} "
                         f"has {free / GB:.1f} GB free — lower it with {knobs}")
    return lines


def parse_nvidia_smi(text: str, visible: str | None) -> FreeMemory | None:
    """The GPUs of ``nvidia-smi --query-gpu=index,uuid,memory.free,memory.total
    --format=csv,noheader,nounits`` output that ``CUDA_VISIBLE_DEVICES`` (``visible``: indices or
    UUID prefixes; None = all) selects, labelled by their index in this process; None when a
    visible device is not among them (a MIG instance, a malformed list)."""
    rows = [[field.strip() for field in line.split(",")] for line in text.splitlines()
            if line.strip()]
    try:
        gpus = [(index, uuid, int(free) * MIB, int(total) * MIB)
                for index, uuid, free, total in rows]
    except ValueError:
        return None
    if visible is None:
        chosen = gpus
    else:
        chosen = []
        for want in (v.strip() for v in visible.split(",") if v.strip()):
            match = [g for g in gpus if want == g[0] or (not want.isdigit()
                                                         and g[1].startswith(want))]
            if len(match) != 1:
                return None
            chosen.append(match[0])
    return {f"GPU {i}": (free, total) for i, (_, _, free, total) in enumerate(chosen)}


def _read_with_nvidia_smi(timeout_s: float, every_gpu: bool = False) -> FreeMemory | None:
    """The visible GPUs' memory as NVML reports it (``every_gpu``: all of the node's, whatever
    ``CUDA_VISIBLE_DEVICES`` says); None without a usable ``nvidia-smi``."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        text = subprocess.run([smi, _SMI_QUERY, "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=timeout_s,
                              check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_nvidia_smi(text, None if every_gpu else os.environ.get("CUDA_VISIBLE_DEVICES"))


def read_node_free_memory(timeout_s: float = 60.0) -> FreeMemory:
    """(free, total) bytes of every GPU ``nvidia-smi`` lists on this node; {} without it (a
    node with no GPU). What the per-node check of a Ray cluster runs on each node."""
    return _read_with_nvidia_smi(timeout_s, every_gpu=True) or {}


def read_free_memory(timeout_s: float = 120.0) -> FreeMemory:
    """(free, total) bytes of every GPU this process sees: from ``nvidia-smi``, else from a
    child process (its CUDA context ends with it); {} without a GPU. Raises
    :class:`PreflightSkipped` if reading fails."""
    import torch

    if not torch.cuda.is_available():  # no context: the driver count only
        return {}
    found = _read_with_nvidia_smi(timeout_s)
    if found:
        return found
    try:
        done = subprocess.run([sys.executable, "-c", _READ], capture_output=True, text=True,
                              timeout=timeout_s, check=True)
        readings = json.loads(done.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as err:
        raise PreflightSkipped(f"reading the GPUs' free memory failed: {type(err).__name__}: "
                               f"{str(err)[:200]}") from err
    return {f"GPU {i}": (int(free), int(total)) for i, (free, total) in enumerate(readings)}


def with_gpu_memory(cfg: RunConfig, total_bytes: int) -> RunConfig:
    """``cfg`` with an unset ``resources.gpu_memory_gb`` taken as ``total_bytes`` (the
    smallest GPU), which sizes the engines' KV cache."""
    if cfg.resources.gpu_memory_gb is not None:
        return cfg
    resources = cfg.resources.model_copy(update={"gpu_memory_gb": total_bytes / GB})
    return cfg.model_copy(update={"resources": resources})


def device_estimates(cfg: RunConfig, model: ModelInfo, total_bytes: int) -> dict[str, int]:
    """Each phase's estimate (bytes per GPU), :func:`with_gpu_memory`."""
    cfg = with_gpu_memory(cfg, total_bytes)
    return phase_estimates(estimate(cfg, model, resolve_sizes(cfg, model)))


def device_preflight(cfg: RunConfig, model: ModelInfo | None,
                     read: Callable[[], FreeMemory] | None = None) -> tuple[list[str], bool]:
    """The lines to print and whether the run is refused: the check of :func:`preflight`
    against the GPUs that ``read`` (default :func:`read_free_memory`) finds, when
    ``trainer.preflight`` is on and the run is on GPUs (``resources.device`` cuda or auto)."""
    if not cfg.trainer.preflight or cfg.resources.device == "cpu":
        return [], False
    if model is None:
        why = "model.path has no readable config.json, so there is nothing to estimate"
        return [f"preflight: not run — {why}"], False
    try:
        gpus = (read or read_free_memory)()
    except PreflightSkipped as err:
        return [f"preflight: not run — {err}"], False
    if not gpus:
        if cfg.resources.device == "auto":  # a CPU run, or GPUs only on other nodes
            return [], False
        why = ("this process sees no GPU (a driver without one, as on a Ray cluster's CPU "
               "head node); the phases were checked against resources.gpu_memory_gb only")
        return [f"preflight: not run — {why}"], False
    estimates = device_estimates(cfg, model, min(total for _, total in gpus.values()))
    problems = preflight(estimates, {gpu: free for gpu, (free, _) in gpus.items()})
    if problems:
        return problems, True
    gpu, (free, _) = min(gpus.items(), key=lambda item: item[1][0])
    need = max(estimates.values(), default=0)
    fits = (f"preflight: every phase fits (largest ~{need / GB:.1f} GB per GPU; least free: "
            f"{gpu}, {free / GB:.1f} GB, of {len(gpus)} GPU(s))")
    return [fits], False


def host_preflight(cfg: RunConfig, model: ModelInfo, nodes: Sequence[HostMemory],
                   gpus: FreeMemory) -> tuple[list[str], bool]:
    """The lines to print and whether the run is refused: each node's host-memory estimate
    (what the pools can place on a node with the GPUs ``gpus`` lists for it, labelled ``node
    HOST (IP) GPU i``) against what it has available; one line per node that cannot hold it,
    naming the parts and the fields that lower it (the offload switches only where the GPU
    with the least free memory has room for the state they would keep). Nothing without GPUs,
    on CPU runs (the state is host memory there already) or with ``trainer.preflight`` off."""
    if not gpus or not cfg.trainer.preflight or cfg.resources.device == "cpu":
        return [], False
    cfg = with_gpu_memory(cfg, min(total for _, total in gpus.values()))
    sizes = resolve_sizes(cfg, model)
    host = host_estimate(cfg, model, sizes)
    gpu_free = min(free for free, _ in gpus.values())
    lines, checked = [], []
    for node in nodes:
        need = host.on_node(sum(1 for label in gpus if label.startswith(f"{node.node} ")))
        if not need.total:  # the pools place nothing there
            continue
        checked.append((node.available - need.total, node, need.total))
        if need.total > node.available:
            fixes = host_fixes(cfg, model, sizes, host, need, node.available, gpu_free) or [
                "fewer train GPUs on the node, or free its memory"]
            lines.append(
                f"preflight: {node.node} needs ~{size(need.total)} of host memory, it has "
                f"{size(node.available)} available ({node.source}) — {need.breakdown()} — "
                f"lower it with {'; or '.join(fixes)}")
    if lines or not checked:
        return lines, bool(lines)
    _, node, need = min(checked, key=lambda c: c[0])
    fits = (f"preflight: host memory fits on every node (tightest: {node.node} needs "
            f"~{size(need)} of {size(node.available)} available)")
    return [fits], False
