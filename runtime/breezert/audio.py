"""PCM framing and resampling for the server's outputs (WAV/PCM bodies, Ogg/Opus, WebRTC track).

Owns: the engine's sample rate, float32 <-> PCM16 conversion, frame arithmetic, splitting a
buffer into whole frames, WAV headers, and building ``soxr`` streaming resamplers. Must not:
keep state between calls, pace anything, or import LiveKit, aiortc, torch or ``breezert.server``.
"""

from __future__ import annotations

import struct

import numpy as np
import soxr

from breezert.constants import SAMPLE_RATE

ENGINE_SAMPLE_RATE = SAMPLE_RATE
"""Rate of the engine's ``AudioChunk.pcm`` (Hz)."""
OPUS_SAMPLE_RATE = 48000
G711_SAMPLE_RATE = 8000
FRAME_MS_CHOICES = (10, 20)
"""Frame durations a WebRTC track may emit (ms)."""

# NOTE(webrtc): soxr's streaming resampler holds audio back until it has a processing block,
# about half as long at "LQ" as at "HQ" (bench/README.md). That hold-back is latency whenever the
# engine is only just ahead of playout (the first chunks of a turn). "LQ" is flat to 8 kHz
# (-5 dB at 10 kHz) with images below -79 dB: transparent for speech, so it is the default.
DEFAULT_RESAMPLE_QUALITY = "LQ"


def samples_per_frame(sample_rate: int, frame_ms: int) -> int:
    """Samples in one ``frame_ms`` frame at ``sample_rate``; raises ValueError when fractional."""
    samples, remainder = divmod(sample_rate * frame_ms, 1000)
    if remainder or samples <= 0:
        raise ValueError(
            f"frame_ms={frame_ms} is not a whole number of samples at {sample_rate} Hz")
    return samples


def float_to_pcm16(pcm: np.ndarray) -> bytes:
    """float32 samples in [-1, 1] -> little-endian signed 16-bit bytes (clipped)."""
    clipped = np.clip(np.asarray(pcm, dtype=np.float32), -1.0, 1.0)
    return (clipped * 32767.0).round().astype("<i2").tobytes()


def float_to_int16(pcm: np.ndarray) -> np.ndarray:
    """float32 samples in [-1, 1] -> int16 samples (clipped)."""
    clipped = np.clip(np.asarray(pcm, dtype=np.float32), -1.0, 1.0)
    return (clipped * 32767.0).round().astype(np.int16)


def new_resampler(
    in_rate: int, out_rate: int, quality: str = DEFAULT_RESAMPLE_QUALITY
) -> soxr.ResampleStream | None:
    """A mono float32 ``soxr`` streaming resampler, or ``None`` when the rates match.

    Feed it with ``resample_chunk(x)`` and end a stream with ``resample_chunk(empty, last=True)``
    (that flushes the audio it holds back); one resampler per continuous stream.
    """
    if in_rate == out_rate:
        return None
    return soxr.ResampleStream(in_rate, out_rate, 1, dtype="float32", quality=quality)


def resample_chunk(
    resampler: soxr.ResampleStream | None, pcm: np.ndarray, *, last: bool = False
) -> np.ndarray:
    """Runs ``pcm`` through ``resampler`` (``None``: passthrough); ``last`` flushes it."""
    pcm = np.ascontiguousarray(pcm, dtype=np.float32)
    if resampler is None:
        return pcm
    return np.asarray(resampler.resample_chunk(pcm, last=last), dtype=np.float32)


def wav_header(sample_rate: int, num_samples: int | None, num_channels: int = 1) -> bytes:
    """The 44-byte header of a PCM16 WAV file.

    ``num_samples=None`` writes the largest sizes the format allows, the convention for a WAV
    streamed before its length is known (players read until the connection closes).
    """
    block_align = 2 * num_channels
    data_size = 0xFFFFFFFF - 36 if num_samples is None else num_samples * block_align
    return b"".join((
        b"RIFF", struct.pack("<I", min(36 + data_size, 0xFFFFFFFF)), b"WAVE",
        b"fmt ", struct.pack("<IHHIIHH", 16, 1, num_channels, sample_rate,
                             sample_rate * block_align, block_align, 16),
        b"data", struct.pack("<I", data_size),
    ))


def encode_wav(pcm: np.ndarray, sample_rate: int) -> bytes:
    """Mono float32 samples -> a complete PCM16 WAV file."""
    return wav_header(sample_rate, len(pcm)) + float_to_pcm16(pcm)
