"""Import stand-in for PyAV on the device machine (``make room-bundle``; not installed anywhere
else). livekit-agents 1.8.9 imports ``av`` at import time for its compressed-audio decoder and
its session recorder, neither of which the room benchmark uses; the real wheel is 35 MB, more
than the device call can carry. Anything taken from it raises, naming the cause."""

from __future__ import annotations

from typing import Any

from _stand_in import stand_in

STAND_IN = True
_Missing, __getattr__ = stand_in(
    "PyAV", "compressed audio decoding and session recording are not available")


def open(*args: Any, **kwargs: Any) -> Any:  # noqa: A001 (av.open)
    return _Missing()
