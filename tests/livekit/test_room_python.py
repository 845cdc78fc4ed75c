"""Real room, Python participant: the agent worker's turns as a ``livekit.rtc`` listener hears them.

Owns: a turn end to end through the server (first audio after the trigger, no gap during speech,
the whole duration), the sender-side feedback reaching the Predictor, interruption at the
listener and in the engine, a second turn, the before-subscribe case and a listener that leaves
mid-turn. Times are ``time.monotonic()`` of this process and the worker's (one machine).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

pytestmark = pytest.mark.livekit

SENTENCE = "Hello from the agent."  # one segment: MAX_FRAMES (25) frames = 2.0 s of tiny noise
LONG = "First sentence here. Second sentence here. Third sentence here."  # 6.0 s
FIRST_AUDIO_LIMIT_S = 1.5  # generous for two shared cores; the measured figure is printed
MAX_GAP_S = 0.060
DURATION_TOLERANCE_S = 0.08  # one 20 ms RoomIO frame each end plus jitter-buffer drift
INTERRUPT_LIMIT_S = 0.100


def counters(snapshot: dict[str, Any]) -> dict[str, int]:
    return dict(snapshot["engine"]["counters"])


def delta(after: dict[str, Any], before: dict[str, Any], name: str) -> int:
    return counters(after).get(name, 0) - counters(before).get(name, 0)


async def idle(worker: Any, timeout_s: float = 5.0) -> dict[str, Any]:
    return await worker.wait_metrics(lambda m: m["engine"]["active_requests"] == 0, timeout_s)


async def speak(room: Any, worker: Any, text: str = SENTENCE) -> tuple[float, dict[str, Any]]:
    """Says ``text`` and waits until it played out; returns (trigger time, tts metrics)."""
    message_id, sent = await room.say(text)
    await worker.wait_event(room.name, "done", id=message_id, timeout_s=30)
    metrics = await worker.wait_event(room.name, "tts_metrics", id=message_id)
    await asyncio.sleep(0.3)  # the tail reaches the listener
    return sent, metrics


def check_turn(room: Any, sent: float, tts_metrics: dict[str, Any]) -> tuple[float, float]:
    """Asserts the turn's audio at the listener; returns (first audio s, energetic span s)."""
    heard = room.recording.energetic(since=sent)
    assert heard, "the listener never heard the turn"
    first, span = heard[0] - sent, heard[-1] - heard[0] + 0.010  # a frame is 10 ms
    gap = room.recording.longest_gap_s(sent, heard[-1])
    print(f"first audio at the listener {first * 1000:.0f} ms after the trigger (agent TTFB "
          f"{tts_metrics['ttfb'] * 1000:.0f} ms), heard {span:.3f} s of "
          f"{tts_metrics['audio_duration']:.3f} s, longest gap {gap * 1000:.0f} ms")
    assert first < FIRST_AUDIO_LIMIT_S
    xfail_unless_real_time(gap, span, tts_metrics["audio_duration"])
    return first, span


def xfail_unless_real_time(gap_s: float, span_s: float, expected_s: float) -> None:
    """The turn played in real time at the listener: no gap over ``MAX_GAP_S`` and its length
    within ``DURATION_TOLERANCE_S`` of ``expected_s``.

    OPEN (issue 15): on two CPU cores shared by the server, the worker, the listeners and the
    engine, the audio reaches the listener with gaps or stretched (it does with the Predictor off
    too, so it is not the Predictor's doing). Reported as xfail with the figures, never silently
    passed; callers run every other check first.
    """
    if gap_s > MAX_GAP_S or abs(span_s - expected_s) > DURATION_TOLERANCE_S:
        pytest.xfail(f"not real-time at the listener here: a {gap_s * 1000:.0f} ms gap, heard "
                     f"{span_s:.3f} s of {expected_s:.3f} s")


async def test_turn_reaches_the_listener_whole_and_steers_the_predictor(
        room_factory: Any, agent_worker: Any) -> None:
    room = await room_factory()
    before = agent_worker.metrics()
    sent, tts_metrics = await speak(room, agent_worker)
    after = await idle(agent_worker)
    # the sender-side queue (RoomIO's rtc.AudioSource, found through its private attributes)
    # was reported while the turn played, and the Predictor's deadlines used those reports
    reports = [e for e in agent_worker.events(room.name) if e["type"] == "report"]
    assert reports and {e["source"] for e in reports} == {"livekit-source"}
    assert max(e["buffered_s"] for e in reports) > 0.05, "the source queue never read > 0"
    assert delta(after, before, "playback_reports_livekit-source") >= 5
    assert delta(after, before, "predictor_feedback_used") >= 5
    check_turn(room, sent, tts_metrics)


async def test_interrupt_stops_the_listener_and_frees_the_request_then_a_second_turn(
        room_factory: Any, agent_worker: Any) -> None:
    room = await room_factory()
    message_id, sent = await room.say(LONG)
    for _ in range(200):  # 1 s into the speech
        heard = room.recording.energetic(since=sent)
        if heard and heard[-1] - heard[0] > 1.0:
            break
        await asyncio.sleep(0.01)
    await room.interrupt()
    interrupted = await agent_worker.wait_event(room.name, "interrupt")
    done = await agent_worker.wait_event(room.name, "done", id=message_id)
    assert done["interrupted"] is True
    await idle(agent_worker, timeout_s=1.0)  # the engine request ended
    await asyncio.sleep(0.5)
    last = room.recording.energetic(since=sent)[-1]
    stop_s = last + 0.010 - interrupted["t"]
    print(f"audio stopped at the listener {stop_s * 1000:.0f} ms after session.interrupt()")
    assert stop_s <= INTERRUPT_LIMIT_S
    assert not room.recording.energetic(since=last + 0.2), "audio came back after the interrupt"

    # the same session speaks again, whole
    sent, tts_metrics = await speak(room, agent_worker)
    check_turn(room, sent, tts_metrics)


async def test_speaking_before_anyone_subscribed_is_not_a_starving_listener(
        room_factory: Any, agent_worker: Any) -> None:
    room = await room_factory(auto_subscribe=False)
    before = agent_worker.metrics()
    message_id, sent = await room.say(SENTENCE)
    # the turn is open; RoomIO holds its frames until a subscriber. Not longer: pacing by its
    # own model (no reports), the engine has made the 2 s turn by ~1.6 s, and a finished
    # request reports nothing while its held audio plays
    await asyncio.sleep(0.8)
    held = agent_worker.metrics()
    pre_reports = [e for e in agent_worker.events(room.name) if e["type"] == "report"]
    print(f"before subscribing: {len(pre_reports)} playout reports, deadline misses "
          f"{delta(held, before, 'predictor_deadline_misses')}")
    # nothing is playing, so nothing may be reported as a (0 s) buffer: the engine would take
    # it for a listener that ran dry and hurry (deadline misses, partial chunks)
    assert pre_reports == []
    assert delta(held, before, "playback_reports_livekit-source") == 0
    # the Predictor's deadlines for the chunks made meanwhile used no report (its own model)
    assert delta(held, before, "predictor_feedback_used") == 0
    assert delta(held, before, "predictor_feedback_missing") > 0

    subscribed = asyncio.get_running_loop().time()
    await room.subscribe()
    await agent_worker.wait_event(room.name, "done", id=message_id, timeout_s=30)
    await asyncio.sleep(0.3)
    heard = room.recording.energetic(since=sent)
    assert heard, "the held turn never played after subscribing"
    span = heard[-1] - heard[0] + 0.010
    gap = room.recording.longest_gap_s(heard[0], heard[-1])
    print(f"after subscribing: heard {span:.3f} s, first "
          f"{(heard[0] - subscribed) * 1000:.0f} ms after subscribe(), longest gap "
          f"{gap * 1000:.0f} ms")
    # once playing, the backlog RoomIO took in at once (frames it holds before its 200 ms
    # AudioSource queue: the private ``_pushed_duration`` / ``_source_pushed_duration`` of
    # livekit-agents 1.8.9) is counted: more than the source alone can hold
    reports = [e["buffered_s"] for e in agent_worker.events(room.name) if e["type"] == "report"]
    print(f"after subscribing: {len(reports)} reports, largest {max(reports):.3f} s")
    assert max(reports) > 0.5
    await idle(agent_worker)
    xfail_unless_real_time(gap, span, 2.0)


async def test_a_listener_that_leaves_mid_turn_ends_the_request(
        room_factory: Any, agent_worker: Any) -> None:
    room = await room_factory()
    _, sent = await room.say(LONG)
    for _ in range(300):
        if room.recording.energetic(since=sent):
            break
        await asyncio.sleep(0.01)
    await room.room.disconnect()  # the only participant: the session closes with it
    await agent_worker.wait_event(room.name, "session_closed", timeout_s=10)
    await idle(agent_worker, timeout_s=5.0)

    # the worker is not stuck: a new room gets a whole turn
    other = await room_factory()
    sent, tts_metrics = await speak(other, agent_worker)
    check_turn(other, sent, tts_metrics)

