"""Import stand-in for aiortc on the device machine (``make room-bundle``; not installed anywhere
else). breezert's server app imports it for its WebRTC endpoint, which the room benchmark's
engine server (``bench/room_engine.py``) never serves: the agents reach it over WebSocket, and
LiveKit carries the calls. aiortc needs cryptography, pylibsrtp and PyAV, more than the device
call can carry. Anything made from it raises, naming the cause."""

from __future__ import annotations

from typing import Any

STAND_IN = True


class _Missing:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("aiortc is a stand-in in the room benchmark's bundle: WebRTC "
                           "peers are not available")

    def __class_getitem__(cls, item: Any) -> Any:
        return cls


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return _Missing
