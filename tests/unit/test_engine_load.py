"""``EngineLoad`` and ``Scheduler.load`` (no torch): the one load figure a dispatcher, ``/readyz``
and the remote client compare.

Owns: the fraction (requests against running slots or real-time demand against its limit, 1
when full or behind real time), its JSON form, the Predictor's least slack over the running
requests that owe audio, and the running streams' real-time demand.
"""

from __future__ import annotations

import pytest

from breezert.request import SegmentPhase
from breezert.sched.block_pool import BlockPool
from breezert.sched.load import EngineLoad
from breezert.sched.scheduler import Scheduler

from tests.unit.test_deadline import make_predictor, stream
from tests.unit.test_scheduler import make_config, make_request

pytestmark = pytest.mark.unit


def test_fraction_counts_requests_against_running_slots() -> None:
    assert EngineLoad(0, 0, 4, 8).fraction == 0.0
    assert EngineLoad(1, 0, 4, 8).fraction == 0.25
    assert not EngineLoad(3, 0, 4, 8).is_full
    assert EngineLoad(4, 0, 4, 8).is_full  # a new request would queue
    assert EngineLoad(4, 5, 4, 8).fraction == 1.0  # capped


def test_negative_slack_is_full_whatever_the_counts() -> None:
    assert not EngineLoad(1, 0, 4, 8, least_slack_s=0.01).is_behind
    behind = EngineLoad(1, 0, 4, 8, least_slack_s=-0.02)
    assert behind.is_behind and behind.is_full and behind.fraction == 1.0


def test_json_round_trip_and_foreign_bodies() -> None:
    load = EngineLoad(2, 1, 4, 8, least_slack_s=0.125)
    body = load.as_json()
    assert body == {"fraction": 0.75, "running": 2, "queued": 1, "max_running": 4,
                    "max_queued": 8, "least_slack_s": 0.125}
    assert EngineLoad.from_json(body) == load
    assert "least_slack_s" not in EngineLoad(0, 0, 4, 8).as_json()
    for foreign in (None, "full", [], {"running": 1}, {"running": "x", "queued": 0,
                                                       "max_running": 4, "max_queued": 8}):
        assert EngineLoad.from_json(foreign) is None


def test_real_time_demand_fills_the_load_and_full_is_when_one_more_would_not_fit() -> None:
    slots = EngineLoad(1, 0, 8, 8)  # 1/8 of the slots
    assert EngineLoad(1, 0, 8, 8, None, 1.5, 4.0).fraction == 1.5 / 4.0  # demand leads
    assert EngineLoad(4, 0, 8, 8, None, 0.2, 4.0).fraction == 0.5  # slots lead
    full = EngineLoad(1, 0, 8, 8, None, 3.2, 4.0)  # 3.2 + 1 > 4: a newcomer would not fit
    assert full.is_full and full.fraction == 1.0 and slots.fraction == 0.125
    body = full.as_json()
    assert (body["realtime_demand"], body["realtime_limit"]) == (3.2, 4.0)
    assert EngineLoad.from_json(body) == full


def test_scheduler_load_has_the_demand_with_admission_by_capacity() -> None:
    sched = Scheduler(make_config(admission_capacity=3.0, admission_headroom=1.0,
                                  admission_learn_window_s=0), BlockPool(512, 16))
    assert sched.load(None, 0.0).realtime_demand == 0.0
    for i in range(2):
        sched.add_request(make_request(f"r{i}", max_frames=50, ignore_eos=True), 0.0)
    load = sched.load(None, 0.0)  # two newcomers, 1 s/s each: a third fits, a fourth not
    assert (load.realtime_demand, load.realtime_limit) == (2.0, 3.0)
    assert load.fraction == pytest.approx(2 / 3) and not load.is_full
    sched.add_request(make_request("r2", max_frames=50, ignore_eos=True), 0.0)
    assert sched.load(None, 0.0).is_full


def test_scheduler_load_counts_running_and_queued() -> None:
    sched = Scheduler(make_config(max_running_requests=2, max_queued_requests=3),
                      BlockPool(512, 16))
    assert sched.load(None, 0.0) == EngineLoad(0, 0, 2, 3)
    for i in range(3):
        sched.add_request(make_request(f"r{i}"), 0.0)
    load = sched.load(None, 0.0)
    assert (load.running, load.queued, load.least_slack_s) == (2, 1, None)
    assert load.is_full


def test_least_slack_is_the_predictors_over_requests_that_owe_audio() -> None:
    predictor = make_predictor()
    sched = Scheduler(make_config(), BlockPool(512, 16))
    # a stream 1 s into playback whose chunks covered 0.8 s: its listener ran dry 0.2 s ago
    late = stream("late", chunk_times=(0.0, 0.4), decoded=10, pending=0)
    # a stream with 2 s of audio out after 1 s: well ahead
    ahead = stream("ahead", chunk_times=(0.0, 0.5), decoded=25, pending=0)
    # an open turn whose text has all been spoken: owes nothing until its next text
    idle = stream("idle", chunk_times=(0.0,), decoded=5, phase=SegmentPhase.ENDED)
    for slot, request in enumerate((late, ahead, idle)):
        request.slot = slot
        sched._running[request.request_id] = request  # as _start leaves it
        sched._table.add(slot, request, slot)
    now = 1.0
    load = sched.load(predictor, now)
    assert load.least_slack_s == pytest.approx(predictor.slack(late, now))
    assert load.is_behind and load.is_full
    del sched._running["late"]
    sched._table.remove(late.slot)
    load = sched.load(predictor, now)
    assert load.least_slack_s == pytest.approx(predictor.slack(ahead, now)) and not load.is_behind
    assert load.fraction == pytest.approx(2 / 32)
    del sched._running["ahead"]
    sched._table.remove(ahead.slot)
    assert sched.load(predictor, now).least_slack_s is None  # the idle turn owes nothing
