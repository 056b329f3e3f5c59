"""``conftest.free_port``: a port for a test's servers, outside the kernel's
ephemeral range (where outgoing connections take their local ports), with
the next ports free as well."""

import socket
from pathlib import Path

from conftest import free_port


def _ephemeral() -> tuple[int, int]:
    """The kernel's ephemeral range (Linux's default where it cannot be
    read, as free_port assumes)."""
    try:
        text = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text()
        lo, hi = text.split()[:2]
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


def test_the_port_and_the_next_ones_are_free_and_outside_the_ephemeral_range():
    lo, hi = _ephemeral()
    for span in (1, 8):
        for _ in range(20):
            port = free_port(span)
            assert port >= 10000
            assert port + span - 1 < lo or port > hi
            socks = [socket.socket() for _ in range(span)]
            try:
                for s, p in zip(socks, range(port, port + span), strict=True):
                    s.bind(("127.0.0.1", p))
            finally:
                for s in socks:
                    s.close()


def test_a_span_with_a_held_port_is_passed_over(monkeypatch):
    """The first span drawn holds a bound port: free_port draws again and
    returns the next span, which is free."""
    import random

    held = socket.socket()
    held.bind(("127.0.0.1", free_port(1)))
    taken = held.getsockname()[1]
    draws = iter([taken - 3, free_port(8)])

    class Draws:
        def choice(self, ranges):
            return ranges[0]

        def randrange(self, a, b):
            return next(draws)

    monkeypatch.setattr(random, "Random", Draws)
    try:
        port = free_port(8)
    finally:
        held.close()
    assert not port <= taken < port + 8
    assert port != taken - 3
