"""Import stand-in for ``livekit-local-inference`` on the device machine (``make room-bundle``;
not installed anywhere else). livekit-agents 1.8.9 imports it at import time for its local VAD
and end-of-turn models, which the room benchmark never runs (no STT, VAD or turn detection);
the real wheel is 35 MB, more than the device call can carry. Using a model raises."""

from __future__ import annotations

from typing import Any

STAND_IN = True
EOT_MAX_SAMPLES = 19200
VAD_WINDOW_SAMPLES = 512


class _Model:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("livekit-local-inference is a stand-in in the room benchmark's "
                           "bundle: its VAD and end-of-turn models are not available")


EOT = VAD = _Model


def init_eot() -> None:
    _Model()


def init_vad() -> None:
    _Model()
