"""Child processes that die with the process that started them (Linux ``PR_SET_PDEATHSIG``).

A SIGKILLed driver runs no cleanup, so each child asks the kernel for SIGKILL when its parent
dies: :func:`popen` does it for commands (in a ``preexec_fn``), :func:`die_with_parent` at the
start of a ``multiprocessing`` worker. The kernel sends the signal when the *thread* that forked
the child exits, not the process, so :func:`popen` and :func:`in_spawner_thread` fork from one
daemon thread that lives as long as the process. Where ``prctl`` is unavailable (not Linux, no
libc) the children are started as before, and nothing is said.
"""

from __future__ import annotations

import ctypes
import functools
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

PR_SET_PDEATHSIG = 1
"""``prctl`` option: the signal the calling process gets when its parent thread exits."""

T = TypeVar("T")


def _load_prctl() -> Callable[..., int] | None:
    """libc's ``prctl`` on Linux; None elsewhere or when it cannot be loaded."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _load_prctl()


def die_with_parent(parent_pid: int | None = None) -> bool:
    """In a child: be SIGKILLed when the parent dies; False where that cannot be arranged.

    ``parent_pid`` closes the race of a parent that died before the request: the child then
    kills itself at once.
    """
    if _PRCTL is None or _PRCTL(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        return False
    if parent_pid is not None and os.getppid() != parent_pid:
        os.kill(os.getpid(), signal.SIGKILL)
    return True


class _Spawner:
    """One daemon thread that runs the calls which fork children, for the process's lifetime."""

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` run on the spawner thread; its result or exception."""
        if threading.current_thread() is self._thread:
            return fn(*args, **kwargs)
        with self._lock:
            if self._thread is None or not self._thread.is_alive():  # also after a fork
                self._calls = queue.SimpleQueue()
                self._thread = threading.Thread(target=self._serve, args=(self._calls,),
                                                name="megarl-spawner", daemon=True)
                self._thread.start()
            future: Future = Future()
            self._calls.put((future, fn, args, kwargs))
        return future.result()

    @staticmethod
    def _serve(calls: queue.SimpleQueue) -> None:
        while True:
            future, fn, args, kwargs = calls.get()
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as err:  # noqa: BLE001 - handed to the caller
                future.set_exception(err)


_SPAWNER = _Spawner()


def in_spawner_thread(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run code that forks children (a process pool's first submits) on the spawner thread."""
    return _SPAWNER.call(fn, *args, **kwargs)


def popen(argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
    """``subprocess.Popen(argv, **kwargs)`` whose process is SIGKILLed when this one dies."""
    if _PRCTL is None:
        return subprocess.Popen(argv, **kwargs)
    preexec = functools.partial(die_with_parent, os.getpid())
    return _SPAWNER.call(subprocess.Popen, list(argv), preexec_fn=preexec, **kwargs)
