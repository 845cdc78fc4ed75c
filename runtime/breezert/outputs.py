"""What crosses the runtime's two hand-offs, as plain data.

Owns: ``StageOutput`` and ``DecodedChunk`` (worker -> engine: what one stage step produced),
``AudioChunk`` and ``SegmentStarted`` (engine -> caller) and PCM conversions. Must not: hold
tensors or engine state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from breezert.audio import float_to_pcm16
from breezert.constants import FRAME_S


@dataclass(frozen=True)
class DecodedChunk:
    """PCM of one CODEC item, as the worker returns it to the engine."""

    request_id: str
    start_frame: int
    num_frames: int
    pcm: np.ndarray  # [num_frames * 1920] float32
    is_final: bool


@dataclass
class StageOutput:
    """What one stage step produced: sampled first codes, decoded chunks, per-request failures."""

    first_codes: dict[str, int] = field(default_factory=dict)
    chunks: list[DecodedChunk] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class AudioChunk:
    """One chunk of a request's audio: ``frame_end - frame_start`` codec frames of PCM. A value
    nobody changes once the engine built it; slotted, not frozen, as ``sched/plan.py``'s items."""

    request_id: str
    pcm: np.ndarray
    """float32 mono samples in [-1, 1], ``1920 * num_frames`` of them at ``sample_rate``."""
    sample_rate: int
    frame_start: int
    """Index of the chunk's first frame in the request's audio (0-based, across segments)."""
    frame_end: int
    segment_index: int
    """Text segment whose frames this chunk carries (the last one, if it spans two)."""
    created_time: float
    """``time.monotonic()`` when the chunk left the engine."""
    is_final: bool = False
    """True for the request's last chunk."""

    @property
    def num_frames(self) -> int:
        return self.frame_end - self.frame_start

    @property
    def duration_s(self) -> float:
        return len(self.pcm) / self.sample_rate

    def pcm16(self) -> bytes:
        """Little-endian signed 16-bit PCM bytes."""
        return float_to_pcm16(self.pcm)


@dataclass(frozen=True)
class SegmentStarted:
    """Text segment ``segment_index`` of a request starts at frame ``start_frame`` of the
    request's audio (exact: the engine's count of the frames of the segments before it).
    ``EngineClient.stream(..., segments=True)`` yields it before the chunk that carries that
    frame; a chunk may carry the end of one segment and the start of the next."""

    request_id: str
    segment_index: int
    start_frame: int

    @property
    def start_s(self) -> float:
        return self.start_frame * FRAME_S
