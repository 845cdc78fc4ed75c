"""How the plugin reaches a BreezeRT runtime: the ``RuntimeClient`` interface and its two kinds.

``InProcessRuntimeClient`` (this process's shared engine; torch is imported on its first turn)
and ``RemoteRuntimeClient`` (a ``breezert serve`` over WebSocket). Must not: import torch or the
engine at import, so that a remote-only agent needs neither.
"""

from .base import RuntimeClient, RuntimeUnavailable, SegmentStart, Turn, TurnOptions
from .local import InProcessRuntimeClient
from .remote import RemoteRuntimeClient, speech_stream_url

__all__ = [
    "InProcessRuntimeClient",
    "RemoteRuntimeClient",
    "RuntimeClient",
    "RuntimeUnavailable",
    "SegmentStart",
    "Turn",
    "TurnOptions",
    "speech_stream_url",
]
