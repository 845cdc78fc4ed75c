"""Import stand-in for aiortc on the device machine (``make room-bundle``; not installed anywhere
else). breezert's server app imports it for its WebRTC endpoint, which the room benchmark's
engine server (``bench/room_engine.py``) never serves: the agents reach it over WebSocket, and
LiveKit carries the calls. aiortc needs cryptography, pylibsrtp and PyAV, more than the device
call can carry. Anything made from it raises, naming the cause."""

from __future__ import annotations

from _stand_in import stand_in

STAND_IN = True
_Missing, __getattr__ = stand_in("aiortc", "WebRTC peers are not available")
