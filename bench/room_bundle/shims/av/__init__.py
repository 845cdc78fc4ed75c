"""Import stand-in for PyAV on the device machine (``make room-bundle``; not installed anywhere
else). livekit-agents 1.8.9 imports ``av`` at import time for its compressed-audio decoder and
its session recorder, neither of which the room benchmark uses; the real wheel is 35 MB, more
than the device call can carry. Anything taken from it raises, naming the cause."""

from __future__ import annotations

from typing import Any

STAND_IN = True


class _Missing:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("PyAV is a stand-in in the room benchmark's bundle: compressed audio "
                           "decoding and session recording are not available")

    def __class_getitem__(cls, item: Any) -> Any:
        return cls


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return _Missing


def open(*args: Any, **kwargs: Any) -> Any:  # noqa: A001 (av.open)
    return _Missing()
