"""``FakeEngine``: the one stand-in ``EngineClient`` of the tests (no torch, no model).

Owns: a fake with the real engine's surface and rules where a server test can tell: text is
cut by the real ``breezert.text.cut_text`` against a token limit (a byte-level count: one
token per UTF-8 byte plus a template overhead), text that is not valid Unicode fails as the real
tokenizer does, open turns take ``append``/``close_input``, ``stream`` yields ``SegmentStarted``
marks, and ``metrics()`` is a real ``EngineMetrics`` snapshot fed real scheduler events. Audio is
a continuous two-tone signal (never silent), ``max_frames`` frames per segment (or
``num_frames``) on the 1, 2, 4, 8, 16 chunk schedule: the first chunk ``first_chunk_s`` after
submit, each next one after a ``1 / speedup`` share of the previous chunk's duration, so it stays
ahead of real time whatever else loads the CPU. ``tests/unit/test_engine_client.py`` runs the
same conformance checks against it and the real ``AsyncEngine``. Not a test module.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from breezert.constants import NUM_CODEBOOKS
from breezert.engine_client import EngineCapacity, Submitted
from breezert.errors import EngineOverloaded, InvalidRequest, RequestAborted, RequestFailed
from breezert.metrics import EngineMetrics
from breezert.outputs import AudioChunk, SegmentStarted
from breezert.request import PlaybackReport, Reference, RequestStatus, SynthesisRequest
from breezert.sched.load import EngineLoad
from breezert.sched.scheduler import ChunkEmitted, RequestFinished
from breezert.text import Split, cut_text

SAMPLE_RATE = 24000
SAMPLES_PER_FRAME = 1920
CHUNK_SIZES = (1, 2, 4, 8, 16)
TEMPLATE_TOKENS = 8
"""Tokens a segment's prompt has beyond its text (speaker, BOS, audio start...)."""


@dataclass(eq=False)
class _Request:
    request_id: str
    frames_per_segment: int
    options: Any
    reference: Reference | None
    enqueue_time: float
    num_segments: int
    is_input_open: bool
    queue: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)
    more: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when a segment is appended or the input closes."""
    task: asyncio.Task[None] | None = None
    is_done: bool = False


class FakeEngine:
    """An ``EngineClient`` that replays synthetic audio (see the module docstring).

    Args:
        num_frames: Frames per segment when the request sets no ``max_frames``.
        first_chunk_s: Submit to the first chunk.
        speedup: How much faster than real time the chunks after the first come.
        fail_after_chunks: Fail the next request after this many chunks (``RequestFailed``),
            then behave.
        max_prompt_tokens: The token limit of one segment's prompt.
        is_overloaded: ``submit`` raises ``EngineOverloaded`` (``max_queued_requests`` full).
        max_running: Running slots the capacity and load figures count against.
    """

    def __init__(self, *, num_frames: int = 12, first_chunk_s: float = 0.03,
                 speedup: float = 4.0, fail_after_chunks: int | None = None,
                 max_prompt_tokens: int = 1022, is_overloaded: bool = False,
                 max_running: int = 8) -> None:
        self.num_frames = num_frames
        self.first_chunk_s = first_chunk_s
        self.speedup = speedup
        self.fail_after_chunks = fail_after_chunks
        self.max_prompt_tokens = max_prompt_tokens
        self.is_overloaded = is_overloaded
        self.max_running = max_running
        self.num_samples_sent = 0
        self.submissions: list[Submitted] = []
        """Every request accepted, in order, as ``submit`` returned it."""
        self._requests: dict[str, _Request] = {}
        self._metrics = EngineMetrics()
        self._is_closed = False

    # ----------------------------------------------------------------- requests
    async def submit(self, request: SynthesisRequest, *, split: Split = Split.NONE) -> Submitted:
        if self.is_overloaded:
            raise EngineOverloaded("max_queued_requests=0 waiting")
        await asyncio.sleep(0)  # the real one prepares on another thread
        counts, owners = self._prepare(request.segments, request.options, request.reference,
                                       split)
        request_id = request.request_id
        assert request_id is not None
        if request_id in self._requests:
            raise InvalidRequest(f"request_id={request_id!r} is already streaming")
        is_queued = len(self._requests) >= self.max_running
        live = _Request(request_id, request.max_frames or self.num_frames, request.options,
                        request.reference, time.monotonic(), len(counts),
                        not request.input_closed)
        self._requests[request_id] = live
        self._metrics.request_added()
        if is_queued:
            self._metrics.incr("queued_requests")
        live.task = asyncio.create_task(self._produce(live))
        self.submissions.append(Submitted(request_id, owners, sum(counts), is_queued))
        return self.submissions[-1]

    async def append(self, request_id: str, text: str, *, split: Split = Split.NONE) -> int:
        live = self._live(request_id)
        await asyncio.sleep(0)
        counts, _ = self._prepare([text], live.options, live.reference, split)
        if not live.is_input_open or live.is_done:
            raise InvalidRequest(f"request_id={request_id!r} does not take more text")
        live.num_segments += len(counts)
        live.more.set()
        return len(counts)

    def close_input(self, request_id: str) -> None:
        live = self._live(request_id)
        live.is_input_open = False
        live.more.set()

    def abort(self, request_id: str) -> None:
        live = self._requests.get(request_id)
        if live is None or live.is_done:
            return
        if live.task is not None:
            live.task.cancel()
        self._finish(live, RequestStatus.ABORTED, RequestAborted(request_id))

    async def stream(
        self, request_id: str, *, segments: bool = False
    ) -> AsyncGenerator[AudioChunk | SegmentStarted, None]:
        live = self._requests.get(request_id)
        if live is None:
            raise InvalidRequest(f"request_id={request_id!r} was not submitted here")
        finished = False
        try:
            while (item := await live.queue.get()) is not None:
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if segments or not isinstance(item, SegmentStarted):
                    yield item
            finished = True
        finally:
            if not finished:  # the consumer left early: abort, as the real engine does
                self.abort(request_id)
            self._requests.pop(request_id, None)

    def report_playback(self, request_id: str, buffered_s: float, measured_at: float,
                        source: str) -> None:
        PlaybackReport(buffered_s, measured_at, source)  # validates: InvalidRequest

    async def encode_reference(self, samples: np.ndarray, sample_rate: int,
                               ref_text: str) -> Reference:
        """Codes of the right shape (``K = ceil(n24 / 1920)`` frames), no model."""
        if not isinstance(ref_text, str) or not ref_text.strip():
            raise InvalidRequest("reference_text: must be non-empty text (the reference's "
                                 "transcript)")
        if sample_rate <= 0:
            raise InvalidRequest(f"sample_rate={sample_rate}: must be a positive int (Hz)")
        num_samples = len(np.asarray(samples))
        if num_samples == 0:
            raise InvalidRequest("samples: no audio")
        num_frames = math.ceil(-(-num_samples * SAMPLE_RATE // sample_rate) / SAMPLES_PER_FRAME)
        codes = np.arange(num_frames * NUM_CODEBOOKS).reshape(num_frames, NUM_CODEBOOKS) % 2048
        return Reference(ref_text=ref_text, ref_codes=codes)

    def is_live(self, request_id: str) -> bool:
        live = self._requests.get(request_id)
        return live is not None and not live.is_done

    # -------------------------------------------------------------- health, metrics
    @property
    def is_running(self) -> bool:
        return not self._is_closed

    def load(self) -> EngineLoad:
        capacity = self.capacity()
        return EngineLoad(capacity.running, capacity.queued, self.max_running, 64)

    def capacity(self) -> EngineCapacity:
        live = sum(not r.is_done for r in list(self._requests.values()))  # any thread
        running = min(live, self.max_running)
        return EngineCapacity(running=running, queued=live - running,
                              max_running=self.max_running,
                              free_slots=self.max_running - running, kv_blocks_free=256,
                              kv_blocks_total=256, codec_slots_used=running)

    def metrics(self) -> dict[str, Any]:
        return self._metrics.snapshot()

    async def aclose(self) -> None:
        for request_id in list(self._requests):
            self.abort(request_id)
        self._is_closed = True

    # ------------------------------------------------------------------ helpers
    def _prepare(self, texts: Any, options: Any, reference: Reference | None,
                 split: Split) -> tuple[list[int], tuple[int, ...]]:
        """Token counts of the segments ``texts`` become, and the text of each."""
        overhead = TEMPLATE_TOKENS + _num_tokens(options.instructions or "")
        if reference is not None:
            overhead += _num_tokens(reference.ref_text) + reference.num_frames

        def fits(piece: str) -> bool:
            return overhead + _num_tokens(piece) <= self.max_prompt_tokens

        counts: list[int] = []
        owners: list[int] = []
        for owner, text in enumerate(texts):
            for piece in cut_text(text, split, fits):
                count = overhead + _num_tokens(piece)
                if count > self.max_prompt_tokens:
                    raise InvalidRequest(
                        f"text: the prompt is {count} tokens, over the context limit of "
                        f"{self.max_prompt_tokens} tokens (max_seq_len="
                        f"{self.max_prompt_tokens + 2}); split the text into segments")
                counts.append(count)
                owners.append(owner)
        return counts, tuple(owners)

    def _live(self, request_id: str) -> _Request:
        live = self._requests.get(request_id)
        if live is None or live.is_done:
            raise InvalidRequest(f"request_id={request_id!r} is not running")
        return live

    async def _produce(self, live: _Request) -> None:
        await asyncio.sleep(self.first_chunk_s)
        fail_after, self.fail_after_chunks = self.fail_after_chunks, None
        start = chunk_index = segment = 0
        while True:
            if segment == live.num_segments:
                if not live.is_input_open:
                    break
                live.more.clear()
                await live.more.wait()
                continue
            live.queue.put_nowait(SegmentStarted(live.request_id, segment, start))
            end = start + live.frames_per_segment
            while start < end:
                if fail_after is not None and chunk_index >= fail_after:
                    self._finish(live, RequestStatus.FAILED,
                                 RequestFailed(live.request_id, "injected fault"))
                    return
                n = min(CHUNK_SIZES[min(chunk_index, len(CHUNK_SIZES) - 1)], end - start)
                is_final = (start + n == end and segment + 1 == live.num_segments
                            and not live.is_input_open)
                self._emit(live, chunk_index, start, n, segment, is_final)
                start += n
                chunk_index += 1
                await asyncio.sleep(n * 0.08 / self.speedup)
            segment += 1
        self._finish(live, RequestStatus.FINISHED, None, num_frames=start)

    def _emit(self, live: _Request, chunk_index: int, start: int, n: int, segment: int,
              is_final: bool) -> None:
        t = np.arange(start * SAMPLES_PER_FRAME, (start + n) * SAMPLES_PER_FRAME) / SAMPLE_RATE
        pcm = (0.3 * np.sin(2 * np.pi * 220 * t) + 0.2 * np.sin(2 * np.pi * 1250 * t))
        now = time.monotonic()
        live.queue.put_nowait(AudioChunk(live.request_id, pcm.astype(np.float32), SAMPLE_RATE,
                                         start, start + n, segment, now, is_final))
        self._metrics.on_events([ChunkEmitted(live.request_id, chunk_index, start, n, segment,
                                              is_final, now, live.enqueue_time)])
        self.num_samples_sent += len(pcm)

    def _finish(self, live: _Request, status: RequestStatus, outcome: BaseException | None,
                num_frames: int = 0) -> None:
        live.is_done = True
        now = time.monotonic()
        self._metrics.on_events([RequestFinished(
            live.request_id, status, str(outcome) if outcome else None, now, live.enqueue_time,
            now if num_frames else None, num_frames)])
        live.queue.put_nowait(outcome)


def _num_tokens(text: str) -> int:
    """One token per UTF-8 byte plus BOS; text that is not valid Unicode fails as the real
    tokenizer fails (a ``TypeError`` from the tokenizers library: issue 16's 500)."""
    try:
        return len(text.encode("utf-8")) + 1
    except UnicodeEncodeError:
        raise TypeError("TextInputSequence must be str") from None
