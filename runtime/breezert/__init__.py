"""BreezeRT: a streaming serving runtime for Breeze-TTS-2."""

__version__ = "0.1.0"
