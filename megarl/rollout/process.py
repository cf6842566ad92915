"""Server processes of the rollout pool: start, wait for health, stop, restart on death.

:class:`ManagedServer` owns one server process (SGLang, the SGLang router, or megarl's embedded
engine) started in its own session so that stopping it stops its children too, and killed by
the kernel when the process that started it dies (:func:`megarl.children.popen`); a server that
requires an API key gets it through ``env`` (never the command line, which other users of the
machine can read) and its health probes send it.
:class:`ServerSupervisor` watches a set of them from a thread and restarts one that died (up to
``max_restarts``), then calls ``on_restart(index)`` so the owner can push the current weights to
the fresh engine (it starts with the weights on disk).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import httpx

from megarl.children import popen
from megarl.net import free_port  # noqa: F401 - where launchers and tests import it

logger = logging.getLogger(__name__)


class ServerStartError(RuntimeError):
    """A server exited or did not become healthy in time."""


class ManagedServer:
    """One server process with a health URL."""

    def __init__(self, argv: Sequence[str], url: str, *, name: str = "server",
                 env: dict[str, str] | None = None, log_path: str | Path | None = None,
                 health_path: str = "/health", api_key: str | None = None) -> None:
        self.argv = list(argv)
        self.url = url.rstrip("/")
        self.name = name
        self.env = env
        self.log_path = Path(log_path) if log_path else None
        self.health_path = health_path
        self.restarts = 0
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        self.process: subprocess.Popen | None = None
        self._log_file = None

    def start(self) -> None:
        """Start the process (output goes to ``log_path``, or is discarded)."""
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log_file = open(self.log_path, "ab")  # noqa: SIM115  (closed by stop())
        sink = self._log_file or subprocess.DEVNULL
        env = {**os.environ, **self.env} if self.env else None
        # its own process group (stop() signals the group: SGLang's schedulers too), in the
        # caller's session: a session of its own is a scheduling group of its own under the
        # kernel's autogroup, and next to busy processes a runnable engine got ~4% of a core.
        # No terminal input: a background group of a terminal's session that read it would stop
        self.process = popen(self.argv, stdin=subprocess.DEVNULL, stdout=sink,
                             stderr=subprocess.STDOUT, env=env, process_group=0)

    @property
    def alive(self) -> bool:
        """Whether the process is running."""
        return self.process is not None and self.process.poll() is None

    def healthy(self, timeout_s: float = 2.0) -> bool:
        """Whether the health URL answers 200."""
        try:
            response = httpx.get(self.url + self.health_path, timeout=timeout_s,
                                 headers=self._headers, trust_env=False)  # no env proxy (M5)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    def wait_ready(self, timeout_s: float = 600.0, poll_s: float = 0.25) -> None:
        """Block until healthy; raise :class:`ServerStartError` (with the log tail) if the
        process exits or the timeout passes."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive:
                code = self.process.returncode if self.process else None
                raise ServerStartError(f"{self.name} ({self.url}) exited with code {code} "
                                       f"while starting; last log lines:\n{self.log_tail()}")
            if self.healthy():
                return
            time.sleep(poll_s)
        raise ServerStartError(f"{self.name} ({self.url}) not healthy after {timeout_s:.0f} s; "
                               f"last log lines:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        """The last lines of the server log (empty without a log file)."""
        if self.log_path is None or not self.log_path.exists():
            return "(no log file; pass log_path to keep the server output)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM the server's process group, then SIGKILL it after ``timeout_s``; children
        that outlived a server killed from outside (SGLang's scheduler processes) are killed
        too."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.process.wait(timeout_s)
        self._signal(signal.SIGKILL)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def _signal(self, sig: signal.Signals) -> None:
        assert self.process is not None
        try:
            os.killpg(self.process.pid, sig)
        except ProcessLookupError:
            pass

    def restart(self, stop_timeout_s: float = 15.0) -> None:
        """Stop (if needed; SIGKILL after ``stop_timeout_s``) and start again."""
        self.stop(stop_timeout_s)
        self.restarts += 1
        self.start()


class ServerSupervisor:
    """Restarts servers that die, from a background thread."""

    def __init__(self, servers: Sequence[ManagedServer], *, max_restarts: int = 3,
                 poll_s: float = 2.0, ready_timeout_s: float = 600.0,
                 on_restart: Callable[[int], None] | None = None) -> None:
        self.servers = list(servers)
        self.max_restarts = max_restarts
        self.poll_s = poll_s
        self.ready_timeout_s = ready_timeout_s
        self.on_restart = on_restart
        self.failed: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="megarl-supervisor",
                                        daemon=True)

    def start(self) -> None:
        """Start watching."""
        self._thread.start()

    def stop(self) -> None:
        """Stop watching (servers keep running; stop them separately)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            for index, server in enumerate(self.servers):
                if server.alive or index in self.failed or self._stop.is_set():
                    continue
                self._revive(index, server)

    def _revive(self, index: int, server: ManagedServer) -> None:
        code = server.process.returncode if server.process else None
        if server.restarts >= self.max_restarts:
            self.failed[index] = (f"{server.name} died (exit code {code}) after "
                                  f"{server.restarts} restarts; last log lines:\n"
                                  f"{server.log_tail()}")
            logger.error(self.failed[index])
            return
        logger.warning("%s died (exit code %s); restarting", server.name, code)
        server.restart()
        try:
            server.wait_ready(self.ready_timeout_s)
        except ServerStartError as err:
            logger.error("restart of %s failed: %s", server.name, err)
            return
        if self.on_restart is not None:
            self.on_restart(index)


def stop_all(servers: Sequence[ManagedServer]) -> None:
    """Stop every server."""
    for server in servers:
        server.stop()


def start_all(servers: Sequence[ManagedServer], ready_timeout_s: float) -> list[ManagedServer]:
    """Start every server, then wait until each is healthy; on any failure stop them all."""
    for server in servers:
        server.start()
    try:
        for server in servers:
            server.wait_ready(ready_timeout_s)
    except BaseException:
        stop_all(servers)
        raise
    return list(servers)
