"""Choosing an engine for each request: least outstanding tokens, sticky per prompt group.

Requests of one prompt group (the ``n`` samples of a prompt, sent together or one by one) go
to the same engine so they share its prefix cache; new groups go to the engine with the fewest
outstanding tokens. Two ways keep an engine out of new assignments: a failed health check
(:meth:`LoadBalancer.set_healthy`, undone by the next good one) and being marked *down*
(:meth:`LoadBalancer.mark_down`: the engine failed or is being restarted; only
:meth:`LoadBalancer.readmit` brings it back, after its weights were re-synced).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable


class NoHealthyEngine(RuntimeError):
    """Every engine is unhealthy or down."""


class LoadBalancer:
    """Tracks outstanding tokens per engine and assigns requests (not thread-safe; one loop)."""

    def __init__(self, num_engines: int, sticky_capacity: int = 65536) -> None:
        if num_engines < 1:
            raise ValueError(f"num_engines: {num_engines} must be >= 1")
        self.outstanding = [0] * num_engines
        self.healthy = [True] * num_engines
        self.down: dict[int, str] = {}
        """Engines excluded until :meth:`readmit`, with the reason."""
        self._sticky: OrderedDict[Hashable, int] = OrderedDict()
        self._sticky_capacity = sticky_capacity

    def available(self, engine: int) -> bool:
        """Whether ``engine`` may receive new requests."""
        return self.healthy[engine] and engine not in self.down

    def acquire(self, group_key: Hashable | None, cost: int) -> int:
        """Pick the engine for a request of ``cost`` tokens and count them as outstanding."""
        engine = self._sticky.get(group_key) if group_key is not None else None
        if engine is None or not self.available(engine):
            candidates = [i for i in range(len(self.healthy)) if self.available(i)]
            if not candidates:
                reasons = "; ".join(f"engine {i}: {why}" for i, why in sorted(self.down.items()))
                raise NoHealthyEngine("no rollout engine can take requests: every engine failed "
                                      f"its health check or is down ({reasons or 'unhealthy'}); "
                                      "see the engine logs")
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
        """Include or exclude an engine from new assignments (the last health check)."""
        self.healthy[engine] = healthy

    def mark_down(self, engine: int, reason: str) -> bool:
        """Exclude ``engine`` until :meth:`readmit`; False if it was already down."""
        if engine in self.down:
            return False
        self.down[engine] = reason
        return True

    def readmit(self, engine: int) -> None:
        """Let a recovered engine receive requests again."""
        self.down.pop(engine, None)
        self.healthy[engine] = True
