"""Streaming Ogg/Opus: engine PCM in, Ogg pages out as soon as each 20 ms packet is encoded.

Owns: one Ogg/Opus stream (one per turn) built with PyAV's libopus encoder and ogg muxer, with
one page per packet so nothing waits in the muxer. Must not: resample (libopus takes the
engine's 24 kHz directly) or know about sockets.
"""

from __future__ import annotations

import fractions
import io

import av
import numpy as np

from breezert.audio import ENGINE_SAMPLE_RATE, float_to_int16, samples_per_frame


class _Collect(io.RawIOBase):
    def __init__(self) -> None:
        self.data = bytearray()

    def writable(self) -> bool:  # NOTE: PyAV's av.open refuses a file object without it
        return True

    def write(self, b: bytes) -> int:  # type: ignore[override]
        self.data += b
        return len(b)

    def take(self) -> bytes:
        out, self.data = bytes(self.data), bytearray()
        return out


class OggOpusWriter:
    """``write(pcm)`` returns the Ogg bytes ready so far; ``close()`` returns the rest."""

    def __init__(self, sample_rate: int = ENGINE_SAMPLE_RATE, frame_ms: int = 20,
                 bit_rate: int = 32000) -> None:
        self.sample_rate = sample_rate
        self._frame_samples = samples_per_frame(sample_rate, frame_ms)
        self._out = _Collect()
        self._container = av.open(self._out, mode="w", format="ogg",
                                  options={"page_duration": str(frame_ms * 1000)})
        self._stream = self._container.add_stream("libopus", rate=sample_rate, layout="mono")
        self._stream.codec_context.bit_rate = bit_rate
        self._stream.codec_context.options = {"application": "voip",
                                              "frame_duration": str(frame_ms)}
        self._pending = np.zeros(0, np.float32)
        self._pts = 0
        self._closed = False

    def write(self, pcm: np.ndarray) -> bytes:
        self._pending = np.concatenate([self._pending, np.asarray(pcm, np.float32)])
        n = len(self._pending) // self._frame_samples * self._frame_samples
        for start in range(0, n, self._frame_samples):
            self._encode(self._pending[start:start + self._frame_samples])
        self._pending = self._pending[n:]
        return self._out.take()

    def close(self) -> bytes:
        """Pads the last frame with silence, flushes the encoder and ends the stream."""
        if self._closed:
            return b""
        self._closed = True
        if len(self._pending):
            pad = np.zeros(self._frame_samples - len(self._pending), np.float32)
            self._encode(np.concatenate([self._pending, pad]))
        for packet in self._stream.encode(None):
            self._container.mux(packet)
        self._container.close()
        return self._out.take()

    def _encode(self, frame_pcm: np.ndarray) -> None:
        frame = av.AudioFrame.from_ndarray(float_to_int16(frame_pcm)[None, :], format="s16",
                                           layout="mono")
        frame.sample_rate = self.sample_rate
        frame.pts = self._pts
        frame.time_base = fractions.Fraction(1, self.sample_rate)
        self._pts += len(frame_pcm)
        for packet in self._stream.encode(frame):
            self._container.mux(packet)
