"""Playback feedback and agent audio outputs: the ``breezert.playout`` handler and the audio
outputs' wiring, against ``FakeRuntimeClient``. What plays through a real ``rtc.AudioSource``
(paced on the Rust SDK's real-time clock) is ``tests/integration/test_agent_playout_rtc.py``.

Owns: what reaches ``Turn.report_playback`` and from which source. Must not: need a LiveKit
server or a model (the rtc FFI runs locally; no room is joined).
"""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace
from typing import Any

import pytest
from livekit import rtc

from breezert_agent import TTS
from breezert_agent.client import TurnOptions
from breezert_agent.models import LISTENER_SETTLE_S
from breezert_agent.playout import PlayoutFeedback
from tests.unit.test_agent_tts import NO_RETRY, FakeRuntimeClient, FakeTurn

pytestmark = pytest.mark.unit

SAMPLE_RATE = 24000


def _packet(
    identity: str = "listener",
    *,
    delay: float,
    emitted: float,
    target: float | None = None,
    concealed: float = 0,
    topic: str = "breezert.playout",
    data: bytes | None = None,
) -> rtc.DataPacket:
    body = {"type": "playout", "trackSid": "TR_agent", "jitterBufferDelay": delay,
            "jitterBufferEmittedCount": emitted, "jitterBufferTargetDelay": target,
            "concealedSamples": concealed, "totalSamplesReceived": emitted}
    return rtc.DataPacket(
        data=data if data is not None else json.dumps(body).encode(),
        kind=rtc.DataPacketKind.KIND_RELIABLE,
        participant=SimpleNamespace(identity=identity),  # type: ignore[arg-type]
        topic=topic,
    )


def _turn() -> FakeTurn:
    return FakeTurn(FakeRuntimeClient(), "req-1", TurnOptions(), ["Hi."], True)


class _Source:
    """Stands in for an ``rtc.AudioSource`` (only ``queued_duration`` is read)."""

    queued_duration = 0.05


# ----------------------------------------------------------------------------- data handler


def test_listener_jitter_buffer_is_reported_for_the_current_turn() -> None:
    feedback, turn = PlayoutFeedback(), _turn()
    feedback.begin(turn)
    feedback.on_data_packet(_packet(delay=10.0, emitted=48_000, target=8.0))
    assert turn.reports == [] and feedback.listeners == {}  # first sample: a baseline only
    # 100 ms later: 2400 samples left the buffer, each after 120 ms in it
    feedback.on_data_packet(_packet(delay=10.0 + 0.12 * 2400, emitted=50_400,
                                    target=8.0 + 0.1 * 2400))
    stats = feedback.listeners["listener/TR_agent"]
    assert stats.delay_s == pytest.approx(0.12) and stats.target_delay_s == pytest.approx(0.1)
    assert len(turn.reports) == 1
    buffered_s, _, source = turn.reports[0]
    assert buffered_s == pytest.approx(0.12) and source == "livekit-client"


def test_sender_queue_adds_to_the_listener_buffer() -> None:
    feedback, turn = PlayoutFeedback(), _turn()
    feedback.attach_audio_source(_Source(), pending_s=lambda: 0.2)  # type: ignore[arg-type]
    feedback.begin(turn)
    feedback.on_data_packet(_packet(delay=0.0, emitted=0))
    feedback.on_data_packet(_packet(delay=0.08 * 2400, emitted=2400))
    buffered_s, _, source = turn.reports[-1]
    assert buffered_s == pytest.approx(0.05 + 0.2 + 0.08) and source == "livekit-client"


def test_stale_or_missing_listener_falls_back_to_the_sender() -> None:
    feedback = PlayoutFeedback(max_age_s=0.5)
    assert feedback.estimate(time.monotonic()) is None  # nothing attached: nothing reported
    feedback.attach_audio_source(_Source())  # type: ignore[arg-type]
    feedback.on_data_packet(_packet(delay=0.0, emitted=0))
    feedback.on_data_packet(_packet(delay=0.3 * 2400, emitted=2400))
    now = time.monotonic()
    assert feedback.estimate(now) == (pytest.approx(0.35), "livekit-client")
    assert feedback.estimate(now + 1.0) == (pytest.approx(0.05), "livekit-source")


def test_the_listener_closest_to_underrun_wins() -> None:
    feedback, turn = PlayoutFeedback(), _turn()
    feedback.begin(turn)
    for identity, delay_s in (("alice", 0.3), ("bob", 0.06)):
        feedback.on_data_packet(_packet(identity, delay=0.0, emitted=0))
        feedback.on_data_packet(_packet(identity, delay=delay_s * 2400, emitted=2400))
    assert turn.reports[-1][0] == pytest.approx(0.06)


def test_bad_packets_are_counted_and_ignored() -> None:
    feedback, turn = PlayoutFeedback(), _turn()
    feedback.begin(turn)
    feedback.on_data_packet(_packet(delay=1.0, emitted=100, topic="chat"))
    assert feedback.num_packets == 0  # other topics are not ours
    for data in (b"not json", b"[1, 2]", json.dumps({"type": "playout"}).encode(),
                 json.dumps({"type": "other", "jitterBufferDelay": 1,
                             "jitterBufferEmittedCount": 1}).encode()):
        feedback.on_data_packet(_packet(delay=0, emitted=0, data=data))
    assert feedback.num_packets == 4 and feedback.num_bad_packets == 4 and turn.reports == []


def test_counter_reset_and_idle_track_give_no_estimate() -> None:
    feedback, turn = PlayoutFeedback(), _turn()
    feedback.begin(turn)
    feedback.on_data_packet(_packet(delay=5.0, emitted=50_000))
    feedback.on_data_packet(_packet(delay=0.1, emitted=1_000))  # re-subscribed: counters reset
    feedback.on_data_packet(_packet(delay=0.1, emitted=1_000))  # nothing emitted: no audio
    assert turn.reports == [] and feedback.listeners == {}


def test_concealment_while_a_turn_plays_is_counted() -> None:
    feedback, turn = PlayoutFeedback(), _turn()
    feedback.begin(turn)
    feedback.on_data_packet(_packet(delay=0.0, emitted=0, concealed=10))
    feedback.on_data_packet(_packet(delay=0.1 * 2400, emitted=2400, concealed=490))
    assert feedback.num_concealed_samples == 480


def test_no_current_turn_means_no_report_and_newest_turn_is_current() -> None:
    feedback, first, second = PlayoutFeedback(), _turn(), _turn()
    feedback.on_data_packet(_packet(delay=0.0, emitted=0))
    feedback.on_data_packet(_packet(delay=240.0, emitted=2400))
    assert first.reports == []
    feedback.begin(first)
    feedback.begin(second)
    assert feedback.current_turn is second
    feedback.end(second)
    assert feedback.current_turn is first


async def test_listen_room_wires_the_data_received_event_and_aclose_unwires_it() -> None:
    room: Any = rtc.EventEmitter()  # a room is an EventEmitter with "data_received"
    client = FakeRuntimeClient()
    tts = TTS(client=client)
    tts.listen_room(room)
    turn = _turn()
    tts.playout.begin(turn)
    room.emit("data_received", _packet(delay=0.0, emitted=0))
    room.emit("data_received", _packet(delay=0.2 * 2400, emitted=2400))
    assert turn.reports[-1][0] == pytest.approx(0.2)
    await tts.aclose()
    room.emit("data_received", _packet(delay=0.4 * 4800, emitted=4800))
    assert len(turn.reports) == 1


# ----------------------------------------------------------------------------- real AudioSource


async def test_attach_audio_output_finds_the_roomio_source_and_its_backlog() -> None:
    # NOTE: builds RoomIO's private output offline (livekit-agents 1.8.9, pinned): this test is
    # the tripwire for the private attributes ``attach_audio_output`` reads.
    from livekit.agents.voice.io import TextOutput
    from livekit.agents.voice.room_io._output import _ParticipantAudioOutput
    from livekit.agents.voice.transcription.synchronizer import TranscriptSynchronizer

    class _Text(TextOutput):
        def __init__(self) -> None:
            super().__init__(label="text", next_in_chain=None)

        async def capture_text(self, text: str) -> None:
            pass

        def flush(self) -> None:
            pass

    room_output = _ParticipantAudioOutput(rtc.Room(), sample_rate=SAMPLE_RATE, num_channels=1,
                                          track_publish_options=rtc.TrackPublishOptions())
    sync = TranscriptSynchronizer(next_in_chain_audio=room_output, next_in_chain_text=_Text())
    feedback = PlayoutFeedback()
    assert feedback.attach_audio_output(sync.audio_output)  # _SyncedAudioOutput -> proxy -> room
    assert feedback.estimate(time.monotonic()) is None  # not playing yet: nothing reported
    room_output.on_playback_started(created_at=time.time())  # forwarded up the chain
    room_output._pushed_duration = 0.5  # accepted by RoomIO
    room_output._source_pushed_duration = 0.2  # of which handed to its AudioSource
    buffered_s, source = feedback.estimate(time.monotonic())  # type: ignore[misc]
    assert buffered_s == pytest.approx(0.3, abs=0.01) and source == "livekit-source"
    assert not PlayoutFeedback().attach_audio_output(None)
    await sync.aclose()
    await room_output.aclose()


# ----------------------------------------------------------------------------- a new listener


def _room_output() -> Any:
    """RoomIO's participant output, built offline (no room joined, nobody subscribed)."""
    from livekit.agents.voice.room_io._output import _ParticipantAudioOutput

    return _ParticipantAudioOutput(rtc.Room(), sample_rate=SAMPLE_RATE, num_channels=1,
                                   track_publish_options=rtc.TrackPublishOptions())


@pytest.mark.usefixtures("virtual_clock")
async def test_audio_waits_for_roomios_first_subscriber_then_the_settle_time() -> None:
    room_output = _room_output()
    feedback = PlayoutFeedback(listener_settle_s=0.1)
    assert feedback.attach_audio_output(room_output)
    waiting = asyncio.ensure_future(feedback.wait_for_listener())
    await asyncio.sleep(1.0)
    assert not waiting.done(), "went on with nobody subscribed"
    room_output.subscribed.set_result(None)
    subscribed = time.monotonic()
    await waiting
    assert time.monotonic() - subscribed == pytest.approx(0.1, abs=0.01)
    start = time.monotonic()
    await feedback.wait_for_listener()  # the next turn: the listener has settled
    assert time.monotonic() - start < 0.01
    await room_output.aclose()


class _RoomOf:
    """What ``PlayoutFeedback.listen_room`` reads of an ``rtc.Room``: its remote participants
    (each with its ``kind``) and its events."""

    def __init__(self, *kinds: int) -> None:
        self.remote_participants = {f"p{i}": SimpleNamespace(kind=kind)
                                    for i, kind in enumerate(kinds)}

    def on(self, *_: object) -> None:
        pass

    def off(self, *_: object) -> None:
        pass


@pytest.mark.usefixtures("virtual_clock")
@pytest.mark.parametrize(("kinds", "settle_s"), [
    ((rtc.ParticipantKind.PARTICIPANT_KIND_SIP,), 0.0),
    ((rtc.ParticipantKind.PARTICIPANT_KIND_SIP, rtc.ParticipantKind.PARTICIPANT_KIND_SIP), 0.0),
    ((rtc.ParticipantKind.PARTICIPANT_KIND_SIP, rtc.ParticipantKind.PARTICIPANT_KIND_STANDARD),
     0.1),
    ((rtc.ParticipantKind.PARTICIPANT_KIND_STANDARD,), 0.1),
    ((), 0.1),
])
async def test_a_room_of_sip_callers_only_is_not_held(kinds: tuple[int, ...],
                                                      settle_s: float) -> None:
    room_output = _room_output()
    feedback = PlayoutFeedback(listener_settle_s=0.1)
    assert feedback.attach_audio_output(room_output)
    feedback.listen_room(_RoomOf(*kinds))  # type: ignore[arg-type]
    waiting = asyncio.ensure_future(feedback.wait_for_listener())
    await asyncio.sleep(0.5)
    room_output.subscribed.set_result(None)
    subscribed = time.monotonic()
    await waiting
    assert time.monotonic() - subscribed == pytest.approx(settle_s, abs=0.01)
    await room_output.aclose()


@pytest.mark.usefixtures("virtual_clock")
async def test_no_wait_for_a_listener_subscribed_before_or_without_roomio() -> None:
    room_output = _room_output()
    room_output.subscribed.set_result(None)
    feedback = PlayoutFeedback(listener_settle_s=0.1)
    assert feedback.attach_audio_output(room_output)
    start = time.monotonic()
    await feedback.wait_for_listener()
    await PlayoutFeedback().wait_for_listener()  # nothing attached
    assert time.monotonic() - start < 0.01
    await room_output.aclose()


@pytest.mark.usefixtures("virtual_clock")
async def test_a_turn_made_before_anyone_subscribed_is_heard_from_its_start() -> None:
    client = FakeRuntimeClient()
    tts = TTS(client=client)
    room_output = _room_output()
    assert tts.attach_audio_output(room_output)
    frames: list[tuple[float, Any]] = []

    async def collect() -> None:
        async for event in tts.synthesize("One sentence.", conn_options=NO_RETRY):
            frames.append((time.monotonic(), event.frame))

    collecting = asyncio.ensure_future(collect())
    await asyncio.sleep(2.0)  # the engine made the whole turn meanwhile
    assert client.num_opens == 1 and frames == [], "audio went out before a subscriber"
    room_output.subscribed.set_result(None)
    subscribed = time.monotonic()
    await collecting
    assert frames[0][0] - subscribed >= LISTENER_SETTLE_S - 0.01
    assert sum(frame.duration for _, frame in frames) == pytest.approx(client.segment_s(),
                                                                        abs=1e-3)
    await tts.aclose()
    await room_output.aclose()
