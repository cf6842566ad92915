"""Checks that every node of the Ray cluster can read a run's input files (PITFALLS S3).

Data files and model directories that exist on the head node only make a run fail late, as a
worker traceback on another node. :func:`check_paths_on_nodes` runs one small task pinned to each
alive node (``NodeAffinitySchedulingStrategy``) before any worker is built; every path a node
cannot read comes back as one line naming the node, the config field, the path and the fix.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from megarl.cluster.errors import ClusterError
from megarl.config.model_info import WEIGHT_PATTERNS

_FIX = ("fix: copy it to the same path on every node, or put it on a file system that every "
        "node mounts")


class NodePathError(ClusterError):
    """One or more nodes cannot read an input file or directory the run needs."""


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
    """Run :func:`check_paths_here` on every alive Ray node, one pinned task each; raise
    :class:`NodePathError` with one line per (node, path) that fails. Returns the node count."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    task = ray.remote(num_cpus=0, max_retries=0)(check_paths_here)
    refs = {n["NodeManagerAddress"]: task.options(scheduling_strategy=(
        NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))).remote(list(checks))
        for n in nodes}
    lines = []
    for ip, ref in refs.items():
        try:
            host, problems = ray.get(ref, timeout=timeout_s)
        except Exception as err:  # noqa: BLE001 - a node that cannot run the check is a problem
            lines.append(f"node {ip}: the input check did not run ({type(err).__name__}: "
                         f"{err}) — fix: check that the node is healthy (ray status)")
            continue
        lines += [f"node {host} ({ip}): {field}: {path} {problem} — {_FIX}"
                  for field, path, problem in problems]
    if lines:
        raise NodePathError(f"{len(lines)} input path problem(s) found before starting workers:"
                            "\n" + "\n".join(lines))
    return len(nodes)


def run_input_checks(files: Mapping[str, Sequence[str]], model_paths: Mapping[str, str]
                     ) -> int:
    """:func:`check_paths_on_nodes` for data files (field -> paths) and model directories
    (field -> directory); returns the number of nodes checked."""
    checks = [PathCheck(field, os.fspath(p)) for field, paths in files.items() for p in paths]
    checks += [PathCheck(field, path, "model") for field, path in model_paths.items() if path]
    return check_paths_on_nodes(checks)
