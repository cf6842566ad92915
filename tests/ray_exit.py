"""A pytest plugin: end the test process without the interpreter's finalization when Ray's
driver threads outlive ray.shutdown().

The test process connects to Ray several times (a private local Ray per test module that drives
a Trainer in-process). After ray.shutdown() the driver's GCS client io thread and gRPC's pollers
stay alive, and the interpreter's finalization can crash under them: CI of 7f17ace passed every
test, then printed ``Segmentation fault`` (Ray's issue #31145 reports the same after restarts in
one process). With such threads alive the process ends in ``pytest_unconfigure``, after the
results are reported and the exit handlers (``atexit``) have run, with pytest's exit status.
"""

from __future__ import annotations

import atexit
import os
import sys
from pathlib import Path

import pytest

# The native threads a Ray driver leaves behind (OS thread names, /proc/self/task/*/comm).
RAY_LEFTOVER_THREADS = ("gcs_client_io", "grpc_global_tim", "event_engine", "timer_manager")

_SESSION = pytest.StashKey[pytest.Session]()


def ray_leftover_threads() -> list[str]:
    """Names of the live OS threads of this process that Ray's driver left behind."""
    names = []
    for task in Path("/proc/self/task").glob("*/comm"):
        try:
            name = task.read_text().strip()
        except OSError:  # the thread ended meanwhile
            continue
        if name.startswith(RAY_LEFTOVER_THREADS):
            names.append(name)
    return names


def pytest_sessionfinish(session: pytest.Session) -> None:
    session.config.stash[_SESSION] = session


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    session = config.stash.get(_SESSION, None)
    threads = ray_leftover_threads()
    if session is None or not threads:
        return
    status = int(session.exitstatus)
    print(f"ray_exit: Ray's driver threads are alive ({', '.join(sorted(set(threads)))}): "
          f"exit {status} without the interpreter's finalization", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
