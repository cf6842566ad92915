"""Bringing failed rollout engines back: restart the process, re-sync weights, readmit.

:class:`~megarl.rollout.sglang.SGLangClient` notices a dead or hung engine (its connections fail
and ``/health`` does not answer, or it fails ``unhealthy_after`` health checks in a row), marks
it down and re-sends its unfinished requests to the other engines. :class:`EngineRecovery`
then brings it back, in an order that never lets it serve stale weights:

1. ``restart(engine)`` starts the engine's server again (same URL) and waits until it is
   healthy. A fresh engine serves the weights on disk, not the trainer's current ones.
2. ``resync(engines)`` pushes the trainer's current weights to the restarted engines and
   returns the ``weight_version`` they now serve. With megarl's weight-update group this means
   re-forming the group (a dead member breaks it for everyone) and broadcasting the current
   weights again under the current version.
3. :meth:`SGLangClient.readmit` checks that each engine reports that version, and only then
   lets it take requests.

``recover()`` runs the three steps once for every engine that is down; ``watch()`` runs them
in the background whenever one goes down. Restarts per engine are bounded
(``max_restarts``); an engine past the bound stays down and is reported in ``failed``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from megarl.rollout.process import ManagedServer
from megarl.rollout.sglang.client import EngineError, SGLangClient

logger = logging.getLogger(__name__)

Restart = Callable[[int], Awaitable[None]]
Resync = Callable[[list[int]], Awaitable[str]]


@dataclass(frozen=True)
class Recovery:
    """One engine brought back."""

    engine: int
    reason: str
    """Why it was marked down."""
    weight_version: str
    """The version it was re-synced to."""
    seconds: float
    """From the start of the restart to readmission."""


class EngineRecovery:
    """Restarts engines the client marked down, re-syncs their weights, readmits them."""

    def __init__(self, client: SGLangClient, restart: Restart, resync: Resync, *,
                 max_restarts: int = 3) -> None:
        self.client = client
        self.restart = restart
        self.resync = resync
        self.max_restarts = max_restarts
        self.restarts = [0] * len(client.urls)
        self.history: list[Recovery] = []
        self.failed: dict[int, str] = {}
        """Engines given up on (restarted ``max_restarts`` times), with the last error."""

    def pending(self) -> list[int]:
        """Engines that are down and not given up on."""
        return sorted(i for i in self.client.down if i not in self.failed)

    async def recover(self) -> list[Recovery]:
        """Bring back every pending engine (restart, re-sync, readmit); raise on failure."""
        engines = self.pending()
        if not engines:
            return []
        reasons = self.client.down
        start = time.monotonic()
        for engine in engines:
            self.restarts[engine] += 1
        await asyncio.gather(*(self.restart(engine) for engine in engines))
        version = await self.resync(engines)
        done = []
        for engine in engines:
            await self.client.readmit(engine, version)
            done.append(Recovery(engine, reasons[engine], str(version),
                                 time.monotonic() - start))
        self.history.extend(done)
        return done

    async def watch(self, poll_s: float = 0.5, retry_s: float = 2.0) -> None:
        """Recover engines whenever some are down, until cancelled (run it as a task)."""
        while True:
            if self.pending():
                try:
                    await self.recover()
                except (EngineError, OSError, RuntimeError, TimeoutError) as err:
                    self._note_failure(err)
                    await asyncio.sleep(retry_s)
                    continue
            await asyncio.sleep(poll_s)

    def _note_failure(self, err: BaseException) -> None:
        for engine in self.pending():
            if self.restarts[engine] >= self.max_restarts:
                self.failed[engine] = (f"engine {engine} ({self.client.urls[engine]}) could not "
                                       f"be recovered after {self.restarts[engine]} restarts: "
                                       f"{err}")
                logger.error(self.failed[engine])
        logger.warning("recovering rollout engines failed (%s: %s); retrying",
                       type(err).__name__, err)


def restart_servers(servers: Sequence[ManagedServer], ready_timeout_s: float = 600.0,
                    stop_timeout_s: float = 5.0) -> Restart:
    """A ``restart`` for :class:`EngineRecovery` over server processes this process owns
    (engine i = ``servers[i]``): stop what is left of it (a hung one is killed after
    ``stop_timeout_s``), start it, wait until healthy."""
    async def restart(engine: int) -> None:
        server = servers[engine]
        await asyncio.to_thread(server.restart, stop_timeout_s)
        await asyncio.to_thread(server.wait_ready, ready_timeout_s)

    return restart
