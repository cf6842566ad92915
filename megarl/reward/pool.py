"""A process pool that gives every task a deadline and replaces workers that hang.

Tasks are dispatched at most one per worker at a time, so a task starts when it is submitted and
its deadline is simply ``submit time + timeout``. Two mechanisms enforce it:

- soft: inside the worker a timer thread sends ``SIGUSR1`` to the worker's main thread when the
  time is up; the handler raises an exception that unwinds the task (this interrupts sleeps,
  Python loops and blocking I/O, and leaves the worker usable);
- hard: if a task outlives its deadline by :data:`HARD_DEADLINE_GRACE_S` (its code blocks the
  signal, swallows the exception, or is stuck in C code), the driver kills every worker, starts a
  fresh pool and re-submits the other tasks that were running (they run again from the start,
  so a task with side effects may see them twice).

Either way the task's result is :data:`TIMED_OUT`. Workers are started with the ``spawn`` method
and the pool waits until all of them have run their initializer before the first deadline counts.
Workers die with the driver (:mod:`megarl.children`), even when it is SIGKILLed.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from megarl.children import die_with_parent, in_spawner_thread

HARD_DEADLINE_GRACE_S = 1.0
_SOFT_TIMEOUT_SIGNAL = signal.SIGUSR1
_OK, _SOFT_TIMED_OUT = "ok", "timed_out"


class _TimedOut:
    """Type of :data:`TIMED_OUT`."""

    def __repr__(self) -> str:
        return "TIMED_OUT"


TIMED_OUT = _TimedOut()


class WorkerCrashed(RuntimeError):
    """A worker process died on its own while running some of the tasks in ``task_indices``."""

    def __init__(self, task_indices: list[int]) -> None:
        super().__init__(f"a worker process died while running one of tasks {task_indices}")
        self.task_indices = task_indices


class _SoftTimeout(BaseException):
    """Raised inside a worker's task when its time is up (BaseException: `except Exception`
    in the task's own code does not swallow it)."""


_worker_armed = False
_worker_barrier: Any = None
_worker_init_error: str | None = None


def _on_soft_timeout(signum: int, frame: Any) -> None:
    if _worker_armed:
        raise _SoftTimeout()


def _init_worker(barrier: Any, parent_pid: int, initializer: Callable[..., None] | None,
                 initargs: tuple) -> None:
    global _worker_barrier, _worker_init_error
    die_with_parent(parent_pid)
    _worker_barrier = barrier
    signal.signal(_SOFT_TIMEOUT_SIGNAL, _on_soft_timeout)
    if initializer is not None:
        try:
            initializer(*initargs)
        except BaseException:  # noqa: BLE001 - reported to the driver by _wait_ready
            _worker_init_error = traceback.format_exc()


def _wait_ready(timeout_s: float) -> tuple[int, str | None]:
    """Block until every worker has initialised; return this worker's pid and init error."""
    _worker_barrier.wait(timeout_s)
    return os.getpid(), _worker_init_error


def _run_task(fn: Callable[..., Any], args: tuple, timeout_s: float) -> tuple[str, Any]:
    """Run ``fn(*args)`` in a worker under the soft timeout."""
    global _worker_armed
    main_thread = threading.main_thread().ident
    timer = threading.Timer(timeout_s, signal.pthread_kill, (main_thread, _SOFT_TIMEOUT_SIGNAL))
    timer.daemon = True
    try:
        _worker_armed = True
        timer.start()
        try:
            return _OK, fn(*args)
        finally:
            _worker_armed = False
            timer.cancel()
    except _SoftTimeout:
        return _SOFT_TIMED_OUT, None


class TimedProcessPool:
    """``num_workers`` spawned processes running tasks with a per-task timeout."""

    def __init__(
        self,
        num_workers: int,
        initializer: Callable[..., None] | None = None,
        initargs: tuple = (),
        start_timeout_s: float = 300.0,
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.num_workers = num_workers
        self.restarts = 0
        self._initializer = initializer
        self._initargs = initargs
        self._start_timeout_s = start_timeout_s
        self._executor: ProcessPoolExecutor | None = None
        self._pids: list[int] = []

    def run(
        self, fn: Callable[..., Any], tasks: Sequence[tuple], timeouts_s: Sequence[float]
    ) -> list[Any]:
        """``[fn(*task) for task in tasks]`` in the workers; a task over its timeout gives
        :data:`TIMED_OUT`. Raises :class:`WorkerCrashed` if a worker dies on its own, and
        re-raises an exception raised by ``fn``; the pool stays usable afterwards."""
        if len(timeouts_s) != len(tasks):
            raise ValueError(f"{len(tasks)} tasks but {len(timeouts_s)} timeouts")
        results: list[Any] = [None] * len(tasks)
        queue = deque(range(len(tasks)))
        inflight: dict[Future, tuple[int, float]] = {}
        try:
            while queue or inflight:
                self._submit(fn, tasks, timeouts_s, queue, inflight)
                nearest = min(deadline for _, deadline in inflight.values())
                wait(inflight, max(0.0, nearest - time.monotonic()), FIRST_COMPLETED)
                self._collect(results, inflight)
                self._expire(results, queue, inflight)
        except BaseException:
            self._stop()
            raise
        return results

    def close(self) -> None:
        """Stop the workers; a later :meth:`run` starts new ones."""
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None
            self._pids = []

    def _submit(
        self,
        fn: Callable[..., Any],
        tasks: Sequence[tuple],
        timeouts_s: Sequence[float],
        queue: deque[int],
        inflight: dict[Future, tuple[int, float]],
    ) -> None:
        executor = self._running_executor()
        while queue and len(inflight) < self.num_workers:
            index = queue.popleft()
            future = executor.submit(_run_task, fn, tasks[index], timeouts_s[index])
            deadline = time.monotonic() + timeouts_s[index] + HARD_DEADLINE_GRACE_S
            inflight[future] = (index, deadline)

    def _collect(self, results: list[Any], inflight: dict[Future, tuple[int, float]]) -> None:
        for future in [f for f in inflight if f.done()]:
            index, _ = inflight.pop(future)
            try:
                status, value = future.result()
            except BrokenProcessPool as exc:
                crashed = sorted([index, *(i for i, _ in inflight.values())])
                raise WorkerCrashed(crashed) from exc
            results[index] = value if status == _OK else TIMED_OUT

    def _expire(
        self, results: list[Any], queue: deque[int], inflight: dict[Future, tuple[int, float]]
    ) -> None:
        now = time.monotonic()
        expired = [future for future, (_, deadline) in inflight.items() if deadline <= now]
        if not expired:
            return
        for future in expired:
            results[inflight.pop(future)[0]] = TIMED_OUT
        queue.extendleft(sorted((index for index, _ in inflight.values()), reverse=True))
        inflight.clear()
        self._stop()
        self.restarts += 1

    def _running_executor(self) -> ProcessPoolExecutor:
        if self._executor is None:
            self._start()
        assert self._executor is not None
        return self._executor

    def _launch(self) -> tuple[ProcessPoolExecutor, list[Future]]:
        """The executor and one ping per worker (submitting them starts the workers)."""
        context = multiprocessing.get_context("spawn")
        barrier = context.Barrier(self.num_workers)
        executor = ProcessPoolExecutor(
            self.num_workers, mp_context=context, initializer=_init_worker,
            initargs=(barrier, os.getpid(), self._initializer, self._initargs),
        )
        return executor, [executor.submit(_wait_ready, self._start_timeout_s)
                          for _ in range(self.num_workers)]

    def _start(self) -> None:
        # Forked from the spawner thread: a worker's parent-death signal follows that thread.
        self._executor, pings = in_spawner_thread(self._launch)
        try:
            ready = [ping.result(timeout=self._start_timeout_s + 5.0) for ping in pings]
        except BrokenProcessPool as exc:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
            raise RuntimeError(
                "worker processes exited while starting (their error is printed above); with "
                "the spawn start method, a script that starts them must keep its top-level code "
                "under `if __name__ == '__main__':`"
            ) from exc
        except BaseException as exc:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
            raise RuntimeError(
                f"{self.num_workers} worker processes did not start within "
                f"{self._start_timeout_s:.0f} s: {type(exc).__name__}: {exc}"
            ) from exc
        self._pids = [pid for pid, _ in ready]
        errors = [error for _, error in ready if error]
        if errors:
            self._stop()
            raise RuntimeError(f"a worker process failed to initialise:\n{errors[0]}")

    def _stop(self) -> None:
        """Kill the workers at once (they may be hung) and drop the executor."""
        if self._executor is None:
            return
        for pid in self._pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._executor.shutdown(wait=True, cancel_futures=True)
        self._executor = None
        self._pids = []
