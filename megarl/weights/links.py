"""Control links from the weight sender to its engines: pipes and HTTP.

- :class:`PipeLink`: ``multiprocessing`` pipes, for engines that are processes started by the
  caller (tests, benchmarks, single-node runs).
- :class:`HttpLink`: ``POST <url>/megarl/weights`` on every engine server (megarl's embedded
  engine, :mod:`megarl.rollout.local.checkpoint_engine`), the same message dicts as JSON.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

import httpx

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


CHECKPOINT_PATH = "/megarl/weights"


class HttpLink:
    """An :class:`~megarl.weights.update.EngineLink` over HTTP to N engine servers.

    ``post`` sends the N requests from a thread pool and returns at once (the sender moves the
    bytes while the engines' requests are in flight); a failed request (connection refused,
    HTTP error, timeout) becomes that engine's ``{"ok": False, "error": ...}`` reply naming the
    URL, so the sender aborts the update with the engine's name. ``api_key`` (``rollout.api_key``)
    is sent as ``Authorization: Bearer <key>`` on every request.
    """

    def __init__(self, urls: Sequence[str], timeout_s: float = 300.0,
                 path: str = CHECKPOINT_PATH, api_key: str | None = None) -> None:
        if not urls:
            raise ValueError("urls: give at least one engine URL (http://host:port)")
        self.urls = [u.rstrip("/") for u in urls]
        self.path = path
        self.timeout_s = timeout_s
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        self._client = httpx.Client(timeout=httpx.Timeout(timeout_s, connect=30.0),
                                    headers=headers, trust_env=False)  # no env proxy (M5)
        self._pool = concurrent.futures.ThreadPoolExecutor(len(self.urls),
                                                           thread_name_prefix="megarl-http-link")

    def __len__(self) -> int:
        """Number of engines."""
        return len(self.urls)

    def _send(self, url: str, message: Message) -> dict[str, Any]:
        op = message.get("op")
        try:
            response = self._client.post(url + self.path, json=message)
        except httpx.TimeoutException:
            return {"ok": False, "error": f"{url}: no answer to {op!r} within {self.timeout_s} s;"
                                          " it may be stuck in a transfer (check its log)"}
        except httpx.HTTPError as err:
            return {"ok": False, "error": f"{url}: {op!r} failed: {type(err).__name__}: {err}"}
        if response.status_code != 200:
            return {"ok": False, "error": f"{url}: {op!r} answered HTTP {response.status_code}: "
                                          f"{response.text[:500]}"}
        return response.json()

    def post(self, messages: Sequence[Message]) -> Replies:
        """Send ``messages[i]`` to engine ``i``; the result waits for every reply."""
        if len(messages) != len(self.urls):
            raise ValueError(f"{len(messages)} messages for {len(self.urls)} engines; give one "
                             "per engine")
        futures = [self._pool.submit(self._send, url, message)
                   for url, message in zip(self.urls, messages)]
        return lambda: [future.result() for future in futures]

    def close(self) -> None:
        """Close the HTTP client and the thread pool."""
        self._pool.shutdown(wait=True)
        self._client.close()


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
