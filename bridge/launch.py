"""Run functions on N local processes joined in one ``torch.distributed`` group.

The conversion and verification steps that build a Megatron model run on every rank of a layout.
:class:`LocalRanks` starts the ranks once with ``torch.multiprocessing`` (spawn; gloo on the CPU,
NCCL with one GPU per rank) and runs picklable top-level functions on all of them; after each
call every rank tears down megatron's parallel state, so the next call may use another layout.
The ranks are not daemonic: megatron's checkpoint writer starts helper processes of its own.

A :class:`~bridge.checks.ConversionError` raised on a rank comes back as the same one-line
error; any other failure as a :class:`RankFailure` with the failing ranks' tracebacks.
:func:`spawn_ranks` is the one-shot form the CLI uses; tests keep one :class:`LocalRanks` for the
session and pass ``ranks.runner`` (same signature, :data:`Runner`).
"""

from __future__ import annotations

import atexit
import os
import queue
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any, Self

import torch
import torch.multiprocessing as mp

from bridge.checks import ConversionError

Runner = Callable[..., list]
"""``runner(world_size, fn, *args) -> [fn(*args) on rank 0, ..., on rank world_size - 1]``."""


class RankFailure(RuntimeError):
    """A rank raised an unexpected exception or died; the message holds its traceback."""


def quiet_library_warnings() -> None:
    """Hide the import-time notices of megatron, mbridge, torch and transformers (missing
    Apex/TE fallbacks, deprecations) so that the conversion's own output stays readable."""
    for module in (r"megatron\.", r"mbridge\.", r"torch\.", r"transformers\."):
        warnings.filterwarnings("ignore", module=module)


def choose_backend(world_size: int) -> str:
    """``nccl`` when there is one GPU per rank, ``gloo`` on a machine without GPUs."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus == 0:
        return "gloo"
    if gpus < world_size:
        raise ConversionError(
            f"the layout needs {world_size} ranks but only {gpus} GPUs are visible; lower "
            "--tp/--pp/--ep or make more GPUs visible (CUDA_VISIBLE_DEVICES)"
        )
    return "nccl"


def _rank_main(rank: int, world_size: int, port: int, backend: str, tasks: Any,
               results: Any) -> None:
    """A rank's loop: join the group (through the parent's store at ``port``), then run tasks
    until told to stop or orphaned."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    import torch.distributed as dist

    quiet_library_warnings()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    if backend == "nccl":
        torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
    parent = os.getppid()
    while os.getppid() == parent:
        try:
            task = tasks.get(timeout=5)
        except queue.Empty:
            continue
        if task is None:
            break
        fn, args = task
        try:
            results.put((rank, "ok", fn(*args)))
        except ConversionError as err:
            results.put((rank, "input", str(err)))
        except BaseException:  # noqa: BLE001 - the traceback goes back to the parent
            results.put((rank, "crash", traceback.format_exc()))
        finally:
            _reset_megatron()
    # no dist.destroy_process_group(): megatron's destroy leaves its subgroups to the process,
    # and destroying them all at the end cost ~10 ms each (895 groups, 9 s, after the conversion
    # tests' layouts); the exit below frees them with the process
    results.close()
    results.join_thread()  # every result is in the pipe
    _exit_without_teardown()


def _exit_without_teardown() -> None:
    """End the rank as a normal exit would (atexit handlers: child processes joined, streams
    flushed) but skip the interpreter's teardown of torch and megatron's modules, which takes
    seconds per rank (12 s on a loaded 2-core machine) and that every caller waited for."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _reset_megatron() -> None:
    """Tear down megatron's parallel state (if a task built one) so the next task may use
    another layout."""
    if "megatron.core.parallel_state" in sys.modules:
        from megarl.megatron.parallel import destroy_parallel

        destroy_parallel()


class LocalRanks:
    """``world_size`` local ranks in one process group that run functions on request."""

    def __init__(self, world_size: int) -> None:
        backend = choose_backend(world_size)
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        # the group's store listens in this process on a port the OS picked as it bound it: a
        # port chosen free and bound later by rank 0 was once taken in between (EADDRINUSE)
        import torch.distributed as dist

        self._store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True,
                                    wait_for_workers=False)
        port = self._store.port
        self._procs = [
            ctx.Process(target=_rank_main,
                        args=(r, world_size, port, backend, self._tasks[r], self._results))
            for r in range(world_size)
        ]
        for proc in self._procs:
            proc.start()
        self.alive = True

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run(self, fn: Callable, *args: Any, timeout: float = 24 * 3600) -> list:
        """``fn(*args)`` on every rank; the results by rank."""
        if not self.alive:
            raise RuntimeError("LocalRanks: closed after an earlier failure; start new ranks")
        for tasks in self._tasks:
            tasks.put((fn, args))
        outcomes = self._collect(timeout)
        if any(kind == "crash" for kind, _ in outcomes.values()):
            self.close()  # a rank died or is stuck in a collective: these ranks are spent
        return _unpack(outcomes, self.world_size)

    def runner(self, world_size: int, fn: Callable, *args: Any) -> list:
        """:data:`Runner` over these ranks (``world_size`` must equal theirs)."""
        if world_size != self.world_size:
            raise ValueError(f"the layout needs {world_size} ranks; these are {self.world_size}")
        return self.run(fn, *args)

    def _collect(self, timeout: float) -> dict[int, tuple[str, Any]]:
        """Every rank's outcome; stop waiting 30 s after the first failure."""
        outcomes: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + timeout
        while len(outcomes) < self.world_size:
            try:
                rank, kind, value = self._results.get(timeout=1.0)
                outcomes[rank] = (kind, value)
                if kind != "ok":  # the others may wait forever in a collective
                    deadline = min(deadline, time.monotonic() + 30)
                continue
            except queue.Empty:
                pass
            dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
            if dead or time.monotonic() > deadline:
                for r, proc in enumerate(self._procs):
                    if r not in outcomes:
                        outcomes[r] = ("crash", f"rank {r} died (exit code {proc.exitcode})"
                                       if r in dead else f"rank {r} did not finish in time")
        return outcomes

    def close(self) -> None:
        """Stop the ranks (terminating any that do not exit within 30 s)."""
        if not self.alive:
            return
        self.alive = False
        for tasks in self._tasks:
            tasks.put(None)
        for proc in self._procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.terminate()
                proc.join()


def _unpack(outcomes: dict[int, tuple[str, Any]], world_size: int) -> list:
    """Results by rank, or the first input error, or a RankFailure with the tracebacks."""
    for rank in range(world_size):
        kind, value = outcomes[rank]
        if kind == "input":
            raise ConversionError(value)
    crashes = {r: v for r, (kind, v) in outcomes.items() if kind == "crash"}
    if crashes:
        detail = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(crashes.items()))
        raise RankFailure(f"ranks {sorted(crashes)} failed:\n{detail}")
    return [outcomes[r][1] for r in range(world_size)]


def spawn_ranks(world_size: int, fn: Callable, *args: Any) -> list:
    """``fn(*args)`` on ``world_size`` fresh local ranks; the results by rank."""
    with LocalRanks(world_size) as ranks:
        return ranks.run(fn, *args)
