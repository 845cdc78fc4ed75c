"""Free ports for the local servers that the benchmark tools and the test suite start.

Owns: choosing a port that is free now and that no outgoing connection will take before the
server binds it. Must not: bind or hold the port itself (the caller's server does).

A port from ``bind(0)`` lies in the kernel's ephemeral range, the range it also hands to the
source ports of outgoing connections; a server that connects somewhere before it listens can
lose it in between (livekit-server's own client to Redis once did: "listen tcp :46055: bind:
address already in use"). So ports are drawn at random from below that range, and checked free
on every address of the family (servers such as livekit-server bind ``:port``).
"""

from __future__ import annotations

import random
import socket
from collections.abc import Iterator
from pathlib import Path

_LOWEST = 10_000
"""Ports below this are left to services that pick fixed ones."""
_PORT_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for outgoing connections' source ports (Linux's default when it
    cannot be read)."""
    try:
        low, high = _PORT_RANGE_FILE.read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def _candidates() -> Iterator[int]:
    """Ports to try, at random, below the ephemeral range; port 0 (the kernel picks) forever
    where that range leaves too few ports below it."""
    low, _ = ephemeral_range()
    while True:
        yield random.randrange(_LOWEST, low) if low - _LOWEST >= 2000 else 0


def free_port(kind: int = socket.SOCK_STREAM, family: int = socket.AF_INET) -> int:
    """A port free now on every address of ``family`` for sockets of ``kind``;
    ``AF_INET6`` asks for one free on IPv4 and IPv6 both."""
    for port in _candidates():
        with socket.socket(family, kind) as sock:
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            try:
                sock.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", port))
            except OSError:
                continue
            return int(sock.getsockname()[1])
    raise AssertionError("unreachable: the candidates never end")
