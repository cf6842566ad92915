"""Run untrusted Python code in a sandbox: a separate process with time and memory limits, no
network, a private temporary directory, and the whole process group killed on timeout.

The child is started in a new session (its own process group) with ``RLIMIT_AS`` (memory),
``RLIMIT_CPU`` (CPU seconds) and ``RLIMIT_FSIZE`` (file size); it is moved into an empty network
namespace when the kernel lets an unprivileged process do so (``unshare(CLONE_NEWUSER |
CLONE_NEWNET)``) and, in any case, its Python refuses to create sockets before the code runs.
The wall-clock limit kills the process group with SIGKILL; the temporary directory it ran in is
removed afterwards, whatever happened.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

_CLONE_NEWUSER, _CLONE_NEWNET = 0x10000000, 0x40000000
TEMP_PREFIX = "megarl-sandbox-"

# Runs before the user's code in the child: no sockets from Python, whatever the namespace.
_PRELUDE = """
import socket as _s, sys as _sys
def _no_network(*a, **k):
    raise PermissionError("network access is disabled in the sandbox")
_s.socket = _s.create_connection = _s.socketpair = _no_network
del _s
_src = _sys.stdin.read()
exec(compile(_src, "<tool>", "exec"), {"__name__": "__main__"})
"""


@dataclass(frozen=True)
class SandboxResult:
    """What one sandboxed run produced."""

    stdout: str
    stderr: str
    returncode: int | None
    """The exit status; None when the run was killed at the wall-clock limit."""
    timed_out: bool
    seconds: float


def _limit_child(memory_bytes: int, cpu_seconds: int, file_bytes: int) -> None:
    """In the child, before exec: resource limits and, where allowed, no network."""
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds))
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_bytes, file_bytes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    with contextlib.suppress(Exception):  # unprivileged user namespaces may be off
        ctypes.CDLL(None, use_errno=True).unshare(_CLONE_NEWUSER | _CLONE_NEWNET)


def run_python(code: str, *, timeout_s: float = 5.0, memory_mb: int = 256,
               max_output_chars: int = 4096, file_mb: int = 16) -> SandboxResult:
    """Run ``code`` with a fresh interpreter in the sandbox (blocking); output is truncated to
    ``max_output_chars`` per stream."""
    workdir = tempfile.mkdtemp(prefix=TEMP_PREFIX)
    start = time.monotonic()
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": workdir, "TMPDIR": workdir,
           "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1"}
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _PRELUDE], cwd=workdir, env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True, close_fds=True,
            preexec_fn=lambda: _limit_child(memory_mb << 20, max(1, int(timeout_s + 1)),
                                            file_mb << 20))
        timed_out = False
        try:
            out, err = proc.communicate(code.encode(), timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc.pid)
            out, err = proc.communicate()
        finally:
            _kill_group(proc.pid)  # children the code left running in its group
        return SandboxResult(
            stdout=out.decode(errors="replace")[:max_output_chars],
            stderr=err.decode(errors="replace")[-max_output_chars:],
            returncode=None if timed_out else proc.returncode, timed_out=timed_out,
            seconds=time.monotonic() - start)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
