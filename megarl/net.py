"""Small network helpers shared by every layer (imports nothing of megarl)."""

from __future__ import annotations

import random
import socket
from pathlib import Path

# Ray's worker processes take 10002-19999 by default; ports below stay with well-known services.
_LOWEST = 20000
# Where the kernel's own range is unreadable (not Linux), the IANA ephemeral range.
_IANA_EPHEMERAL = (49152, 65535)
_RNG = random.SystemRandom()  # never the global generator: seeded processes would pick alike


def ephemeral_range() -> tuple[int, int]:
    """The ports the kernel hands out for outgoing connections and ``bind(0)``."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return _IANA_EPHEMERAL


def _candidate_ports() -> range | None:
    """The larger stretch between ``_LOWEST`` and 65535 outside the ephemeral range."""
    low, high = ephemeral_range()
    below = range(_LOWEST, max(_LOWEST, low))
    above = range(max(_LOWEST, high + 1), 65536)
    best = max(below, above, key=len)
    return best if len(best) >= 1000 else None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now, for a server that binds it a moment later.

    The port is drawn outside the kernel's ephemeral range: every outgoing connection on the
    machine (HTTP clients, gloo, Ray) takes a port from that range, so a port picked there by
    ``bind(0)`` and released can be taken before the server binds it (EADDRINUSE at a
    rendezvous). Where no such stretch exists, it falls back to ``bind(0)``.
    """
    ports = _candidate_ports()
    for _ in range(64 if ports is not None else 0):
        port = _RNG.choice(ports)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
