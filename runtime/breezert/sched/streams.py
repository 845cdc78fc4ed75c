"""StreamTable: the running requests as numpy columns over slots, for per-step decisions.

Owns the per-slot copy of what the scheduling policies and the deadline predictor read each step
(phases, frame counts, chunk log summary, the listener's latest report, how long each stage has
been ready) and of what a DECODE, DEPTH or CODEC batch carries (the active segment, its prompt
lengths and block tables, the request ids), so that one step's ranking and its batch are a few
array operations whatever the number of streams. The ``Request`` stays the truth: ``add``
copies one request's row from it, and the scheduler calls the narrower ``set_*`` / ``advance``
/ ``record_chunks`` updates wherever it changes a request. A free row has no phase and no
pending frames, so whole-column readiness never picks it; ``step_memo`` keeps columns derived
from these for the length of one ``schedule`` (the scheduler turns it on and off). Must not:
change a request, read a clock or import torch.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence

import numpy as np

from breezert.constants import Stage
from breezert.request import Request, Segment, SegmentPhase

STAGES = (Stage.TEXT_ENCODE, Stage.PREFILL, Stage.DECODE, Stage.DEPTH, Stage.CODEC)
"""Stage codes: a stage's index here (``STAGE_CODE``)."""
STAGE_CODE = {stage: code for code, stage in enumerate(STAGES)}

NO_PHASE = -1
"""``phase`` of a request with no active segment (every segment ended, input open)."""
PHASE_CODE = {phase: code for code, phase in enumerate(
    (SegmentPhase.QUEUED, SegmentPhase.TEXT_ENCODE, SegmentPhase.PREFILL, SegmentPhase.DEPTH,
     SegmentPhase.DECODE))}
QUEUED, TEXT_ENCODE, PREFILL, DEPTH, DECODE = range(5)

FEW_ROWS = 4
"""Up to this many rows, the per-step updates and checks go row by row in plain Python: a
numpy call costs several times a scalar write at the one or two streams of a first packet,
where every step's host time is on the listener's clock."""


class StreamTable:
    """One row per slot (``live`` rows hold a running request); see the module doc.

    Columns: ``seq`` (admission order), ``priority``, ``enqueue_time``, ``num_branches``,
    ``num_chunks``, ``chunk_target`` (the schedule's next entry), ``first_target`` and
    ``largest_target`` (its first and largest entries), ``first_chunk_time``,
    ``last_chunk_time`` (NaN before one), ``decoded`` and ``pending`` frames, ``phase`` of the
    active segment (``PHASE_CODE``, ``NO_PHASE``) and its ``active_index``, ``later_text_encode`` / ``later_prefill``
    (a later segment waits in that phase), the report (``has_report``, ``report_at``,
    ``report_buffered``, ``frames_since``: frames emitted after it was measured),
    ``ready_since[stage]`` (step since which the stage is ready unserved, -1: not ready),
    ``early_target`` (schedule target of a chunk cut short, -1: none), ``is_served`` (it ran a
    step), ``input_closed`` (no segment comes any more); of the active segment, what a DECODE
    or DEPTH batch carries: ``segment_start`` (the request's frames before it; its own are
    ``decoded + pending - segment_start``), ``prompt_lens`` (``[slot, branch]``; without CFG
    both columns hold the one branch's) and ``block_ids`` (its block tables, the segment's own
    tuple); ``segments`` (the active ``Segment`` objects) and ``request_ids`` (``None`` on free
    rows).
    """

    def __init__(self, num_slots: int) -> None:
        n = num_slots
        self.requests: list[Request | None] = [None] * n
        self.live = np.zeros(n, bool)
        self.live_slots = np.zeros(0, np.int64)
        """The live rows, ascending (kept by ``add`` and ``remove``: read every step)."""
        self.seq = np.zeros(n, np.int64)
        self.priority = np.zeros(n, np.int64)
        self.enqueue_time = np.zeros(n)
        self.num_branches = np.zeros(n, np.int64)
        self.num_chunks = np.zeros(n, np.int64)
        self.chunk_target = np.zeros(n, np.int64)
        self.first_target = np.zeros(n, np.int64)
        self.largest_target = np.zeros(n, np.int64)
        self.first_chunk_time = np.full(n, np.nan)
        self.last_chunk_time = np.full(n, np.nan)
        self.decoded = np.zeros(n, np.int64)
        self.pending = np.zeros(n, np.int64)
        self.phase = np.full(n, NO_PHASE, np.int64)
        self.active_index = np.full(n, -1, np.int64)
        self.later_text_encode = np.zeros(n, bool)
        self.later_prefill = np.zeros(n, bool)
        self.has_report = np.zeros(n, bool)
        self.report_at = np.zeros(n)
        self.report_buffered = np.zeros(n)
        self.frames_since = np.zeros(n, np.int64)
        self.ready_since = np.full((len(STAGES), n), -1, np.int64)
        self.early_target = np.full(n, -1, np.int64)
        self.is_served = np.zeros(n, bool)
        self.input_closed = np.zeros(n, bool)
        self.request_ids = np.full(n, None, object)
        self.segment_start = np.zeros(n, np.int64)
        self.prompt_lens = np.zeros((n, 2), np.int64)
        self.block_ids: list[tuple[tuple[int, ...], ...]] = [()] * n
        self.segments: list[Segment | None] = [None] * n
        self.step_memo: dict | None = None
        """Columns derived from these, kept while the scheduler's ``schedule`` asks
        (``DeadlinePredictor.step_buffered``, ``step_slacks``); ``None`` (none kept) outside."""

    @classmethod
    def of(cls, requests: Sequence[Request]) -> StreamTable:
        """A table of ``requests`` in rows 0.. (in that order): for questions about requests
        outside a scheduler (the predictor's per-request answers, tests)."""
        table = cls(len(requests))
        for row, request in enumerate(requests):
            table.add(row, request, row)
        return table

    # ------------------------------------------------------------------ rows
    def add(self, slot: int, request: Request, seq: int) -> None:
        """``request`` takes ``slot`` (admitted ``seq``-th): its whole row, nothing ready."""
        self.requests[slot] = request
        self.request_ids[slot] = request.request_id
        self.live[slot] = True
        self.live_slots = np.flatnonzero(self.live)
        self.is_served[slot] = request.first_scheduled_time is not None
        self.input_closed[slot] = request.input_closed
        self.seq[slot] = seq
        self.priority[slot] = request.priority
        self.enqueue_time[slot] = request.enqueue_time
        self.num_branches[slot] = request.num_branches
        schedule = request.chunk_schedule
        assert schedule is not None, "chunk_schedule is resolved by add_request"
        self.first_target[slot] = schedule[0]
        self.largest_target[slot] = max(schedule)
        self.ready_since[:, slot] = -1
        self.early_target[slot] = -1
        self.set_segments(slot, request)
        self.set_chunks(slot, request)

    def remove(self, slot: int) -> None:
        self.requests[slot] = None
        self.request_ids[slot] = None
        self.block_ids[slot] = ()
        self.segments[slot] = None
        self.live[slot] = False
        self.live_slots = np.flatnonzero(self.live)
        self.ready_since[:, slot] = -1
        self.phase[slot] = NO_PHASE  # a free row is never ready (whole-column readiness)
        self.pending[slot] = 0
        self.later_text_encode[slot] = self.later_prefill[slot] = False

    def set_segments(self, slot: int, request: Request) -> None:
        """The active segment's phase, frames, prompt and blocks, and the later segments'
        phases (after a phase change, or blocks handed out)."""
        active = self.segments[slot] = request.active_segment
        if active is None:
            self.phase[slot] = NO_PHASE
            self.active_index[slot] = -1
            self.later_text_encode[slot] = self.later_prefill[slot] = False
            self.segment_start[slot] = 0
            self.prompt_lens[slot] = 0
            self.block_ids[slot] = ()
            return
        self.phase[slot] = PHASE_CODE[active.phase]
        self.active_index[slot] = active.index
        self.segment_start[slot] = request.num_frames - active.num_frames
        lens = active.prompt_lens
        self.prompt_lens[slot, 0], self.prompt_lens[slot, 1] = lens[0], lens[-1]
        self.block_ids[slot] = active.block_ids
        later = {seg.phase for seg in request.segments[active.index + 1:]}
        self.later_text_encode[slot] = SegmentPhase.TEXT_ENCODE in later
        self.later_prefill[slot] = SegmentPhase.PREFILL in later

    def set_chunks(self, slot: int, request: Request) -> None:
        """The chunk log, frame counts and report (a whole row's, at admission and in tests)."""
        times = request.chunk_emit_times
        self.num_chunks[slot] = len(times)
        self.chunk_target[slot] = request.current_chunk_target
        self.first_chunk_time[slot] = times[0] if times else np.nan
        self.last_chunk_time[slot] = times[-1] if times else np.nan
        self.decoded[slot] = request.num_decoded_frames
        self.pending[slot] = request.num_pending_frames
        self.set_report(slot, request)

    def record_chunks(self, rows: np.ndarray, num_frames: np.ndarray, targets: list[int],
                      now: float) -> None:
        """``set_chunks`` for ``rows`` after one chunk each of ``num_frames`` that their
        requests recorded at ``now`` (``targets``: their schedules' next entries), the report's
        count of frames since it kept up without a search: one write per column (row by row for
        ``FEW_ROWS`` rows or fewer)."""
        if len(rows) <= FEW_ROWS:
            for row, frames, target in zip(rows.tolist(), num_frames.tolist(), targets,
                                           strict=True):
                self._record_chunk(row, frames, target, now)
            return
        self.num_chunks[rows] += 1
        self.chunk_target[rows] = targets
        self.first_chunk_time[rows[self.num_chunks[rows] == 1]] = now
        self.last_chunk_time[rows] = now
        self.decoded[rows] += num_frames
        self.pending[rows] -= num_frames
        after = self.has_report[rows] & (self.report_at[rows] < now)
        self.frames_since[rows[after]] += num_frames[after]

    def _record_chunk(self, row: int, num_frames: int, target: int, now: float) -> None:
        """``record_chunks`` for one row."""
        self.num_chunks[row] += 1
        self.chunk_target[row] = target
        if self.num_chunks[row] == 1:
            self.first_chunk_time[row] = now
        self.last_chunk_time[row] = now
        self.decoded[row] += num_frames
        self.pending[row] -= num_frames
        if self.has_report[row] and self.report_at[row] < now:
            self.frames_since[row] += num_frames

    def held(self, slots: np.ndarray) -> list[int]:
        """Of a plan's ``slots``, those whose request still runs (one that ended since the plan,
        aborted or failed, keeps its slot until the plan's commit with its row empty, so a
        row is either the plan's request or empty): a gather (a few rows: row by row)."""
        if len(slots) <= FEW_ROWS:
            live = self.live
            return [slot for slot in slots.tolist() if live[slot]]
        return slots[self.live[slots]].tolist()

    def advance(self, slots: list[int], phase: int) -> None:
        """The active segments of ``slots`` moved on to ``phase`` (``DECODE``: after a frame,
        one more pending each; ``DEPTH``: after DECODE): one write per column (row by row for
        ``FEW_ROWS`` rows or fewer)."""
        if len(slots) > FEW_ROWS:
            rows = np.array(slots, np.int64)
            if phase == DECODE:
                self.pending[rows] += 1
            self.phase[rows] = phase
            return
        pending, phases = self.pending, self.phase
        for slot in slots:
            if phase == DECODE:
                pending[slot] += 1
            phases[slot] = phase

    def set_report(self, slot: int, request: Request) -> None:
        """The listener's latest report (after it changed)."""
        report = request.playback
        self.has_report[slot] = report is not None
        if report is None:
            self.report_at[slot] = self.report_buffered[slot] = self.frames_since[slot] = 0
        else:
            times = request.chunk_emit_times
            self.report_at[slot] = report.measured_at
            self.report_buffered[slot] = report.buffered_s
            ends = request.chunk_frame_ends
            index = bisect_right(times, report.measured_at)
            self.frames_since[slot] = (ends[-1] if ends else 0) - (
                ends[index - 1] if index > 0 else 0)

    # ------------------------------------------------------------------ views
    def request_list(self, slots: np.ndarray) -> list[Request]:
        requests = self.requests
        return [requests[s] for s in slots.tolist()]  # type: ignore[misc]
