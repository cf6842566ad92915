"""Deliberate crashes at named points of a run, for the recovery tests.

``MEGARL_CRASH_AT=POINT:STEP[:DELAY_S]`` makes the process that reaches ``POINT`` at ``STEP``
kill itself with SIGKILL (no cleanup, no atexit: what a node failure or the OOM killer does),
``DELAY_S`` seconds after it got there (0 = at once), so a crash can land in the middle of a
phase. The points are the timed phases of a step (every :func:`megarl.metrics.timing.timer`
block: ``gen``, ``reward``, ``old_log_prob``, ``update_actor``, ``sync_weights``, ...) and
``save``; the step is the one the trainer announced with :func:`set_step`. Unset, nothing
happens.

``MEGARL_FAIL_AT=POINT`` raises :class:`InjectedFault` where the driver reaches ``POINT`` of
:func:`megarl.trainer.workers.build_workers` (``start_actor``, ``start_rollout``,
``start_critic``): a start-up that fails after some workers exist.

``MEGARL_CKPT_WRITE_DELAY_S=SECONDS`` makes each rank's background checkpoint writer wait that
long before writing its files: a slow file system, so a test can act while a write is under way.

``MEGARL_ENGINE_STEP_DELAY_S=SECONDS`` makes the embedded rollout engine wait that long after each
generation step: a slow device, so a test can pause or abort while requests are surely mid-way
whatever the machine's speed.

``MEGARL_OOM_AT=PHASE[:RANK]`` raises ``torch.OutOfMemoryError`` when a process (the one whose
``RANK`` environment variable is ``RANK``, or any) enters ``PHASE`` of
:func:`megarl.memory.phase_memory`: the out-of-memory path without filling a GPU. Two more points
are the embedded engine's: ``resume_rollout`` (its ``/resume_memory_occupation``) and
``engine_decode`` (every decode step, so every retry: the path where its recovery gives up).
"""

from __future__ import annotations

import os
import signal
import threading

ENV = "MEGARL_CRASH_AT"
OOM_ENV = "MEGARL_OOM_AT"
FAIL_ENV = "MEGARL_FAIL_AT"
WRITE_DELAY_ENV = "MEGARL_CKPT_WRITE_DELAY_S"
ENGINE_DELAY_ENV = "MEGARL_ENGINE_STEP_DELAY_S"
_step = 0


def set_step(step: int) -> None:
    """The step the process is working on now (the trainer calls this at each step start)."""
    global _step
    _step = step


def parse_crash_spec(spec: str) -> tuple[str, int, float]:
    """``POINT:STEP[:DELAY_S]`` -> (point, step, delay); a one-line error names the variable."""
    parts = spec.split(":")
    try:
        if len(parts) not in (2, 3):
            raise ValueError
        return parts[0], int(parts[1]), float(parts[2]) if len(parts) == 3 else 0.0
    except ValueError:
        raise ValueError(f"{ENV}={spec!r}: expected POINT:STEP or POINT:STEP:DELAY_S, e.g. "
                         "update_actor:3 or gen:2:0.5") from None


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def crash_point(point: str, step: int | None = None) -> None:
    """SIGKILL this process (now or after the delay) if ``MEGARL_CRASH_AT`` names this point at
    ``step`` (default: the step of :func:`set_step`)."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    name, at_step, delay = parse_crash_spec(spec)
    if name != point or at_step != (_step if step is None else step):
        return
    if delay <= 0:
        _kill_self()
    timer = threading.Timer(delay, _kill_self)
    timer.daemon = True
    timer.start()


class InjectedFault(RuntimeError):
    """The error :func:`fail_point` raises."""


def fail_point(point: str) -> None:
    """Raise :class:`InjectedFault` if ``MEGARL_FAIL_AT`` names ``point``."""
    if os.environ.get(FAIL_ENV) == point:
        raise InjectedFault(f"{FAIL_ENV}={point}: injected failure")


def checkpoint_write_delay() -> float:
    """Seconds a background checkpoint writer waits before writing (``MEGARL_CKPT_WRITE_DELAY_S``,
    default 0)."""
    return float(os.environ.get(WRITE_DELAY_ENV) or 0.0)


def engine_step_delay() -> float:
    """Seconds the embedded engine waits after each generation step
    (``MEGARL_ENGINE_STEP_DELAY_S``, default 0)."""
    return float(os.environ.get(ENGINE_DELAY_ENV) or 0.0)


def oom_point(phase: str) -> None:
    """Raise ``torch.OutOfMemoryError`` if ``MEGARL_OOM_AT`` names ``phase`` (and this rank)."""
    spec = os.environ.get(OOM_ENV)
    if not spec:
        return
    name, _, rank = spec.partition(":")
    if name == phase and (not rank or rank == os.environ.get("RANK", "0")):
        import torch

        raise torch.OutOfMemoryError(f"CUDA out of memory ({OOM_ENV}={spec})")
