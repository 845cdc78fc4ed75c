"""Import stand-in for aioice on the device machine (``make room-bundle``), with the aiortc
stand-in (see ``aiortc/__init__.py``): breezert's server scopes aioice's host-address discovery
and parses STUN for its WebRTC endpoint, which the room benchmark never serves."""

from __future__ import annotations

from aiortc import __getattr__  # noqa: F401 (PEP 562: every name is the stand-in)
