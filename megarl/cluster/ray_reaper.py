"""A watchdog that kills the agents of a local Ray instance when its driver dies (issue 28).

A local Ray started by :func:`megarl.cluster.init_ray` shares its driver's fate through the
kernel: the GCS, the raylet and the other head processes get SIGKILL when the driver dies. The
raylet's agents (``ray::DashboardAgent``, ``ray::RuntimeEnvAgent``; Ray 2.x cannot start a raylet
without them) notice at once that their raylet is gone, but then spend 60 s trying to report it
to the dead GCS before they exit, reparented to init. This watchdog, started by the driver next
to the instance, waits until the driver (the other end of its stdin) or the raylet is gone, then
SIGKILLs the raylet's descendants it saw at its start, and exits. It never kills before that.

It runs as a script of its own (``python -P ray_reaper.py RAYLET_PID``): it imports neither
megarl's cluster package nor Ray, so it costs a bare interpreter while it waits.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import psutil

POLL_S = 0.5
"""How often the watchdog looks whether the raylet is still running."""

_REAPERS: list[subprocess.Popen] = []
"""The watchdogs this process started: their stdin pipes must stay open while it lives."""


def start_reaper(raylet_pid: int) -> subprocess.Popen:
    """Start the watchdog that kills the agents of the raylet ``raylet_pid`` when this process
    (or that raylet) dies; it stays in this process's session and group."""
    _REAPERS[:] = [proc for proc in _REAPERS if proc.poll() is None]  # reaps the finished
    proc = subprocess.Popen([sys.executable, "-P", str(Path(__file__).resolve()),
                             str(raylet_pid)], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    _REAPERS.append(proc)
    return proc


def wait_until_gone(raylet: psutil.Process, driver_fd: int, poll_s: float = POLL_S) -> str:
    """Block until the driver closed ``driver_fd``'s other end or ``raylet`` stopped; says which."""
    while True:
        if select.select([driver_fd], [], [], poll_s)[0] and not os.read(driver_fd, 4096):
            return "driver gone"
        try:
            if not raylet.is_running() or raylet.status() == psutil.STATUS_ZOMBIE:
                return "raylet gone"
        except psutil.NoSuchProcess:
            return "raylet gone"


def kill_all(procs: list[psutil.Process]) -> None:
    """SIGKILL each process of ``procs`` still running (not a new one under a reused pid)."""
    for proc in procs:
        try:
            proc.kill()  # psutil checks that the pid was not reused
        except psutil.Error:
            pass


def main(argv: list[str]) -> int:
    """Watch the raylet ``argv[0]`` and the driver on stdin; kill the raylet's descendants."""
    # A terminal's Ctrl-C or hang-up reaches the whole group: outlive the driver it stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        raylet = psutil.Process(int(argv[0]))
        agents = raylet.children(recursive=True)
    except psutil.NoSuchProcess:
        return 0
    wait_until_gone(raylet, sys.stdin.fileno())
    kill_all(agents)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
