"""Starting or joining Ray (PITFALLS S2) and writing its timeline (M6).

:func:`init_ray` follows ``ray.address`` / ``ray.num_cpus``: an address joins that cluster;
none looks for a Ray instance already running on this node and attaches to it (or, with
``on_existing="error"``, stops with a message saying how to stop it) before starting a new local
one. A stale instance that cannot be joined is reported with its process id and ``ray stop``.
``on_existing="start"`` starts a separate instance next to it (tests that must not share one).

A local instance started here runs its workers at the driver's priority. Ray's default lowers
every worker process to niceness 15: the train ranks and engines then get a few percent of a CPU
that anything else at normal priority wants (megarl's own driver and reward processes, another
job), so on a busy machine each phase runs many times slower than the same step without Ray and
runs into its timeout.

A local instance started here also goes with its driver: Ray kills its head processes when the
driver dies, and a watchdog (:mod:`megarl.cluster.ray_reaper`) kills the raylet's agents, which
would otherwise outlive a SIGKILLed driver by a minute or more.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from megarl.cluster.errors import RayStartError
from megarl.cluster.ray_reaper import start_reaper

logger = logging.getLogger(__name__)

OnExisting = Literal["attach", "error", "start"]

_PROBE_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class LocalRay:
    """A Ray instance found running on this node (through its raylet process)."""

    gcs_address: str
    """host:port of its GCS, what ``ray.init(address=...)`` takes."""
    raylet_pid: int
    """Process id of its raylet."""
    user: str
    """The user owning the raylet process."""
    started: float
    """When the raylet started (seconds since the epoch)."""


@dataclass(frozen=True)
class RayRuntime:
    """What :func:`init_ray` did and what the cluster offers."""

    gcs_address: str
    """The GCS address of the cluster this process is connected to."""
    started_here: bool
    """True when this call started a new local Ray instance."""
    cpus: float
    """CPUs of the whole cluster."""
    gpus: float
    """GPUs of the whole cluster."""


def find_local_ray() -> list[LocalRay]:
    """The Ray instances whose raylet runs on this node, newest first (from the process table)."""
    import ray  # noqa: F401 - puts Ray's bundled psutil on sys.path

    psutil = importlib.import_module("psutil")

    found = []
    for proc in psutil.process_iter(["pid", "cmdline", "username", "create_time"]):
        cmdline = proc.info.get("cmdline") or []
        if not cmdline or os.path.basename(cmdline[0]) != "raylet":
            continue
        for arg in " ".join(cmdline).split():
            if arg.startswith(("--gcs-address=", "--gcs_address=")):
                found.append(LocalRay(arg.split("=", 1)[1], proc.info["pid"],
                                      proc.info.get("username") or "?",
                                      proc.info.get("create_time") or 0.0))
                break
    return sorted(found, key=lambda r: -r.started)


def _how_to_stop(existing: list[LocalRay]) -> str:
    listed = ", ".join(f"GCS {r.gcs_address} (raylet pid {r.raylet_pid}, user {r.user})"
                       for r in existing)
    return (f"running on this node: {listed}. Stop it with `ray stop` (run as its user; stops "
            f"every Ray process of that user on this node), or set ray.address="
            f"{existing[0].gcs_address} to join it")


def init_ray(
    address: str | None = None,
    num_cpus: int | None = None,
    *,
    include_dashboard: bool = False,
    on_existing: OnExisting = "attach",
    namespace: str = "megarl",
) -> RayRuntime:
    """Join the cluster at ``address``, attach to a local Ray (the newest), or start one;
    ``address="local"`` always starts a new private instance.

    ``num_cpus`` limits a newly started local instance (default: ``SLURM_CPUS_ON_NODE`` when set,
    else Ray's own detection); it cannot change a cluster being joined. Idempotent within a
    process: when Ray is already initialised here, reports on that connection.
    """
    import ray

    if ray.is_initialized():
        return _runtime(started_here=False)
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address == "local":
        on_existing, address = "start", None
    if address is not None:
        _join(address, namespace, reason=f"ray.address={address!r}")
        _warn_ignored_num_cpus(num_cpus, f"ray.address={address!r}")
        return _runtime(started_here=False)
    existing = find_local_ray()
    if existing and on_existing != "start":
        if on_existing == "error":
            raise RayStartError(f"ray.address is null but a Ray instance is already "
                                f"{_how_to_stop(existing)}")
        logger.warning("attaching to the Ray instance already running on this node at %s "
                       "(raylet pid %d); set ray.address to choose explicitly",
                       existing[0].gcs_address, existing[0].raylet_pid)
        _join(existing[0].gcs_address, namespace, reason="an existing local Ray instance",
              existing=existing)
        _warn_ignored_num_cpus(num_cpus, "the running local instance")
        return _runtime(started_here=False)
    if num_cpus is None and os.environ.get("SLURM_CPUS_ON_NODE"):
        num_cpus = int(os.environ["SLURM_CPUS_ON_NODE"])
        logger.info("ray.num_cpus unset: using SLURM_CPUS_ON_NODE=%d", num_cpus)
    try:
        # "local": a new instance even where `ray start` left an address for ray.init to join.
        # No prestarted idle workers: megarl's workers carry a runtime env (their environment
        # variables), so Ray starts a worker of their own for each and an idle default worker
        # would only cost its start (~1 s of CPU) and memory.
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=include_dashboard,
                 namespace=namespace, _system_config={
                     "worker_niceness": 0, "enable_worker_prestart": False,
                     "prestart_worker_first_driver": False})
    except Exception as err:
        existing = find_local_ray()
        hint = (_how_to_stop(existing) if existing else
                "check free ports and /tmp space; under Slurm set ray.num_cpus to the CPUs "
                "allocated to this job")
        raise RayStartError(f"could not start a local Ray instance (num_cpus={num_cpus}): "
                            f"{err}\nfix: {hint}") from err
    runtime = _runtime(started_here=True)
    _reap_agents_with_this_process(runtime.gcs_address)
    return runtime


def _reap_agents_with_this_process(gcs_address: str) -> None:
    """Start the watchdog that kills the agents of the local raylet of ``gcs_address`` when this
    process dies (or when that raylet stops)."""
    raylets = [r for r in find_local_ray() if r.gcs_address == gcs_address]
    if not raylets:
        logger.warning("no raylet of the local Ray at %s found: its agents may outlive this "
                       "process if it is killed", gcs_address)
        return
    start_reaper(raylets[0].raylet_pid)


def _warn_ignored_num_cpus(num_cpus: int | None, target: str) -> None:
    """After joining: warn when ``num_cpus`` differs from the CPUs this node of the cluster
    offers (a Slurm job's nodes were started with it: then it is only what they offer)."""
    if num_cpus is None:
        return
    import ray

    here = ray.get_runtime_context().get_node_id()
    offered = next((node["Resources"].get("CPU") for node in ray.nodes()
                    if node["NodeID"] == here), None)
    if offered != num_cpus:
        logger.warning("ray.num_cpus=%s is ignored when joining %s (this node offers %s CPUs): "
                       "the CPUs of a running cluster are set where it was started (`ray start "
                       "--num-cpus`)", num_cpus, target, offered)


def _join(
    address: str, namespace: str, *, reason: str, existing: list[LocalRay] | None = None
) -> None:
    import ray

    fix = (_how_to_stop(existing) if existing else
           f"check that `ray status --address {address}` works from this node, or set "
           "ray.address=null to start a local Ray")
    unreachable = _unreachable(address)
    if unreachable:
        # Ray itself retries an unreachable GCS for minutes; fail at once instead.
        raise RayStartError(f"could not join Ray at {address} ({reason}): {unreachable}\n"
                            f"fix: {fix}")
    try:
        ray.init(address=address, namespace=namespace)
    except Exception as err:  # connection failures come in several types
        raise RayStartError(f"could not join Ray at {address} ({reason}): {err}\nfix: {fix}") \
            from err


def _unreachable(address: str, timeout_s: float = _PROBE_TIMEOUT_S) -> str | None:
    """Why a ``host:port`` GCS address cannot be reached, or None (also for ``auto``/``ray://``)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "://" in address:
        return None
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return None
    except OSError as err:
        return f"nothing answers at {host}:{port} ({err.strerror or err})"


def _runtime(started_here: bool) -> RayRuntime:
    import ray

    resources = ray.cluster_resources()
    return RayRuntime(
        gcs_address=ray.get_runtime_context().gcs_address,
        started_here=started_here,
        cpus=float(resources.get("CPU", 0.0)),
        gpus=float(resources.get("GPU", 0.0)),
    )


def write_timeline(path: str | Path) -> Path:
    """Write Ray's chrome-trace timeline of this job to ``path`` (open it in chrome://tracing
    or ui.perfetto.dev). Worker-group calls appear as ``<role>.<method>``."""
    import ray

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    events = ray.timeline()
    for event in events:
        # Worker-group calls all execute WorkerHost.call_packed; the task name holds the method.
        category = str(event.get("cat", ""))
        if category.startswith("task::"):
            event["name"] = category[len("task::"):]
    path.write_text(json.dumps(events))
    return path
