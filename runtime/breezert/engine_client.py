"""``EngineClient``: the typed surface the server and the plugin drive an engine through.

Owns: the protocol (submit, append, close, abort, stream, reference audio, health, metrics) and
the plain records it returns (``Submitted``, ``EngineCapacity``). ``AsyncEngine`` implements it;
so does the one test fake (``tests/fake_engine.py``), and a conformance test runs the same
checks against both. Must not: import torch or the engine, so that callers typed against it
stay importable without either.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from breezert.outputs import AudioChunk, SegmentStarted
from breezert.request import Reference, SynthesisRequest
from breezert.sched.load import EngineLoad
from breezert.text import Split


@dataclass(frozen=True)
class Submitted:
    """A request the engine has accepted, as its text front end prepared it."""

    request_id: str
    segment_owners: tuple[int, ...]
    """The caller's text (an index into ``SynthesisRequest.segments``) of each engine segment:
    the front end may cut one text into several (``Split``)."""
    num_prompt_tokens: int
    """Prompt tokens over every segment (the longest CFG branch of each): OpenAI's ``usage``."""
    is_queued: bool
    """Every running slot was taken when it was submitted: it waits for one
    (``max_running_requests``; an open turn holds its slot until its input closes)."""


@dataclass(frozen=True)
class EngineCapacity:
    """The engine's capacity gauges at one moment (lengths and counters, read without the
    engine lock)."""

    running: int
    """Requests holding a running slot."""
    queued: int
    """Requests waiting for a running slot."""
    max_running: int
    """Running slots (``scheduler.max_running_requests``)."""
    free_slots: int
    kv_blocks_free: int
    kv_blocks_total: int
    codec_slots_used: int
    """Streaming codec state slots in use on the worker (one per running slot)."""


class EngineClient(Protocol):
    """What a front end (the HTTP/WebSocket/WebRTC server, the plugin's in-process client)
    needs of an engine. Every method but the ``async`` ones returns at once; the ``async`` ones
    do their CPU work (tokenizing, prompt templates, reference encoding) off the event loop.
    ``load``, ``capacity`` and ``metrics`` are safe from any thread (``/metrics`` reads them
    on a worker thread); the rest belong to the event loop the request was submitted on."""

    async def submit(self, request: SynthesisRequest, *, split: Split = Split.NONE) -> Submitted:
        """Prepares the request's text once (off the event loop), then queues it.

        Raises ``InvalidRequest`` (naming the field) or ``EngineOverloaded`` at once."""
        ...

    async def append(self, request_id: str, text: str, *, split: Split = Split.NONE) -> int:
        """Adds text to a running turn whose input is open; returns how many engine segments
        it became. Raises ``InvalidRequest`` when the turn is not running."""
        ...

    def close_input(self, request_id: str) -> None:
        """No more text: the turn ends after its last segment."""
        ...

    def abort(self, request_id: str) -> None:
        """Stops the request now and frees what it holds (a no-op once it has finished)."""
        ...

    def stream(
        self, request_id: str, *, segments: bool = False
    ) -> AsyncGenerator[AudioChunk | SegmentStarted, None]:
        """The submitted request's chunks until it finishes (with ``segments``, a
        ``SegmentStarted`` before each engine segment's first audio). Raises ``RequestFailed``,
        ``RequestAborted`` or ``EngineOverloaded`` on those outcomes; leaving early aborts."""
        ...

    def report_playback(
        self, request_id: str, buffered_s: float, measured_at: float, source: str
    ) -> None:
        """The listener's playback-buffer level; raises ``InvalidRequest`` for a bad report."""
        ...

    async def encode_reference(self, samples: np.ndarray, sample_rate: int,
                               ref_text: str) -> Reference:
        """Reference audio -> ``Reference`` (off the event loop); raises ``InvalidRequest``
        naming ``reference_text``, ``samples``/``sample_rate`` or ``reference_audio``."""
        ...

    def is_live(self, request_id: str) -> bool:
        """Whether the request is still queued or running."""
        ...

    @property
    def is_running(self) -> bool:
        """The engine loop is alive (False once it died of a fatal error)."""
        ...

    def load(self) -> EngineLoad:
        """How full the engine is now (``EngineLoad.fraction``, 1 = full)."""
        ...

    def capacity(self) -> EngineCapacity:
        """Slots, KV blocks and codec slots in use now."""
        ...

    def metrics(self) -> dict[str, Any]:
        """``EngineMetrics.snapshot()``: counters, stage step times, TTFB histogram."""
        ...

    async def aclose(self) -> None:
        """Aborts every request and stops the engine (its owner calls it)."""
        ...
