"""``breezert_bench.ports``: ports for local servers, kept out of the kernel's ephemeral range."""

from __future__ import annotations

import itertools
import socket
from pathlib import Path

import pytest

from breezert_bench import ports

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("kind", [socket.SOCK_STREAM, socket.SOCK_DGRAM])
def test_a_port_lies_below_the_ephemeral_range_and_binds_on_every_address(kind: int) -> None:
    low, _ = ports.ephemeral_range()
    for _ in range(20):
        port = ports.free_port(kind)
        assert 10_000 <= port < low
        with socket.socket(socket.AF_INET, kind) as sock:
            sock.bind(("0.0.0.0", port))


def test_a_dual_stack_port_binds_on_ipv4_and_ipv6() -> None:
    if not socket.has_ipv6:
        pytest.skip("this kernel has no IPv6 sockets")
    port = ports.free_port(family=socket.AF_INET6)
    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(("::", port))


def test_a_port_in_use_is_never_given(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", ports.free_port()))
        taken = held.getsockname()[1]
        candidates = ports._candidates
        monkeypatch.setattr(ports, "_candidates",
                            lambda: itertools.chain([taken, taken], candidates()))
        assert ports.free_port() != taken


def test_a_range_that_starts_low_leaves_the_choice_to_the_kernel(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    range_file = tmp_path / "ip_local_port_range"
    range_file.write_text("1024\t65535\n")
    monkeypatch.setattr(ports, "_PORT_RANGE_FILE", range_file)
    assert ports.ephemeral_range() == (1024, 65535)
    assert next(ports._candidates()) == 0
    assert ports.free_port() > 0
    range_file.write_text("garbage")
    assert ports.ephemeral_range() == (32768, 60999)
