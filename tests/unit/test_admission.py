"""Admission by real-time capacity and by frame cycle (``sched/admission.py`` and the
scheduler's use of them), on a virtual clock with fake step costs: admitted while the running
streams' demand (or the frame cycle) leaves room, queued for a short predicted wait, refused at
once with a long one (and that wait); the capacity learned from step timings, robust to one slow
step and learned again once load drops; the cycle averaged from DEPTH step to DEPTH step; the
config fields that switch them on."""

from __future__ import annotations

import math

import numpy as np
import pytest

from breezert.config import EngineConfig
from breezert.constants import FRAME_S, Stage
from breezert.errors import EngineOverloaded, InvalidConfig
from breezert.request import PlaybackReport, RequestStatus
from breezert.sched.admission import (
    FrameCycle,
    RealtimeCapacity,
    capacity_wait,
    cycle_stream_limit,
    fits,
    stream_demand,
)
from breezert.sched.scheduler import STARTING_CHUNKS, RequestFinished, Scheduler, SegmentEnded
from breezert.sched.slot_wait import frame_time_s, remaining_frames

from tests.unit.test_scheduler import FOREVER, Harness, make_config, make_request

pytestmark = pytest.mark.unit

FIXED = {"admission_learn_window_s": 0, "admission_headroom": 1.0}
"""A fixed capacity, all of it admitted: each test's numbers follow from the capacity alone."""


def _harness(capacity: float, **overrides: object) -> Harness:
    return Harness(make_config(admission_capacity=capacity, **{**FIXED, **overrides}))


def _long(request_id: str, frames: int = 200) -> object:
    return make_request(request_id, max_frames=frames, ignore_eos=True)


# ----------------------------------------------------------------------------- the model


def test_a_stream_needs_its_remaining_audio_over_what_it_has_until_then() -> None:
    remaining = np.array([4.0, 4.0, 0.0, np.nan, 1.0])
    buffered = np.array([0.0, 4.0, 3.0, 9.0, 3.0])
    # a newcomer 1, half as much with as much buffered as left, none when done, unknown 1
    assert stream_demand(remaining, buffered).tolist() == [1.0, 0.5, 0.0, 1.0, 0.25]


def test_the_wait_is_the_end_of_the_stream_whose_end_makes_room() -> None:
    demand = np.array([1.0, 0.5, 1.0])
    ends = np.array([3.0, 1.0, 2.0])
    assert capacity_wait(demand, ends, 1, limit=4.0) == 0.0  # 2.5 + 1 fits now
    assert capacity_wait(demand, ends, 1, limit=3.0) == 1.0  # the 0.5 at 1 s: 2.0 + 1
    assert capacity_wait(demand, ends, 1, limit=2.5) == 2.0  # then the 1.0 at 2 s
    assert capacity_wait(demand, ends, 2, limit=2.5) == 3.0  # two newcomers: all must end
    unknown = np.array([np.nan, 1.0, 2.0])
    assert capacity_wait(demand, unknown, 1, limit=2.5) == 2.0  # room before the unknown one
    assert capacity_wait(demand, unknown, 2, limit=2.5) is None  # it stands in the way
    # nothing running fits anything (an idle engine serves); otherwise the limit holds
    assert fits(0.0, 1, limit=0.5) and not fits(0.1, 1, limit=0.5)


def _window(capacity: RealtimeCapacity, streams: int, round_s: float, slow_s: float = 0.0) -> None:
    """One window of the fake engine: rounds of a DECODE and a DEPTH step over ``streams``
    (one frame each), ``round_s`` a round; ``slow_s`` adds one stalled step without frames."""
    if slow_s:
        capacity.observe_step(slow_s, 0, streams)
    busy = slow_s
    assert capacity.window_s is not None
    while busy < capacity.window_s:
        capacity.observe_step(round_s / 2, 0, streams)  # DECODE: no frame yet
        capacity.observe_step(round_s / 2, streams, streams)  # DEPTH: a frame each
        busy += round_s


def _round_s(streams: int) -> float:
    """The fake engine: 20 ms a round plus 0.5 ms a stream, so exactly 120 streams get 1 s/s
    (0.02 + 0.0005 * 120 = 0.08 s a frame): the true capacity is 120 s of audio per second."""
    return 0.02 + 0.0005 * streams


def _admitted(capacity: RealtimeCapacity, headroom: float = 0.9) -> int:
    return math.floor(headroom * capacity.value)


def test_an_underestimate_rises_to_what_the_engine_keeps_ahead_of() -> None:
    capacity = RealtimeCapacity(40.0, window_s=1.0)
    values = []
    for _ in range(40):  # offered load is endless: admission fills what the estimate allows
        _window(capacity, _admitted(capacity), _round_s(_admitted(capacity)))
        values.append(capacity.value)
    assert values == sorted(values)  # every window kept its streams ahead: it only rose
    # at 90 % of C every stream gets 1 s/s where 0.9 * 0.08 / (0.02 + 0.00045 C) = 1:
    # C = 115.6, under the true 120 (a lower bound never passes the truth)
    assert 110.0 < capacity.value < 120.0
    assert capacity.num_samples == 40


def test_an_overestimate_falls_to_the_rate_the_streams_got() -> None:
    capacity = RealtimeCapacity(300.0, window_s=1.0)
    got = 200 * FRAME_S / _round_s(200)  # 133 s/s for 200 streams: they fall behind
    for _ in range(15):
        _window(capacity, 200, _round_s(200))
        # never below what the streams got (to within a window cut between DECODE and DEPTH)
        assert capacity.value >= 0.99 * got
    assert capacity.value < got + 5.0


def test_one_slow_step_is_a_part_of_a_window_and_a_fraction_of_the_way() -> None:
    capacity = RealtimeCapacity(115.0, window_s=1.0)
    before = capacity.value
    _window(capacity, 103, _round_s(103), slow_s=0.3)  # one 0.3 s stall, 4x a round
    assert capacity.value < before  # it fell behind: the estimate took note ...
    assert capacity.value >= 0.9 * before  # ... without refusing everybody
    assert _admitted(capacity) >= 0.85 * 103
    # a light load never lowers it, however slow a step: its streams still stay ahead
    light = RealtimeCapacity(115.0, window_s=1.0)
    _window(light, 4, _round_s(4), slow_s=0.5)
    assert light.value == 115.0


def test_after_a_slow_spell_the_capacity_is_learned_again_once_load_drops() -> None:
    capacity = RealtimeCapacity(115.0, window_s=1.0)
    for _ in range(10):  # the device got 3x slower under 100 streams: they fell behind
        _window(capacity, 100, 3 * _round_s(100))
    slow = capacity.value
    assert slow < 50.0
    streams = 100
    for _ in range(10):  # load drops as streams end, to what the estimate admits
        streams = min(streams, _admitted(capacity))
        _window(capacity, streams, _round_s(streams))
    assert capacity.value > slow  # the streams it kept ahead raised it
    for _ in range(40):  # and fresh arrivals fill it again
        _window(capacity, _admitted(capacity), _round_s(_admitted(capacity)))
    assert 110.0 < capacity.value < 120.0


def test_without_a_window_the_capacity_stays_as_configured() -> None:
    capacity = RealtimeCapacity(50.0, window_s=None)
    for _ in range(100):  # 100 streams at 0.5 s a frame: far behind, and nothing learned
        capacity.observe_step(0.5, 100, 100)
    assert capacity.value == 50.0 and capacity.num_samples == 0


# ----------------------------------------------------------------------------- the scheduler


def _expected_wait(h: Harness) -> float:
    """The capacity wait of the module doc, by hand: the first running stream to end (all run
    at the same time per frame), its remaining frames at that time per frame."""
    running = [h.sched.get_request(r) for r in ("a", "b")]
    per_frame = frame_time_s(running, h.now)  # type: ignore[arg-type]
    assert per_frame is not None
    return min(remaining_frames(r, None) for r in running) * per_frame  # type: ignore[arg-type,misc]


def test_admitted_under_capacity_refused_at_once_with_the_wait_past_it() -> None:
    h = _harness(2.0, max_queue_wait_s=0.5)
    a, b = h.add(_long("a"), eos_after=FOREVER), h.add(_long("b"), eos_after=FOREVER)
    assert a.status is b.status is RequestStatus.RUNNING  # 0 + 1 and then 1 + 1 fit in 2
    while a.num_frames < 20:
        assert h.step() is not None
    # each stream needs 180 frames (14.4 s) with ~1 s buffered: ~0.93 s/s, ~1.9 together
    with pytest.raises(EngineOverloaded, match="predicted wait for real-time capacity") as exc:
        h.add(make_request("late"))
    assert exc.value.reason == "capacity"
    assert exc.value.retry_after_s == pytest.approx(_expected_wait(h))
    assert exc.value.retry_after_s > 0.5
    assert "admission_headroom=1" in str(exc.value)
    assert h.sched.get_request("late") is None and h.sched.num_waiting == 0  # never queued
    assert h.sched.stats().num_free_slots == h.config.max_running_requests - 2  # slots were free


def test_a_short_wait_queues_and_starts_when_room_frees() -> None:
    h = _harness(2.0, max_queue_wait_s=0.5)
    a, _ = h.add(_long("a", 30), eos_after=FOREVER), h.add(_long("b"), eos_after=FOREVER)
    while a.num_frames < 27:  # three frames to go: room within the bound
        assert h.step() is not None
    wait = _expected_wait(h)
    assert wait < 0.5
    c = h.add(make_request("c"), eos_after=3)
    assert c.status is RequestStatus.WAITING
    start = h.now
    while c.status is RequestStatus.WAITING:
        assert h.step() is not None
    # admitted within its predicted wait: once a's generation ended (or sooner, as the
    # streams' buffers grew and their demand fell)
    assert h.now - start <= wait + 2 * h.dt
    ended = [e for e in h.events if isinstance(e, SegmentEnded) and e.request_id == "a"]
    assert ended or a.num_frames < 30
    h.run()
    assert h.finished("c").status is RequestStatus.FINISHED
    h.assert_all_free()


def test_streams_far_ahead_of_their_listeners_need_less() -> None:
    h = _harness(2.0, max_queue_wait_s=0.01)
    a, b = h.add(_long("a"), eos_after=FOREVER), h.add(_long("b"), eos_after=FOREVER)
    while min(a.num_chunks, b.num_chunks) < 2:
        assert h.step() is not None
    with pytest.raises(EngineOverloaded):  # the listeners barely started: ~1 s/s each
        h.add(make_request("c"))
    for request in (a, b):  # each listener reports 20 s ahead: ~0.42 s/s each
        h.sched.report_playback(request.request_id, PlaybackReport(20.0, h.now, "test"))
    c = h.add(_long("c"), eos_after=FOREVER)
    assert c.status is RequestStatus.RUNNING  # 0.85 + 1 fits in 2
    with pytest.raises(EngineOverloaded, match="real-time capacity"):  # the newcomer needs 1
        h.add(make_request("d"))


def test_an_idle_engine_admits_whatever_its_estimate() -> None:
    h = _harness(0.5, max_queue_wait_s=0.01)  # less than one stream
    a = h.add(_long("a", 20), eos_after=FOREVER)
    assert a.status is RequestStatus.RUNNING
    while a.num_frames < 2:
        assert h.step() is not None
    with pytest.raises(EngineOverloaded, match="real-time capacity"):
        h.add(make_request("b"))
    while not a.is_generation_done:  # its audio is all made: it needs nothing more
        assert h.step() is not None
    b = h.add(make_request("b"), eos_after=2)
    assert b.status is RequestStatus.RUNNING
    h.run()
    h.assert_all_free()


def test_a_queue_head_waiting_for_capacity_costs_a_count_per_step(
        monkeypatch: pytest.MonkeyPatch) -> None:
    h = _harness(2.0, max_queue_wait_s=None)
    for name in ("a", "b"):
        h.add(_long(name, 400), eos_after=FOREVER)
    for _ in range(30):
        h.step()
    calls = []
    demand = h.sched._demand
    monkeypatch.setattr(h.sched, "_demand", lambda now: calls.append(now) or demand(now))
    c = h.add(make_request("c"))
    assert c.status is RequestStatus.WAITING  # wait unknown to no bound: it queues
    calls.clear()
    steps = 100  # 1 s of 10 ms steps: the demand is computed again every 50 ms at most
    for _ in range(steps):
        if c.status is not RequestStatus.WAITING:
            break
        h.step()
    assert len(calls) <= steps * h.dt / 0.05 + 1


def test_the_scheduler_learns_from_the_steps_the_engine_reports() -> None:
    h = Harness(make_config(admission_capacity=100.0, admission_learn_window_s=0.05))
    for name in ("a", "b"):
        h.add(_long(name, 60), eos_after=FOREVER)
    while (plan := h.step()) is not None:
        # 2 streams, 30 ms a DEPTH frame: 5.3 s/s, kept ahead: no reason to lower 100
        h.sched.observe_step(plan, 0.03 if plan.stage is Stage.DEPTH else 0.001)
    assert h.sched.capacity is not None and h.sched.capacity.num_samples > 0
    assert h.sched.capacity.value == 100.0
    slow = Harness(make_config(admission_capacity=100.0, admission_learn_window_s=0.05))
    for name in ("a", "b"):
        slow.add(_long(name, 60), eos_after=FOREVER)
    while (plan := slow.step()) is not None:  # 0.5 s a frame: 0.32 s/s for 2 streams, behind
        slow.sched.observe_step(plan, 0.5 if plan.stage is Stage.DEPTH else 0.001)
    assert slow.sched.capacity is not None and slow.sched.capacity.value < 10.0


def test_admission_is_off_by_default_and_the_fields_are_checked() -> None:
    assert Scheduler(make_config(), Harness().pool).capacity is None
    base = EngineConfig.from_file("configs/tiny.toml").model_dump()
    for field, value in (("admission_capacity", 0), ("admission_capacity", float("inf")),
                         ("admission_headroom", 1.5), ("admission_learn_window_s", -1.0)):
        data = {**base, "scheduler": {**base["scheduler"], field: value}}
        with pytest.raises(InvalidConfig, match=f"scheduler.{field}"):
            EngineConfig.from_dict(data)


# ----------------------------------------------------------------------------- the frame cycle


def test_a_cycle_is_the_busy_time_from_one_depth_step_to_the_next() -> None:
    cycle = FrameCycle(alpha=0.5)
    assert cycle.value is None
    for duration, depth in ((0.002, False), (0.003, False), (0.010, True)):
        cycle.observe_step(duration, depth)
    assert cycle.value == pytest.approx(0.015)  # the first cycle sets it
    cycle.observe_step(float("nan"), False)  # a broken timing is dropped
    cycle.observe_step(0.020, False)
    cycle.observe_step(0.005, True)
    assert cycle.value == pytest.approx(0.015 + 0.5 * (0.025 - 0.015))
    with pytest.raises(ValueError, match="alpha"):
        FrameCycle(alpha=0.0)


def test_the_cycle_feeds_streams_in_proportion_once_it_nears_its_bound() -> None:
    assert cycle_stream_limit(None, 10, 0.04) == math.inf  # not measured yet
    assert cycle_stream_limit(0.03, 0, 0.04) == math.inf  # nothing owed audio
    assert cycle_stream_limit(0.02, 10, 0.04) == math.inf  # within half: fixed costs rule
    assert cycle_stream_limit(0.05, 100, 0.04) == pytest.approx(80.0)
    assert cycle_stream_limit(0.03, 30, 0.04) == pytest.approx(40.0)


def _cycled(max_queue_wait_s: float | None) -> Harness:
    """Two long streams whose DEPTH steps cost 30 ms (a cycle of ~33 ms with the other
    stages' 1 ms): within ``admission_max_cycle_s`` = 40 ms the cycle feeds 2 x 40 / 33 ~ 2.4
    streams, so a third does not fit."""
    h = Harness(make_config(admission_max_cycle_s=0.04, max_queue_wait_s=max_queue_wait_s))
    a = h.add(_long("a", 60), eos_after=FOREVER)
    b = h.add(_long("b", 400), eos_after=FOREVER)
    assert a.status is b.status is RequestStatus.RUNNING  # no cycle measured yet
    while a.num_frames < 20:
        plan = h.step()
        assert plan is not None
        h.sched.observe_step(plan, 0.03 if plan.stage is Stage.DEPTH else 0.001)
    assert h.sched.cycle is not None and 0.031 <= h.sched.cycle.value <= 0.036
    return h


def test_past_the_cycle_bound_a_newcomer_is_refused_with_the_wait_for_a_stream_to_end() -> None:
    h = _cycled(max_queue_wait_s=0.1)
    with pytest.raises(EngineOverloaded, match="room in the frame cycle") as exc:
        h.add(make_request("late"))
    assert exc.value.reason == "cycle"
    a = h.sched.get_request("a")
    per_frame = frame_time_s([a, h.sched.get_request("b")], h.now)
    assert exc.value.retry_after_s == pytest.approx(remaining_frames(a, None) * per_frame)
    assert "admission_max_cycle_s=0.04" in str(exc.value)
    assert h.sched.get_request("late") is None and h.sched.num_waiting == 0


def test_a_newcomer_waits_for_room_in_the_cycle_and_starts_when_a_stream_ends() -> None:
    h = _cycled(max_queue_wait_s=None)
    c = h.add(make_request("c"), eos_after=3)
    assert c.status is RequestStatus.WAITING
    a = h.sched.get_request("a")
    while c.status is RequestStatus.WAITING:
        plan = h.step()
        assert plan is not None
        h.sched.observe_step(plan, 0.03 if plan.stage is Stage.DEPTH else 0.001)
    assert a.is_generation_done  # it started once a's generation ended, not before
    h.run()
    h.assert_all_free()


def test_the_cycle_bound_is_off_by_default_and_its_field_is_checked() -> None:
    assert Scheduler(make_config(), Harness().pool).cycle is None
    base = EngineConfig.from_file("configs/tiny.toml").model_dump()
    for value in (0, float("inf"), -0.04):
        data = {**base, "scheduler": {**base["scheduler"], "admission_max_cycle_s": value}}
        with pytest.raises(InvalidConfig, match="scheduler.admission_max_cycle_s"):
            EngineConfig.from_dict(data)


# ----------------------------------------------------------------------------- streams starting


def test_at_most_the_bound_of_streams_are_in_their_start_at_once() -> None:
    """A burst's newcomers start a few at a time: a third arrival waits until one of the two
    running streams has ``STARTING_CHUNKS`` chunks out, then starts (and everything ends)."""
    h = Harness(make_config(admission_max_starting=2))
    a = h.add(_long("a", 60), eos_after=FOREVER)
    b = h.add(_long("b", 60), eos_after=FOREVER)
    c = h.add(make_request("c"), eos_after=3)
    assert a.status is b.status is RequestStatus.RUNNING and c.status is RequestStatus.WAITING
    while c.status is RequestStatus.WAITING:
        # each step's schedule admits first: c starts in the step after a stream's 3rd chunk
        started = max(len(a.chunk_emit_times), len(b.chunk_emit_times)) >= STARTING_CHUNKS
        assert h.step() is not None
        assert (c.status is RequestStatus.RUNNING) == started
    h.run()
    h.assert_all_free()


def test_past_the_starting_bound_a_newcomer_is_refused_with_the_wait_for_a_start() -> None:
    """With a short ``max_queue_wait_s``, an arrival past the bound is refused at once with the
    wait until the first starting stream has made its first chunks' frames."""
    h = Harness(make_config(admission_max_starting=2, max_queue_wait_s=0.001))
    a = h.add(_long("a", 60), eos_after=FOREVER)
    b = h.add(_long("b", 60), eos_after=FOREVER)
    while a.num_frames < 1:
        assert h.step() is not None
    assert len(a.chunk_emit_times) < STARTING_CHUNKS
    with pytest.raises(EngineOverloaded, match="streams starting") as exc:
        h.add(make_request("late"))
    assert exc.value.reason == "starting"
    per_frame = frame_time_s([a, b], h.now)
    assert per_frame is not None
    left = min(sum(r.chunk_schedule[:STARTING_CHUNKS]) - r.num_frames for r in (a, b))
    assert exc.value.retry_after_s == pytest.approx(left * per_frame)
    assert "admission_max_starting=2" in str(exc.value)
    assert h.sched.get_request("late") is None and h.sched.num_waiting == 0
    h.run()
    h.assert_all_free()


def test_the_starting_bound_is_off_by_default_and_its_field_is_checked() -> None:
    h = Harness(make_config())
    requests = [h.add(_long(f"r{i}", 20), eos_after=FOREVER) for i in range(4)]
    assert all(r.status is RequestStatus.RUNNING for r in requests)
    base = EngineConfig.from_file("configs/tiny.toml").model_dump()
    for value in (0, -1):
        data = {**base, "scheduler": {**base["scheduler"], "admission_max_starting": value}}
        with pytest.raises(InvalidConfig, match="scheduler.admission_max_starting"):
            EngineConfig.from_dict(data)


def test_a_request_refused_after_queueing_reaches_its_caller_with_the_wait() -> None:
    """The engine's outcome of an expired request becomes the caller's ``EngineOverloaded``
    with reason ``waited`` and the wait the scheduler still predicted (HTTP's Retry-After)."""
    from breezert.async_engine import _raise_for
    from breezert.engine import RequestOutcome

    outcome = RequestOutcome("late", RequestStatus.FAILED, "waited 0.3 s in the queue",
                             overloaded=True, retry_after_s=1.5)
    with pytest.raises(EngineOverloaded, match="waited 0.3 s") as exc:
        _raise_for(outcome)
    assert exc.value.reason == "waited" and exc.value.retry_after_s == 1.5


def test_a_request_refused_after_queueing_counts_as_refused_not_failed() -> None:
    """``requests_refused_waited`` beside the refusals at arrival (``requests_refused_<reason>``),
    so an operator's refusal counts hold every refusal; a request that failed otherwise still
    counts as failed."""
    from breezert.metrics import EngineMetrics

    def finished(request_id: str, overloaded: bool) -> RequestFinished:
        return RequestFinished(request_id, RequestStatus.FAILED, "x", 1.0, 0.5, None, 0,
                               overloaded)

    metrics = EngineMetrics()
    metrics.on_events([finished("late", True), finished("broken", False)])
    counters = metrics.snapshot()["counters"]
    assert counters["requests_refused_waited"] == 1 and counters["requests_failed"] == 1
