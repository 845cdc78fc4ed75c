"""``aiortc.sdp`` of the aiortc stand-in (see ``aiortc/__init__.py``)."""

from __future__ import annotations

from aiortc import __getattr__  # noqa: F401 (PEP 562: every name is the stand-in)
