"""``free_port`` draws rendezvous ports where outgoing connections cannot take them."""

from __future__ import annotations

import socket

import pytest

from megarl import net


def test_free_port_is_outside_the_kernels_ephemeral_range_and_bindable():
    low, high = net.ephemeral_range()
    assert 0 < low <= high <= 65535
    for host in ("127.0.0.1", "0.0.0.0"):
        ports = {net.free_port(host) for _ in range(20)}
        assert len(ports) > 1  # drawn, not one fixed port for every process
        for port in ports:
            assert not low <= port <= high, (port, low, high)
            assert port >= 20000  # above Ray's worker ports
            with socket.socket() as sock:
                sock.bind((host, port))


def test_free_port_skips_a_port_that_is_taken(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        later = [p for p in range(21234, 21300) if p != busy]
        draws = iter([busy, busy, *later])
        monkeypatch.setattr(net._RNG, "choice", lambda ports: next(draws))
        monkeypatch.setattr(net, "_candidate_ports", lambda: range(20000, 32768))
        assert net.free_port("127.0.0.1") in later  # the taken port was drawn twice, skipped


@pytest.mark.parametrize("kernel_range", [(1024, 65535), (20500, 64999)])
def test_free_port_falls_back_to_the_kernel_where_no_stretch_is_left(monkeypatch, kernel_range):
    monkeypatch.setattr(net, "ephemeral_range", lambda: kernel_range)
    assert net._candidate_ports() is None
    port = net.free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_candidate_ports_take_the_larger_stretch(monkeypatch):
    monkeypatch.setattr(net, "ephemeral_range", lambda: (32768, 60999))
    assert net._candidate_ports() == range(20000, 32768)
    monkeypatch.setattr(net, "ephemeral_range", lambda: (21000, 40000))
    assert net._candidate_ports() == range(40001, 65536)
