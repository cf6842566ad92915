"""Paths and environments shared by the launcher tests."""

from __future__ import annotations

import os
import random
import socket
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
PROBE = Path(__file__).with_name("ray_probe.py")


def ray_port_env() -> dict[str, str]:
    """Free ports for every port the launch scripts give Ray (other Rays may run on this host)."""
    names = ("RAY_PORT", "RAY_NODE_MANAGER_PORT", "RAY_OBJECT_MANAGER_PORT",
             "RAY_RUNTIME_ENV_AGENT_PORT", "RAY_DASHBOARD_AGENT_GRPC_PORT",
             "RAY_METRICS_EXPORT_PORT", "RAY_DASHBOARD_AGENT_LISTEN_PORT",
             "RAY_CLIENT_SERVER_PORT")
    # Below the kernel's ephemeral range (32768+): a free port taken from that range can be
    # handed out as the source port of an outgoing connection (Ray opens many on loopback)
    # before Ray binds it; a CI run failed so ("Address already in use" for the client server).
    first = worker_port_range()
    workers = range(first, first + WORKER_PORTS)
    chosen: list[int] = []
    for _ in range(1000):
        port = random.randrange(20000, 32000)
        if port not in workers and port not in chosen and _bindable(port):
            chosen.append(port)
            if len(chosen) == len(names):
                break
    else:
        raise RuntimeError("no free ports for Ray in 20000-32000")
    env = {name: str(port) for name, port in zip(names, chosen)}
    env.update(RAY_MIN_WORKER_PORT=str(first), RAY_MAX_WORKER_PORT=str(first + WORKER_PORTS - 1))
    return env


WORKER_PORTS = 100


def _bindable(port: int) -> bool:
    """Nothing holds ``port`` on any address (loopback included)."""
    for host in ("", "127.0.0.1"):
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                return False
    return True


def worker_port_range() -> int:
    """The first of WORKER_PORTS free ports in 20000-30000, below the ephemeral range."""
    for _ in range(50):
        first = random.randrange(20000, 30000 - WORKER_PORTS)
        if all(_bindable(port) for port in range(first, first + WORKER_PORTS)):
            return first
    raise RuntimeError("no block of free ports for Ray workers in 20000-30000")


def job_env(**extra: str) -> dict[str, str]:
    """The environment a user would submit with: the venv on PATH, one thread per process."""
    env = dict(os.environ, PATH=f"{VENV_BIN}:{os.environ.get('PATH', '')}", OMP_NUM_THREADS="1",
               RAY_USAGE_STATS_ENABLED="0")
    env.update(extra)
    return env


def processes_mentioning(text: str) -> list[str]:
    """Command lines of live processes that contain ``text``."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if text in cmdline:
            found.append(f"{proc.name}: {cmdline[:200]}")
    return found
