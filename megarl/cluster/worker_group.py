"""Ray worker groups: one actor per pool slot, forming one role's torch.distributed world.

``RayWorkerGroup(worker_cls, pool, role, log_dir=...)`` starts a
:class:`~megarl.cluster.actor_host.WorkerHost` actor on every bundle of ``pool``, orders them by
(node IP, GPU index, bundle), gives each its rank, world size and the rendezvous address (rank 0's
node IP and a port it found free) as torchrun-style environment, redirects each one's output to
``<log_dir>/<role>_rank<r>.log`` and instantiates ``worker_cls`` there. Calls are driven from
the driver:

- ``execute_all(method, *args, **kwargs)``: the same arguments to every rank; results by rank.
- ``execute_rank_split(method, per_rank_args, **kwargs)``: ``per_rank_args[r]`` to rank r.
- ``*_async`` variants return a :class:`GroupCall` (its ``refs`` are Ray object refs); its
  ``get(timeout_s, phase)`` waits with a timeout and a phase name for messages.

Arguments are serialised once per call (``ray.put``); an argument that is itself a Ray object
ref is fetched on the worker. ``env`` is set in each worker process before the worker class is
imported there (so ``OMP_NUM_THREADS`` and the like take effect).

Every wait watches all ranks at once, so a worker that raises (:class:`WorkerError`, whole
traceback, rank and host) or dies (:class:`WorkerDiedError`, with its log's last lines) is
reported at once even while other ranks are blocked in a collective waiting for it; a call that
does not finish in time (:class:`WorkerTimeoutError`) names the ranks that did not finish and
shows their stacks, dumped into their logs on the spot (PITFALLS S4, T2, T6).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from megarl.cluster.actor_host import (
    WorkerHost,
    read_log_tail,
    read_stack_dump,
    request_stack_dump,
)
from megarl.cluster.errors import (
    DeadRank,
    PoolSchedulingError,
    RankFailure,
    StuckRank,
    WorkerDiedError,
    WorkerError,
    WorkerTimeoutError,
)
from megarl.cluster.pools import ResourcePool, Slot, ip_sort_key
from megarl.cluster.worker import WorkerClass, WorkerInfo, worker_class, worker_class_name

logger = logging.getLogger(__name__)

_POLL_S = 0.2           # how often a wait re-checks every rank
_FAILURE_GRACE_S = 1.0  # after a first failure, how long to collect failures of other ranks
_STACK_DUMP_WAIT_S = 0.5
_LOG_TAIL_LINES = 40


@dataclass
class _Member:
    """What the driver knows about one actor, for messages."""

    rank: int
    host: str = "?"
    pid: int = 0
    node_id: str = ""
    log_path: str = ""


class GroupCall:
    """A call in flight on every rank of a group; ``get`` collects the results by rank."""

    def __init__(self, group: RayWorkerGroup, method: str, refs: list[Any]) -> None:
        self.group = group
        self.method = method
        self.refs = refs
        """One Ray object ref per rank, in rank order."""

    def get(self, timeout_s: float | None = None, phase: str | None = None,
            abort: Callable[[], BaseException | None] | None = None) -> list[Any]:
        """Wait for every rank (``timeout_s`` defaults to the group's ``call_timeout_s``).

        ``phase`` names the step in error messages (default: the method name). ``abort`` is
        asked at every poll; an error it returns is raised at once (what the ranks wait for
        will not come: e.g. an engine refused the bucket the ranks are broadcasting).
        """
        timeout_s = self.group.call_timeout_s if timeout_s is None else timeout_s
        return self.group.wait(self.refs, phase or self.method, timeout_s, abort)


class RayWorkerGroup:
    """One Ray actor per slot of ``pool`` running ``worker_cls``, ranked and rendezvous-ready."""

    def __init__(
        self,
        worker_cls: WorkerClass,
        pool: ResourcePool,
        role: str,
        *,
        log_dir: str | Path,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        call_timeout_s: float | None = None,
        start_timeout_s: float = 300.0,
        echo_logs: bool = True,
    ) -> None:
        if not isinstance(worker_cls, str):  # a path is imported where the workers run
            try:
                worker_class(worker_cls)
            except TypeError as err:
                raise TypeError(f"RayWorkerGroup({role!r}): {err}") from None
        self.worker_cls = worker_cls
        self.worker_name = worker_class_name(worker_cls)
        self.pool = pool
        self.role = role
        self.log_dir = Path(log_dir).absolute()
        self.call_timeout_s = call_timeout_s
        self.infos: list[WorkerInfo] = []
        """Each rank's identity, in rank order."""
        self.slots: list[Slot] = []
        """Each rank's pool slot, in rank order."""
        self._handles: list[Any] = []
        self._placements: list[dict[str, Any]] = []
        self._members: list[_Member] = []
        self._driver_node_id = ""
        try:
            self._start(tuple(args), dict(kwargs or {}), dict(env or {}), start_timeout_s,
                        echo_logs)
        except BaseException:
            self.shutdown()  # no half-started group keeps its actors
            raise

    @property
    def world_size(self) -> int:
        """Number of ranks."""
        return len(self._handles)

    @property
    def log_paths(self) -> list[str]:
        """Each rank's log file, in rank order."""
        return [m.log_path for m in self._members]

    def _start(self, args: tuple, kwargs: dict[str, Any], env: dict[str, str],
               timeout_s: float, echo: bool) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        t0 = time.monotonic()
        self._driver_node_id = ray.get_runtime_context().get_node_id()
        share = self.pool.worker_resources()
        host_cls = ray.remote(WorkerHost)
        handles = []
        for slot in self.pool.slots:
            strategy = PlacementGroupSchedulingStrategy(
                self.pool.placement_groups[slot.pg_index],
                placement_group_bundle_index=slot.bundle_index)
            handles.append(host_cls.options(
                num_cpus=share.get("CPU", 0.0), num_gpus=share.get("GPU", 0.0),
                scheduling_strategy=strategy, max_restarts=0,
            ).remote(self.role, env))
        self._handles = handles
        self._members = [_Member(rank=i) for i in range(len(handles))]
        try:
            placements = self.wait([h.placement.remote() for h in handles], "start", timeout_s)
        except WorkerTimeoutError as err:
            raise PoolSchedulingError(
                f"{self.role}: {len(err.ranks)} of {len(handles)} actors not placed on "
                f"{self.pool.name} within {timeout_s:g} s; each asks {share} of one bundle "
                f"{self.pool.bundle}. fix: if other worker groups already use this pool, create "
                f"it with max_colocate_count >= the number of groups sharing it") from None
        self._assign_ranks(placements)
        self._rendezvous(timeout_s, echo)
        refs = [h.construct.options(name=f"{self.role}.__init__").remote(
            self.worker_cls, args, kwargs) for h in self._handles]
        self.wait(refs, f"{self.worker_name}.__init__", timeout_s)
        logger.info("%s: %d workers of %s started in %.1f s (logs in %s)", self.role,
                    self.world_size, self.worker_name, time.monotonic() - t0,
                    self.log_dir)

    def _assign_ranks(self, placements: list[dict[str, Any]]) -> None:
        """Put the actors in rank order and record where each one runs."""
        order = rank_order(placements, self.pool.slots)
        self._handles = [self._handles[i] for i in order]
        self._placements = [placements[i] for i in order]
        self.slots = [self.pool.slots[i] for i in order]
        self._members = [
            _Member(rank=r, host=f"{p['hostname']} ({p['node_ip']})", pid=p["pid"],
                    node_id=p["node_id"], log_path=str(self.log_dir / f"{self.role}_rank{r}.log"))
            for r, p in enumerate(self._placements)
        ]

    def _rendezvous(self, timeout_s: float, echo: bool) -> None:
        """Pick rank 0's port, then give every actor its identity and log file."""
        master_port = self.wait([self._handles[0].free_port.remote()], "start", timeout_s)[0]
        master_addr = self._placements[0]["node_ip"]
        per_node: dict[str, list[int]] = {}
        for rank, p in enumerate(self._placements):
            per_node.setdefault(p["node_id"], []).append(rank)
        self.infos = []
        for rank, p in enumerate(self._placements):
            same_node = per_node[p["node_id"]]
            self.infos.append(WorkerInfo(
                role=self.role, rank=rank, world_size=len(self._placements),
                local_rank=same_node.index(rank), local_world_size=len(same_node),
                master_addr=master_addr, master_port=master_port, node_ip=p["node_ip"],
                hostname=p["hostname"], device=self.pool.device,
                log_path=self._members[rank].log_path,
            ))
        refs = [h.setup.remote(info, echo) for h, info in zip(self._handles, self.infos)]
        self.wait(refs, "setup", timeout_s)

    def execute_all_async(self, method: str, *args: Any, **kwargs: Any) -> GroupCall:
        """Start ``method`` with the same arguments on every rank."""
        import ray

        self._check_method(method)
        if self.world_size > 1 and (args or kwargs):
            payload = ray.put((args, kwargs))  # serialised once, fetched by every rank
            refs = [self._submit(h, method, payload) for h in self._handles]
        else:
            refs = [self._submit(h, method, (args, kwargs)) for h in self._handles]
        return GroupCall(self, method, refs)

    def execute_rank_split_async(
        self, method: str, per_rank_args: Sequence[Any], **kwargs: Any
    ) -> GroupCall:
        """Start ``method`` on rank r with ``per_rank_args[r]`` (a tuple of positional
        arguments; any other value is the single positional argument) plus ``kwargs``."""
        self._check_method(method)
        if len(per_rank_args) != self.world_size:
            raise ValueError(f"{self.role}.{method}: per_rank_args has {len(per_rank_args)} "
                             f"entries but the group has {self.world_size} ranks")
        refs = []
        for handle, rank_args in zip(self._handles, per_rank_args):
            rank_args = rank_args if isinstance(rank_args, tuple) else (rank_args,)
            refs.append(self._submit(handle, method, (rank_args, kwargs)))
        return GroupCall(self, method, refs)

    def execute_all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``method`` with the same arguments on every rank; results by rank."""
        return self.execute_all_async(method, *args, **kwargs).get()

    def execute_rank_split(
        self, method: str, per_rank_args: Sequence[Any], **kwargs: Any
    ) -> list[Any]:
        """Call ``method`` on rank r with ``per_rank_args[r]``; results by rank."""
        return self.execute_rank_split_async(method, per_rank_args, **kwargs).get()

    def _submit(self, handle: Any, method: str, payload: Any) -> Any:
        return handle.call_packed.options(name=f"{self.role}.{method}").remote(method, payload)

    def _check_method(self, method: str) -> None:
        if isinstance(self.worker_cls, str):
            return  # not imported here; the worker reports a missing method
        if not callable(getattr(self.worker_cls, method, None)):
            raise TypeError(f"{self.role}: worker class {self.worker_name} has no "
                                 f"method {method!r}")

    def wait(self, refs: list[Any], phase: str, timeout_s: float | None,
             abort: Callable[[], BaseException | None] | None = None) -> list[Any]:
        """Results of one ref per rank; raise at the first failure, death or the timeout, or
        the error ``abort`` returns (asked at every poll)."""
        import ray

        index = {ref: i for i, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        failures: list[RankFailure] = []
        dead: list[tuple[int, Exception]] = []
        pending = list(refs)
        start = time.monotonic()
        first_failure = None
        while pending:
            reason = abort() if abort is not None else None
            if reason is not None:
                raise reason
            now = time.monotonic()
            if first_failure is not None and now - first_failure >= _FAILURE_GRACE_S:
                break
            if timeout_s is not None and now - start >= timeout_s:
                break
            budget = _POLL_S if timeout_s is None else min(_POLL_S, start + timeout_s - now)
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=max(0, budget))
            for ref in ready:
                rank = index[ref]
                try:
                    results[rank] = ray.get(ref)
                except ray.exceptions.RayTaskError as err:
                    failures.extend(self._task_failures(rank, err))
                except ray.exceptions.RayActorError as err:
                    dead.append((rank, err))
            if (failures or dead) and first_failure is None:
                first_failure = time.monotonic()
        if dead:
            raise WorkerDiedError(self.role, phase, [self._dead_rank(r, e) for r, e in dead])
        if failures:
            raise WorkerError(self.role, phase, failures)
        if pending:
            stuck = sorted(index[ref] for ref in pending)
            raise WorkerTimeoutError(self.role, phase, timeout_s or 0.0, len(refs),
                                     self._stuck_ranks(stuck, phase))
        return results

    def _task_failures(self, rank: int, err: Exception) -> list[RankFailure]:
        cause = getattr(err, "cause", None)
        if isinstance(cause, WorkerError):
            return list(cause.failures)
        member = self._members[rank]
        return [RankFailure(rank, member.host, member.pid, str(err))]

    def _dead_rank(self, rank: int, err: Exception) -> DeadRank:
        member = self._members[rank]
        return DeadRank(rank, member.host, member.pid, _death_cause(err), member.log_path,
                        self._log_tail(member))

    def _stuck_ranks(self, ranks: list[int], phase: str) -> list[StuckRank]:
        """Make the stuck ranks dump their stacks into their logs, then read the dumps."""
        members = [self._members[r] for r in ranks]
        for m in members:
            if m.log_path:
                self._on_node(m, request_stack_dump, m.pid, m.log_path, phase)
        time.sleep(_STACK_DUMP_WAIT_S)
        stuck = []
        for m in members:
            dump = self._on_node(m, read_stack_dump, m.log_path) if m.log_path else None
            stuck.append(StuckRank(m.rank, m.host, m.pid, m.log_path or "(no log yet)",
                                   dump if isinstance(dump, str) else ""))
        return stuck

    def _log_tail(self, member: _Member) -> str:
        if not member.log_path:
            return "(no log yet: the worker died before its log was set up; see Ray's logs " \
                   "in /tmp/ray/session_latest/logs)"
        tail = self._on_node(member, read_log_tail, member.log_path, _LOG_TAIL_LINES)
        return tail if isinstance(tail, str) else f"(could not read the log on {member.host})"

    def _on_node(self, member: _Member, fn: Any, *args: Any) -> Any:
        """Run ``fn(*args)`` on the member's node: here when local, else as a pinned Ray task."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        if not member.node_id or member.node_id == self._driver_node_id:
            return fn(*args)
        strategy = NodeAffinitySchedulingStrategy(member.node_id, soft=False)
        task = ray.remote(num_cpus=0)(fn).options(scheduling_strategy=strategy)
        try:
            return ray.get(task.remote(*args), timeout=30)
        except Exception as err:  # noqa: BLE001 - a best-effort probe of a remote node
            logger.warning("could not run %s on %s: %s", fn.__name__, member.host, err)
            return None

    def shutdown(self) -> None:
        """Kill every actor of the group (the pool's placement groups stay)."""
        import ray

        for handle in self._handles:
            try:
                ray.kill(handle, no_restart=True)
            except Exception as err:  # noqa: BLE001 - already gone is fine
                logger.debug("ray.kill on a %s actor: %s", self.role, err)
        self._handles = []

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def rank_order(placements: Sequence[Mapping[str, Any]], slots: Sequence[Slot]) -> list[int]:
    """Actor indices in rank order: by node IP (numeric), then GPU index, then bundle.

    ``placements[i]`` (``node_ip``, ``gpu_ids``) is where actor i, started on ``slots[i]``, runs.
    """
    def key(i: int) -> tuple:
        p = placements[i]
        gpu = p["gpu_ids"][0] if p["gpu_ids"] else -1
        return (ip_sort_key(p["node_ip"]), gpu, slots[i].pg_index, slots[i].bundle_index)

    return sorted(range(len(placements)), key=key)


def _death_cause(err: Exception) -> str:
    """The informative part of Ray's actor-death message (exit type and detail)."""
    text = " ".join(str(err).split())
    at = text.lower().find("worker exit type:")
    if at >= 0:
        text = text[at:]
    end = text.find(" Some common causes")
    return text[:end + 1] if end >= 0 else text[:600]

