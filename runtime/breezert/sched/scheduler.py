"""Scheduler: picks which requests advance which stage under slot, token, row and block budgets.

Owns the ``Request`` lifecycle (admission by slots, KV blocks, real-time capacity, the frame
cycle, the latter two decided with ``sched/admission.py``, and streams starting at once;
segments, KV blocks, chunks, finish) and emits one
``StepPlan`` per step, then consumes its ``StepResult``. Never imports torch and never reads the
clock: every method takes ``now`` (monotonic seconds). The stage choice and the chunk size are
policy objects (``StagePolicy``, ``ChunkPolicy``) so the deadline predictor can replace them.
They decide over the ``StreamTable`` (numpy columns per slot) that the scheduler keeps in step
with every change it makes to a running request: a step's readiness, ranking and pick cost a
few array operations, and so does a DECODE or DEPTH batch (arrays over its requests, read off
the table); Python runs per request only where a ``Request`` changes (a generated frame, a
phase, a chunk) and for the few items of the other stages.

One step: ``plan = schedule(now)``; the worker runs it; ``events = commit(plan, result, now)``.
"""

from __future__ import annotations

import heapq
from bisect import insort_right
from dataclasses import dataclass

import numpy as np

from breezert.config import SchedulerConfig
from breezert.constants import CODEBOOK_SIZE, FRAME_EOS_ID, FRAME_S, Stage
from breezert.errors import EngineOverloaded, InvalidRequest
from breezert.request import PlaybackReport, Request, RequestStatus, Segment, SegmentPhase
from breezert.sched.admission import (
    FrameCycle,
    RealtimeCapacity,
    capacity_wait,
    cycle_stream_limit,
    fits,
    stream_demand,
)
from breezert.sched.block_pool import BlockPool
from breezert.sched.deadline import DeadlinePredictor
from breezert.sched.load import EngineLoad, least_slack
from breezert.sched.plan import (
    CodecBatch,
    BATCHES,
    DecodeBatch,
    DepthBatch,
    NewRequestData,
    PrefillItem,
    StageItem,
    StageItems,
    StepPlan,
    StepResult,
    TextEncodeItem,
)
from breezert.sched.policy import (
    ChunkPolicy,
    DefaultStagePolicy,
    ScheduleChunkPolicy,
    StagePolicy,
)
from breezert.sched.slot_wait import (
    FramesPerToken,
    frame_time_s,
    predicted_slot_wait,
    remaining_frames,
)
from breezert.sched.streams import (
    DECODE,
    DEPTH,
    FEW_ROWS,
    NO_PHASE,
    PREFILL,
    STAGE_CODE,
    STAGES,
    TEXT_ENCODE,
    StreamTable,
)

STARTING_CHUNKS = 3
"""A stream is starting (``admission_max_starting``) until this many chunks are out."""
_CAPACITY_RECHECK_S = 0.05
"""While the head of the queue waits for real-time capacity, the running streams' demand is
computed again (a pass over them) at most this often, or at once after a segment or request
ends: a step with nobody admissible pays one count, not that pass."""

_TEXT_ENCODE, _PREFILL, _CODEC = (STAGE_CODE[s] for s in (Stage.TEXT_ENCODE, Stage.PREFILL,
                                                          Stage.CODEC))
_READY_BY_PHASE = np.zeros((len(STAGE_CODE), 6), bool)
"""Whether a segment phase (column: ``PHASE_CODE``, ``NO_PHASE`` the last) makes a stage
(row: ``STAGE_CODE``) ready by itself."""
for _stage, _phase in ((Stage.TEXT_ENCODE, TEXT_ENCODE), (Stage.PREFILL, PREFILL),
                       (Stage.DECODE, DECODE), (Stage.DEPTH, DEPTH)):
    _READY_BY_PHASE[STAGE_CODE[_stage], _phase] = True

# ----------------------------------------------------------------------------- events
# Values that nobody changes once built; slotted, not frozen, as the plan's items (sched/plan.py).


@dataclass(slots=True)
class ChunkEmitted:
    """A CODEC item was decoded: frames ``start_frame..start_frame+num_frames-1`` are audio."""

    request_id: str
    chunk_index: int
    start_frame: int
    num_frames: int
    segment_index: int
    """Text segment whose frames the chunk carries (the last one, if it spans two)."""
    is_final: bool
    time: float
    enqueue_time: float
    """When the request was added (its first chunk's ``time`` minus this is its TTFB)."""


@dataclass(slots=True)
class SegmentEnded:
    """A segment stopped generating (its KV blocks are free again)."""

    request_id: str
    segment_index: int
    num_frames: int
    reason: str
    """``eos`` or ``max_frames``."""


@dataclass(slots=True)
class RequestFinished:
    """A request reached a terminal status; its slot is released in the next plan."""

    request_id: str
    status: RequestStatus
    error: str | None
    time: float
    enqueue_time: float
    last_chunk_time: float | None
    """When its last chunk left (``None``: it emitted none)."""
    num_emitted_frames: int
    """Frames of audio it emitted."""
    overloaded: bool = False
    """Refused before it got a slot: it waited past ``max_queue_wait_s`` (retryable)."""
    retry_after_s: float | None = None
    """With ``overloaded``: its predicted wait still left when it was refused, if known."""


SchedulerEvent = ChunkEmitted | SegmentEnded | RequestFinished


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """A snapshot for metrics."""

    num_running: int
    num_waiting: int
    num_free_slots: int
    num_free_blocks: int
    num_blocks: int
    num_finished: dict[str, int]  # per terminal RequestStatus value


# ----------------------------------------------------------------------------- scheduler


class Scheduler:
    """Multi-stage scheduler over requests, slots and a ``BlockPool``.

    Args:
        config: Budgets and defaults.
        block_pool: The backbone KV block pool (the scheduler owns allocation).
        stage_policy: Ranks ready work; ``DefaultStagePolicy`` when ``None``.
        chunk_policy: Sizes chunks; ``ScheduleChunkPolicy`` when ``None``.
        buffers: Tells how far each listener is ahead, for the streams' real-time demand
            (``admission_capacity``): the engine's ``DeadlinePredictor`` (listener reports),
            else one from ``config`` (audio emitted since the first chunk).
    """

    def __init__(
        self,
        config: SchedulerConfig,
        block_pool: BlockPool,
        *,
        stage_policy: StagePolicy | None = None,
        chunk_policy: ChunkPolicy | None = None,
        buffers: DeadlinePredictor | None = None,
    ) -> None:
        self.config = config
        self.block_pool = block_pool
        self.stage_policy = stage_policy or DefaultStagePolicy(config.starvation_limit_s)
        self.chunk_policy = chunk_policy or ScheduleChunkPolicy()
        self._requests: dict[str, Request] = {}  # waiting + running
        self._waiting: list[Request] = []  # sorted by (-priority, enqueue_time), FIFO on ties
        self._running: dict[str, Request] = {}  # admission order
        self._short_of_blocks: set[str] = set()
        """Running requests with a segment still QUEUED (no KV blocks yet): the only ones
        ``_admit`` has blocks to give, so that admitting a burst does not walk every running
        request for each new one."""
        self._free_slots = list(range(config.max_running_requests))  # a heap: lowest first
        self._new_requests: list[NewRequestData] = []
        self._released: list[str] = []
        self._step_id = 0
        self._inflight: StepPlan | None = None
        self._held: list[tuple[int, list[Segment]]] = []
        """Slots and segments (KV blocks) of requests that ended while a plan naming them was
        in flight: the worker may still write them, so they are freed at that plan's commit."""
        self._num_finished = {s.value: 0 for s in RequestStatus if s.is_finished}
        self._frames_per_token = FramesPerToken()  # segments that ended by EOS
        self._table = StreamTable(config.max_running_requests)
        """The running requests' rows, by slot (what the policies decide on)."""
        self._num_admitted = 0
        self.capacity: RealtimeCapacity | None = None
        """The real-time capacity admission keeps within (``admission_capacity``), or ``None``."""
        if config.admission_capacity is not None:
            self.capacity = RealtimeCapacity(config.admission_capacity,
                                             config.admission_learn_window_s or None)
        self.cycle: FrameCycle | None = None
        """The frame cycle admission keeps within (``admission_max_cycle_s``), or ``None``."""
        if config.admission_max_cycle_s is not None:
            self.cycle = FrameCycle()
        self._buffers = buffers or DeadlinePredictor(
            feedback_stale_s=config.predictor_feedback_stale_s)
        self._capacity_recheck_at = -np.inf
        self._num_owing = 0  # running streams owed audio at the last schedule()
        self._apply = {Stage.TEXT_ENCODE: self._apply_text_encode,
                       Stage.PREFILL: self._apply_prefill}

    # ------------------------------------------------------------------ requests in
    def add_request(self, request: Request, now: float) -> None:
        """Queues a new request (WAITING) and admits it right away if a slot, blocks and the
        real-time capacity (``admission_capacity``) allow.

        Raises:
            InvalidRequest: duplicate id, or a segment that can never fit (too long for
                ``max_model_len`` or for the whole block pool).
            EngineOverloaded: it would be the (max_queued_requests+1)-th waiting request, or
                its predicted wait for a slot or for real-time capacity is past
                ``max_queue_wait_s`` (``reason`` says which; ``retry_after_s`` is that wait).
        """
        if request.request_id in self._requests or request.status is not RequestStatus.WAITING:
            raise InvalidRequest(f"request_id={request.request_id!r} is already known")
        self._resolve_defaults(request)
        for segment in request.segments:
            self._check_segment(request, segment)
        self._admit(now)  # requests already admissible go first
        request.enqueue_time = now
        self._requests[request.request_id] = request
        insort_right(self._waiting, request, key=lambda r: (-r.priority, r.enqueue_time))
        self._capacity_recheck_at = -np.inf  # an arrival sees the demand as it is now
        self._admit(now)
        if request.status is not RequestStatus.WAITING:
            return
        position = self._waiting.index(request)
        waits, demand = self._predicted_waits(request, position, now)
        known = {reason: wait for reason, wait in waits.items() if wait is not None}
        reason = max(known, key=known.__getitem__) if known else None
        wait = known[reason] if reason is not None else None
        max_queued, max_wait = self.config.max_queued_requests, self.config.max_queue_wait_s
        ahead = f"{len(self._waiting) - 1} waiting ahead or beside it"
        if len(self._waiting) > max_queued:
            refusal = EngineOverloaded(f"{max_queued} requests already waiting "
                                       f"(max_queued_requests={max_queued})", wait, "queue_full")
        elif max_wait is None or wait is None or wait <= max_wait:
            return
        elif reason == "cycle":
            refusal = EngineOverloaded(
                f"its predicted wait for room in the frame cycle is {wait:.1f} s "
                f"(max_queue_wait_s={max_wait:g}): {self._owing_count()} streams are owed audio "
                f"and the engine's cycle of {1000 * (self.cycle.value or 0.0):.1f} ms feeds "
                f"{self._cycle_limit():.1f} within admission_max_cycle_s="
                f"{self.config.admission_max_cycle_s:g}; {ahead}", wait, reason)
        elif reason == "starting":
            refusal = EngineOverloaded(
                f"its predicted wait for one of {len(self._starting_rows())} streams starting "
                f"to get through its first {STARTING_CHUNKS} chunks is {wait:.1f} s "
                f"(admission_max_starting={self.config.admission_max_starting}, "
                f"max_queue_wait_s={max_wait:g}); {ahead}", wait, reason)
        elif reason == "capacity":
            assert self.capacity is not None
            cfg = self.config
            refusal = EngineOverloaded(
                f"its predicted wait for real-time capacity is {wait:.1f} s (max_queue_wait_s="
                f"{max_wait:g}): the running streams need {demand:.1f} s of audio per second "
                f"of the {cfg.admission_headroom * self.capacity.value:.1f} it admits "
                f"(admission_headroom={cfg.admission_headroom:g} of a capacity of "
                f"{self.capacity.value:.1f}); {ahead}", wait, reason)
        else:
            refusal = EngineOverloaded(
                f"its predicted wait for a slot is {wait:.1f} s (max_queue_wait_s={max_wait:g}; "
                f"{len(self._running)} running, {ahead})", wait, reason)
        self._waiting.remove(request)
        del self._requests[request.request_id]
        raise refusal

    def _predicted_waits(self, request: Request, position: int,
                         now: float) -> tuple[dict[str, float | None], float]:
        """What the waiting ``request`` at ``position`` waits for, and for how long (``None``:
        unknown): ``slot_wait`` (a slot, or KV blocks: the running requests' ends),
        ``capacity`` (real-time room: the running streams' generation ends) and ``cycle`` (room
        in the frame cycle: the same ends); and the running streams' real-time demand (0
        without ``admission_capacity``)."""
        waits: dict[str, float | None] = {}
        room_bound, total = False, 0.0  # held back by the real-time capacity or the cycle
        ends = None
        if self.capacity is not None:
            demand, ends = self._demand(now)
            limit, total = self.config.admission_headroom * self.capacity.value, float(demand.sum())
            room_bound = not fits(total, position + 1, limit)
            if room_bound:
                waits["capacity"] = capacity_wait(demand, ends, position + 1, limit)
        cycle_limit = self._cycle_limit()
        if self.cycle is not None and self._owing_count() + position + 1 > cycle_limit:
            room_bound = True
            if ends is None:
                ends = self._demand(now)[1]
            waits["cycle"] = capacity_wait(np.ones_like(ends), ends, position + 1, cycle_limit)
        most = self.config.admission_max_starting
        if most is not None and len(self._starting_rows()) + position + 1 > most:
            room_bound = True
            waits["starting"] = self._starting_wait(position, most, now)
        first = request.segments[0] if request.segments else None
        if (not room_bound or position >= len(self._free_slots) or first is None
                or not self.block_pool.can_allocate(
                    sum(first.blocks_per_branch(self.block_pool.block_size)))):
            waits["slot_wait"] = self.predicted_queue_wait(position, now)
        return waits, total

    def predicted_queue_wait(self, position: int, now: float) -> float | None:
        """Seconds until the request at ``position`` (0 = next) of the waiting queue gets a slot,
        from the running requests' remaining audio and their time per frame
        (``sched/slot_wait.py``); ``None`` when unknown."""
        return predicted_slot_wait(list(self._running.values()), position, now,
                                   self._frames_per_token.value)

    def expire_waiting(self, now: float) -> list[SchedulerEvent]:
        """Refuses the waiting requests that waited past ``max_queue_wait_s`` (FAILED with
        ``overloaded`` and the longest of their predicted waits still left, if any is known:
        the caller may retry then, or elsewhere)."""
        max_wait = self.config.max_queue_wait_s
        if max_wait is None:
            return []
        waited = {r.request_id: now - r.enqueue_time for r in self._waiting
                  if r.enqueue_time is not None}
        late = [r for r in self._waiting if waited.get(r.request_id, 0.0) > max_wait]
        events = []
        for request in late:
            waits, _ = self._predicted_waits(request, self._waiting.index(request), now)
            known = [wait for wait in waits.values() if wait is not None]
            events.append(self._finish(
                request, RequestStatus.FAILED, now,
                f"waited {waited[request.request_id]:.1f} s for a slot "
                f"(max_queue_wait_s={max_wait:g})", overloaded=True,
                retry_after_s=max(known) if known else None))
        return events

    def append_segment(self, request_id: str, segment: Segment, now: float) -> None:
        """Adds a text segment to a live request whose input is still open.

        Raises:
            InvalidRequest: unknown or finished request, input closed, or a bad segment.
        """
        request = self._live(request_id)
        if request.input_closed:
            raise InvalidRequest(f"request {request_id}: input is closed")
        self._check_segment(request, segment)
        request.add_segment(segment)
        self._track_blocks(request)
        if request.slot is not None:
            self._table.set_segments(request.slot, request)
        self._admit(now)

    def close_input(self, request_id: str, now: float) -> list[SchedulerEvent]:
        """Marks that no more segments come; finishes the request if nothing is left to do."""
        request = self._live(request_id)
        request.input_closed = True
        if request.slot is not None:
            self._table.input_closed[request.slot] = True
        return self._maybe_finish(request, now)

    def abort(self, request_id: str, now: float) -> list[SchedulerEvent]:
        """Aborts a waiting or running request, freeing its slot and blocks at once.

        Returns ``[]`` for an unknown or already finished request.
        """
        request = self._requests.get(request_id)
        if request is None:
            return []
        return [self._finish(request, RequestStatus.ABORTED, now)]

    def report_playback(self, request_id: str, report: PlaybackReport) -> bool:
        """Hands the listener's report to a live request; False if it is not live."""
        request = self._requests.get(request_id)
        if request is None:
            return False
        request.report_playback(report)
        if request.slot is not None:
            self._table.set_report(request.slot, request)
        return True

    # ------------------------------------------------------------------ one step
    def schedule(self, now: float) -> StepPlan | None:
        """Admits what fits, then plans one stage over a batch; ``None`` if nothing is ready.

        Raises:
            RuntimeError: the previous plan has not been committed.
        """
        if self._inflight is not None:
            raise RuntimeError(f"step {self._inflight.step_id} is not committed yet")
        self._admit(now)
        self._table.step_memo = {}  # the table stays as it is until the plan is built
        try:
            slots, stages, codec_frames = self._ready(now)
            if not len(slots):
                return None
            if len(slots) == 1:  # a lone ready pair: nothing to rank, any policy runs it
                stage, candidates = STAGES[int(stages[0])], slots
            else:
                ranked = self.stage_policy.rank(self._table, slots, stages, now)
                stage, candidates = self.stage_policy.pick(self._table, ranked, now)
        finally:
            self._table.step_memo = None
        items = self._build_items(stage, candidates, codec_frames)
        self._mark_served(stage, items, now)
        self._step_id += 1
        plan = StepPlan(self._step_id, stage, items, tuple(self._new_requests),
                        tuple(self._released))
        self._new_requests.clear()
        self._released.clear()
        self._inflight = plan
        return plan

    def commit(self, plan: StepPlan, result: StepResult, now: float) -> list[SchedulerEvent]:
        """Applies the worker's result of ``plan``; returns what happened, in order.

        A ``failed`` entry fails that request only. Items of requests that ended meanwhile
        (aborted) are ignored.

        Raises:
            ValueError: ``plan`` is not the plan in flight, or ``result`` belongs to another step.
        """
        inflight = self._inflight
        if inflight is None or plan.step_id != inflight.step_id or result.step_id != plan.step_id:
            raise ValueError(f"commit of step {result.step_id} does not match the plan in flight")
        self._inflight = None
        for slot, segments in self._held:
            for seg in segments:
                self._free_blocks(seg)
            heapq.heappush(self._free_slots, slot)
        self._held.clear()
        events: list[SchedulerEvent] = []
        for request_id, reason in result.failed.items():
            if request_id in self._running:
                events.append(self._finish(self._running[request_id], RequestStatus.FAILED,
                                           now, reason))
        table, running = self._table, self._running
        items = plan.items
        if isinstance(items, DecodeBatch):
            self._commit_decode(items)
        elif isinstance(items, DepthBatch):
            events.extend(self._commit_depth(items, result, now))
        elif isinstance(items, CodecBatch):
            events.extend(self._commit_codec(items, now))
        else:
            apply = self._apply[plan.stage]
            for item in items:
                request = running.get(item.request_id)
                if request is not None:
                    apply(request, item)
        # requests with nothing left to generate or decode may finish now (their input closed):
        # after CODEC any of the plan's, after DEPTH those whose segment just ended; after the
        # other stages every item's request still has its active segment
        if isinstance(items, CodecBatch) and len(items) <= FEW_ROWS:
            live, phase, pending = table.live, table.phase, table.pending
            done = [slot for slot in items.slots.tolist() if live[slot]
                    and phase[slot] == NO_PHASE and pending[slot] == 0]
        elif isinstance(items, CodecBatch):
            slots = items.slots
            done = slots[table.live[slots] & (table.phase[slots] == NO_PHASE)
                         & (table.pending[slots] == 0)].tolist()
        elif plan.stage is Stage.DEPTH:
            done = [slot for event in events if isinstance(event, SegmentEnded)
                    and (slot := running[event.request_id].slot) is not None
                    and table.phase[slot] == NO_PHASE and table.pending[slot] == 0]
        else:
            done = []
        for slot in dict.fromkeys(done):
            request = table.requests[slot]
            assert request is not None
            events.extend(self._maybe_finish(request, now))
        return events

    def _commit_decode(self, batch: DecodeBatch) -> None:
        """Each live request's active segment moves on to DEPTH: a phase write per segment,
        the table's rows in one write."""
        table = self._table
        advanced = table.held(batch.slots)
        segments, depth = table.segments, SegmentPhase.DEPTH
        for slot in advanced:
            segments[slot].phase = depth  # type: ignore[union-attr]
        table.advance(advanced, DEPTH)

    def _commit_depth(self, batch: DepthBatch, result: StepResult,
                      now: float) -> list[SchedulerEvent]:
        """Each live request's first code: a frame (one more frame of the segment and of the
        request, then DECODE, or the segment's end at its frame limit), EOS (the segment ends)
        or a bad code (the request fails); the table's rows of the advanced ones in one write."""
        table, first_codes = self._table, result.first_codes
        requests, segments = table.requests, table.segments
        advanced: list[int] = []
        events: list[SchedulerEvent] = []
        for slot in table.held(batch.slots):
            request = requests[slot]
            assert request is not None
            request_id = request.request_id
            seg = segments[slot]
            assert seg is not None
            code = first_codes.get(request_id)
            if code is not None and 0 <= code < CODEBOOK_SIZE:
                seg.num_frames += 1
                request.num_frames += 1
                if seg.num_frames < seg.max_frames:
                    seg.phase = SegmentPhase.DECODE
                    advanced.append(slot)
                    continue
                table.pending[slot] = request.num_pending_frames
                events.append(self._end_segment(request, seg, "max_frames"))
            elif code == FRAME_EOS_ID:
                events.append(self._end_segment(request, seg, "eos"))
            else:
                reason = f"DEPTH returned first code {code!r} (expected 0..2047 or EOS 2051)"
                events.append(self._finish(request, RequestStatus.FAILED, now, reason))
        table.advance(advanced, DECODE)
        return events

    def _commit_codec(self, batch: CodecBatch, now: float) -> list[SchedulerEvent]:
        """The live requests' chunks: the chunk policy sees them before they are recorded, then
        each request's log and event (what leaves the engine), and the table's rows in one
        write. A chunk's segment is the active one when its last frame is past the active
        segment's start (the table's columns, past ``FEW_ROWS`` chunks); otherwise the
        request's segments are walked."""
        table = self._table
        held = table.held(batch.slots)
        if len(held) < len(batch):  # some ended since the plan: their rows are empty
            if not held:
                return []
            batch = batch.select(table.live[batch.slots])
        rows, frames = batch.slots, batch.num_frames
        self.chunk_policy.on_chunks(table, rows, frames, now)
        segment_index = [-1] * len(held)  # -1: walk the segments (a few rows: each does)
        if len(held) > FEW_ROWS:
            in_active = (table.phase[rows] != NO_PHASE) & (
                table.decoded[rows] + frames > table.segment_start[rows])
            segment_index = np.where(in_active, table.active_index[rows], -1).tolist()
        events: list[SchedulerEvent] = []
        targets = []
        requests = table.requests
        for slot, start, num, final, index in zip(
                held, batch.start_frame.tolist(), frames.tolist(), batch.is_final.tolist(),
                segment_index, strict=True):
            request = requests[slot]
            assert request is not None
            request.num_decoded_frames += num
            request.record_chunk(now)
            schedule = request.chunk_schedule
            num_chunks = len(request.chunk_emit_times)
            targets.append(schedule[min(num_chunks, len(schedule) - 1)])  # type: ignore[index]
            events.append(ChunkEmitted(
                request.request_id, num_chunks - 1, start, num,
                index if index >= 0 else _segment_of(request, start + num), final, now,
                request.enqueue_time))
        table.record_chunks(rows, frames, targets, now)
        return events

    def take_released(self) -> tuple[str, ...]:
        """Releases not yet sent in a plan; the caller hands them to the worker itself.

        For when ``schedule`` returns ``None``: without a next plan, an idle worker would keep
        the finished requests' slot state forever.
        """
        released = tuple(self._released)
        self._released.clear()
        return released

    # ------------------------------------------------------------------ queries
    def has_work(self) -> bool:
        """Whether any request is waiting or running (``schedule`` may still return ``None``
        while every running request waits for input)."""
        return bool(self._requests)

    def get_request(self, request_id: str) -> Request | None:
        """The live (waiting or running) request, or ``None``."""
        return self._requests.get(request_id)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def load(self, predictor: DeadlinePredictor | None, now: float) -> EngineLoad:
        """Running and queued requests against the limits, ``predictor``'s least slack, and the
        running streams' real-time demand against its limit (with ``admission_capacity``)."""
        cfg = self.config
        demand = limit = None
        if self.capacity is not None:
            demand = float(self._demand(now)[0].sum())
            limit = cfg.admission_headroom * self.capacity.value
        return EngineLoad(len(self._running), len(self._waiting), cfg.max_running_requests,
                          cfg.max_queued_requests,
                          None if predictor is None else least_slack(self._table, predictor, now),
                          demand, limit)

    def stats(self) -> SchedulerStats:
        pool = self.block_pool
        return SchedulerStats(len(self._running), len(self._waiting), len(self._free_slots),
                              pool.num_free, pool.num_blocks, dict(self._num_finished))

    # ------------------------------------------------------------------ admission
    def _resolve_defaults(self, request: Request) -> None:
        cfg = self.config
        request.max_frames = request.max_frames or cfg.default_max_frames
        request.chunk_schedule = request.chunk_schedule or cfg.default_chunk_schedule
        if max(request.chunk_schedule) > cfg.max_codec_frames:
            raise InvalidRequest(f"chunk_schedule={request.chunk_schedule}: entries must be <= "
                                 f"max_codec_frames={cfg.max_codec_frames}")

    def _check_segment(self, request: Request, segment: Segment) -> None:
        assert request.max_frames is not None
        if segment.num_branches != request.num_branches:
            raise InvalidRequest(f"prompt_lens={segment.prompt_lens}: request "
                                 f"{request.request_id} has {request.num_branches} CFG branch(es)")
        limit = self.config.max_model_len - 1 - max(segment.prompt_lens)
        segment.max_frames = min(request.max_frames, limit)
        if segment.max_frames <= 0:
            raise InvalidRequest(f"prompt_lens={segment.prompt_lens}: no room for frames within "
                                 f"max_model_len={self.config.max_model_len}")
        need = sum(segment.blocks_per_branch(self.block_pool.block_size))
        if need > self.block_pool.num_blocks:
            raise InvalidRequest(f"prompt_lens={segment.prompt_lens}: needs {need} KV blocks, "
                                 f"the pool has {self.block_pool.num_blocks}")

    def _admit(self, now: float) -> None:
        """Hands out blocks and slots: running requests' active segments, then waiting
        requests (strict priority/FIFO order: a request that does not fit, in slots, blocks or
        real-time capacity, blocks those behind it), then lookahead segments."""
        for request in self._awaiting_blocks():
            self._allocate_segments(request, lookahead=0)
        for request in list(self._waiting):
            if not self._free_slots:
                break
            if not request.segments:
                continue  # open input without text yet: nothing to admit, blocks nobody
            if not self._has_capacity(now) or not self._allocate(request.segments[0]):
                break
            self._start(request)
        for request in self._awaiting_blocks():
            self._allocate_segments(request, lookahead=self.config.max_lookahead_segments)

    def _has_capacity(self, now: float) -> bool:
        """Whether one more stream fits the frame cycle, the streams starting at once
        (``admission_max_starting``) and the real-time capacity (each always without its
        bound): the first two by a count of the streams owed audio; the capacity at once when
        they fit even at 1 s/s each (a count), otherwise from their demand, computed again at
        most every ``_CAPACITY_RECHECK_S`` unless something ended."""
        if self.cycle is not None and self._owing_count() + 1 > self._cycle_limit():
            return False
        most = self.config.admission_max_starting
        if most is not None and len(self._starting_rows()) >= most:
            return False
        capacity = self.capacity
        if capacity is None:
            return True
        limit = self.config.admission_headroom * capacity.value
        if fits(float(self._owing_count()), 1, limit):
            return True
        if now < self._capacity_recheck_at:
            return False
        if fits(float(self._demand(now)[0].sum()), 1, limit):
            return True
        self._capacity_recheck_at = now + _CAPACITY_RECHECK_S
        return False

    def _starting_rows(self) -> np.ndarray:
        """Rows of the running streams still in their start: owed audio, fewer than
        ``STARTING_CHUNKS`` chunks out."""
        table = self._table
        return np.flatnonzero(table.live & (table.phase != NO_PHASE)
                              & (table.num_chunks < STARTING_CHUNKS))

    def _starting_wait(self, position: int, most: int, now: float) -> float | None:
        """Seconds until the waiting request at ``position`` fits ``admission_max_starting``:
        each starting stream is through its start once it has made the frames of its first
        ``STARTING_CHUNKS`` chunks, at the running requests' time per frame; ``None`` before
        any frame was made."""
        per_frame = frame_time_s(list(self._running.values()), now)
        if per_frame is None:
            return None
        left = [max(1, sum(r.chunk_schedule[:STARTING_CHUNKS])  # type: ignore[index]
                    - r.num_frames) for r in self._table.request_list(self._starting_rows())]
        ends = np.array(left, float) * per_frame
        return capacity_wait(np.ones_like(ends), ends, position + 1, most)

    def _owing_count(self) -> int:
        """Running streams owed audio (a segment in a phase)."""
        table = self._table
        return int(np.count_nonzero(table.live & (table.phase != NO_PHASE)))

    def _cycle_limit(self) -> float:
        """Streams owed audio the frame cycle can feed within ``admission_max_cycle_s``
        (``inf`` without that bound or before a cycle was measured)."""
        bound = self.config.admission_max_cycle_s
        if self.cycle is None or bound is None:
            return np.inf
        return cycle_stream_limit(self.cycle.value, self._num_owing, bound)

    def _demand(self, now: float) -> tuple[np.ndarray, np.ndarray]:
        """Per running stream owed audio: its real-time demand (s/s) and its predicted end of
        generation (seconds from ``now``; NaN: unknown), ``sched/admission.py``."""
        table = self._table
        rows = np.flatnonzero(table.live & (table.phase != NO_PHASE))
        requests = table.request_list(rows)
        ratio = self._frames_per_token.value
        frames = np.array([np.nan if (n := remaining_frames(r, ratio)) is None else n
                           for r in requests], float)
        demand = stream_demand(frames * FRAME_S, self._buffers.buffered(table, rows, now))
        per_frame = frame_time_s(requests, now)
        return demand, frames * (np.nan if per_frame is None else per_frame)

    def observe_step(self, plan: StepPlan, duration_s: float) -> None:
        """One executed step, for the learned real-time capacity (O(1)): the engine calls it
        after each commit with the busy time since the previous step ended (the step and the
        host work before it), or the step's own time after an idle spell."""
        if self.capacity is not None:
            frames = len(plan.items) if plan.stage is Stage.DEPTH else 0
            self.capacity.observe_step(duration_s, frames, self._num_owing)
        if self.cycle is not None:
            self.cycle.observe_step(duration_s, plan.stage is Stage.DEPTH)

    def _awaiting_blocks(self) -> list[Request]:
        """Running requests that have a QUEUED segment, in admission order."""
        short = self._short_of_blocks
        return [r for r in self._running.values() if r.request_id in short] if short else []

    def _track_blocks(self, request: Request) -> None:
        """Keeps ``request`` in ``_short_of_blocks`` exactly while it runs with a QUEUED
        segment."""
        if request.request_id in self._running and any(
                seg.phase is SegmentPhase.QUEUED for seg in request.segments):
            self._short_of_blocks.add(request.request_id)
        else:
            self._short_of_blocks.discard(request.request_id)

    def _start(self, request: Request) -> None:
        self._waiting.remove(request)
        request.status = RequestStatus.RUNNING
        request.slot = heapq.heappop(self._free_slots)
        self._running[request.request_id] = request
        self._num_admitted += 1
        self._table.add(request.slot, request, self._num_admitted)
        self._track_blocks(request)
        self._new_requests.append(NewRequestData(
            request_id=request.request_id, slot=request.slot, num_branches=request.num_branches,
            cfg_scale=request.cfg_scale, seed=request.seed, sampling=request.sampling,
            ignore_eos=request.ignore_eos,
        ))

    def _allocate_segments(self, request: Request, lookahead: int) -> None:
        active = request.active_segment
        if active is None:
            return
        for segment in request.segments[active.index: active.index + 1 + lookahead]:
            if segment.phase is SegmentPhase.QUEUED and not self._allocate(segment):
                break
        self._track_blocks(request)
        self._table.set_segments(_slot(request), request)

    def _allocate(self, segment: Segment) -> bool:
        need = segment.blocks_per_branch(self.block_pool.block_size)
        if not self.block_pool.can_allocate(sum(need)):
            return False
        segment.block_ids = tuple(tuple(self.block_pool.allocate(n)) for n in need)
        segment.phase = SegmentPhase.TEXT_ENCODE
        return True

    # ------------------------------------------------------------------ readiness
    def _ready(self, now: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The ready (slot, stage code) pairs, and the CODEC item size per slot (0 = not
        ready; the chunk policy is asked once per step for every request with pending frames).

        Generation stages of the active segment; TEXT_ENCODE/PREFILL of lookahead segments only
        while the active one generates (see ``_segments_in``); CODEC when a chunk is full, or
        with whatever is pending when no segment can generate now (generation is done, or the
        next segment is not ready or not there yet: a gap in the audio anyway). Keeps each
        pair's ``ready_since`` (the step since which it has been ready unserved)."""
        table = self._table
        if self.capacity is not None or self.cycle is not None:  # admission's count of the
            # streams owed audio (the ones the next steps, and so the cycle, serve)
            self._num_owing = int(np.count_nonzero(table.phase[table.live_slots] != NO_PHASE))
        if len(table.live_slots) <= FEW_ROWS:
            return self._ready_rows(now)
        return self._ready_arrays(now)

    def _ready_arrays(self, now: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``_ready`` as array operations over the table's whole columns (a free row has no
        phase and no pending frames, so it is never ready: no gather of the live rows)."""
        table = self._table
        phase, pending = table.phase, table.pending
        generating = phase >= DEPTH  # DEPTH or DECODE
        ready = _READY_BY_PHASE[:, phase]  # in STAGES order; CODEC and lookahead below
        ready[_TEXT_ENCODE] |= generating & table.later_text_encode
        ready[_PREFILL] |= generating & table.later_prefill
        codec_frames = np.zeros(len(phase), np.int64)
        rows = np.flatnonzero(pending)
        if len(rows):
            target = np.minimum(np.maximum(self.chunk_policy.chunk_frames(table, rows, now), 1),
                                self.config.max_codec_frames)
            waiting = pending[rows]
            frames = np.where(waiting >= target, target,
                              np.where(generating[rows], 0, waiting))
            codec_frames[rows] = frames
            ready[_CODEC, rows] = frames > 0
        since = table.ready_since
        np.copyto(since, self._step_id, where=ready & (since < 0))
        np.copyto(since, -1, where=~ready)
        stages, slots = np.nonzero(ready)
        return slots, stages, codec_frames

    def _ready_rows(self, now: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``_ready`` row by row, for a few running requests: the same pairs in the same order
        (stage code, then slot) and the same ``ready_since`` as ``_ready_arrays``, whose ~20
        numpy calls cost three times this at one or two streams, at each step of a first
        packet (tests/unit/test_sched_vectorized.py holds the two equal)."""
        table = self._table
        live = table.live_slots.tolist()
        pending, since, step = table.pending, table.ready_since, self._step_id
        codec_frames = np.zeros(len(table.live), np.int64)
        waiting = {slot: int(pending[slot]) for slot in live if pending[slot] > 0}
        if waiting:
            rows = np.fromiter(waiting, np.int64, len(waiting))
            targets = self.chunk_policy.chunk_frames(table, rows, now).tolist()
            max_frames = self.config.max_codec_frames
            for (slot, frames), target in zip(waiting.items(), targets, strict=True):
                target = min(max(target, 1), max_frames)
                codec_frames[slot] = waiting[slot] = (
                    target if frames >= target else 0 if table.phase[slot] >= DEPTH else frames)
        pairs: list[tuple[int, int]] = []
        for slot in live:
            phase = int(table.phase[slot])
            generating = phase >= DEPTH
            ready = (phase == TEXT_ENCODE or generating and bool(table.later_text_encode[slot]),
                     phase == PREFILL or generating and bool(table.later_prefill[slot]),
                     phase == DECODE, phase == DEPTH, waiting.get(slot, 0) > 0)  # STAGES order
            for code, is_ready in enumerate(ready):
                if not is_ready:
                    since[code, slot] = -1
                    continue
                if since[code, slot] < 0:
                    since[code, slot] = step
                pairs.append((code, slot))
        pairs.sort()
        return (np.array([slot for _, slot in pairs], np.int64),
                np.array([code for code, _ in pairs], np.int64), codec_frames)

    # ------------------------------------------------------------------ batching
    def _build_items(self, stage: Stage, slots: np.ndarray, codec_frames: np.ndarray) \
            -> StageItems:
        if stage is Stage.DECODE:
            return self._decode_batch(self._generate_slots(stage, slots))
        if stage is Stage.DEPTH:
            return self._depth_batch(self._generate_slots(stage, slots))
        if stage is Stage.CODEC:
            return self._codec_batch(slots, codec_frames)
        candidates = self._table.request_list(slots)
        if stage is Stage.TEXT_ENCODE:
            return tuple(self._text_encode_items(candidates))
        if stage is Stage.PREFILL:
            return tuple(self._prefill_items(candidates))
        raise AssertionError(stage)

    def _text_encode_items(self, candidates: list[Request]) -> list[StageItem]:
        cfg = self.config
        items: list[StageItem] = []
        num_tokens = num_requests = 0
        for request in candidates:
            if num_requests == cfg.max_text_encode_requests:
                break
            before = len(items)
            for seg in _segments_in(request, SegmentPhase.TEXT_ENCODE):
                assert seg.num_text_tokens is not None
                if items and num_tokens + seg.num_text_tokens > cfg.max_text_encode_tokens:
                    break  # the first item always runs, even when longer than the budget
                items.append(TextEncodeItem(request.request_id, _slot(request), seg.index,
                                            seg.num_text_tokens, seg.prompt))
                num_tokens += seg.num_text_tokens
            num_requests += len(items) > before
        return items

    def _prefill_items(self, candidates: list[Request]) -> list[StageItem]:
        items: list[StageItem] = []
        budget, num_requests = self.config.max_prefill_tokens, 0
        for request in candidates:
            if num_requests == self.config.max_prefill_requests or budget == 0:
                break
            before = len(items)
            for seg in _segments_in(request, SegmentPhase.PREFILL):
                for branch, (length, cursor) in enumerate(zip(seg.prompt_lens,
                                                              seg.prefill_cursors, strict=True)):
                    num_tokens = min(length - cursor, budget)
                    if num_tokens <= 0:
                        continue
                    items.append(PrefillItem(
                        request.request_id, _slot(request), seg.index, branch, cursor,
                        num_tokens, seg.block_ids[branch], cursor + num_tokens == length))
                    budget -= num_tokens
            num_requests += len(items) > before
        return items

    def _generate_slots(self, stage: Stage, candidates: np.ndarray) -> np.ndarray:
        """The candidates (ranked slots) that join a DECODE or DEPTH batch: in order, each that
        still fits the row limit (a 1-branch request behind a 2-branch one that did not fit may),
        up to the request limit."""
        cfg = self.config
        if stage is Stage.DECODE:
            max_requests, max_rows = cfg.max_decode_requests, cfg.max_decode_rows
        else:
            max_requests, max_rows = cfg.max_depth_requests, cfg.max_depth_rows
        if len(candidates) <= max_requests and 2 * len(candidates) <= max_rows:
            return candidates  # all fit, whatever their branches
        taken = _fill(self._table.num_branches[candidates], max_rows)
        return candidates[taken[:max_requests]]

    def _decode_batch(self, slots: np.ndarray) -> DecodeBatch:
        """Each request's active segment fed the frame DEPTH just produced."""
        table = self._table
        frame_index = table.decoded[slots] + table.pending[slots] - table.segment_start[slots] - 1
        block_ids = table.block_ids
        return DecodeBatch(tuple(table.request_ids[slots].tolist()), slots,
                           table.active_index[slots], frame_index, table.num_branches[slots],
                           table.prompt_lens[slots] + frame_index[:, None],
                           tuple([block_ids[slot] for slot in slots.tolist()]))

    def _depth_batch(self, slots: np.ndarray) -> DepthBatch:
        """Each request's next frame of its active segment."""
        table = self._table
        output_frame_index = table.decoded[slots] + table.pending[slots]
        return DepthBatch(tuple(table.request_ids[slots].tolist()), slots,
                          table.active_index[slots],
                          output_frame_index - table.segment_start[slots],
                          table.num_branches[slots], output_frame_index)

    def _codec_batch(self, candidates: np.ndarray, codec_frames: np.ndarray) -> CodecBatch:
        """A chunk of each candidate (ranked slots, ``codec_frames`` frames) that still fits
        the step's frame budget (the first always; a smaller chunk behind one that did not fit
        may), up to the request limit."""
        cfg, table = self.config, self._table
        candidates = candidates[: cfg.max_codec_requests]
        budget = cfg.max_codec_step_frames
        if table.num_chunks[candidates[0]] == 0:  # a first packet leads: keep it quick
            budget = min(budget, cfg.max_startup_codec_step_frames)
        frames = codec_frames[candidates]
        if len(candidates) > 1:
            taken = _fill(frames, budget, first_always=True)
            candidates, frames = candidates[taken], frames[taken]
        is_final = ((frames == table.pending[candidates]) & table.input_closed[candidates]
                    & (table.phase[candidates] == NO_PHASE))
        return CodecBatch(tuple(table.request_ids[candidates].tolist()), candidates,
                          table.decoded[candidates], frames, table.num_chunks[candidates] == 0,
                          is_final)

    def _mark_served(self, stage: Stage, items: StageItems, now: float) -> None:
        """The served requests are ready unserved no more; a first serve is timed."""
        if isinstance(items, BATCHES):
            slots = items.slots.tolist()
        else:
            slots = [item.slot for item in items]
        table = self._table
        since, served = table.ready_since[STAGE_CODE[stage]], table.is_served
        if len(slots) > FEW_ROWS:
            since[slots] = -1
            first = [slot for slot, done in zip(slots, served[slots].tolist()) if not done]
        else:
            for slot in slots:
                since[slot] = -1
            first = [slot for slot in slots if not served[slot]]
        for slot in first:
            served[slot] = True
            request = table.requests[slot]
            assert request is not None
            request.first_scheduled_time = now

    # ------------------------------------------------------------------ results
    # Appliers of one TEXT_ENCODE or PREFILL item: each changes its request and its table row
    # (neither has events). DECODE, DEPTH and CODEC: ``_commit_*``.
    def _apply_text_encode(self, request: Request, item: TextEncodeItem) -> None:
        request.segments[item.segment_index].phase = SegmentPhase.PREFILL
        self._table.set_segments(item.slot, request)

    def _apply_prefill(self, request: Request, item: PrefillItem) -> None:
        seg = request.segments[item.segment_index]
        assert seg.prefill_cursors[item.branch] == item.start_pos
        seg.prefill_cursors[item.branch] += item.num_tokens
        if seg.prefill_cursors == list(seg.prompt_lens):
            seg.phase = SegmentPhase.DEPTH
            self._table.set_segments(item.slot, request)

    def _end_segment(self, request: Request, seg: Segment, reason: str) -> SegmentEnded:
        seg.phase = SegmentPhase.ENDED
        self._capacity_recheck_at = -np.inf  # less demand: the queue's head may fit now
        if reason == "eos":
            self._frames_per_token.observe(seg.num_frames, seg.num_text_tokens)
        self._free_blocks(seg)
        self._table.set_segments(_slot(request), request)
        return SegmentEnded(request.request_id, seg.index, seg.num_frames, reason)

    def _maybe_finish(self, request: Request, now: float) -> list[SchedulerEvent]:
        if request.is_generation_done and request.num_pending_frames == 0:
            return [self._finish(request, RequestStatus.FINISHED, now)]
        return []

    def _finish(self, request: Request, status: RequestStatus, now: float,
                error: str | None = None, *, overloaded: bool = False,
                retry_after_s: float | None = None) -> RequestFinished:
        """Moves a live request to a terminal status and frees everything it holds."""
        self._capacity_recheck_at = -np.inf
        if request.status is RequestStatus.WAITING:
            self._waiting.remove(request)
        else:
            assert request.slot is not None
            if self._inflight is not None and request.request_id in self._inflight.request_ids:
                self._held.append((request.slot, list(request.segments)))
            else:
                for seg in request.segments:
                    self._free_blocks(seg)
                heapq.heappush(self._free_slots, request.slot)
            del self._running[request.request_id]
            self._table.remove(request.slot)
            self._short_of_blocks.discard(request.request_id)
            pending = [d for d in self._new_requests if d.request_id != request.request_id]
            if len(pending) == len(self._new_requests):
                self._released.append(request.request_id)  # the worker knows it: release
            self._new_requests[:] = pending
        del self._requests[request.request_id]
        request.status, request.finish_time, request.error = status, now, error
        self._num_finished[status.value] += 1
        return RequestFinished(request.request_id, status, error, now, request.enqueue_time,
                               request.last_chunk_time, request.num_decoded_frames, overloaded,
                               retry_after_s)

    def _free_blocks(self, seg: Segment) -> None:
        for table in seg.block_ids:
            self.block_pool.free(table)
        seg.block_ids = ()

    def _live(self, request_id: str) -> Request:
        request = self._requests.get(request_id)
        if request is None:
            raise InvalidRequest(f"request_id={request_id!r} is unknown or already finished")
        return request


def _fill(sizes: np.ndarray, budget: int, *, first_always: bool = False) -> np.ndarray:
    """The indices of ``sizes`` (each >= 1) that join a batch within ``budget``, in order: each
    that fits what those before it left (the first one always, with ``first_always``); one
    that does not fit is skipped, a smaller one behind it may still join. The prefix that fits
    costs a cumulative sum; the entries past it go one by one."""
    total = np.cumsum(sizes)
    fit = int(np.searchsorted(total, budget, "right"))
    if fit == len(sizes):
        return np.arange(fit)
    fit = max(fit, 1) if first_always else fit
    taken, left = list(range(fit)), budget - (int(total[fit - 1]) if fit else 0)
    for i, size in enumerate(sizes[fit:].tolist(), fit):
        if left <= 0:
            break
        if size <= left:
            taken.append(i)
            left -= size
    return np.array(taken, np.int64)


def _segments_in(request: Request, phase: SegmentPhase) -> list[Segment]:
    """Segments in ``phase`` that may run now: the active one, and lookahead segments only once
    the active one generates (lookahead must never delay the active segment's first frame)."""
    active = request.active_segment
    if active is None:
        return []
    return [s for s in request.segments
            if s.phase is phase and (s is active or active.is_generating)]


def _segment_of(request: Request, frame_end: int) -> int:
    """Index of the segment holding frame ``frame_end - 1`` of the request's audio."""
    end = 0
    for segment in request.segments:
        end += segment.num_frames
        if frame_end <= end:
            return segment.index
    return len(request.segments)


def _slot(request: Request) -> int:
    assert request.slot is not None, f"request {request.request_id} has no slot"
    return request.slot

