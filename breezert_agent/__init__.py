"""BreezeRT for LiveKit Agents: ``breezert_agent.TTS`` streams each turn as one engine request.

Exports the plugin classes and registers the plugin with LiveKit the first time one of them is
imported (do that on the main thread, as LiveKit requires). The exports load lazily so that
``breezert_agent.audio`` / ``breezert_agent.webrtc`` (used by ``breezert serve``) import neither
LiveKit nor its 1 s of start-up; nothing else happens on import.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from .version import __version__

if TYPE_CHECKING:
    from .tts import TTS, ChunkedStream, SynthesizeStream

__all__ = ["TTS", "ChunkedStream", "SynthesizeStream", "__version__"]

_PLUGIN_EXPORTS = ("TTS", "ChunkedStream", "SynthesizeStream")
_is_registered = False


def _register_plugin() -> None:
    global _is_registered
    if _is_registered or threading.current_thread() is not threading.main_thread():
        return  # LiveKit accepts registrations on the main thread only
    from livekit.agents import Plugin

    from .log import logger

    class BreezeRTPlugin(Plugin):
        def __init__(self) -> None:
            super().__init__(__name__, __version__, __name__, logger)

    Plugin.register_plugin(BreezeRTPlugin())
    _is_registered = True


def __getattr__(name: str) -> Any:
    if name in _PLUGIN_EXPORTS:
        from . import tts

        _register_plugin()
        return getattr(tts, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
