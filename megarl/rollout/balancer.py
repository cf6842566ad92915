"""Choosing an engine for each request: least outstanding tokens, sticky per prompt group.

Requests of one prompt group (the ``n`` samples of a prompt, sent together or one by one) go
to the same engine so they share its prefix cache; new groups go to the engine with the fewest
outstanding tokens. Engines marked unhealthy receive nothing until marked healthy again.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable


class NoHealthyEngine(RuntimeError):
    """Every engine is marked unhealthy."""


class LoadBalancer:
    """Tracks outstanding tokens per engine and assigns requests (not thread-safe; one loop)."""

    def __init__(self, num_engines: int, sticky_capacity: int = 65536) -> None:
        if num_engines < 1:
            raise ValueError(f"num_engines: {num_engines} must be >= 1")
        self.outstanding = [0] * num_engines
        self.healthy = [True] * num_engines
        self._sticky: OrderedDict[Hashable, int] = OrderedDict()
        self._sticky_capacity = sticky_capacity

    def acquire(self, group_key: Hashable | None, cost: int) -> int:
        """Pick the engine for a request of ``cost`` tokens and count them as outstanding."""
        engine = self._sticky.get(group_key) if group_key is not None else None
        if engine is None or not self.healthy[engine]:
            candidates = [i for i, ok in enumerate(self.healthy) if ok]
            if not candidates:
                raise NoHealthyEngine("no healthy rollout engine: every engine failed its "
                                      "health check; see the engine logs")
            engine = min(candidates, key=lambda i: (self.outstanding[i], i))
        if group_key is not None:
            self._sticky[group_key] = engine
            self._sticky.move_to_end(group_key)
            while len(self._sticky) > self._sticky_capacity:
                self._sticky.popitem(last=False)
        self.outstanding[engine] += cost
        return engine

    def release(self, engine: int, cost: int) -> None:
        """The request of ``cost`` tokens on ``engine`` finished (or failed)."""
        self.outstanding[engine] -= cost

    def set_healthy(self, engine: int, healthy: bool) -> None:
        """Include or exclude an engine from new assignments."""
        self.healthy[engine] = healthy
