"""Errors of the cluster layer: each message says which role, rank and host, what happened, and
what to do (PITFALLS S2, S4, T2, T6).

The worker-side errors are picklable, so one raised inside a Ray actor reaches the driver intact.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# Full tracebacks printed per error; further failing ranks are listed by rank only.
_MAX_TRACEBACKS = 3


class ClusterError(RuntimeError):
    """Base class of every error raised by :mod:`megarl.cluster`."""


class RayStartError(ClusterError):
    """Ray could not be started or joined (a stale instance, a wrong address, CPU limits)."""


class PoolSchedulingError(ClusterError):
    """A resource pool's placement group could not be scheduled in time."""


@dataclass(frozen=True)
class RankFailure:
    """One rank's exception: where it ran and the traceback text as the worker printed it."""

    rank: int
    host: str
    pid: int
    traceback: str


class WorkerError(ClusterError):
    """One or more ranks of a worker group raised in a call; carries every traceback whole."""

    def __init__(self, role: str, method: str, failures: Sequence[RankFailure]) -> None:
        self.role = role
        self.method = method
        self.failures = sorted(failures, key=lambda f: f.rank)
        super().__init__(self._message())

    def __reduce__(self):
        return (type(self), (self.role, self.method, self.failures))

    @property
    def ranks(self) -> list[int]:
        """The ranks that raised."""
        return [f.rank for f in self.failures]

    def _message(self) -> str:
        head = (f"{self.role} rank(s) {self.ranks} raised in {self.method!r}" if len(
            self.failures) > 1 else "")
        blocks = [head] if head else []
        for failure in self.failures[:_MAX_TRACEBACKS]:
            blocks.append(
                f"{self.role} rank {failure.rank} (host {failure.host}, pid {failure.pid}) raised "
                f"in {self.method!r}:\n{failure.traceback.rstrip()}"
            )
        rest = [f.rank for f in self.failures[_MAX_TRACEBACKS:]]
        if rest:
            blocks.append(f"(ranks {rest} raised too; tracebacks omitted)")
        return "\n".join(blocks)


@dataclass(frozen=True)
class DeadRank:
    """A rank whose process died: where it ran, why Ray thinks it died, and its log's tail."""

    rank: int
    host: str
    pid: int
    cause: str
    log_path: str
    log_tail: str


class WorkerDiedError(ClusterError):
    """A worker process died (os._exit, a signal, OOM killer, a crash in native code)."""

    def __init__(self, role: str, phase: str, dead: Sequence[DeadRank]) -> None:
        self.role = role
        self.phase = phase
        self.dead = sorted(dead, key=lambda d: d.rank)
        super().__init__(self._message())

    def __reduce__(self):
        return (type(self), (self.role, self.phase, self.dead))

    @property
    def ranks(self) -> list[int]:
        """The ranks whose process died."""
        return [d.rank for d in self.dead]

    def _message(self) -> str:
        blocks = []
        for d in self.dead:
            tail = d.log_tail.rstrip() or "(empty)"
            blocks.append(
                f"{self.role} rank {d.rank} (host {d.host}, pid {d.pid}) died during "
                f"{self.phase!r}: {d.cause}\n"
                f"--- last lines of its log ({d.log_path}) ---\n{tail}\n"
                f"--- full log: {d.log_path} ---"
            )
        blocks.append("fix: read the log lines above; a death without a Python traceback is "
                      "usually the OOM killer (see `dmesg`), a crash in native code, or an "
                      "explicit exit. Shut the group down (shutdown()) before exiting.")
        return "\n".join(blocks)


@dataclass(frozen=True)
class StuckRank:
    """A rank that did not finish a phase in time, with the stacks it dumped into its log."""

    rank: int
    host: str
    pid: int
    log_path: str
    stacks: str
    note: str = ""
    """Where to look when the stacks are not attached (naive mode: torchrun's log)."""


class WorkerTimeoutError(ClusterError):
    """A call did not finish on every rank in time (often a collective some rank never joined)."""

    def __init__(
        self, role: str, phase: str, timeout_s: float, world_size: int,
        stuck: Sequence[StuckRank],
    ) -> None:
        self.role = role
        self.phase = phase
        self.timeout_s = timeout_s
        self.world_size = world_size
        self.stuck = sorted(stuck, key=lambda s: s.rank)
        super().__init__(self._message())

    def __reduce__(self):
        return (type(self), (self.role, self.phase, self.timeout_s, self.world_size, self.stuck))

    @property
    def ranks(self) -> list[int]:
        """The ranks that did not finish."""
        return [s.rank for s in self.stuck]

    def _message(self) -> str:
        finished = sorted(set(range(self.world_size)) - set(self.ranks))
        lines = [
            f"timeout: phase {self.phase!r} of role {self.role} did not finish within "
            f"{self.timeout_s:g} s on {len(self.stuck)} of {self.world_size} ranks: "
            + ", ".join(f"rank {s.rank} (host {s.host}, pid {s.pid})" for s in self.stuck)
            + f"; finished: ranks {finished}"
        ]
        for s in self.stuck[:_MAX_TRACEBACKS]:
            if s.note:
                lines.append(f"rank {s.rank}: {s.note}")
            if s.stacks.strip():
                lines.append(f"--- rank {s.rank}: its stacks, dumped into {s.log_path} ---\n"
                             f"{s.stacks.rstrip()}")
        lines.append(
            "fix: the ranks above are stuck, often in a collective another rank never entered "
            "(see their stacks); if the phase is only slow, raise the call timeout "
            "(call_timeout_s). Shut the group down (shutdown()) before exiting."
        )
        return "\n".join(lines)
