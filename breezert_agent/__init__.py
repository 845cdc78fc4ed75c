"""BreezeRT for LiveKit Agents: ``breezert_agent.TTS`` streams each turn as one engine request.

Exports the plugin classes and the worker ``load_fnc`` (``engine_load``), and registers the
plugin with LiveKit on import, like first-party plugins (so import it on the main thread).
Must not: import torch (the in-process engine loads on the first in-process turn or prewarm) or
the runtime's server.
"""

from __future__ import annotations

from livekit.agents import Plugin

from .load import FULL_LOAD, engine_load, engine_worker_options, load_threshold
from .log import logger
from .tts import TTS, ChunkedStream, SynthesizeStream
from .version import __version__

__all__ = ["FULL_LOAD", "TTS", "ChunkedStream", "SynthesizeStream", "__version__",
           "engine_load", "engine_worker_options", "load_threshold"]


class BreezeRTPlugin(Plugin):
    def __init__(self) -> None:
        super().__init__(__name__, __version__, __package__ or __name__, logger)


Plugin.register_plugin(BreezeRTPlugin())
