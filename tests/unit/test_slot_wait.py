"""The predicted wait for a slot (``sched/slot_wait.py``): a function of the running requests'
remaining audio and their time per frame, and the scheduler's refusal that carries it."""

from __future__ import annotations

import pytest

from breezert.errors import EngineOverloaded
from breezert.request import Request, RequestStatus, Segment, SegmentPhase
from breezert.sched.slot_wait import FramesPerToken, predicted_slot_wait, remaining_frames

from tests.unit.test_scheduler import FOREVER, Harness, make_config, make_request

pytestmark = pytest.mark.unit

NOW = 100.0


def _running(request_id: str, *, max_frames: int, done: int, running_s: float = 2.0,
             ignore_eos: bool = True, num_text_tokens: int = 10,
             input_closed: bool = True) -> Request:
    """A request that has generated ``done`` frames of a ``max_frames`` segment in
    ``running_s`` seconds."""
    segment = Segment((12,), num_text_tokens=num_text_tokens)
    request = Request(request_id, segments=[segment], ignore_eos=ignore_eos,
                      input_closed=input_closed)
    segment.max_frames, segment.num_frames, segment.phase = max_frames, done, SegmentPhase.DECODE
    request.status, request.num_frames = RequestStatus.RUNNING, done
    request.first_scheduled_time = NOW - running_s
    return request


def test_the_wait_is_the_running_requests_remaining_audio_at_their_frame_time() -> None:
    # 80 frames in 6 s of running: 0.075 s a frame; 10, 180 and 80 frames to go
    running = [_running("a", max_frames=50, done=40), _running("b", max_frames=200, done=20),
               _running("c", max_frames=100, done=20)]
    waits = [predicted_slot_wait(running, p, NOW, None) for p in range(4)]
    assert waits[:3] == pytest.approx([0.75, 6.0, 13.5])
    # the 4th in line waits for the first slot's next occupant: one mean request length
    # ((2 + 0.75) + (2 + 13.5) + (2 + 6.0)) / 3 = 8.75 s after the first slot frees
    assert waits[3] == pytest.approx(0.75 + 8.75)
    # less audio left, shorter wait; a slower engine (same frames in twice the time), longer
    sooner = [_running("a", max_frames=50, done=45), *running[1:]]
    assert predicted_slot_wait(sooner, 0, NOW, None) < waits[0]
    slower = [_running(r.request_id, max_frames=r.segments[0].max_frames,
                       done=r.num_frames, running_s=4.0) for r in running]
    assert predicted_slot_wait(slower, 0, NOW, None) == pytest.approx(2 * waits[0])


def test_segments_that_stop_at_eos_use_the_learned_frames_per_token() -> None:
    learned = FramesPerToken()
    assert learned.value is None
    learned.observe(30, 10)  # 3 frames a token
    learned.observe(50, 10)  # 5: the EWMA moves a fifth of the way
    assert learned.value == pytest.approx(3.4)
    request = _running("a", max_frames=750, done=10, ignore_eos=False, num_text_tokens=20)
    assert remaining_frames(request, None) is None  # no segment has ended yet: unknown
    assert remaining_frames(request, learned.value) == 68 - 10
    capped = _running("b", max_frames=40, done=10, ignore_eos=False, num_text_tokens=20)
    assert remaining_frames(capped, learned.value) == 30  # max_frames still bounds it
    overdue = _running("c", max_frames=750, done=90, ignore_eos=False, num_text_tokens=20)
    assert remaining_frames(overdue, learned.value) == 1  # past its estimate: EOS any frame


def test_no_frame_yet_or_idle_open_turns_make_the_wait_unknown() -> None:
    assert predicted_slot_wait([_running("a", max_frames=50, done=0)], 0, NOW, None) is None
    idle_open = _running("open", max_frames=50, done=50, input_closed=False)
    idle_open.segments[0].phase = SegmentPhase.ENDED
    assert remaining_frames(idle_open, None) is None
    busy = _running("busy", max_frames=50, done=40)
    # the next in line gets the busy request's slot; the one after waits on the open turn
    assert predicted_slot_wait([idle_open, busy], 0, NOW, None) == pytest.approx(
        10 * 4.0 / 90)
    assert predicted_slot_wait([idle_open, busy], 1, NOW, None) is None


def test_the_scheduler_refuses_at_once_with_the_predicted_wait() -> None:
    """Two long requests hold both slots: a newcomer whose predicted wait is past
    ``max_queue_wait_s`` is refused when it comes (never queued), with that wait; one whose
    wait fits queues and gets the first slot to free."""
    h = Harness(make_config(max_running_requests=2, max_queued_requests=8, max_queue_wait_s=0.8),
                dt=0.01)
    a = h.add(make_request("a", max_frames=60, ignore_eos=True), eos_after=FOREVER)
    b = h.add(make_request("b", max_frames=200, ignore_eos=True), eos_after=FOREVER)
    while a.num_frames < 20:
        assert h.step() is not None
    wait = h.sched.predicted_queue_wait(0, h.now)
    assert wait is not None and wait > 0.8
    with pytest.raises(EngineOverloaded, match="predicted wait for a slot") as refused:
        h.add(make_request("late"))
    assert refused.value.retry_after_s == pytest.approx(wait)
    assert h.sched.get_request("late") is None and h.sched.num_waiting == 0
    while a.num_frames < 58:  # two frames to go: the next slot frees within the limit
        assert h.step() is not None
    soon = h.sched.predicted_queue_wait(0, h.now)
    assert soon is not None and soon < 0.8 < wait
    waiting = h.add(make_request("next"), eos_after=3)
    assert waiting.status is RequestStatus.WAITING
    h.run()
    assert h.finished("next").status is RequestStatus.FINISHED
    assert waiting.first_scheduled_time is not None
    assert waiting.first_scheduled_time >= h.finished("a").time - 1e-9
    assert b.status is RequestStatus.FINISHED
    h.assert_all_free()
