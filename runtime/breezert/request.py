"""Requests: the user-facing ``SynthesisRequest`` and the scheduler's logical ``Request`` state.

Owns request validation, lifecycle status and timestamps, the chunk log and the listener's latest
playback report, per-segment cursors and block ids, and
the chunk arithmetic (pending frames, chunk targets). Must not import torch or touch a tensor: a
segment's tokenized prompt is an opaque object the engine builds and the worker reads; only
the scheduler mutates a ``Request`` (the worker never sees one).
"""

from __future__ import annotations

import enum
import math
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from breezert.constants import CODEBOOK_SIZE, NUM_CODEBOOKS, Stage
from breezert.options import SynthesisOptions, check, is_int, is_number, is_text

MAX_CHUNK_FRAMES = 64
"""Largest chunk a request may ask for (the codec's per-item frame limit)."""


class RequestStatus(str, enum.Enum):
    """Lifecycle: WAITING -> RUNNING -> FINISHED | ABORTED | FAILED (abort also from WAITING)."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"
    FAILED = "failed"

    @property
    def is_finished(self) -> bool:
        """Terminal: the request holds no resources any more."""
        return self in (RequestStatus.FINISHED, RequestStatus.ABORTED, RequestStatus.FAILED)


class SegmentPhase(str, enum.Enum):
    """Where one segment is; DEPTH and DECODE name the segment's next generation step."""

    QUEUED = "queued"  # no KV blocks yet
    TEXT_ENCODE = "text_encode"  # blocks held, text not encoded
    PREFILL = "prefill"  # text encoded, prompt not fully prefilled
    DEPTH = "depth"  # hidden state ready: sample the next frame (waits here until active)
    DECODE = "decode"  # a frame was sampled: feed it to the backbone
    ENDED = "ended"  # EOS or frame limit; blocks freed


# ----------------------------------------------------------------------------- user-facing


def check_chunk_schedule(schedule: Sequence[int], name: str = "chunk_schedule") -> tuple[int, ...]:
    """Returns ``schedule`` as a tuple, or raises ``InvalidRequest`` naming ``name``."""
    check(isinstance(schedule, (list, tuple)) and len(schedule) > 0, name,
             "must be a non-empty sequence of frame counts", schedule)
    check(all(is_int(n) and 0 < n <= MAX_CHUNK_FRAMES for n in schedule), name,
             f"entries must be ints in 1..{MAX_CHUNK_FRAMES}", schedule)
    return tuple(schedule)


def num_cfg_branches(cfg_scale: float) -> int:
    """Backbone branches for a CFG scale: 2 (cond, uncond), or 1 when the scale is 1 (cond only)
    or 0 (uncond only: SPEC §2.4 "s = 0 means run only the negative prompt")."""
    return 1 if cfg_scale in (0.0, 1.0) else 2


@dataclass(frozen=True, eq=False)
class Reference:
    """Reference audio for voice clone / direction: its transcript and its codec codes."""

    ref_text: str
    ref_codes: np.ndarray
    """``[K, 16]`` int64 codes, each in 0..2047 (the codec encoder's output); any ``[K][16]``
    integer sequence is accepted and kept as one read-only array."""

    def __post_init__(self) -> None:
        check(is_text(self.ref_text), "reference.ref_text", "must be non-empty text", "...")
        codes = np.asarray(self.ref_codes)
        check(codes.ndim == 2 and codes.shape[0] > 0 and codes.shape[1] == NUM_CODEBOOKS,
              "reference.ref_codes", f"needs K >= 1 frames of {NUM_CODEBOOKS} codes",
              codes.shape)
        check(codes.dtype.kind in "iu", "reference.ref_codes", "codes must be integers",
              str(codes.dtype))
        check(bool(((codes >= 0) & (codes < CODEBOOK_SIZE)).all()), "reference.ref_codes",
              f"codes must be ints in 0..{CODEBOOK_SIZE - 1}", "...")
        codes = codes.astype(np.int64)  # a copy: the caller's array stays theirs
        codes.setflags(write=False)
        object.__setattr__(self, "ref_codes", codes)

    @property
    def num_frames(self) -> int:
        return int(self.ref_codes.shape[0])


@dataclass(frozen=True)
class SynthesisRequest:
    """One conversational turn to synthesize, as a caller writes it.

    Every field is validated on construction; ``InvalidRequest`` (a ``ValueError``) names the
    field. ``text`` may be one string or a sequence of segments; with ``input_closed=False`` more
    segments are appended while it runs (an empty sequence is then allowed).
    """

    text: str | Sequence[str]
    options: SynthesisOptions = field(default_factory=SynthesisOptions)
    """Voice, instructions, CFG, seed and sampling (validated by ``SynthesisOptions``)."""
    reference: Reference | None = None
    chunk_schedule: tuple[int, ...] | None = None
    """Frames per chunk, last entry repeating; ``None`` = the config's default."""
    max_frames: int | None = None
    """Frame limit per segment; ``None`` = the config's default."""
    ignore_eos: bool = False
    """Generate until ``max_frames`` (the sampler never picks EOS)."""
    priority: int = 0
    """Higher runs first among waiting and starting requests."""
    request_id: str | None = None
    """``None``: a fresh uuid4 hex is assigned."""
    input_closed: bool = True
    """False: more segments will be appended; the turn ends only after ``close_input``."""

    def __post_init__(self) -> None:
        segments = (self.text,) if isinstance(self.text, str) else self.text
        check(isinstance(segments, (list, tuple)), "text", "must be a str or a sequence", "...")
        segments = tuple(segments)
        check(len(segments) > 0 or not self.input_closed, "text",
              "must not be empty when input_closed", segments)
        check(all(is_text(s) for s in segments), "text",
              "segments must be non-empty, non-whitespace strings", "...")
        if not isinstance(self.text, str):
            object.__setattr__(self, "text", segments)
        check(isinstance(self.options, SynthesisOptions), "options",
              "must be SynthesisOptions", type(self.options).__name__)
        check(self.reference is None or isinstance(self.reference, Reference), "reference",
              "must be a Reference or None", type(self.reference).__name__)
        check(self.max_frames is None or (is_int(self.max_frames) and self.max_frames > 0),
              "max_frames", "must be None or a positive int", self.max_frames)
        check(is_int(self.priority), "priority", "must be an int", self.priority)
        check(isinstance(self.ignore_eos, bool), "ignore_eos", "must be a bool", self.ignore_eos)
        check(isinstance(self.input_closed, bool), "input_closed", "must be a bool",
              self.input_closed)
        if self.chunk_schedule is not None:
            object.__setattr__(self, "chunk_schedule", check_chunk_schedule(self.chunk_schedule))
        if self.request_id is None:
            object.__setattr__(self, "request_id", uuid.uuid4().hex)
        check(is_text(self.request_id), "request_id", "must be a non-empty str",
              self.request_id)

    @property
    def segments(self) -> tuple[str, ...]:
        """The text segments, in order."""
        return (self.text,) if isinstance(self.text, str) else tuple(self.text)


# ----------------------------------------------------------------------------- scheduler state


@dataclass(frozen=True)
class PlaybackReport:
    """One listener report: ``buffered_s`` of audio ahead of the playhead at ``measured_at``."""

    buffered_s: float
    """Audio queued ahead of the listener's playhead, seconds (>= 0)."""
    measured_at: float
    """``time.monotonic()`` when it was measured."""
    source: str
    """Where it came from: ``simulated``, ``webrtc``, ``livekit-source``, ``livekit-client``."""

    def __post_init__(self) -> None:
        check(is_number(self.buffered_s) and math.isfinite(self.buffered_s)
              and self.buffered_s >= 0, "buffered_s", "must be a finite number >= 0",
              self.buffered_s)
        check(is_number(self.measured_at) and math.isfinite(self.measured_at), "measured_at",
              "must be a finite number (time.monotonic())", self.measured_at)
        check(is_text(self.source), "source", "must be non-empty text", self.source)


@dataclass(eq=False)
class Segment:
    """One text segment of a request, generated as its own prompt (fresh backbone KV).

    The engine creates it after tokenizing on the host; everything below ``prompt`` is the
    scheduler's bookkeeping.
    """

    prompt_lens: tuple[int, ...]
    """Prompt tokens per CFG branch (branch 0 = cond, 1 = uncond); lengths may differ."""
    prompt: Any = None
    """Opaque tokenized prompt, handed to the worker in this segment's ``TextEncodeItem``."""
    num_text_tokens: int | None = None
    """Tokens the text encoder processes (budget accounting); ``None`` = ``sum(prompt_lens)``."""

    index: int = field(default=-1, init=False)
    max_frames: int = field(default=0, init=False)
    """Frame limit: min(request max_frames, max_model_len - 1 - longest prompt)."""
    phase: SegmentPhase = field(default=SegmentPhase.QUEUED, init=False)
    prefill_cursors: list[int] = field(default_factory=list, init=False)
    """Prompt tokens already prefilled, per branch."""
    block_ids: tuple[tuple[int, ...], ...] = field(default=(), init=False)
    """KV block table per branch; empty unless the segment holds blocks."""
    num_frames: int = field(default=0, init=False)
    """Frames generated so far (EOS is not a frame)."""

    def __post_init__(self) -> None:
        lens = tuple(self.prompt_lens)
        check(len(lens) in (1, 2) and all(is_int(n) and n > 0 for n in lens), "prompt_lens",
                 "needs 1 or 2 positive ints (one per CFG branch)", lens)
        self.prompt_lens = lens
        if self.num_text_tokens is None:
            self.num_text_tokens = sum(lens)
        check(is_int(self.num_text_tokens) and self.num_text_tokens >= 0, "num_text_tokens",
                 "must be an int >= 0", self.num_text_tokens)
        self.prefill_cursors = [0] * len(lens)

    @property
    def num_branches(self) -> int:
        return len(self.prompt_lens)

    @property
    def is_ended(self) -> bool:
        return self.phase is SegmentPhase.ENDED

    @property
    def is_generating(self) -> bool:
        """Prefilled and not ended: DEPTH or DECODE can run once the segment is active."""
        return self.phase in (SegmentPhase.DEPTH, SegmentPhase.DECODE)

    def blocks_per_branch(self, block_size: int) -> list[int]:
        """KV blocks each branch needs for its prompt plus ``max_frames`` frames."""
        return [-(-(n + self.max_frames) // block_size) for n in self.prompt_lens]


@dataclass(eq=False)
class Request:
    """The scheduler's logical state of one request: Python ints and lists (the segments'
    prompts ride along opaque, for the worker).

    Build it with ``Request.from_synthesis`` (or directly in tests). Fields after ``input_closed``
    are lifecycle state owned by the scheduler.
    """

    request_id: str
    segments: list[Segment] = field(default_factory=list)
    num_branches: int = 1
    priority: int = 0
    chunk_schedule: tuple[int, ...] | None = None
    """Frames per chunk, last entry repeating; ``None``: the scheduler's default at admission."""
    max_frames: int | None = None
    """Frame limit per segment; ``None``: the scheduler's default at admission."""
    ignore_eos: bool = False
    options: SynthesisOptions = field(default_factory=SynthesisOptions)
    """Voice, CFG and seed as the caller set them (appended segments are prompted with them)."""
    reference: Reference | None = None
    """Voice-clone reference of every segment's prompt."""
    sampling: Any = None
    """Resolved ``SamplingParams`` (the engine resolves the options over the checkpoint's
    defaults at admission); ``None`` = the worker's defaults."""
    input_closed: bool = True

    status: RequestStatus = field(default=RequestStatus.WAITING, init=False)
    slot: int | None = field(default=None, init=False)
    enqueue_time: float = field(default=0.0, init=False)
    first_scheduled_time: float | None = field(default=None, init=False)
    chunk_emit_times: list[float] = field(default_factory=list, init=False)
    """When each chunk left the engine (the request's one record of its emissions)."""
    chunk_frame_ends: list[int] = field(default_factory=list, init=False)
    """Frames of audio emitted up to and including each chunk (parallel to the times)."""
    playback: PlaybackReport | None = field(default=None, init=False)
    """The listener's latest playback-buffer report, if any."""
    finish_time: float | None = field(default=None, init=False)
    error: str | None = field(default=None, init=False)
    num_frames: int = field(default=0, init=False)
    """Frames generated over all segments (the audio stream's length so far)."""
    num_decoded_frames: int = field(default=0, init=False)
    """Frames decoded into emitted chunks (the audio stream's emitted length)."""

    def __post_init__(self) -> None:
        check(is_text(self.request_id), "request_id", "must be a non-empty str",
              self.request_id)
        check(self.num_branches in (1, 2), "num_branches", "must be 1 or 2", self.num_branches)
        if self.chunk_schedule is not None:
            self.chunk_schedule = check_chunk_schedule(self.chunk_schedule)
        check(self.max_frames is None or (is_int(self.max_frames) and self.max_frames > 0),
              "max_frames", "must be None or a positive int", self.max_frames)
        segments, self.segments = list(self.segments), []
        for segment in segments:
            self.add_segment(segment)

    @classmethod
    def from_synthesis(
        cls,
        synth: SynthesisRequest,
        segments: Sequence[Segment],
        *,
        sampling: Any = None,
        num_branches: int | None = None,
    ) -> Request:
        """Builds the logical request of a ``SynthesisRequest``; defaults left ``None`` are
        resolved by ``Scheduler.add_request`` from its ``SchedulerConfig``.

        Args:
            synth: The validated user request.
            segments: The tokenized ``Segment``s of ``synth``'s text, in order: at least one per
                text segment (the text front end may cut one text into several).
            sampling: The resolved ``SamplingParams`` (``None``: the worker's defaults).
            num_branches: CFG branches of every segment; ``None`` = ``num_cfg_branches``. The
                engine passes what the prompt has: plain and clone prompts have no negative,
                so they run one branch whatever the scale.

        Raises:
            InvalidRequest: segment count or CFG branch count mismatch.
        """
        check(len(segments) >= len(synth.segments), "segments",
              f"expected at least one per text segment ({len(synth.segments)})",
              len(segments))
        assert synth.request_id is not None  # set by SynthesisRequest.__post_init__
        return cls(
            request_id=synth.request_id,
            segments=list(segments),
            num_branches=num_branches or num_cfg_branches(float(synth.options.cfg_scale)),
            priority=synth.priority,
            chunk_schedule=synth.chunk_schedule,
            max_frames=synth.max_frames,
            ignore_eos=synth.ignore_eos,
            options=synth.options,
            reference=synth.reference,
            sampling=sampling,
            input_closed=synth.input_closed,
        )

    @property
    def cfg_scale(self) -> float:
        return float(self.options.cfg_scale)

    @property
    def seed(self) -> int | None:
        return self.options.seed

    def record_chunk(self, now: float) -> None:
        """A chunk ending at frame ``num_decoded_frames`` left the engine at ``now``."""
        self.chunk_emit_times.append(now)
        self.chunk_frame_ends.append(self.num_decoded_frames)

    def report_playback(self, report: PlaybackReport) -> None:
        """Keeps ``report`` unless the one held was measured later."""
        if self.playback is None or report.measured_at >= self.playback.measured_at:
            self.playback = report

    def add_segment(self, segment: Segment) -> None:
        """Appends a segment (its branch count must match the request's) and numbers it."""
        check(segment.num_branches == self.num_branches, "prompt_lens",
                 f"request {self.request_id} has {self.num_branches} CFG branch(es)",
                 segment.prompt_lens)
        check(segment.index == -1, "segment", "already belongs to a request", segment.index)
        segment.index = len(self.segments)
        self.segments.append(segment)

    # ------------------------------------------------------------------ derived state
    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def active_segment(self) -> Segment | None:
        """The first segment that has not ended (the one that generates next), if any."""
        for segment in self.segments:
            if not segment.is_ended:
                return segment
        return None

    @property
    def is_generation_done(self) -> bool:
        """Input closed and every segment ended: no more frames will come."""
        return self.input_closed and all(s.is_ended for s in self.segments)

    @property
    def is_at_gap(self) -> bool:
        """No segment can generate now (between segments, or waiting for input)."""
        active = self.active_segment
        return active is None or not active.is_generating

    @property
    def num_pending_frames(self) -> int:
        """Generated frames not yet handed to the codec."""
        return self.num_frames - self.num_decoded_frames

    @property
    def num_chunks(self) -> int:
        """Chunks emitted so far."""
        return len(self.chunk_emit_times)

    @property
    def current_chunk_target(self) -> int:
        """Frames of the next chunk per the schedule (its last entry repeats)."""
        assert self.chunk_schedule is not None, "chunk_schedule is resolved by add_request"
        return self.chunk_schedule[min(self.num_chunks, len(self.chunk_schedule) - 1)]

    @property
    def is_streaming(self) -> bool:
        """At least one chunk has been emitted."""
        return bool(self.chunk_emit_times)

    @property
    def first_chunk_time(self) -> float | None:
        return self.chunk_emit_times[0] if self.chunk_emit_times else None

    @property
    def last_chunk_time(self) -> float | None:
        return self.chunk_emit_times[-1] if self.chunk_emit_times else None
