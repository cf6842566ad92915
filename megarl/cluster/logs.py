"""Per-worker log files (PITFALLS T6): a worker's stdout and stderr go to its own file.

:func:`redirect_output` points file descriptors 1 and 2 of the worker process at
``<log_dir>/<role>_rank<r>.log``, so everything the process writes, Python or native code, lands
there and survives ``os._exit`` or a crash. A background thread copies new lines to the original
stdout, so Ray still streams them to the driver's console. ``SIGUSR1`` makes the process dump
every thread's stack into the same file (used when a call times out), and a fatal signal does the
same through :mod:`faulthandler`.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
import time
from pathlib import Path

STACK_DUMP_SIGNAL = signal.SIGUSR1
"""The signal that makes a worker write all thread stacks into its log."""

_ECHO_INTERVAL_S = 0.25


def redirect_output(path: str | Path, *, echo: bool = True, prefix: str = "") -> Path:
    """Send this process's stdout/stderr (fd 1 and 2) to ``path``; optionally echo to the old fd 1.

    Echoed lines start with ``prefix``. Also enables faulthandler on fatal signals and on
    :data:`STACK_DUMP_SIGNAL`.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    original_stdout = os.dup(1)
    log_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    # Line-buffered Python streams: the last print before a crash is in the file.
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(line_buffering=True)
    faulthandler.enable(file=sys.stderr, all_threads=True)
    faulthandler.register(STACK_DUMP_SIGNAL, file=sys.stderr, all_threads=True)
    if echo:
        start = path.stat().st_size
        thread = threading.Thread(
            target=_echo, args=(path, start, original_stdout, prefix.encode()), daemon=True,
            name="megarl-log-echo")
        thread.start()
    else:
        os.close(original_stdout)
    return path


def _echo(path: Path, start: int, out_fd: int, prefix: bytes) -> None:
    """Copy whole lines written to ``path`` after byte ``start`` to ``out_fd``, forever."""
    pending = b""
    with open(path, "rb") as src:
        src.seek(start)
        while True:
            time.sleep(_ECHO_INTERVAL_S)
            pending += src.read()
            *lines, pending = pending.split(b"\n")
            if lines:
                os.write(out_fd, b"".join(prefix + line + b"\n" for line in lines))


def tail_lines(path: str | Path, n: int = 40, max_bytes: int = 64 * 1024) -> str:
    """The last ``n`` lines of a text file (reads at most ``max_bytes`` from its end)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read()
    except OSError as err:
        return f"(could not read {path}: {err.strerror})"
    lines = data.decode("utf-8", errors="replace").splitlines()
    return "\n".join(lines[-n:])
