"""One module per stage: input preparation and the forward pass of that stage only.

Each stage exposes ``run(items, batch) -> StageOutput``. Must not: decide what runs (the
scheduler does) or reach into another stage's state beyond the shared ``BatchState``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


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
