"""``av.audio.codeccontext`` of the PyAV stand-in (see ``av/__init__.py``)."""

from __future__ import annotations

from av import __getattr__  # noqa: F401 (PEP 562: every name is the stand-in)
