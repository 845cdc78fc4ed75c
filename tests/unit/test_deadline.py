"""DeadlinePredictor, StageTimeModel and the deadline policies on a fake clock (no torch).

Each decision is checked on hand-built ``Request`` states (put into a ``StreamTable``, as the
scheduler keeps its running requests): deadlines from fresh, stale and missing feedback, urgency
and startup order, wait-to-batch, far-ahead streams yielding, early emit; then the scheduler
driven end to end with the policies and a fake worker.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import pytest
from breezert.config import SchedulerConfig
from breezert.constants import FRAME_S, Stage
from breezert.errors import InvalidRequest
from breezert.request import PlaybackReport, Request, RequestStatus, Segment, SegmentPhase
from breezert.sched.block_pool import BlockPool
from breezert.sched.deadline import DeadlinePredictor, StageTimeModel
from breezert.sched.policy import (
    DeadlineChunkPolicy,
    DeadlineStagePolicy,
    Ranked,
    StagePolicy,
    make_policies,
)
from breezert.sched.scheduler import ChunkEmitted, Scheduler
from breezert.sched.streams import STAGE_CODE, STAGES, StreamTable

from tests.unit.test_scheduler import FakeWorker, make_config, make_request

pytestmark = pytest.mark.unit

FRAME_TIME = 0.01  # DECODE + DEPTH, seconds, before the margin
CODEC_TIME = 0.004


# ----------------------------------------------------------------------------- helpers


def make_predictor(**kwargs: object) -> DeadlinePredictor:
    """Margin 1, steady steps: DECODE 4 ms + DEPTH 6 ms per frame, CODEC 4 ms, others 1 ms."""
    model = StageTimeModel(alpha=0.5, margin=1.0, prior_s=0.001)
    for stage, seconds in ((Stage.DECODE, 0.004), (Stage.DEPTH, 0.006),
                           (Stage.CODEC, CODEC_TIME)):
        for rows in (1, 2, 4):
            model.observe(stage, rows, seconds)
    params: dict[str, object] = dict(ttfb_target_s=0.2, min_slack_s=0.05, max_lead_s=1.0,
                                     feedback_stale_s=0.5)
    params.update(kwargs)
    return DeadlinePredictor(model, **params)  # type: ignore[arg-type]


def stream(request_id: str, *, chunk_times: tuple[float, ...] = (), decoded: int = 0,
           pending: int = 0, phase: SegmentPhase = SegmentPhase.DEPTH,
           schedule: tuple[int, ...] = (1, 2, 4, 8, 16), enqueue_time: float = 0.0,
           priority: int = 0) -> Request:
    """A running request in a given state: ``decoded`` frames out in chunks emitted at
    ``chunk_times``, ``pending`` frames generated but not decoded, its segment at ``phase``."""
    request = Request(request_id, segments=[Segment((10,))], chunk_schedule=schedule,
                      max_frames=500, priority=priority)
    request.status = RequestStatus.RUNNING
    request.enqueue_time = enqueue_time
    request.chunk_emit_times = list(chunk_times)
    request.chunk_frame_ends = [decoded * (i + 1) // len(chunk_times)
                                for i in range(len(chunk_times))]
    request.num_frames = decoded + pending
    request.num_decoded_frames = decoded
    seg = request.segments[0]
    seg.phase, seg.num_frames, seg.max_frames = phase, decoded + pending, 500
    return request


_TABLES: dict[int, StreamTable] = {}
_ROW = np.zeros(1, np.int64)


def row_of(request: Request) -> StreamTable:
    """The request's one-row table, kept across calls (the chunk policy's early-emit target
    lives there) and brought up to date with the request, as the scheduler does."""
    table = _TABLES.get(id(request))
    if table is None:
        table = _TABLES[id(request)] = StreamTable.of([request])
    table.set_segments(0, request)
    table.set_chunks(0, request)
    return table


def frames(policy: DeadlineChunkPolicy, request: Request, now: float) -> int:
    return int(policy.chunk_frames(row_of(request), _ROW, now)[0])


def emit(hook: DeadlinePredictor | DeadlineChunkPolicy, request: Request, num_frames: int,
         now: float) -> None:
    """What the scheduler does for a decoded chunk: tell the chunk policy (or the predictor
    directly), then record it on the request."""
    hook.on_chunks(row_of(request), _ROW, np.array([num_frames]), now)
    request.num_decoded_frames += num_frames
    request.num_frames = max(request.num_frames, request.num_decoded_frames)
    request.record_chunk(now)


def report(request: Request, buffered_s: float, measured_at: float, source: str) -> None:
    """A listener report, as the engine hands it to the scheduler's request."""
    request.report_playback(PlaybackReport(buffered_s, measured_at, source))


@dataclass
class Ready:
    """A policy's ranking of some (request, stage) pairs, read as ((class, first criterion),
    request, stage) triples in serving order."""

    table: StreamTable
    ranked: Ranked
    requests: list[Request]

    def __iter__(self) -> Iterator[tuple[tuple[float, float], Request, Stage]]:
        for slot, stage, cls, k1 in zip(self.ranked.slots.tolist(), self.ranked.stages.tolist(),
                                        self.ranked.cls.tolist(), self.ranked.k1.tolist(),
                                        strict=True):
            yield (cls, k1), self.requests[slot], STAGES[stage]

    def __getitem__(self, index: int) -> tuple[tuple[float, float], Request, Stage]:
        return list(self)[index]

    def without(self, request: Request) -> Ready:
        keep = self.ranked.slots != self.requests.index(request)
        return Ready(self.table, self.ranked.take(np.flatnonzero(keep)), self.requests)


def ranked(policy: StagePolicy, pairs: Sequence[tuple[Request, Stage]], now: float,
           waited: dict[tuple[str, Stage], int] | None = None) -> Ready:
    """``policy``'s ranking of ``pairs``; ``waited``: the step since which a pair is ready
    (0 when not given)."""
    requests = list(dict.fromkeys(r for r, _ in pairs))
    table = StreamTable.of(requests)
    slots = np.array([requests.index(r) for r, _ in pairs], np.int64)
    stages = np.array([STAGE_CODE[s] for _, s in pairs], np.int64)
    table.ready_since[stages, slots] = [(waited or {}).get((r.request_id, s), 0)
                                        for r, s in pairs]
    return Ready(table, policy.rank(table, slots, stages, now), requests)


def pick(policy: StagePolicy, ready: Ready, now: float) -> tuple[Stage, list[Request]]:
    stage, slots = policy.pick(ready.table, ready.ranked, now)
    return stage, [ready.requests[s] for s in slots.tolist()]


# ----------------------------------------------------------------------------- stage-time model


def test_time_model_prior_ewma_margin_and_nearest_bucket() -> None:
    model = StageTimeModel(alpha=0.5, margin=1.5, prior_s=0.02)
    assert model.predict(Stage.DEPTH) == pytest.approx(0.03)  # unseen stage: prior x margin
    model.observe(Stage.DEPTH, 4, 0.010)
    assert model.predict(Stage.DEPTH, 3) == pytest.approx(0.015)  # bucket 4, no spread yet
    model.observe(Stage.DEPTH, 4, 0.014)  # mean 0.012, deviation 0.5 * 0.004 = 0.002
    assert model.predict(Stage.DEPTH, 4) == pytest.approx((0.012 + 2 * 0.002) * 1.5)
    model.observe(Stage.DEPTH, 32, 0.050)
    assert model.predict(Stage.DEPTH, 1) == pytest.approx((0.012 + 0.004) * 1.5)  # nearest: 4
    assert model.predict(Stage.DEPTH, 64) == pytest.approx(0.075)  # nearest: 32
    assert model.predict(Stage.DEPTH) == pytest.approx(0.075)  # None: last observed size (32)
    assert model.predict(Stage.CODEC) == pytest.approx(0.03)  # other stages unaffected
    model.observe(Stage.DEPTH, 4, float("nan"))  # ignored
    assert model.predict(Stage.DEPTH, 4) == pytest.approx((0.012 + 0.004) * 1.5)


def test_time_model_without_rows_prices_the_largest_recent_batch() -> None:
    """A question without a row count (a streaming request's next frame or chunk) is priced at
    the largest of the stage's last ``recent_steps`` steps: newcomers' one-row startup steps
    between the streams' batches do not make the batch look cheap; older steps drop out."""
    model = StageTimeModel(alpha=1.0, margin=1.0, recent_steps=3)
    model.observe(Stage.DEPTH, 64, 0.014)
    model.observe(Stage.DEPTH, 1, 0.0096)  # a lone first frame after the batch
    assert model.predict(Stage.DEPTH) == pytest.approx(0.014)  # the batch, not the last step
    assert model.predict(Stage.DEPTH, 1) == pytest.approx(0.0096)  # with rows: that bucket
    model.observe(Stage.DEPTH, 1, 0.0096)
    model.observe(Stage.DEPTH, 2, 0.0097)  # the 64-row step is now 4 steps back
    assert model.predict(Stage.DEPTH) == pytest.approx(0.0097)
    last = StageTimeModel(alpha=1.0, margin=1.0, recent_steps=1)
    last.observe(Stage.DEPTH, 64, 0.014)
    last.observe(Stage.DEPTH, 1, 0.0096)
    assert last.predict(Stage.DEPTH) == pytest.approx(0.0096)  # 1: the last step, as before
    with pytest.raises(ValueError):
        StageTimeModel(recent_steps=0)


def test_time_model_memo_answers_as_a_fresh_computation_after_every_observation() -> None:
    """Predictions are kept between observations (the scheduler asks hundreds per step);
    each observation drops them, so every answer equals one computed from the statistics."""
    import random

    rng = random.Random(3)
    model = StageTimeModel(alpha=0.3, margin=1.2, prior_s=0.02)
    stages, sizes = (Stage.DECODE, Stage.DEPTH, Stage.CODEC), (None, 1, 3, 16, 64, 200)
    for _ in range(300):
        if rng.random() < 0.4:
            model.observe(rng.choice(stages), rng.choice(sizes[1:]), rng.uniform(0.001, 0.02))
        stage, rows = rng.choice(stages), rng.choice(sizes)
        first = model.predict(stage, rows)
        assert first == model.predict(stage, rows) == model._predict(stage, rows)


def test_time_model_follows_a_slowdown() -> None:
    model = StageTimeModel(alpha=0.2, margin=1.0)
    for _ in range(50):
        model.observe(Stage.DECODE, 8, 0.002)
    assert model.predict(Stage.DECODE, 8) == pytest.approx(0.002)
    for _ in range(50):
        model.observe(Stage.DECODE, 8, 0.008)
    assert model.predict(Stage.DECODE, 8) == pytest.approx(0.008, rel=0.01)


# ----------------------------------------------------------------------------- many rows


def _random_stream(rng: object, i: int) -> Request:
    import random

    assert isinstance(rng, random.Random)
    chunks = tuple(sorted(rng.uniform(0.0, 1.0) for _ in range(rng.randrange(0, 4))))
    request = stream(f"r{i}", chunk_times=chunks, decoded=rng.randrange(8, 40) * len(chunks),
                     pending=rng.randrange(0, 6),
                     phase=rng.choice([ph for ph in SegmentPhase if ph is not SegmentPhase.ENDED]),
                     enqueue_time=rng.uniform(0.0, 0.5))
    if chunks and rng.random() < 0.6:
        request.playback = PlaybackReport(rng.uniform(0.0, 0.4), rng.uniform(0.5, 1.2), "test")
    return request


def test_answers_over_a_table_are_each_rows_own() -> None:
    """Each row of a many-row table gets the answer its request gets alone (fresh, stale and
    missing reports, every phase, startup and streaming), in any order of rows."""
    import random

    rng = random.Random(7)
    p = make_predictor()
    requests = [_random_stream(rng, i) for i in range(40)]
    table = StreamTable.of(requests)
    rows = np.arange(len(requests))[::-1].copy()
    for now in (0.9, 1.05, 1.3, 1.9):
        alone = [(p.deadline(r, now), p.buffered_s(r, now), p.slack(r, now),
                  p.slack(r, now, delay_s=0.03), p.work_s(r, 3)) for r in requests[::-1]]
        together = zip(p.deadlines(table, rows, now).tolist(),
                       p.buffered(table, rows, now).tolist(), p.slacks(table, rows, now).tolist(),
                       p.slacks(table, rows, now, 0.03).tolist(),
                       p.work(table, rows, np.full(len(rows), 3)).tolist(), strict=True)
        assert list(together) == alone
        assert len({a[2] for a in alone}) > 20  # the rows differ


# ----------------------------------------------------------------------------- deadlines


def test_startup_deadline_is_enqueue_plus_ttfb_target() -> None:
    p = make_predictor(ttfb_target_s=0.25)
    request = stream("new", phase=SegmentPhase.PREFILL, enqueue_time=3.0)
    assert p.deadline(request, now=3.1) == pytest.approx(3.25)
    assert p.buffered_s(request, now=3.1) == 0.0


def test_missing_feedback_estimates_from_audio_delivered_since_first_chunk() -> None:
    p = make_predictor()
    request = stream("a", chunk_times=(1.0, 1.05), decoded=3)  # 0.24 s delivered from 1.0
    assert p.buffered_s(request, now=1.1) == pytest.approx(0.14)
    assert p.deadline(request, now=1.1) == pytest.approx(1.24)
    assert p.buffered_s(request, now=2.0) == 0.0  # floored: dry since 1.24
    assert p.deadline(request, now=2.0) == pytest.approx(2.0)
    assert p.feedback_source(request, 1.1) == "missing"


def test_fresh_feedback_wins_and_counts_audio_emitted_after_it() -> None:
    p = make_predictor()
    request = stream("a")
    emit(p, request, 1, now=1.0)
    emit(p, request, 2, now=1.1)  # the estimate says dry at 1.24
    report(request, 0.05, 1.15, "webrtc")  # the listener lags behind
    assert p.buffered_s(request, now=1.17) == pytest.approx(0.03)
    emit(p, request, 4, now=1.18)  # + 0.32 s after the report
    assert p.buffered_s(request, now=1.2) == pytest.approx(0.05 + 0.32 - 0.05)
    assert p.deadline(request, now=1.2) == pytest.approx(1.52)
    assert p.feedback_source(request, 1.2) == "used"
    report(request, 9.0, 1.0, "webrtc")  # older: ignored
    assert p.buffered_s(request, now=1.2) == pytest.approx(0.32)


def test_stale_feedback_falls_back_to_the_estimate() -> None:
    p = make_predictor(feedback_stale_s=0.5)
    request = stream("a")
    emit(p, request, 8, now=1.0)  # estimate: dry at 1.64
    report(request, 0.0, 1.0, "simulated")  # the listener: dry
    assert p.buffered_s(request, now=1.2) == 0.0 and p.feedback_source(request, 1.2) == "used"
    assert p.buffered_s(request, now=1.6) == pytest.approx(0.04)  # 0.6 s old: the estimate
    assert p.feedback_source(request, 1.6) == "stale"
    emit(p, request, 1, now=1.6)
    assert p.counters["predictor_feedback_stale"] == 1


@pytest.mark.parametrize("field,buffered_s,measured_at", [
    ("buffered_s", -0.1, 1.0), ("buffered_s", float("nan"), 1.0),
    ("buffered_s", float("inf"), 1.0), ("buffered_s", True, 1.0),
    ("measured_at", 0.2, float("nan")), ("measured_at", 0.2, float("inf")),
    ("measured_at", 0.2, "now")])
def test_a_report_that_no_clock_can_hold_is_refused_naming_its_field(
        field: str, buffered_s: object, measured_at: object) -> None:
    """A NaN ``measured_at`` would make the request ignore every later report (no report is
    newer than NaN), an infinite buffer would park the stream forever: both are refused where
    the report is made, with the engine's typed error."""
    with pytest.raises(InvalidRequest, match=f"^{field}="):
        PlaybackReport(buffered_s, measured_at, "test")  # type: ignore[arg-type]
    assert PlaybackReport(0.0, 0.0, "test").buffered_s == 0.0


def test_deadline_misses_and_feedback_sources_are_counted_per_streaming_chunk() -> None:
    seen: dict[str, int] = {}
    p = make_predictor()
    p._on_count = lambda name, value: seen.__setitem__(name, seen.get(name, 0) + value)
    request = stream("a")
    emit(p, request, 1, now=1.0)  # first chunk: no deadline yet (TTFB is measured elsewhere)
    emit(p, request, 2, now=1.05)  # due by 1.08: on time, estimate
    emit(p, request, 4, now=1.30)  # due by 1.24: a miss
    report(request, 1.0, 1.3, "simulated")
    emit(p, request, 8, now=1.5)  # due by 1.3 + 1.0 = 2.3: on time, from the report
    assert p.counters["predictor_deadline_misses"] == 1
    assert p.counters["predictor_feedback_missing"] == 2
    assert p.counters["predictor_feedback_used"] == 1
    assert seen["predictor_deadline_misses"] == 1  # mirrored into the engine's metrics


# ----------------------------------------------------------------------------- stage policy


def test_urgent_stream_goes_before_startup_and_relaxed_stream_after() -> None:
    p = make_predictor()
    policy = DeadlineStagePolicy(p)
    now = 2.0
    newcomer = stream("new", phase=SegmentPhase.PREFILL, enqueue_time=1.9)
    urgent = stream("urgent", chunk_times=(1.0, 1.1), decoded=3, phase=SegmentPhase.DECODE)
    relaxed = stream("relaxed", chunk_times=(1.9,), decoded=8, phase=SegmentPhase.DECODE)
    ready = ranked(policy, [(relaxed, Stage.DECODE), (newcomer, Stage.PREFILL),
                            (urgent, Stage.DECODE)], now)
    assert [r.request_id for _, r, _ in ready] == ["urgent", "new", "relaxed"]
    assert pick(policy, ready, now) == (Stage.DECODE, [urgent, relaxed])


def test_startup_step_goes_first_when_the_urgent_slack_absorbs_it() -> None:
    p = make_predictor()
    policy = DeadlineStagePolicy(p)
    now = 2.0
    newcomer = stream("new", phase=SegmentPhase.PREFILL, enqueue_time=1.9)  # PREFILL: 1 ms
    urgent = stream("urgent", chunk_times=(1.9,), decoded=1, phase=SegmentPhase.DECODE)
    report(urgent, 0.04, now, "webrtc")  # slack 26 ms
    ready = ranked(policy, [(urgent, Stage.DECODE), (newcomer, Stage.PREFILL)], now)
    assert ready[0][1] is urgent and ready[0][0][0] == 0
    assert pick(policy, ready, now) == (Stage.PREFILL, [newcomer])
    report(urgent, 0.0, now, "webrtc")  # no slack left
    ready = ranked(policy, [(urgent, Stage.DECODE), (newcomer, Stage.PREFILL)], now)
    assert pick(policy, ready, now) == (Stage.DECODE, [urgent])


def test_overdue_startup_competes_with_urgent_streams_on_slack_when_asked() -> None:
    now = 2.0
    overdue = stream("overdue", phase=SegmentPhase.PREFILL, enqueue_time=1.75)  # due at 1.95
    fresh = stream("fresh", phase=SegmentPhase.PREFILL, enqueue_time=1.99)
    urgent = stream("urgent", chunk_times=(1.9,), decoded=1, phase=SegmentPhase.DECODE)
    pairs = [(urgent, Stage.DECODE), (fresh, Stage.PREFILL), (overdue, Stage.PREFILL)]
    for edf, order in ((False, ["urgent", "overdue", "fresh"]),
                       (True, ["overdue", "urgent", "fresh"])):
        p = make_predictor(overdue_startup_urgent=edf)
        report(urgent, 0.03, now, "webrtc")  # slack ~16 ms
        ready = ranked(DeadlineStagePolicy(p), pairs, now)
        assert [r.request_id for _, r, _ in ready] == order, edf
    assert SchedulerConfig().predictor_overdue_startup_urgent is False  # until measured


def test_draining_reported_buffer_is_served_first() -> None:
    p = make_predictor()
    policy = DeadlineStagePolicy(p)
    a = stream("a", chunk_times=(1.0,), decoded=16, phase=SegmentPhase.DEPTH)
    b = stream("b", chunk_times=(1.0,), decoded=16, phase=SegmentPhase.DEPTH)
    report(a, 0.5, 1.5, "webrtc")
    report(b, 0.02, 1.5, "webrtc")  # b's listener is draining
    ready = ranked(policy, [(a, Stage.DEPTH), (b, Stage.DEPTH)], now=1.51)
    assert [r.request_id for _, r, _ in ready] == ["b", "a"]
    assert ready[0][0][0] == 0  # urgent class
    report(b, 0.02, 0.9, "webrtc")  # older: ignored
    report(b, 0.6, 1.51, "webrtc")  # b refilled, a drained
    report(a, 0.0, 1.51, "webrtc")
    ready = ranked(policy, [(a, Stage.DEPTH), (b, Stage.DEPTH)], now=1.52)
    assert [r.request_id for _, r, _ in ready] == ["a", "b"]


def test_lookahead_prefill_is_not_ranked_by_the_streams_slack() -> None:
    policy = DeadlineStagePolicy(make_predictor())
    request = stream("a", chunk_times=(1.0,), decoded=1, phase=SegmentPhase.DECODE)
    request.add_segment(Segment((10,)))
    request.segments[1].phase = SegmentPhase.PREFILL
    ready = ranked(policy, [(request, Stage.PREFILL), (request, Stage.DECODE)], 1.2,
                   waited={("a", Stage.PREFILL): 3, ("a", Stage.DECODE): 7})
    assert [(key, stage) for key, _, stage in ready] == [
        ((0, ready[0][0][1]), Stage.DECODE),  # dry: urgent
        ((2, 3), Stage.PREFILL)]


def test_far_ahead_stream_ranks_last_and_yields_startup_batches() -> None:
    p = make_predictor(max_lead_s=1.0)
    policy = DeadlineStagePolicy(p)
    now = 1.0
    ahead = stream("ahead", chunk_times=(0.5,), decoded=40, phase=SegmentPhase.DEPTH)  # 2.7 s
    steady = stream("steady", chunk_times=(0.5,), decoded=12, phase=SegmentPhase.DEPTH)
    newcomer = stream("new", phase=SegmentPhase.DEPTH, enqueue_time=0.9)
    ready = ranked(policy, [(ahead, Stage.DEPTH), (steady, Stage.DEPTH),
                            (newcomer, Stage.DEPTH)], now)
    assert [pair[0][0] for pair in ready] == [1, 2, 3]
    assert pick(policy, ready, now) == (Stage.DEPTH, [newcomer, steady])
    assert p.counters["predictor_lead_yields"] == 1
    without_startup = ready.without(newcomer)
    assert pick(policy, without_startup, now) == (Stage.DEPTH, [steady, ahead])  # no yield
    assert p.counters["predictor_lead_yields"] == 1


# ----------------------------------------------------------------------------- wait to batch


WAITED = {("a", Stage.CODEC): 1, ("a", Stage.DECODE): 2, ("b", Stage.DEPTH): 2}


def _codec_pair(p: DeadlinePredictor, buffered_s: float,
                b_buffered_s: float = 0.5) -> tuple[Request, Request]:
    """A: a full chunk (2 frames) pending; B: one frame short of its 2-frame chunk. A's CODEC
    has waited longest (ranked first: ``WAITED``)."""
    a = stream("a", chunk_times=(1.0,), decoded=1, pending=2, phase=SegmentPhase.DECODE)
    b = stream("b", chunk_times=(1.0,), decoded=1, pending=1, phase=SegmentPhase.DEPTH)
    report(a, buffered_s, 1.2, "simulated")
    report(b, b_buffered_s, 1.2, "simulated")
    return a, b


def test_waits_for_one_more_frame_when_batching_codec_saves_time() -> None:
    p = make_predictor()
    policy = DeadlineStagePolicy(p)
    a, b = _codec_pair(p, buffered_s=0.5)
    ready = ranked(policy, [(a, Stage.CODEC), (a, Stage.DECODE), (b, Stage.DEPTH)],
                   now=1.2, waited=WAITED)
    assert ready[0][2] is Stage.CODEC  # the ranking alone would decode A now
    assert pick(policy, ready, 1.2) == (Stage.DEPTH, [b])
    assert p.counters["predictor_waits"] == 1


def test_no_wait_when_the_ready_streams_deadline_would_not_hold() -> None:
    p = make_predictor()
    policy = DeadlineStagePolicy(p)
    a, b = _codec_pair(p, buffered_s=0.055)  # one DEPTH + CODEC would leave 45 ms < 50 ms
    ready = ranked(policy, [(a, Stage.CODEC), (a, Stage.DECODE), (b, Stage.DEPTH)],
                   now=1.2, waited=WAITED)
    assert pick(policy, ready, 1.2) == (Stage.CODEC, [a])
    assert p.counters["predictor_waits"] == 0


def test_no_wait_when_batching_saves_nothing_or_for_a_first_chunk() -> None:
    model = StageTimeModel(alpha=1.0, margin=1.0)
    for rows in (1, 2):
        model.observe(Stage.CODEC, rows, 0.004 * rows)  # linear: two steps cost one batch
        model.observe(Stage.DEPTH, rows, 0.001)
    p = DeadlinePredictor(model)
    policy = DeadlineStagePolicy(p)
    a, b = _codec_pair(p, buffered_s=0.5)
    ready = ranked(policy, [(a, Stage.CODEC), (b, Stage.DEPTH)],
                   now=1.2, waited=WAITED)
    assert pick(policy, ready, 1.2)[0] is Stage.CODEC
    p2 = make_predictor()
    starter = stream("s", pending=1, phase=SegmentPhase.DECODE, enqueue_time=1.19)
    b2 = stream("b", pending=0, phase=SegmentPhase.DEPTH, enqueue_time=1.19)
    policy2 = DeadlineStagePolicy(p2)
    ready = ranked(policy2, [(starter, Stage.CODEC), (b2, Stage.DEPTH)],
                   now=1.2, waited=WAITED)
    assert pick(policy2, ready, 1.2)[0] is Stage.CODEC  # TTFB never waits
    assert p.counters["predictor_waits"] == p2.counters["predictor_waits"] == 0


# ----------------------------------------------------------------------------- early emit


def test_chunk_policy_cuts_a_chunk_that_would_miss_its_deadline() -> None:
    p = make_predictor()
    chunks = DeadlineChunkPolicy(p)
    # 16-frame target, 5 pending; 0.2 s of audio left: 11 more frames take 0.11 s + codec.
    request = stream("a", chunk_times=(1.0, 1.1, 1.2, 1.3, 1.4), decoded=15, pending=5,
                     schedule=(1, 2, 4, 8, 16))
    report(request, 0.2, 2.0, "webrtc")
    assert frames(chunks, request, 2.0) == 16  # on time
    report(request, 0.1, 2.0, "webrtc")
    assert frames(chunks, request, 2.0) == 16  # late, but one more frame still fits
    report(request, 0.012, 2.0, "webrtc")
    assert frames(chunks, request, 2.0) == 5  # now or late
    emit(p, request, 5, now=2.01)
    assert p.counters["predictor_early_emits"] == 1
    assert p.counters["predictor_deadline_misses"] == 0


def test_chunk_policy_keeps_the_schedule_for_startup_and_gaps() -> None:
    p = make_predictor()
    chunks = DeadlineChunkPolicy(p)
    starter = stream("s", pending=1, schedule=(4,), enqueue_time=0.0)
    assert frames(chunks, starter, 5.0) == 4  # TTFB target missed: still the schedule
    at_gap = stream("g", chunk_times=(1.0,), decoded=4, pending=2, schedule=(4,),
                    phase=SegmentPhase.PREFILL)
    assert frames(chunks, at_gap, 5.0) == 4  # the scheduler flushes at a gap anyway
    emit(p, at_gap, 2, now=5.0)
    assert p.counters["predictor_early_emits"] == 0


def test_chunk_policy_cuts_only_where_the_partial_chunk_averts_the_gap() -> None:
    """A chunk is cut while the frames it has still reach the listener in time (4 ms of codec)
    and one more frame would not (14 ms); a stream whose listener is already dry keeps
    generating: cutting would cost a CODEC step and shorten the gap by a frame at most."""
    p = make_predictor()
    chunks = DeadlineChunkPolicy(p)
    request = stream("a", chunk_times=(1.0, 1.1, 1.2, 1.3, 1.4), decoded=15, pending=5,
                     schedule=(1, 2, 4, 8, 16))
    report(request, CODEC_TIME + 0.001, 2.0, "webrtc")
    assert frames(chunks, request, 2.0) == 5  # the cut averts the gap
    emit(chunks, request, 5, now=2.0 + CODEC_TIME)
    assert p.counters["predictor_early_emits"] == 1
    assert p.counters["predictor_deadline_misses"] == 0
    dry = stream("d", chunk_times=(1.0, 1.1, 1.2, 1.3, 1.4), decoded=15, pending=5,
                 schedule=(1, 2, 4, 8, 16))
    report(dry, 0.0, 2.0, "webrtc")
    # fast steps: 10 ms a frame + 4 ms codec + 50 ms slack fit in one frame's 80 ms of audio,
    # so the 5 frames it has cover making the next chunk: they go out, not as an early emit
    assert frames(chunks, dry, 2.0) == 5
    emit(chunks, dry, 5, now=2.0 + CODEC_TIME)
    assert p.counters["predictor_early_emits"] == 1
    assert p.counters["predictor_deadline_misses"] == 1


def test_a_dry_stream_gets_a_chunk_that_covers_making_the_next_one() -> None:
    """Steps slower than real time (100 ms a frame for 80 ms of audio) and a dry listener: the
    chunk waits for the frames that cover making and decoding the next one (100 + 20 + 50 ms:
    three frames), not the one frame it has (a CODEC step per frame would put the engine
    further behind); never more than the schedule's entry."""
    slow = slow_predictor(frame_s=0.100, codec_s=0.020)
    chunks = DeadlineChunkPolicy(slow)
    request = stream("d", chunk_times=(1.0, 1.1, 1.2, 1.3, 1.4), decoded=15, pending=1,
                     schedule=(1, 2, 4, 8, 16))
    report(request, 0.0, 2.0, "webrtc")
    assert frames(chunks, request, 2.0) == 3
    request.num_frames += 3
    request.segments[0].num_frames += 3
    assert frames(chunks, request, 2.3) == 4  # four frames there: all go
    emit(chunks, request, 4, now=2.3)
    assert slow.counters["predictor_early_emits"] == 0
    short = stream("s", chunk_times=(1.0,), decoded=1, pending=1, schedule=(1, 2))
    report(short, 0.0, 2.0, "webrtc")
    assert frames(chunks, short, 2.0) == 2  # the schedule's entry (2) caps the cover (3)


def slow_predictor(frame_s: float, codec_s: float) -> DeadlinePredictor:
    """Margin 1, steady steps: DECODE + DEPTH ``frame_s`` per frame, CODEC ``codec_s``."""
    model = StageTimeModel(alpha=1.0, margin=1.0, prior_s=0.001)
    for stage, seconds in ((Stage.DECODE, frame_s / 2), (Stage.DEPTH, frame_s / 2),
                           (Stage.CODEC, codec_s)):
        model.observe(stage, 1, seconds)
    return DeadlinePredictor(model, min_slack_s=0.05)


def test_first_chunk_cover_sizes_the_first_chunk_from_step_times() -> None:
    starter = stream("s", pending=1, phase=SegmentPhase.DEPTH)  # schedule (1, 2, 4, 8, 16)
    fast = DeadlineChunkPolicy(make_predictor(), first_chunk_cover=True)
    assert frames(fast, starter, 0.0) == 1  # 10 ms frame + 4 ms codec + 50 ms < 80 ms
    slow = slow_predictor(frame_s=0.060, codec_s=0.010)  # 120 ms to cover: two frames
    assert frames(DeadlineChunkPolicy(slow, first_chunk_cover=True), starter, 0.0) == 2
    assert frames(DeadlineChunkPolicy(slow), starter, 0.0) == 1  # the switch off
    crawl = slow_predictor(frame_s=3.0, codec_s=0.5)  # far past real time: the largest entry
    assert frames(DeadlineChunkPolicy(crawl, first_chunk_cover=True), starter, 0.0) == 16
    streaming = stream("t", chunk_times=(1.0,), decoded=2, pending=1, phase=SegmentPhase.DEPTH)
    report(streaming, 1.0, 1.1, "webrtc")
    assert frames(DeadlineChunkPolicy(slow, first_chunk_cover=True), streaming, 1.1) == 2
    # only the first chunk is sized: a streaming request keeps its schedule entry (2)


def test_first_chunk_cover_is_counted_once_per_covered_first_chunk() -> None:
    p = slow_predictor(frame_s=0.060, codec_s=0.010)
    chunks = DeadlineChunkPolicy(p, first_chunk_cover=True)
    request = stream("s", pending=2, phase=SegmentPhase.DEPTH)
    for now in (0.1, 0.2):  # asked on every step until the frames are there: no count
        assert frames(chunks, request, now) == 2
    emit(chunks, request, 2, now=0.3)  # the first chunk (covered)
    emit(chunks, request, 2, now=0.4)  # the second
    assert p.counters["predictor_first_chunk_covers"] == 1
    plain = stream("p", pending=1, phase=SegmentPhase.DEPTH)
    emit(chunks, plain, 1, 0.5)  # a first chunk of the schedule's own size
    assert p.counters["predictor_first_chunk_covers"] == 1


# ----------------------------------------------------------------------------- scheduler


class PredictorHarness:
    """Scheduler with the deadline policies, a fake worker and a fake clock; the engine's part
    (step times into the predictor) done here."""

    def __init__(self, config: SchedulerConfig, dt: float = 0.01) -> None:
        self.predictor = make_predictor(min_slack_s=config.predictor_min_slack_s,
                                        max_lead_s=config.predictor_max_lead_s)
        stage_policy, chunk_policy = make_policies(config, self.predictor)
        self.sched = Scheduler(config, BlockPool(512, 16), stage_policy=stage_policy,
                               chunk_policy=chunk_policy)
        self.worker = FakeWorker(eos_after_default=10**9)
        self.now, self.dt = 0.0, dt
        self.chunks: dict[str, list[ChunkEmitted]] = {}

    def step(self) -> bool:
        plan = self.sched.schedule(self.now)
        if plan is None:
            return False
        self.now += self.dt
        self.predictor.observe_step(plan.stage, plan.num_rows, self.dt)
        for event in self.sched.commit(plan, self.worker.run(plan), self.now):
            if isinstance(event, ChunkEmitted):
                self.chunks.setdefault(event.request_id, []).append(event)
        return True

    def run(self, max_steps: int = 5000) -> None:
        for _ in range(max_steps):
            if not self.step():
                return


def assert_whole_in_order(chunks: list[ChunkEmitted], num_frames: int) -> None:
    """One request's chunks carry ``num_frames`` frames back to back."""
    assert sum(c.num_frames for c in chunks) == num_frames
    assert [c.start_frame for c in chunks] == [sum(c.num_frames for c in chunks[:k])
                                              for k in range(len(chunks))]


def test_scheduler_with_deadline_policies_completes_every_stream_in_order() -> None:
    config = make_config(use_predictor=True, predictor_min_slack_s=0.05,
                         predictor_max_lead_s=1.0)
    h = PredictorHarness(config)
    for i in range(6):
        h.worker.eos_after[(f"r{i}", 0)] = 40
        h.sched.add_request(make_request(f"r{i}"), h.now)
        for _ in range(15):
            h.step()
    h.run()
    for i in range(6):
        assert_whole_in_order(h.chunks[f"r{i}"], 40)
        assert h.chunks[f"r{i}"][-1].is_final
    assert not h.sched.has_work()


def test_make_policies_is_off_by_default() -> None:
    assert make_policies(SchedulerConfig(), make_predictor()) == (None, None)
    stage, chunk = make_policies(SchedulerConfig(use_predictor=True), make_predictor())
    assert isinstance(stage, DeadlineStagePolicy) and isinstance(chunk, DeadlineChunkPolicy)
    assert stage.starvation_limit_s == SchedulerConfig().starvation_limit_s
    assert not chunk.first_chunk_cover
    _, covered = make_policies(SchedulerConfig(use_predictor=True,
                                               predictor_first_chunk_cover=True),
                               make_predictor())
    assert isinstance(covered, DeadlineChunkPolicy) and covered.first_chunk_cover


@pytest.mark.parametrize("cover", [False, True])
def test_scheduler_with_slow_steps_covers_the_first_chunk_and_loses_no_frame(cover: bool) -> None:
    config = make_config(use_predictor=True, predictor_min_slack_s=0.05,
                         predictor_max_lead_s=1.0, predictor_first_chunk_cover=cover)
    h = PredictorHarness(config, dt=0.03)  # 30 ms per step: a frame takes 60 ms
    for i in range(3):
        h.worker.eos_after[(f"r{i}", 0)] = 20
        h.sched.add_request(make_request(f"r{i}"), h.now)
    h.run()
    for i in range(3):
        assert_whole_in_order(h.chunks[f"r{i}"], 20)
        assert (h.chunks[f"r{i}"][0].num_frames > 1) is cover
    assert not h.sched.has_work()
    assert h.predictor.counters["predictor_first_chunk_covers"] == (3 if cover else 0)
    assert FRAME_S == 0.08


def test_past_capacity_every_admitted_request_starts_within_a_bounded_wait() -> None:
    """Steps slower than real time (a frame is two 50 ms steps for 80 ms of audio): from its
    second chunk on every stream is urgent, for good. A newcomer still without audio
    ``starvation_limit_s`` past its first-chunk deadline ranks with them (with the least slack),
    so it starts within a few steps of that; before, startup work waited behind the urgent
    streams forever (the first wave streamed, the later ones never started)."""
    config = make_config(use_predictor=True, predictor_min_slack_s=0.05,
                         predictor_max_lead_s=1.0, starvation_limit_s=0.3)
    h = PredictorHarness(config, dt=0.05)
    requests = []
    for wave in range(4):
        for i in range(4):
            requests.append(make_request(f"w{wave}r{i}"))
            h.sched.add_request(requests[-1], h.now)
        for _ in range(40):
            assert h.step()
    assert FRAME_S < 2 * h.dt  # past capacity at any number of streams
    bound = h.predictor.ttfb_target_s + config.starvation_limit_s + 8 * h.dt
    waits = {r.request_id: r.chunk_emit_times[0] - r.enqueue_time if r.chunk_emit_times
             else None for r in requests}
    assert all(wait is not None and wait <= bound for wait in waits.values()), waits
    assert all(len(h.chunks[r.request_id]) > 1 for r in requests[:12])  # the streams go on


def test_past_real_time_dry_streams_keep_chunks_of_several_frames() -> None:
    """Steps slower than real time (50 ms each, a frame is two for 80 ms of audio): the
    streams run dry for good. Their chunks then cover making the next one (a 100 ms frame,
    a 50 ms CODEC step and 50 ms of slack: three frames) instead of going out frame by frame,
    a CODEC step per frame, as every cut chunk did before (the first ones are single frames
    while the time model still prices the harness's 10 ms frames)."""
    config = make_config(use_predictor=True, predictor_min_slack_s=0.05,
                         predictor_max_lead_s=1.0, default_chunk_schedule=(1, 2, 4, 8, 16))
    h = PredictorHarness(config, dt=0.05)
    for i in range(2):
        h.worker.eos_after[(f"r{i}", 0)] = 60
        h.sched.add_request(make_request(f"r{i}"), h.now)
    h.run()
    streaming_chunks = 0
    for i in range(2):
        chunks = h.chunks[f"r{i}"]
        assert_whole_in_order(chunks, 60)
        sizes = [c.num_frames for c in chunks]
        assert len(sizes) < 30 and set(sizes[10:-1]) == {3}, sizes
        streaming_chunks += len(sizes) - 1
    # dry from the first chunks on (the time model learns the 50 ms steps): no cut could avert
    # a gap, so none counts as an early emit; every streaming chunk is a deadline miss
    assert h.predictor.counters["predictor_early_emits"] == 0
    assert h.predictor.counters["predictor_deadline_misses"] == streaming_chunks
