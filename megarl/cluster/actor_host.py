"""The Ray actor that hosts one :class:`~megarl.cluster.worker.Worker` instance.

:class:`RayWorkerGroup` starts one host per pool slot and drives it in three steps: ``placement``
(where did Ray put me, which GPU), ``setup`` (rank, rendezvous environment, log redirection) and
``construct`` (instantiate the worker class). After that every call goes through
:meth:`call_packed`, which turns an exception into a :class:`~megarl.cluster.errors.WorkerError`
carrying the rank, the host and the whole traceback.

A Ray worker inherits the environment of whoever started Ray. When that was a process launched
by torchrun (a driver under torchrun, or ``ray start`` inside a torchrun job), the worker would
carry torchrun's rendezvous variables; ``TORCHELASTIC_USE_AGENT_STORE=True`` among them makes
``init_process_group`` connect every rank, rank 0 included, as a client to a store that nobody
serves, and the group's rendezvous hangs. The host drops them (:data:`LAUNCHER_ENV`) before it
applies the group's ``env`` and, at ``setup``, the group's own rendezvous.
"""

from __future__ import annotations

import os
import socket
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

from megarl import net
from megarl.cluster.errors import RankFailure, WorkerError
from megarl.cluster.logs import STACK_DUMP_SIGNAL, redirect_output, tail_lines
from megarl.cluster.worker import Worker, WorkerClass, WorkerInfo, worker_class

STACK_DUMP_MARKER = "=== megarl: stack dump of every thread"

LAUNCHER_ENV = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE",
    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE",
)
"""What torchrun sets for its children: never inherited by a worker (the module's docstring)."""


class WorkerHost:
    """One worker process: placement report, rendezvous set-up, and calls into the worker."""

    def __init__(self, role: str, env: dict[str, str]) -> None:
        for name in LAUNCHER_ENV:
            os.environ.pop(name, None)
        os.environ.update(env)
        self._role = role
        self._info: WorkerInfo | None = None
        self._worker: Worker | None = None

    def __repr__(self) -> str:
        return self._role if self._info is None else f"{self._role}_rank{self._info.rank}"

    def placement(self) -> dict[str, Any]:
        """Where Ray placed this process: node, host, pid and the GPUs it was given."""
        import ray

        context = ray.get_runtime_context()
        gpu_ids = context.get_accelerator_ids().get("GPU", [])
        return {
            "node_ip": ray.util.get_node_ip_address(),
            "node_id": context.get_node_id(),
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "gpu_ids": sorted(int(g) if str(g).isdigit() else g for g in gpu_ids),
        }

    def free_port(self) -> int:
        """A TCP port free on this node a moment ago (rank 0 picks the rendezvous port)."""
        return net.free_port("0.0.0.0")

    def setup(self, info: WorkerInfo, echo: bool) -> None:
        """Take the rank, export the torchrun-style environment, redirect output to the log."""
        self._info = info
        os.environ.update(info.env())
        if info.log_path:
            redirect_output(info.log_path, echo=echo, prefix=f"[{info.role} rank {info.rank}] ")
            print(f"=== megarl {info.role} rank {info.rank}/{info.world_size} pid {os.getpid()} "
                  f"on {info.hostname} ({info.node_ip}) started at {time.ctime()} ===",
                  flush=True)

    def construct(self, worker_cls: WorkerClass, args: tuple, kwargs: dict[str, Any]) -> None:
        """Instantiate the worker class (importing a ``"module:Name"`` path here) with its
        identity set before ``__init__``."""
        info = self._require_info()
        self._worker = self._run(
            "__init__", lambda: worker_class(worker_cls).create_with_info(info, args, kwargs))

    def call_packed(self, method: str, payload: tuple[tuple, dict[str, Any]]) -> Any:
        """Run ``worker.method(*args, **kwargs)`` for ``payload = (args, kwargs)``; an
        exception comes back as a WorkerError with rank, host and traceback.

        Arguments that are Ray object refs are fetched here first.
        """
        if self._worker is None:
            raise RuntimeError(f"{self!r}: {method!r} called before the worker was constructed")
        def run_method() -> Any:
            args, kwargs = payload
            args = _fetch_refs(args)
            kwargs = dict(zip(kwargs, _fetch_refs(tuple(kwargs.values()))))
            return getattr(self._worker, method)(*args, **kwargs)

        return self._run(method, run_method)

    def _run(self, method: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - every worker exception goes back whole
            text = _format_without_host_frames(exc)
            info = self._require_info()
            print(f"[megarl] {info.role} rank {info.rank} raised in {method!r}:\n{text}",
                  file=sys.stderr, flush=True)
            host = f"{info.hostname} ({info.node_ip})"
            raise WorkerError(info.role, method, [
                RankFailure(info.rank, host, os.getpid(), text)]) from None

    def _require_info(self) -> WorkerInfo:
        if self._info is None:
            raise RuntimeError(f"{self!r}: setup() must run before the worker is used")
        return self._info


def _fetch_refs(values: tuple) -> list[Any]:
    """``values`` with every Ray object ref replaced by its value."""
    import ray

    refs = [i for i, v in enumerate(values) if isinstance(v, ray.ObjectRef)]
    fetched = list(values)
    for i, value in zip(refs, ray.get([values[i] for i in refs]) if refs else []):
        fetched[i] = value
    return fetched


def _format_without_host_frames(exc: BaseException) -> str:
    """The full traceback text of ``exc``, starting at the worker's own frames."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def read_log_tail(path: str, n: int) -> str:
    """The last ``n`` lines of a log on this node (run as a Ray task on the log's node)."""
    return tail_lines(path, n)


def request_stack_dump(pid: int, log_path: str, phase: str) -> bool:
    """Mark ``log_path`` and make process ``pid`` (on this node) dump its stacks into it.

    Returns False when the process is gone.
    """
    with open(log_path, "a") as log:
        log.write(f"{STACK_DUMP_MARKER} (phase {phase!r} timed out; requested by the driver at "
                  f"{time.ctime()})\n")
    try:
        os.kill(pid, STACK_DUMP_SIGNAL)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def read_stack_dump(log_path: str) -> str:
    """The stacks written after the last dump marker of ``log_path`` (log-echo thread left out)."""
    text = tail_lines(log_path, 400)
    at = text.rfind(STACK_DUMP_MARKER)
    if at >= 0:
        text = text[at:]
    blocks = text.split("\n\n")
    return "\n\n".join(b for b in blocks if "in _echo" not in b)
