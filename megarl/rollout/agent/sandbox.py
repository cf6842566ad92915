"""Run untrusted Python code in a sandbox: a separate process with time and memory limits, no
network, a private temporary directory, and the whole process group killed on timeout.

The child is a fresh interpreter started in a new session (its own process group); before the
code runs it sets ``RLIMIT_AS`` (memory), ``RLIMIT_CPU`` (CPU seconds) and ``RLIMIT_FSIZE``
(file size), moves into an empty network namespace when the kernel lets an unprivileged process
do so (``unshare(CLONE_NEWUSER | CLONE_NEWNET)``) and, in any case, makes Python refuse to
create sockets.
The wall-clock limit kills the process group with SIGKILL; the temporary directory it ran in is
removed afterwards, whatever happened.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

_CLONE_NEWUSER, _CLONE_NEWNET = 0x10000000, 0x40000000
TEMP_PREFIX = "megarl-sandbox-"

# Runs in the fresh child interpreter before the user's code (not as a preexec_fn, which is
# unsafe in a process with threads): resource limits, an empty network namespace where the
# kernel allows it, and no sockets from Python whatever the namespace.
_PRELUDE = """
import ctypes as _c, resource as _r, socket as _s, sys as _sys
for _k, _v in ((_r.RLIMIT_AS, {memory}), (_r.RLIMIT_CPU, {cpu}), (_r.RLIMIT_FSIZE, {fsize}),
               (_r.RLIMIT_CORE, 0)):
    _r.setrlimit(_k, (_v, _v))
try:
    _c.CDLL(None, use_errno=True).unshare({flags})
except Exception:
    pass
def _no_network(*a, **k):
    raise PermissionError("network access is disabled in the sandbox")
_s.socket = _s.create_connection = _s.socketpair = _no_network
_src = _sys.stdin.read()
del _c, _r, _s, _k, _v
exec(compile(_src, "<tool>", "exec"), {{"__name__": "__main__"}})
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


def run_python(code: str, *, timeout_s: float = 5.0, memory_mb: int = 256,
               max_output_chars: int = 4096, file_mb: int = 16) -> SandboxResult:
    """Run ``code`` with a fresh interpreter in the sandbox (blocking); output is truncated to
    ``max_output_chars`` per stream."""
    workdir = tempfile.mkdtemp(prefix=TEMP_PREFIX)
    start = time.monotonic()
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": workdir, "TMPDIR": workdir,
           "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1"}
    prelude = _PRELUDE.format(memory=memory_mb << 20, cpu=max(1, int(timeout_s + 1)),
                              fsize=file_mb << 20, flags=_CLONE_NEWUSER | _CLONE_NEWNET)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", prelude], cwd=workdir, env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True, close_fds=True)
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
