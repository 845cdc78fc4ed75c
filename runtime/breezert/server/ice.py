"""Which host addresses aiortc gathers ICE candidates on: loopback when bound to loopback.

Owns: a scoped override of aioice's host-address discovery. aioice skips 127.0.0.1 and ::1
(``aioice.ice.get_host_addresses``), so a server bound to 127.0.0.1 and a client on the same
machine with no other interface could never connect. Must not: change gathering outside the
``host_addresses`` scope; other aiortc users in the process see aioice's default behaviour.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import aioice.ice

from breezert.config import is_loopback_host


@dataclass(frozen=True)
class HostAddresses:
    """``only``: gather on exactly these (``None``: every interface, aioice's default);
    ``extra``: add these to whatever else is gathered."""

    only: tuple[str, ...] | None = None
    extra: tuple[str, ...] = ()


_SCOPE: ContextVar[HostAddresses | None] = ContextVar("breezert_ice_host_addresses", default=None)
_original: Callable[[bool, bool], list[str]] | None = None


def _scoped_get_host_addresses(use_ipv4: bool, use_ipv6: bool) -> list[str]:
    assert _original is not None
    scope = _SCOPE.get()
    if scope is None:
        return _original(use_ipv4, use_ipv6)
    base = list(scope.only) if scope.only is not None else _original(use_ipv4, use_ipv6)
    for address in scope.extra:
        if address not in base:
            base.append(address)
    return [a for a in base if (use_ipv6 if ":" in a else use_ipv4)]


def install() -> None:
    """Routes aioice's host-address discovery through the scope (idempotent)."""
    global _original
    if _original is None:
        _original = aioice.ice.get_host_addresses
        aioice.ice.get_host_addresses = _scoped_get_host_addresses


@contextmanager
def host_addresses(scope: HostAddresses | None) -> Iterator[None]:
    """Within this block (and tasks it starts), ICE gathering uses ``scope``.

    Wrap ``await pc.setLocalDescription(...)``: aiortc gathers candidates inside it.
    """
    install()
    token = _SCOPE.set(scope)
    try:
        yield
    finally:
        _SCOPE.reset(token)


def scope_for(bind_host: str, ice_addresses: Sequence[str] | None = None) -> HostAddresses:
    """The gathering scope of a server bound to ``bind_host``.

    ``ice_addresses`` (configured) replaces interface discovery. Otherwise every interface is
    used, plus loopback when the server is bound to a loopback address (127.0.0.1 or ::1).
    """
    if ice_addresses:
        return HostAddresses(only=tuple(ice_addresses))
    if is_loopback_host(bind_host):
        loopback = "::1" if bind_host == "::1" else "127.0.0.1"
        return HostAddresses(extra=(loopback,))
    return HostAddresses()
