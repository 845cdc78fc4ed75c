"""``aioice.ice`` of the aioice stand-in (see ``aioice/__init__.py``)."""

from __future__ import annotations

from aiortc import __getattr__  # noqa: F401 (PEP 562: every name is the stand-in)
