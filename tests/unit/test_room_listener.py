"""The room benchmark's listener (``bench/room_listener.py``) against synthetic tracks with
known gaps: its playout clock (first audio, quiet and late gaps, the turn's end), its reports
(parsed by the plugin's own ``PlayoutFeedback``, as the JS reporter's are) and the receiver
log the itemisation reads; and ``bench/room.py``'s itemisation of one turn.

Owns: the listener's arithmetic. Must not: need a LiveKit server or a model.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from livekit import rtc

from breezert_agent.playout import PlayoutFeedback
from tests.bench_scripts import bench_script
from tests.unit.test_agent_tts import FakeRuntimeClient, FakeTurn
from breezert_agent.client import TurnOptions

pytestmark = pytest.mark.unit

F = 0.01  # one 10 ms frame
LOUD, QUIET = 3000.0, 5.0


room_listener = bench_script("room_listener")


def _feed(clock: Any, frames: list[tuple[float, float]], t0: float = 100.0) -> None:
    """``frames``: (arrival offset from t0, rms), each 10 ms long."""
    for offset, rms in frames:
        clock.push(t0 + offset, F, rms)


def _steady(start: float, count: int, rms: float = LOUD) -> list[tuple[float, float]]:
    """``count`` frames arriving on time, 10 ms apart from ``start``."""
    return [(start + i * F, rms) for i in range(count)]


def test_first_audio_is_the_first_energetic_frame_plus_the_prebuffer() -> None:
    clock = room_listener.PlayoutClock(prebuffer_s=0.02)
    clock.arm()
    _feed(clock, _steady(0.0, 5, QUIET) + _steady(0.05, 30) + _steady(0.35, 20, QUIET))
    heard = clock.finish()
    assert heard is not None
    assert heard.first_arrival == pytest.approx(100.05)
    assert heard.first_heard == pytest.approx(100.07)
    assert heard.first_sound_arrival == pytest.approx(100.0)  # the quiet lead-in is sound
    assert heard.gaps == ()  # leading and trailing silence are not gaps
    assert heard.audio_s == pytest.approx(0.30)
    assert heard.span_s == pytest.approx(0.30)
    assert heard.min_rms == LOUD


def test_the_first_sound_is_the_first_frame_past_digital_silence() -> None:
    """The source's silence between turns decodes to 0: the turn's audio starts at its first
    frame above it, however quiet (the transport's end), before its first energetic one."""
    clock = room_listener.PlayoutClock(prebuffer_s=0.02)
    clock.arm()
    _feed(clock, _steady(0.0, 4, 0.0) + _steady(0.04, 3, QUIET) + _steady(0.07, 10))
    heard = clock.finish()
    assert heard is not None
    assert heard.first_sound_arrival == pytest.approx(100.04)
    assert heard.first_arrival == pytest.approx(100.07)


def test_a_hole_in_the_stream_is_one_quiet_gap_at_its_place() -> None:
    clock = room_listener.PlayoutClock(prebuffer_s=0.02)
    clock.arm()
    # 8 frames of speech (80 ms: one codec frame), a 40 ms hole, then 20 frames more
    _feed(clock, _steady(0.0, 8) + _steady(0.08, 4, QUIET) + _steady(0.12, 20))
    heard = clock.finish()
    assert heard is not None
    assert [(g.at_s, g.length_s, g.kind) for g in heard.gaps] == [(0.08, 0.04, "quiet")]
    assert heard.gap_s == pytest.approx(0.04)
    assert heard.span_s == pytest.approx(0.32)


def test_a_frame_after_its_due_time_is_a_late_gap_and_the_clock_slips() -> None:
    clock = room_listener.PlayoutClock(prebuffer_s=0.02)
    clock.arm()
    # 10 on-time frames, then a 55 ms stall of delivery (35 ms past the 20 ms prebuffer's
    # cover), then the rest as a burst
    frames = _steady(0.0, 10) + [(0.155 + i * 0.001, LOUD) for i in range(10)]
    _feed(clock, frames)
    heard = clock.finish()
    assert heard is not None
    (gap,) = heard.gaps
    assert gap.kind == "late" and gap.at_s == pytest.approx(0.10)
    # due at 100.0 + 0.02 + 0.10 = 100.12, arrived at 100.155
    assert gap.length_s == pytest.approx(0.035)
    assert heard.span_s == pytest.approx(0.20 + 0.035)


def test_a_late_frame_the_prebuffer_covers_is_no_gap() -> None:
    clock = room_listener.PlayoutClock(prebuffer_s=0.02)
    clock.arm()
    _feed(clock, _steady(0.0, 10) + [(0.115, LOUD)] + _steady(0.12, 5))
    heard = clock.finish()
    assert heard is not None and heard.gaps == ()


def test_lateness_after_the_last_energetic_frame_is_the_end_not_a_gap() -> None:
    clock = room_listener.PlayoutClock(prebuffer_s=0.0)
    clock.arm()
    _feed(clock, _steady(0.0, 10) + [(0.5, QUIET), (0.9, QUIET)])
    heard = clock.finish()
    assert heard is not None and heard.gaps == ()


def test_every_gap_of_a_synthetic_track_is_counted() -> None:
    """Three known holes (20, 60, 10 ms) and one 30 ms delivery stall in 2 s of speech."""
    clock = room_listener.PlayoutClock(prebuffer_s=0.02)
    clock.arm()
    t, frames, played = 0.0, [], 0
    holes = {50: 2, 100: 6, 150: 1}  # frame index -> quiet frames inserted there
    for i in range(200):
        if i in holes:
            for _ in range(holes[i]):
                frames.append((t, QUIET))
                t += F
        if i == 170:
            t += 0.05  # 30 ms past the prebuffer's cover
        frames.append((t, LOUD))
        t += F
        played += 1
    _feed(clock, frames)
    heard = clock.finish()
    assert heard is not None
    quiet = [(g.length_s) for g in heard.gaps if g.kind == "quiet"]
    late = [(g.length_s) for g in heard.gaps if g.kind == "late"]
    assert quiet == pytest.approx([0.02, 0.06, 0.01])
    assert late == pytest.approx([0.03])
    assert heard.audio_s == pytest.approx(2.0 + 0.09)


def test_nothing_heard_and_an_unarmed_clock() -> None:
    clock = room_listener.PlayoutClock()
    _feed(clock, _steady(0.0, 10))  # not armed: ignored
    clock.arm()
    _feed(clock, _steady(0.0, 10, QUIET))
    assert clock.finish() is None
    with pytest.raises(ValueError, match="prebuffer_s"):
        room_listener.PlayoutClock(prebuffer_s=-0.01)


def test_frame_rms() -> None:
    import numpy as np

    assert room_listener.frame_rms(np.full(480, 1000, np.int16).tobytes()) == pytest.approx(1000)
    assert room_listener.frame_rms(b"") == 0.0


# ----------------------------------------------------------------------------- reports


def _inbound(delay: float, emitted: int, concealed: int = 0) -> Any:
    return SimpleNamespace(inbound=SimpleNamespace(
        jitter_buffer_delay=delay, jitter_buffer_emitted_count=emitted,
        jitter_buffer_target_delay=0.5 * delay, jitter_buffer_minimum_delay=0.2 * delay,
        concealed_samples=concealed, concealment_events=1 if concealed else 0,
        total_samples_received=emitted))


def _as_packet(message: dict[str, Any]) -> rtc.DataPacket:
    return rtc.DataPacket(data=json.dumps(message).encode(), kind=rtc.DataPacketKind.KIND_LOSSY,
                          participant=SimpleNamespace(identity="listener"),  # type: ignore[arg-type]
                          topic=room_listener.PLAYOUT_TOPIC)


def test_reports_are_the_js_reporters_message_and_the_plugin_reads_them() -> None:
    first = room_listener.playout_message(_inbound(48.0, 4800 * 100), "TR_a", 1000.0)
    assert first["type"] == "playout" and first["v"] == 1 and first["trackSid"] == "TR_a"
    js_counters = {"jitterBufferDelay", "jitterBufferEmittedCount", "jitterBufferTargetDelay",
                   "jitterBufferMinimumDelay", "concealedSamples", "concealmentEvents",
                   "totalSamplesReceived"}  # examples/playout_reporter.js's COUNTERS
    assert js_counters <= set(first)
    # 4800 samples emitted in the next 100 ms, each 60 ms in the buffer; 480 concealed
    second = room_listener.playout_message(_inbound(48.0 + 4800 * 0.06, 4800 * 101, 480),
                                           "TR_a", 1100.0)
    feedback = PlayoutFeedback()
    turn = FakeTurn(FakeRuntimeClient(), "req-1", TurnOptions(), ["Hi."], True)
    feedback.begin(turn)
    feedback.on_data_packet(_as_packet(first))
    feedback.on_data_packet(_as_packet(second))
    assert feedback.num_bad_packets == 0 and feedback.num_concealed_samples == 480
    estimate = feedback.estimate(feedback.listeners["listener/TR_a"].received_time)
    assert estimate is not None
    assert estimate[0] == pytest.approx(0.06) and estimate[1] == "livekit-client"
    assert turn.reports and turn.reports[-1][0] == pytest.approx(0.06)


def test_the_receiver_log_gives_the_first_audios_buffer_and_the_concealment() -> None:
    log = room_listener.ReceiverLog()
    for i, (delay, emitted, concealed) in enumerate([(0.0, 0, 0), (1.0, 4800, 0),
                                                     (1.0 + 4800 * 0.04, 9600, 960),
                                                     (1.0 + 4800 * 0.09, 14400, 960)]):
        log.add(10.0 + 0.1 * i, {"jitterBufferDelay": delay, "jitterBufferEmittedCount": emitted,
                                 "concealedSamples": concealed})
    assert log.delay_after(10.15) == pytest.approx(0.04)
    assert log.delay_after(10.25) == pytest.approx(0.05)
    assert log.delay_after(11.0) is None
    assert log.concealed_between(10.0, 10.3, 48000) == pytest.approx(0.02)
    assert log.concealed_between(10.2, 10.3, 48000) == 0.0


def test_one_turns_first_audio_is_itemised_along_its_path() -> None:
    room = bench_script("room")
    turn = {"sent": 1.000, "jitter_buffer_s": 0.030,
            "agent": {"received": 1.004, "said": 1.005, "opened": 1.007, "first_audio": 1.037,
                      "playback_started": 1.039, "source_queued_s": 0.0},
            "heard": {"first_sound_arrival": 1.090, "first_arrival": 1.100, "first_heard": 1.120}}
    items = room.itemise(turn, 0.02)
    assert items["heard_after_say"] == pytest.approx(0.115)
    assert items["heard_after_trigger"] == pytest.approx(0.120)
    assert items["engine_ttfb"] == pytest.approx(0.030)
    assert items["beyond_engine_ttfb"] == pytest.approx(0.085)
    assert items["wire"] == pytest.approx(0.061)
    assert items["content_lead_in"] == pytest.approx(0.010)  # the audio's quiet start
    assert items["transport"] == pytest.approx(0.051)
    assert items["path_beyond_engine_ttfb"] == pytest.approx(0.075)
    assert items["sfu_network_est"] == pytest.approx(0.051 - 0.030 - room.OPUS_FRAME_S)
    path = sum(items[k] for k in room.ITEMS)
    assert path == pytest.approx(items["heard_after_say"])  # the parts add up to the whole
    assert room.itemise({"sent": 1.0, "agent": None}, 0.02) is None
    # a result from before the first-sound stamp: the whole wire is transport
    del turn["heard"]["first_sound_arrival"]
    assert room.itemise(turn, 0.02)["transport"] == pytest.approx(0.061)


def test_a_listener_groups_ready_line_is_found_past_native_library_noise(tmp_path: Path) -> None:
    room = bench_script("room")
    noisy = io.StringIO('Nvidia Decoder is supported.\nREADY [{"room": "r0"}]\nDONE\n')
    log = tmp_path / "g0.log"
    assert room.await_ready(noisy, log) == [{"room": "r0"}]
    log.write_text("Traceback ...\nTimeoutError: no bench.ready\n")
    with pytest.raises(RuntimeError, match="(?s)Nvidia Decoder is supported.*TimeoutError"):
        room.await_ready(io.StringIO("Nvidia Decoder is supported.\n"), log)


def test_the_loop_lag_is_the_latest_wake_up_in_a_window() -> None:
    lag = room_listener.LoopLag()
    lag.samples.extend([(1.0, 0.001), (1.1, 0.030), (1.2, 0.002), (2.0, 0.500)])
    assert lag.max_between(1.0, 1.5) == pytest.approx(0.030)
    assert lag.max_between(3.0, 4.0) is None


def test_the_agents_publish_options_come_from_the_environment_spec() -> None:
    room_agent = bench_script("room_agent")
    options = room_agent.publish_options("dtx=0,red=0")
    assert (options.dtx, options.red) == (False, False)
    assert options.HasField("dtx") and options.HasField("red")
    default = room_agent.publish_options("")
    assert not default.HasField("dtx") and not default.HasField("red")  # the SDK's own
    with pytest.raises(ValueError, match="ptime=10"):
        room_agent.publish_options("ptime=10")


class _FakePublication:
    """An audio publication whose ``set_subscribed(True)`` fires the room's track event."""

    def __init__(self, listener: Any, comes: bool) -> None:
        self.sid, self.kind, self.subscribed = "TR_a", rtc.TrackKind.KIND_AUDIO, False
        self.listener, self.comes, self.asked = listener, comes, 0

    def set_subscribed(self, subscribed: bool) -> None:
        self.asked += 1
        if self.comes:
            self.subscribed = subscribed
            self.listener._subscribed.set()


def _listener_with(comes: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, _FakePublication]:
    monkeypatch.setattr(room_listener, "SUBSCRIBE_NUDGE_S", 0.05)
    listener = object.__new__(room_listener.ListenerRoom)
    listener.name = "r0"
    listener._subscribed = __import__("asyncio").Event()
    publication = _FakePublication(listener, comes)
    agent = SimpleNamespace(track_publications={"TR_a": publication})
    listener.room = SimpleNamespace(remote_participants={"agent-1": agent})
    return listener, publication


def test_a_ready_agents_track_that_does_not_come_is_asked_for_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio

    listener, publication = _listener_with(True, monkeypatch)
    assert asyncio.run(listener._await_track(1.0)) is True and publication.asked == 1
    listener, publication = _listener_with(False, monkeypatch)
    with pytest.raises(room_listener.RoomJoinError, match=r"r0: .*\('TR_a', False\).*agent-1"):
        asyncio.run(listener._await_track(0.06))
    assert publication.asked == 1
    listener, publication = _listener_with(False, monkeypatch)
    listener._subscribed.set()  # came by itself: no nudge
    assert asyncio.run(listener._await_track(1.0)) is False and publication.asked == 0


def test_rooms_not_joined_count_as_unheard_turns_and_are_named_in_the_table() -> None:
    room = bench_script("room")
    heard = {"sent": 0.0, "heard": {"first_arrival": 0.1, "first_heard": 0.12,
                                    "first_sound_arrival": 0.1, "span_s": 1.0, "audio_s": 1.0,
                                    "gaps": [], "min_rms": 500.0}}
    lost = {"room": "r1", "index": 1, "error": "not joined: RoomJoinError: r1: ..."}
    ready = [{"room": "r0", "variant": "listener", "use_predictor": True, "join_s": 1.0,
              "subscribe_nudged": True},
             {"room": "r1", "join_error": "RoomJoinError: r1: ..."}]
    run = {"turns": [heard, lost], "rooms": [{"reports_sent": 1}, {"reports_sent": 0}],
           "ready": ready, "wall_s": 2.0}
    summary = room.summarize_run(run, 0.02)
    assert (summary["turns"], summary["heard"]) == (2, 1)
    assert summary["rooms_not_joined"] == 1 and summary["subscribes_nudged"] == 1
    assert summary["errors"] == [lost["error"]]
    room._check_wiring(ready, "listener")  # the room without an agent is not a wiring fault
    table = room.text_table([{"variant": "listener", "listeners": 2, "load": "open",
                              "summary": {**summary, "engine_ttfb": {"p50": 0.05}}}])
    assert "1/2 (1 rooms not joined)" in table


def test_the_agents_own_dry_spells_tell_which_quiet_gaps_began_before_its_source() -> None:
    """A piece of audio that reaches the agent after everything before it has played leaves
    the agent's source dry; the summary counts such turns and which turns with a quiet gap
    heard had one (the others' gaps lie past the agent)."""
    room = bench_script("room")
    # 80 ms, then 160 ms arriving at 0.05 (in time), then 160 ms at 0.45: dry from 0.24 to 0.45
    late = [[0.0, 0.08], [0.05, 0.16], [0.45, 0.16]]
    assert room.source_dry_s(late) == pytest.approx(0.21)
    assert room.source_dry_s([[0.0, 0.08], [0.08, 0.16], [0.2, 0.16]]) == 0.0
    assert room.source_dry_s([[0.0, 0.08], [0.09, 0.16]]) == pytest.approx(0.01)
    assert room.source_dry_s([]) is None and room.source_dry_s(None) is None

    def turn(audio_in: list[list[float]] | None, quiet: bool,
             loop_lag: float = 0.001) -> dict[str, Any]:
        gaps = [{"at_s": 0.04, "length_s": 0.2, "kind": "quiet"}] if quiet else []
        agent = {"audio_in": audio_in, "loop_lag_max_s": loop_lag} if audio_in else {}
        return {"agent": agent, "heard": {"gaps": gaps}}

    dry = room.source_dry_summary([
        turn(late, quiet=True),            # the agent ran dry: the gap began before its source
        turn([[0.0, 0.08], [0.05, 0.2]], quiet=True),  # in time at the agent: past it
        turn([[0.0, 0.08], [0.3, 0.1]], quiet=False, loop_lag=0.15),  # dry, its loop stalled
        turn(None, quiet=True),            # an older agent: not recorded
    ])
    assert dry == {"recorded": 3, "turns_with": 2, "longest_s": pytest.approx(0.22),
                   "quiet_gap_turns": 2, "quiet_gap_turns_dry": 1,
                   "dry_turns_agent_loop_stalled": 1}


def test_the_agents_full_collections_are_stamped_and_counted_per_turn() -> None:
    """The agent process's full collector passes (they hold the GIL: every room of the
    process waits) are recorded with their times, found by a turn's window, and summed over
    the turns with and without a quiet gap heard."""
    import gc
    import time

    room_agent, room = bench_script("room_agent"), bench_script("room")
    passes = room_agent.FullCollections()
    try:
        begin = time.monotonic()
        gc.collect(1)  # a younger generation's pass is not a full one
        assert passes.between(begin, time.monotonic())["count"] == 0
        gc.collect()
        end = time.monotonic()
        within = passes.between(begin, end)
        assert within["count"] == 1 and 0.0 <= within["longest_s"] <= end - begin
        assert passes.between(end + 1.0, end + 2.0)["count"] == 0
    finally:
        gc.callbacks.remove(passes._on_pass)

    def turn(gc_full: dict[str, Any] | None, quiet: bool) -> dict[str, Any]:
        gaps = [{"at_s": 0.5, "length_s": 0.1, "kind": "quiet"}] if quiet else []
        agent = {} if gc_full is None else {"gc_full": gc_full}
        return {"agent": agent, "heard": {"gaps": gaps}}

    one = {"count": 1, "longest_s": 0.19, "total_s": 0.19}
    none = {"count": 0, "longest_s": 0.0, "total_s": 0.0}
    assert room.gc_full_summary([turn(one, True), turn(none, True), turn(one, False),
                                 turn(None, True)]) == {
        "recorded": 3, "turns_with": 2, "longest_s": 0.19, "quiet_gap_turns": 2,
        "quiet_gap_turns_with_pass": 1}
