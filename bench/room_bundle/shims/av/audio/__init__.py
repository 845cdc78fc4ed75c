"""``av.audio`` of the PyAV stand-in (see ``av/__init__.py``): breezert's server imports its
Opus codec context for WebRTC tracks, which the room benchmark's engine server never opens."""

from __future__ import annotations

from av import __getattr__  # noqa: F401 (PEP 562: every name is the stand-in)
