"""No-Ray mode (PITFALLS M4): the same workers in the processes torchrun starts.

Design: SPMD. ``torchrun --nproc-per-node N <driver>`` starts N processes that all run the same
driver code (the trainer). :func:`init_naive` joins them in one process group. Each process then
holds one worker of every role (``NaiveWorkerGroup(worker_cls, role)``), with rank = torchrun
rank, so every role spans all N ranks and the workers' own ``init_distributed`` reuses that one
group. ``execute_all`` runs the method on the local worker, then every rank publishes its result
(or exception) in the rendezvous store and reads everyone's, so each process returns the same
list of results by rank that a Ray driver would get and the driver code after it takes the same
decisions on every rank. Differences from Ray mode, on purpose:

- a worker exception raises :class:`WorkerError` (rank, host, traceback) on every rank that
  reaches the exchange; a rank that does not publish within the call timeout is named in a
  :class:`WorkerTimeoutError` and asked (same host) to print its stacks to its stderr;
- output is not redirected: torchrun's ``--log-dir`` / ``--redirects`` / ``--tee`` keep per-rank
  logs;
- ``env`` is applied to the whole process (all roles), when the group is created;
- results travel through the rendezvous TCP store: fine for debugging, slow for large tensors.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import signal
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from megarl.cluster.errors import (
    ClusterError,
    RankFailure,
    StuckRank,
    WorkerError,
    WorkerTimeoutError,
)
from megarl.cluster.worker import Device, Worker, WorkerInfo, host_ip

_POLL_S = 0.05
_FAILURE_GRACE_S = 1.0
_NO_LIMIT_S = 7 * 24 * 3600.0
_STACK_DUMP_SIGNAL = signal.SIGUSR1


@dataclass
class NaiveContext:
    """This process's place in the torchrun world and the store the groups exchange results in."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: Device
    store: Any
    """A ``torch.distributed.Store`` shared by all ranks (prefixed for megarl)."""
    hostname: str = field(default_factory=socket.gethostname)
    _groups_created: int = 0

    def next_group_id(self) -> int:
        """A per-process counter; SPMD order makes it equal on every rank."""
        self._groups_created += 1
        return self._groups_created


_CONTEXT: NaiveContext | None = None


def init_naive(backend: str | None = None, timeout_s: float = 1800.0) -> NaiveContext:
    """Join the torchrun world (default process group from the env) and return the context.

    ``backend`` defaults to nccl when CUDA is available, else gloo. Idempotent.
    """
    global _CONTEXT
    if _CONTEXT is not None:
        return _CONTEXT
    import torch
    import torch.distributed as dist

    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
               if k not in os.environ]
    if missing and not dist.is_initialized():
        raise ClusterError(f"trainer.worker_group=naive: {', '.join(missing)} not set; launch "
                           "the driver with `torchrun --nproc-per-node <N> ...`")
    device: Device = "cuda" if torch.cuda.is_available() else "cpu"
    if dist.is_initialized():
        # Someone (e.g. init_distributed_from_env) made the group: share its rendezvous store.
        store = dist.distributed_c10d._get_default_store()
    else:
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world_size,
                                           timeout=timedelta(seconds=timeout_s)))
        if device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(
            backend=backend or ("nccl" if device == "cuda" else "gloo"),
            store=dist.PrefixStore("default_pg", store), rank=rank, world_size=world_size,
            timeout=timedelta(seconds=timeout_s))
    faulthandler.register(_STACK_DUMP_SIGNAL, all_threads=True)
    world_size = dist.get_world_size()
    _CONTEXT = NaiveContext(
        rank=dist.get_rank(), world_size=world_size,
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size))),
        device=device, store=dist.PrefixStore("megarl_naive", store),
    )
    return _CONTEXT


def torchrun_world_size() -> int:
    """How many processes the torchrun that launched this one started (1 when not under
    torchrun)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return 1
    return int(os.environ.get("WORLD_SIZE", "1"))


class NaiveCall:
    """A call already run on the local worker; ``get`` exchanges the outcomes of all ranks."""

    def __init__(self, group: NaiveWorkerGroup, method: str, outcome: tuple[bool, Any]) -> None:
        self.group = group
        self.method = method
        self._outcome = outcome
        self._seq = group._next_seq()

    def get(self, timeout_s: float | None = None, phase: str | None = None,
            abort: Callable[[], BaseException | None] | None = None) -> list[Any]:
        """Every rank's result, by rank (``timeout_s`` defaults to the group's). The local
        rank's call has run already, so ``abort`` (RayWorkerGroup's) has nothing to cut short."""
        timeout_s = self.group.call_timeout_s if timeout_s is None else timeout_s
        return self.group._exchange(self._seq, phase or self.method, self._outcome, timeout_s)


class NaiveWorkerGroup:
    """One role's worker in this torchrun process; the same call API as RayWorkerGroup."""

    def __init__(
        self,
        worker_cls: type[Worker],
        role: str,
        *,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        call_timeout_s: float | None = None,
        context: NaiveContext | None = None,
    ) -> None:
        if not (isinstance(worker_cls, type) and issubclass(worker_cls, Worker)):
            raise TypeError(f"NaiveWorkerGroup({role!r}): worker_cls must be a subclass of "
                            f"megarl.cluster.Worker, got {worker_cls!r}")
        self.ctx = context or _CONTEXT
        if self.ctx is None:
            raise ClusterError(f"NaiveWorkerGroup({role!r}): call megarl.cluster.naive."
                               "init_naive() first (in every torchrun process)")
        self.worker_cls = worker_cls
        self.role = role
        self.call_timeout_s = call_timeout_s
        self._group_id = self.ctx.next_group_id()
        self._seq = 0
        self._pids: list[int] = [0] * self.ctx.world_size
        self._hosts: list[str] = ["?"] * self.ctx.world_size
        os.environ.update(dict(env or {}))
        self.info = WorkerInfo(
            role=role, rank=self.ctx.rank, world_size=self.ctx.world_size,
            local_rank=self.ctx.local_rank, local_world_size=self.ctx.local_world_size,
            master_addr=os.environ.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(os.environ.get("MASTER_PORT", "0")),
            node_ip=host_ip(), hostname=self.ctx.hostname, device=self.ctx.device,
        )
        self.worker: Worker | None = None
        outcome = self._run("__init__", lambda: worker_cls.create_with_info(self.info, tuple(args),
                                                                  dict(kwargs or {})))
        if outcome[0]:
            self.worker, outcome = outcome[1], (True, (os.getpid(), self.ctx.hostname))
        seq = self._next_seq()
        for rank, (pid, host) in enumerate(self._exchange(
                seq, f"{worker_cls.__name__}.__init__", outcome, call_timeout_s)):
            self._pids[rank], self._hosts[rank] = pid, host

    @property
    def world_size(self) -> int:
        """Number of ranks (the torchrun world)."""
        return self.ctx.world_size

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _run(self, method: str, fn: Any) -> tuple[bool, Any]:
        try:
            return (True, fn())
        except Exception as exc:  # noqa: BLE001 - exchanged whole with the other ranks
            import traceback

            text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
            return (False, RankFailure(self.ctx.rank, self.ctx.hostname, os.getpid(), text))

    def _call_local(self, method: str, args: tuple, kwargs: dict[str, Any]) -> NaiveCall:
        if not callable(getattr(self.worker_cls, method, None)):
            raise TypeError(f"{self.role}: worker class {self.worker_cls.__name__} has no "
                                 f"method {method!r}")
        outcome = self._run(method, lambda: getattr(self.worker, method)(*args, **kwargs))
        return NaiveCall(self, method, outcome)

    def execute_all_async(self, method: str, *args: Any, **kwargs: Any) -> NaiveCall:
        """Run ``method`` on the local worker now; ``get()`` gathers every rank's result."""
        return self._call_local(method, args, kwargs)

    def execute_rank_split_async(
        self, method: str, per_rank_args: Sequence[Any], **kwargs: Any
    ) -> NaiveCall:
        """Run ``method`` with ``per_rank_args[rank]`` (tuple = positional args) locally."""
        if len(per_rank_args) != self.world_size:
            raise ValueError(f"{self.role}.{method}: per_rank_args has {len(per_rank_args)} "
                             f"entries but the group has {self.world_size} ranks")
        mine = per_rank_args[self.ctx.rank]
        return self._call_local(method, mine if isinstance(mine, tuple) else (mine,), kwargs)

    def execute_all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``method`` with the same arguments on every rank; results by rank."""
        return self.execute_all_async(method, *args, **kwargs).get()

    def execute_rank_split(
        self, method: str, per_rank_args: Sequence[Any], **kwargs: Any
    ) -> list[Any]:
        """Call ``method`` on rank r with ``per_rank_args[r]``; results by rank."""
        return self.execute_rank_split_async(method, per_rank_args, **kwargs).get()

    def shutdown(self) -> None:
        """Drop the local worker."""
        self.worker = None

    def _exchange(
        self, seq: int, phase: str, outcome: tuple[bool, Any], timeout_s: float | None
    ) -> list[Any]:
        """Publish this rank's outcome, read every rank's; raise on failures or the timeout."""
        store, world = self.ctx.store, self.ctx.world_size
        prefix = f"g{self._group_id}/c{seq}"
        keys = [f"{prefix}/r{r}" for r in range(world)]
        store.set(keys[self.ctx.rank], pickle.dumps(outcome))
        outcomes: dict[int, tuple[bool, Any]] = {}
        start, first_failure = time.monotonic(), None
        limit = _NO_LIMIT_S if timeout_s is None else timeout_s
        while len(outcomes) < world:
            for r in range(world):
                if r not in outcomes and store.check([keys[r]]):
                    outcomes[r] = pickle.loads(store.get(keys[r]))
                    if not outcomes[r][0] and first_failure is None:
                        first_failure = time.monotonic()
            now = time.monotonic()
            if len(outcomes) == world or now - start >= limit or (
                    first_failure is not None and now - first_failure >= _FAILURE_GRACE_S):
                break
            time.sleep(_POLL_S)
        failures = [o[1] for o in outcomes.values() if not o[0]]
        if failures:
            raise WorkerError(self.role, phase, failures)
        if len(outcomes) < world:
            missing = [r for r in range(world) if r not in outcomes]
            raise WorkerTimeoutError(self.role, phase, limit, world, self._stuck(missing))
        if store.add(f"{prefix}/read", 1) == world:
            for key in keys + [f"{prefix}/read"]:
                store.delete_key(key)
        return [outcomes[r][1] for r in range(world)]

    def _stuck(self, ranks: list[int]) -> list[StuckRank]:
        """Ask stuck ranks on this host to print their stacks (to their own stderr)."""
        stuck = []
        for r in ranks:
            note = "(see torchrun's log of this rank)"
            if self._hosts[r] == self.ctx.hostname and self._pids[r]:
                try:
                    os.kill(self._pids[r], _STACK_DUMP_SIGNAL)
                    note = "(its stacks were printed to its stderr: see torchrun's log)"
                except ProcessLookupError:
                    note = "(the process is gone)"
            stuck.append(StuckRank(r, self._hosts[r], self._pids[r], "", "", note=note))
        return stuck

