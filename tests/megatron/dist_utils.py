"""Run a function on N real processes joined in a process group on 127.0.0.1; collect results.

``RankPool(n)`` starts n processes once and runs picklable top-level functions on all of them: ``pool.run(fn, *args)``
returns ``[fn(*args) on rank 0, ..., on rank n-1]`` or raises with the failing ranks'
tracebacks. After every call each worker tears down megatron's parallel state, so the next call
can build another layout. A call that times out kills the pool (a rank may be stuck in a
collective); :func:`run_on_ranks` is the one-shot form.

Gloo ranks are forked from a fork server that imported torch, megatron-core and megarl's
megatron engine once per test session (:data:`PRELOAD`), so a new pool costs a fork, not the
seconds of those imports per rank. Each rank takes the environment and working directory its
creator has when it starts the pool, as a spawned process would. On a machine with CUDA the
ranks are spawned (CUDA must not be initialised in a forked process).
"""

from __future__ import annotations

import gc
import os
import queue
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

PRELOAD = ["torch", "torch.distributed", "megatron.core", "transformers",
           "megarl.megatron.model", "megarl.megatron.update", "megarl.megatron.logprobs",
           "megarl.megatron.checkpoint", "megarl.megatron.critic", "megarl.megatron.parallel",
           "megarl.data.tiny_model"]
"""Modules the fork server of gloo ranks imports once (a module missing here is imported by the
rank that needs it, as before)."""


def _context(backend: str):
    import torch

    if backend != "gloo" or torch.cuda.is_available():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # takes effect when the session's server starts
    return ctx


def _worker(rank: int, world_size: int, port: int, backend: str, tasks, results,
            env: dict[str, str], cwd: str) -> None:
    # the fork server's environment is the one of the first pool; this pool's creator's counts
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        OMP_NUM_THREADS="1",
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            results.put((rank, True, fn(*args, **kwargs)))
        except BaseException:  # noqa: BLE001 - the traceback goes back to the test
            results.put((rank, False, traceback.format_exc()))
        finally:
            _reset_megatron()
            # a worker built by the task set its objects aside (settle_long_lived_objects):
            # hand them back, so the next tasks' collections free this one's cycles
            gc.unfreeze()
    # no dist.destroy_process_group(): every layout's subgroups are still there (megatron's
    # destroy drops only its references) and destroying hundreds costs ~10 ms each; the exit
    # below frees them with the process
    results.close()
    results.join_thread()  # every result is in the pipe
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skips the interpreter's teardown of torch and megatron: seconds per rank


def _reset_megatron() -> None:
    if "megatron.core" not in sys.modules:
        return  # nothing to tear down; importing megatron-core here would cost seconds
    from megarl.megatron.parallel import destroy_parallel

    destroy_parallel()


class RankPool:
    """A persistent group of ``world_size`` ranks (gloo, or nccl one GPU per rank) that runs
    functions on every rank."""

    def __init__(self, world_size: int, backend: str = "gloo") -> None:
        ctx = _context(backend)
        self.world_size = world_size
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        # the group's store listens here, on a port the OS picked as it bound it (a port chosen
        # free and bound later by rank 0 can be taken in between: EADDRINUSE, a dead rank)
        import torch.distributed as dist

        self._store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True,
                                    wait_for_workers=False)
        port = self._store.port
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(rank, world_size, port, backend, self._tasks[rank], self._results,
                      dict(os.environ), os.getcwd()),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for p in self._procs:
            p.start()
        self.alive = True

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 300, **kwargs: Any):
        """``fn(*args, **kwargs)`` on every rank; the list of return values by rank."""
        if not self.alive:
            raise RuntimeError("RankPool was closed (an earlier call failed or timed out)")
        for q in self._tasks:
            q.put((fn, args, kwargs))
        outcomes: dict[int, tuple[bool, Any]] = {}
        deadline = time.monotonic() + timeout
        while len(outcomes) < self.world_size:
            if any(not ok for ok, _ in outcomes.values()):
                # once a rank failed, the others may wait forever in a collective
                deadline = min(deadline, time.monotonic() + 30)
            try:
                rank, ok, value = self._results.get(timeout=1.0)
                outcomes[rank] = (ok, value)
                continue
            except queue.Empty:
                pass
            dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
            if dead or time.monotonic() > deadline:
                self.close()
                detail = "\n".join(tb for ok, tb in outcomes.values() if not ok)
                missing = sorted(set(range(self.world_size)) - set(outcomes))
                why = f"ranks {dead} died" if dead else f"ranks {missing} did not finish"
                raise RuntimeError(f"{fn.__name__}: {why} (timeout {timeout}s)\n{detail}")
        failures = {r: v for r, (ok, v) in outcomes.items() if not ok}
        if failures:
            detail = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items()))
            raise RuntimeError(f"{fn.__name__} failed on ranks {sorted(failures)}:\n{detail}")
        return [outcomes[r][1] for r in range(self.world_size)]

    def close(self) -> None:
        """Stop the workers (terminating any that do not exit)."""
        if not self.alive:
            return
        self.alive = False
        for q in self._tasks:
            q.put(None)
        for p in self._procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                p.join()


def run_on_ranks(world_size: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list:
    """Spawn ``world_size`` gloo ranks, run ``fn`` on each, return the results by rank."""
    pool = RankPool(world_size)
    try:
        return pool.run(fn, *args, **kwargs)
    finally:
        pool.close()
