"""A control link over ``multiprocessing`` pipes: the sender in one process, engines in others.

Used where engines are processes started by the caller (tests, benchmarks, single-node runs);
SGLang-style servers are reached over HTTP instead, with the same message dicts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

from megarl.weights.transports import Message
from megarl.weights.update import Replies


class PipeLink:
    """An :class:`~megarl.weights.update.EngineLink` over one pipe per engine process."""

    def __init__(self, conns: Sequence[Connection], timeout_s: float = 300.0) -> None:
        self.conns = list(conns)
        self.timeout_s = timeout_s

    def __len__(self) -> int:
        """Number of engines."""
        return len(self.conns)

    def post(self, messages: Sequence[Message]) -> Replies:
        """Send ``messages[i]`` to engine ``i``; the result waits for every reply."""
        if len(messages) != len(self.conns):
            raise ValueError(f"{len(messages)} messages for {len(self.conns)} engines; give one "
                             "per engine")
        for conn, message in zip(self.conns, messages):
            conn.send(message)
        op = messages[0].get("op") if messages else None

        def wait() -> list[dict[str, Any]]:
            replies = []
            for i, conn in enumerate(self.conns):
                if not conn.poll(self.timeout_s):
                    raise TimeoutError(f"engine {i} did not answer {op!r} within "
                                       f"{self.timeout_s} s; it may be stuck in a transfer or "
                                       "dead (check its log)")
                replies.append(conn.recv())
            return replies

        return wait


def serve(conn: Connection, handle: Callable[[Message], dict[str, Any]]) -> None:
    """Answer control messages from ``conn`` until it closes or an ``op: shutdown`` arrives."""
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message.get("op") == "shutdown":
            conn.send({"ok": True})
            return
        conn.send(handle(message))
