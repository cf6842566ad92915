"""Generation that runs while the trainer trains: an event loop on a thread of its own.

The trainer's phases are blocking calls (Ray tasks on the train pool), so the overlapping
schedulers run generation on a :class:`RolloutLoop`: an asyncio loop on a background thread
with its own rollout client (an HTTP client belongs to the loop that uses it). The trainer
thread hands it coroutines and waits on their futures only when it needs their result.
:class:`BusyClock` measures how long the rollout side had work in flight, for idle ratios.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

T = TypeVar("T")


class BusyClock:
    """Wall time during which at least one generation request was in flight."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active = 0
        self._since = 0.0
        self._busy = 0.0

    @contextmanager
    def track(self) -> Iterator[None]:
        """Count the enclosed request as in flight."""
        with self._lock:
            if self._active == 0:
                self._since = time.monotonic()
            self._active += 1
        try:
            yield
        finally:
            with self._lock:
                self._active -= 1
                if self._active == 0:
                    self._busy += time.monotonic() - self._since

    def busy_seconds(self) -> float:
        """Busy time so far (including the current busy stretch)."""
        with self._lock:
            current = time.monotonic() - self._since if self._active else 0.0
            return self._busy + current


class RolloutLoop:
    """An asyncio event loop on a background thread, with the rollout client it owns."""

    def __init__(self, make_client: Callable[[], Any], name: str = "megarl-rollout") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()
        self._closed = False

        async def create() -> Any:
            return make_client()

        self.client = self.run(create())

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future:
        """Schedule ``coro`` on the loop; the future holds its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None,
            phase: str = "rollout") -> T:
        """Run ``coro`` on the loop and wait for its result."""
        future = self.submit(coro)
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"{phase}: no answer from the rollout within {timeout_s:.0f} s "
                               "(trainer.phase_timeout_s); see the rollout engine logs") from None

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the loop thread (thread-safe)."""
        if not self._closed:
            self.loop.call_soon_threadsafe(fn, *args)

    def close(self) -> None:
        """Cancel what still runs, close the client, stop the thread."""
        if self._closed:
            return

        async def shutdown() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.client.close()

        try:
            self.run(shutdown(), timeout_s=60.0, phase="stop the rollout loop")
        finally:
            self._closed = True
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10.0)
            if not self._thread.is_alive():
                self.loop.close()
