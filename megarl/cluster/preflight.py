"""Checks on every node of the Ray cluster before any worker is built.

- Inputs (PITFALLS S3): data files and model directories that exist on the head node only make
  a run fail late, as a worker traceback on another node. :func:`check_paths_on_nodes` runs one
  small task pinned to each alive node (``NodeAffinitySchedulingStrategy``); every path a node
  cannot read comes back as one line naming the node, the config field, the path and the fix.
- GPU memory (PITFALLS T1): the driver's preflight sees only the driver's GPUs (none on a CPU
  head node). :func:`gpu_memory_on_nodes` reads every node's GPUs the same way, labelled by
  node, for :func:`megarl.memory_preflight.device_preflight` to hold each phase against.
- Host memory: :func:`host_memory_on_nodes` reads what every node has available
  (:func:`read_host_memory`: ``MemAvailable``, or what the process's cgroup still allows when
  that is less), for :func:`megarl.memory_preflight.host_preflight` to hold the per-node
  estimate against.
"""

from __future__ import annotations

import functools
import os
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megarl.cluster.errors import ClusterError
from megarl.config.model_info import WEIGHT_PATTERNS

if TYPE_CHECKING:
    from megarl.memory_preflight import FreeMemory

_FIX = ("fix: copy it to the same path on every node, or put it on a file system that every "
        "node mounts")


class NodePathError(ClusterError):
    """One or more nodes cannot read an input file or directory the run needs."""


class NodeMemoryError(ClusterError):
    """A phase's memory estimate exceeds the free memory of a GPU on some node, or a node's
    host-memory estimate what the node has available."""


@dataclass(frozen=True)
class HostMemory:
    """One node's host memory as the preflight read it."""

    node: str
    """``node HOST (IP)``, the prefix of the node's GPU labels in :func:`gpu_memory_on_nodes`."""
    available: int
    total: int
    source: str
    """What limits ``available``: ``MemAvailable``, or the cgroup's limit file."""


@dataclass(frozen=True)
class PathCheck:
    """One input to check: the config field it comes from, the path, and what it must be."""

    field: str
    path: str
    kind: str = "file"
    """``file`` (readable), or ``model`` (a directory with a readable config.json and weights)."""


def _unreadable_file(path: Path) -> str | None:
    if not path.exists():
        return "does not exist"
    if not path.is_file():
        return "is not a file"
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError as err:
        return f"cannot be read ({err.strerror or err})"
    return None


def _model_problem(path: Path) -> tuple[str, str] | None:
    """(path, problem) for the first thing wrong with a model directory, or None."""
    if not path.is_dir():
        return str(path), "does not exist" if not path.exists() else "is not a directory"
    problem = _unreadable_file(path / "config.json")
    if problem:
        return str(path / "config.json"), problem
    weights = sorted(f for pattern in WEIGHT_PATTERNS for f in path.glob(pattern))
    if not weights:
        return str(path), "holds no weights (*.safetensors or pytorch_model*.bin)"
    for weight in weights:
        problem = _unreadable_file(weight)
        if problem:
            return str(weight), problem
    return None


def check_paths_here(checks: Sequence[PathCheck]) -> tuple[str, list[tuple[str, str, str]]]:
    """This node's hostname and its problems: (field, path, what is wrong) per failing check."""
    problems = []
    for check in checks:
        if check.kind == "model":
            found = _model_problem(Path(check.path))
            if found:
                problems.append((check.field, *found))
        else:
            problem = _unreadable_file(Path(check.path))
            if problem:
                problems.append((check.field, check.path, problem))
    return socket.gethostname(), problems


def check_paths_on_nodes(checks: Sequence[PathCheck], timeout_s: float = 60.0) -> int:
    """Run :func:`check_paths_here` on every alive Ray node (:func:`_pinned_on_each_node`); raise
    :class:`NodePathError` with one line per (node, path) that fails. Returns the node count."""
    refs = _pinned_on_each_node(check_paths_here, list(checks))
    lines = []
    for ip, result in refs.items():
        try:
            host, problems = result(timeout_s)
        except Exception as err:  # noqa: BLE001 - a node that cannot run the check is a problem
            lines.append(f"node {ip}: the input check did not run ({type(err).__name__}: "
                         f"{err}) — fix: check that the node is healthy (ray status)")
            continue
        lines += [f"node {host} ({ip}): {field}: {path} {problem} — {_FIX}"
                  for field, path, problem in problems]
    if lines:
        raise NodePathError(f"{len(lines)} input path problem(s) found before starting workers:"
                            "\n" + "\n".join(lines))
    return len(refs)


def run_input_checks(files: Mapping[str, Sequence[str]], model_paths: Mapping[str, str]
                     ) -> int:
    """:func:`check_paths_on_nodes` for data files (field -> paths) and model directories
    (field -> directory); returns the number of nodes checked."""
    checks = [PathCheck(field, os.fspath(p)) for field, paths in files.items() for p in paths]
    checks += [PathCheck(field, path, "model") for field, path in model_paths.items() if path]
    return check_paths_on_nodes(checks)


def _pinned_on_each_node(fn: Callable[..., Any], *args: Any
                         ) -> dict[str, Callable[[float], Any]]:
    """``fn(*args)`` on each alive node: node IP -> a getter (its argument: a timeout in
    seconds) of the result, which raises what the run raised. The driver's own node runs it
    here, at once (a pinned task would start a Ray worker for it: ~1 s of CPU); every other
    node as one pinned task."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id()
    task = ray.remote(num_cpus=0, max_retries=0)(fn)
    getters: dict[str, Callable[[float], Any]] = {}
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        if node["NodeID"] == here:
            getters[node["NodeManagerAddress"]] = _ran_here(fn, *args)
            continue
        ref = task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
            node["NodeID"], soft=False)).remote(*args)
        getters[node["NodeManagerAddress"]] = functools.partial(_get, ref)
    return getters


def _get(ref: Any, timeout_s: float) -> Any:
    import ray

    return ray.get(ref, timeout=timeout_s)


def _ran_here(fn: Callable[..., Any], *args: Any) -> Callable[[float], Any]:
    """A getter of ``fn(*args)`` run now in this process (its error raised by the getter)."""
    try:
        value = fn(*args)
    except Exception as err:  # noqa: BLE001 - raised where a task's would be
        error = err  # the name ``err`` is unbound after this block

        def fail(timeout_s: float) -> Any:
            raise error

        return fail
    return lambda timeout_s: value


def _gpu_memory_here(read: Callable[[], FreeMemory]) -> tuple[str, FreeMemory]:
    return socket.gethostname(), read()


def gpu_memory_on_nodes(read: Callable[[], FreeMemory] | None = None, timeout_s: float = 120.0
                        ) -> tuple[FreeMemory, list[str]]:
    """Every alive node's GPUs, ``read`` there (default: every GPU ``nvidia-smi`` lists,
    :func:`~megarl.memory_preflight.read_node_free_memory`), labelled ``node HOST (IP) GPU i``;
    and one line per node whose reading failed."""
    from megarl.memory_preflight import read_node_free_memory

    refs = _pinned_on_each_node(_gpu_memory_here, read or read_node_free_memory)
    found: FreeMemory = {}
    failed = []
    for ip, result in refs.items():
        try:
            host, gpus = result(timeout_s)
        except Exception as err:  # noqa: BLE001 - reported, the check goes on without it
            failed.append(f"preflight: node {ip}: its GPUs could not be read "
                          f"({type(err).__name__}: {str(err)[:200]})")
            continue
        found.update({f"node {host} ({ip}) {gpu}": reading for gpu, reading in gpus.items()})
    return found, failed


_NO_LIMIT = 1 << 60
"""cgroup v1 writes "no limit" as a number near 2**63."""


def _meminfo(path: str) -> tuple[int, int]:
    """(MemAvailable, MemTotal) bytes of a /proc/meminfo file."""
    fields: dict[str, int] = {}
    with open(path) as f:
        for line in f:
            name, _, rest = line.partition(":")
            if rest.split():
                fields[name] = int(rest.split()[0]) * 1024
    return fields["MemAvailable"], fields["MemTotal"]


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # v2 writes "max" for no limit


def _inactive_file(path: Path, key: str) -> int:
    """Reclaimable page cache of a cgroup (``key`` of its memory.stat; 0 when unreadable)."""
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def cgroup_room(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup"
                ) -> tuple[int, int, str] | None:
    """(room, limit, limit file) of the tightest memory limit on this process's cgroup and its
    ancestors (v2 ``memory.max``; v1 ``memory.limit_in_bytes``): the limit less the usage, with
    the inactive page cache (which the kernel reclaims first) counted as room. None without a
    limit (or cgroups)."""
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    v1 = [line.split(":", 2)[2] for line in lines
          if line.count(":") >= 2 and "memory" in line.split(":", 2)[1].split(",")]
    if v1:
        base, rel = Path(root) / "memory", v1[0]
        files = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
    else:
        v2 = [line.split(":", 2)[2] for line in lines if line.startswith("0::")]
        if not v2:
            return None
        base, rel = Path(root), v2[0]
        files = ("memory.max", "memory.current", "inactive_file")
    best = None
    here = base / rel.strip("/")
    for directory in (here, *here.parents):
        limit = _read_int(directory / files[0])
        usage = _read_int(directory / files[1])
        if limit is not None and limit < _NO_LIMIT and usage is not None:
            room = limit - usage + _inactive_file(directory / "memory.stat", files[2])
            if best is None or room < best[0]:
                best = (max(0, room), limit, str(directory / files[0]))
        if directory == base:
            break
    return best


def read_host_memory(meminfo: str = "/proc/meminfo", proc_cgroup: str = "/proc/self/cgroup",
                     cgroup_root: str = "/sys/fs/cgroup") -> tuple[int, int, str]:
    """(available, total, source) bytes of host memory here: ``MemAvailable`` and ``MemTotal``,
    or the room and limit of this process's cgroup when it allows less (a container, a Slurm
    job's ``--mem``: /proc/meminfo shows the whole machine there)."""
    available, total = _meminfo(meminfo)
    room = cgroup_room(proc_cgroup, cgroup_root)
    if room is not None and room[0] < available:
        return room[0], min(total, room[1]), room[2]
    return available, total, "MemAvailable"


def _host_memory_here(read: Callable[[], tuple[int, int, str]]
                      ) -> tuple[str, tuple[int, int, str]]:
    return socket.gethostname(), read()


def host_memory_on_nodes(read: Callable[[], tuple[int, int, str]] | None = None,
                         timeout_s: float = 120.0) -> tuple[list[HostMemory], list[str]]:
    """Every alive node's host memory, ``read`` there (default :func:`read_host_memory`); and
    one line per node whose reading failed."""
    refs = _pinned_on_each_node(_host_memory_here, read or read_host_memory)
    found, failed = [], []
    for ip, result in refs.items():
        try:
            host, (available, total, source) = result(timeout_s)
        except Exception as err:  # noqa: BLE001 - reported, the check goes on without it
            failed.append(f"preflight: node {ip}: its host memory could not be read "
                          f"({type(err).__name__}: {str(err)[:200]})")
            continue
        found.append(HostMemory(f"node {host} ({ip})", available, total, source))
    return found, failed
