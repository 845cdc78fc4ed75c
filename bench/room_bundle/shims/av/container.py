"""``av.container`` of the PyAV stand-in (see ``av/__init__.py``)."""

from __future__ import annotations

from typing import Any

from av import _Missing


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return _Missing
