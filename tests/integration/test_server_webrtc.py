"""An aiortc client against the server over loopback: first audio, no gaps, cancel, PCMU, 10 ms.

Owns: the WebRTC contract end to end on one machine with loopback ICE only on the client side:
decoded audio arrives within its measured bound after ``say`` (``tests/latency_bounds.json``),
a turn of the real engine plays without gaps or late ticks (contiguous RTP timestamps,
no silent frame inside it), ``cancel`` silences the next frame and frees the engine request,
PCMU-only peers get 8 kHz audio, 10 ms Opus frames decode completely, and bad offers/messages
get clear errors while the peer stays usable, and a peer that vanishes mid-turn is freed within
``webrtc_liveness_timeout_s`` while an idle healthy one stays.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np
import pytest
from aiortc import RTCConfiguration, RTCPeerConnection, RTCRtpReceiver, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError
from breezert.async_engine import AsyncEngine
from breezert.config import ServingConfig
from breezert.server import webrtc_api
from breezert.server.ice import HostAddresses, host_addresses
from breezert.server.webrtc_track import EngineAudioTrack
from tests import latency
from tests.fake_engine import FakeEngine
from tests.integration._server import (
    FRAMES_PER_TURN,
    serve,
    state_of,
    wait_idle,
)
from tests.latency import LatencyMiss
from tests.realtime import retried_when_starved

pytestmark = pytest.mark.integration

SILENT = 300  # int16 peak below which a decoded frame counts as silence
TURN_S = FRAMES_PER_TURN * 0.08


@dataclass
class Received:
    time: float
    pts: int
    samples: int
    sample_rate: int
    peak: int


@dataclass
class Client:
    """A loopback-only aiortc peer that records every decoded frame and control message."""

    pc: RTCPeerConnection
    answer: dict[str, Any] = field(default_factory=dict)
    frames: list[Received] = field(default_factory=list)
    messages: asyncio.Queue[dict[str, Any]] = field(default_factory=asyncio.Queue)
    channel: Any = None
    _reader: asyncio.Task[None] | None = None

    def send(self, **message: Any) -> float:
        self.channel.send(json.dumps(message))
        return time.monotonic()

    async def next_message(self, kind: str, timeout_s: float = 20.0) -> dict[str, Any]:
        while True:
            message = await asyncio.wait_for(self.messages.get(), timeout_s)
            if message["type"] == kind:
                return message
            assert message["type"] != "error" or kind == "error", message

    def audible(self, since: float = 0.0) -> list[Received]:
        return [f for f in self.frames if f.peak > SILENT and f.time >= since]

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        await self.pc.close()


async def connect(url: str, *, codec: str | None = None, frame_ms: int | None = None) -> Client:
    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    client = Client(pc)
    transceiver = pc.addTransceiver("audio", direction="recvonly")
    if codec is not None:
        transceiver.setCodecPreferences([c for c in RTCRtpReceiver.getCapabilities("audio").codecs
                                         if c.mimeType.lower() == codec.lower()])
    client.channel = pc.createDataChannel("control")
    client.channel.on("message", lambda raw: client.messages.put_nowait(json.loads(raw)))
    track_ready: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    pc.on("track", track_ready.set_result)
    # The client has no interface but loopback: only the server's loopback candidate can work.
    with host_addresses(HostAddresses(only=("127.0.0.1",))):
        await pc.setLocalDescription(await pc.createOffer())
    body: dict[str, Any] = {"type": "offer", "sdp": pc.localDescription.sdp}
    if frame_ms is not None:
        body["frame_ms"] = frame_ms
    async with aiohttp.ClientSession() as http, \
            http.post(f"{url}/v1/webrtc/offer", json=body) as r:
        client.answer = await r.json()
        assert r.status == 200, client.answer
    await pc.setRemoteDescription(RTCSessionDescription(client.answer["sdp"], "answer"))
    track = await asyncio.wait_for(track_ready, 5)

    async def read() -> None:
        while True:
            try:
                frame = await track.recv()
            except MediaStreamError:
                return
            samples = frame.to_ndarray()
            client.frames.append(Received(time.monotonic(), int(frame.pts), frame.samples,
                                          frame.sample_rate, int(np.abs(samples).max())))

    client._reader = asyncio.create_task(read())
    assert (await client.next_message("ready", 10))["codec"] == client.answer["codec"]
    return client


def _turn_frames(client: Client, since: float) -> list[Received]:
    """Decoded frames from the turn's first audible frame to its last one."""
    frames = [f for f in client.frames if f.time >= since]
    loud = [i for i, f in enumerate(frames) if f.peak > SILENT]
    assert loud, "no audio was received"
    return frames[loud[0]:loud[-1] + 1]


def _assert_contiguous(frames: list[Received], samples_per_frame: int) -> None:
    assert all(f.samples == samples_per_frame for f in frames), {f.samples for f in frames}
    steps = {b.pts - a.pts for a, b in itertools.pairwise(frames)}
    assert steps == {samples_per_frame}, f"RTP timestamps jump: {sorted(steps)}"


@retried_when_starved(LatencyMiss)
async def test_opus_turn_first_audio_then_cancel(engine: AsyncEngine) -> None:
    async with serve(engine) as (url, app):
        client = await connect(url)
        assert client.answer["codec"] == "audio/opus"
        assert " 127.0.0.1 " in client.answer["sdp"], "no loopback candidate in the answer"
        await asyncio.sleep(0.3)  # silence flows before anyone speaks
        assert client.frames and not client.audible()

        say_time = client.send(type="say", text="Hello from the loopback test.")
        first = await client.next_message("first_audio")
        done = await client.next_message("turn_done")
        await asyncio.sleep(0.3)  # the client's jitter buffer still holds the tail
        assert done["status"] == "finished"
        audible = client.audible(say_time)
        first_s = audible[0].time - say_time
        turn = _turn_frames(client, say_time)
        num_gaps = sum(f.peak <= SILENT for f in turn)
        print(f"\nWebRTC loopback (opus, 20 ms, real engine): first decoded audio "
              f"{first_s * 1000:.0f} ms after say (server: first frame sent "
              f"{first['server_ms']:.0f} ms after say); engine-late ticks {done['starved_frames']},"
              f" silent frames inside the turn {num_gaps}")
        latency.check("webrtc_first_audio", first_s)
        _assert_contiguous(turn, 960)
        # real time: no silent frame inside the turn and no tick the engine was late for (the
        # track counts those); a late engine fails here (BREEZERT_INJECT_STALL_MS proves it)
        if num_gaps or done["starved_frames"]:
            raise LatencyMiss(f"not real-time: {num_gaps} silent frames inside the turn, "
                              f"{done['starved_frames']} ticks the engine was late for")
        await wait_idle(engine)

        # Barge-in on a long turn: the next frame after clear() is silent, the request is freed.
        track: EngineAudioTrack = next(iter(state_of(app).peers)).track
        ticks: list[tuple[int, bool]] = []
        original_next_frame = track.next_frame
        original_clear = track.clear
        cleared_at: list[int] = []

        def spy_next_frame(now: float) -> np.ndarray:
            pcm = original_next_frame(now)
            ticks.append((track.num_frames_sent, bool(np.abs(pcm).max() > 0.01)))
            return pcm

        def spy_clear() -> float:
            cleared_at.append(track.num_frames_sent)
            return original_clear()

        track.next_frame, track.clear = spy_next_frame, spy_clear  # type: ignore[method-assign]
        state_of(app).request_options = {"max_frames": 150, "ignore_eos": True}
        client.send(type="say", text="A much longer story that we will interrupt.")
        await client.next_message("first_audio")
        await asyncio.sleep(0.4)
        cancel_time = client.send(type="cancel")
        done = await client.next_message("turn_done")
        assert done["status"] == "cancelled"
        await wait_idle(engine)  # engine request aborted: every slot and KV block is free
        await asyncio.sleep(0.4)
        after = [loud for tick, loud in ticks if tick >= cleared_at[0]]
        assert after and not any(after), "audio kept playing after cancel"
        late = client.audible(cancel_time)
        stop_s = (late[-1].time - cancel_time) if late else 0.0
        print(f"cancel: last audible frame decoded {stop_s * 1000:.0f} ms after cancel "
              f"({len(late)} frames were already in flight or in the client's jitter buffer)")
        assert stop_s < 0.3
        await client.close()


async def test_no_gaps_when_the_engine_keeps_up() -> None:
    """Transport only: a stand-in engine that is always ahead, so any gap is ours."""
    replay = FakeEngine()
    async with serve(replay, warmup=False) as (url, _):
        client = await connect(url)
        for _ in range(2):  # two turns: the second starts on a running track
            say_time = client.send(type="say", text="No gaps please.")
            first = await client.next_message("first_audio")
            done = await client.next_message("turn_done")
            await asyncio.sleep(0.25)
            turn = _turn_frames(client, say_time)
            assert done["starved_frames"] == 0
            _assert_contiguous(turn, 960)
            assert all(f.peak > SILENT for f in turn), "a silent frame inside the utterance"
            assert abs(len(turn) - round(TURN_S / 0.02)) <= 1  # codec delay may spill one frame
        print(f"\nWebRTC loopback (opus, 20 ms, replay engine): first decoded audio "
              f"{(turn[0].time - say_time) * 1000:.0f} ms after say "
              f"(server {first['server_ms']:.0f} ms, engine's first chunk after 30 ms)")
        await client.close()


async def test_pcmu_peer_gets_8khz_audio(engine: AsyncEngine) -> None:
    async with serve(engine) as (url, _):
        client = await connect(url, codec="audio/PCMU")
        assert client.answer["codec"] == "audio/PCMU"
        say_time = client.send(type="say", text="Telephony check.")
        done = await client.next_message("turn_done")
        await asyncio.sleep(0.3)
        turn = _turn_frames(client, say_time)
        assert {f.sample_rate for f in turn} == {8000}
        _assert_contiguous(turn, 160)
        assert abs(len(turn) * 0.02 - TURN_S) <= 0.04 + 0.02 * done["starved_frames"]
        print(f"\nWebRTC loopback (PCMU, real engine): first decoded audio "
              f"{(turn[0].time - say_time) * 1000:.0f} ms after say")
        await client.close()


async def test_opus_10ms_frames_decode_completely() -> None:
    replay = FakeEngine()
    async with serve(replay, warmup=False) as (url, _):
        client = await connect(url, frame_ms=10)
        assert client.answer["frame_ms"] == 10
        say_time = client.send(type="say", text="Ten millisecond frames.")
        await client.next_message("turn_done")
        await asyncio.sleep(0.3)
        frames = [f for f in client.frames if f.time >= say_time]
        _assert_contiguous(frames, 480)  # one 10 ms packet -> one whole 10 ms frame
        turn = _turn_frames(client, say_time)
        assert all(f.peak > SILENT for f in turn)
        sent_48k = replay.num_samples_sent * 2
        assert abs(sum(f.samples for f in turn) - sent_48k) <= 480  # the padded last frame
        await client.close()


async def test_failed_request_ends_the_turn_and_the_peer_goes_on() -> None:
    replay = FakeEngine(fail_after_chunks=2)
    async with serve(replay, warmup=False) as (url, app):
        client = await connect(url)
        client.send(type="say", text="This one breaks.")
        done = await client.next_message("turn_done")
        assert done["status"] == "failed" and "injected fault" in done["error"]
        client.send(type="say", text="This one works.")
        assert (await client.next_message("turn_done"))["status"] == "finished"
        assert next(iter(state_of(app).peers)).track.is_idle
        await client.close()


async def test_control_errors_keep_the_peer_usable(engine: AsyncEngine) -> None:
    async with serve(engine, serving={"max_text_chars": 50}) as (url, _):
        client = await connect(url)
        for raw, code in [("{nope", "bad_json"), ('{"type": "shout"}', "unknown_type"),
                          ('{"type": "end"}', "no_open_turn"),
                          ('{"type": "say", "text": "' + "y" * 51 + '"}', "text_too_long"),
                          (json.dumps({"type": "playout", "jitterBufferDelay": "x",
                                       "jitterBufferEmittedCount": 1}), "bad_field")]:
            client.channel.send(raw)
            error = await client.next_message("error")
            assert error["code"] == code and error["message"]
        client.send(type="say", text="Still fine.")
        assert (await client.next_message("turn_done"))["status"] == "finished"
        await client.close()


async def test_bad_offers_and_too_many_peers(engine: AsyncEngine) -> None:
    async with serve(engine, serving={"max_peers": 1}) as (url, app), \
            aiohttp.ClientSession() as http:
        for body, needle in [({"type": "offer"}, "sdp is required"),
                             ({"type": "offer", "sdp": "v=0\r\nnonsense\r\n"}, "no audio m-line"),
                             ({"type": "offer", "sdp": "v=0\r\nm=audio x RTP/AVP 0\r\n"},
                              "invalid SDP"),
                             ({"type": "answer", "sdp": "v=0"}, "only an 'offer'"),
                             ({"type": "offer", "sdp": "v=0", "frame_ms": 30}, "frame_ms")]:
            async with http.post(f"{url}/v1/webrtc/offer", json=body) as r:
                assert r.status == 400 and needle in (await r.json())["error"]["message"]
        async with http.post(f"{url}/v1/webrtc/offer", data=b"{",
                             headers={"Content-Type": "application/json"}) as r:
            assert r.status == 400
        assert not state_of(app).peers  # rejected offers leave nothing behind
        client = await connect(url)
        second = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        second.addTransceiver("audio", direction="recvonly")
        with host_addresses(HostAddresses(only=("127.0.0.1",))):
            await second.setLocalDescription(await second.createOffer())
        async with http.post(f"{url}/v1/webrtc/offer",
                             json={"type": "offer", "sdp": second.localDescription.sdp}) as r:
            assert r.status == 503 and "too many peers" in (await r.json())["error"]["message"]
        await second.close()
        await client.close()
        for _ in range(100):  # the server notices the closed peer and frees its place
            if not state_of(app).peers:
                break
            await asyncio.sleep(0.05)
        assert not state_of(app).peers


async def test_playout_stats_feed_report_playback(engine: AsyncEngine, monkeypatch) -> None:
    reports: list[tuple[str, float, str]] = []
    real = engine.report_playback

    def record(request_id: str, buffered_s: float, measured_at: float, source: str) -> None:
        reports.append((request_id, buffered_s, source))
        real(request_id, buffered_s, measured_at, source)

    monkeypatch.setattr(engine, "report_playback", record)
    async with serve(engine, request_options={"max_frames": 40, "ignore_eos": True}) as (url, _):
        client = await connect(url)
        client.send(type="say", text="Feedback please.")
        started = await client.next_message("turn_started")
        await client.next_message("first_audio")
        delay, emitted = 0.0, 0
        for _ in range(3):  # what a browser sends every 100 ms: cumulative counters
            emitted += 4800
            delay += 4800 * 0.08
            client.send(type="playout", jitterBufferDelay=delay, jitterBufferEmittedCount=emitted,
                        concealmentEvents=0)
            await asyncio.sleep(0.1)
        client.send(type="cancel")
        await client.next_message("turn_done")
        await client.close()
    assert len(reports) == 3 and {r[0] for r in reports} == {started["turn_id"]}
    assert all(r[2] == "webrtc" and r[1] >= 0.08 for r in reports)  # jitter buffer + our queue


def _vanish(client: Client) -> None:
    """The client's network is gone: its UDP sockets close with nothing more sent (no DTLS
    close_notify, no SCTP ABORT, no consent answers), so the server hears silence."""
    connection = client.pc.getTransceivers()[0].receiver.transport.transport._connection
    assert connection._protocols
    for protocol in connection._protocols:
        protocol.transport.close()


async def test_a_vanished_peer_is_freed_within_the_liveness_bound(engine: AsyncEngine) -> None:
    assert ServingConfig().webrtc_liveness_timeout_s <= 10
    bound_s, slack_s = 3.0, 3.0
    serving = {"max_peers": 1, "webrtc_liveness_timeout_s": bound_s}
    async with serve(engine, serving=serving,
                     request_options={"max_frames": 150, "ignore_eos": True}) as (url, app):
        client = await connect(url)
        peer = next(iter(state_of(app).peers))
        assert webrtc_api._ice_connection(peer.transceiver) is not None, \
            "aiortc/aioice internals that the consent probe uses have changed"
        await asyncio.sleep(2.5 * bound_s)  # idle, no turn: it answers consent checks and stays
        assert state_of(app).peers == {peer} and peer.pc.connectionState == "connected"

        client.send(type="say", text="A long story the listener will never hear the end of.")
        await client.next_message("first_audio")
        assert peer.controller.active is not None
        assert engine.engine.scheduler.stats().num_running == 1, "the request ended too soon"
        vanished = time.monotonic()
        _vanish(client)
        # Closing frees the place at once, then ends the turn (its task awaited): wait for both.
        while (state_of(app).peers or peer.controller.active is not None) \
                and time.monotonic() - vanished < bound_s + slack_s:
            await asyncio.sleep(0.05)
        freed_s = time.monotonic() - vanished
        print(f"\nvanished peer closed, its turn ended {freed_s:.2f} s after it went "
              f"(webrtc_liveness_timeout_s={bound_s:g})")
        assert not state_of(app).peers, f"vanished peer still holds its place at {freed_s:.1f} s"
        assert peer.controller.active is None, f"its turn still runs at {freed_s:.1f} s"
        assert freed_s > bound_s - 1.5  # closed by the bound, not by something else
        await wait_idle(engine)  # its engine request was aborted
        second = await connect(url)  # max_peers is 1: the place is free again
        await second.close()
        await client.close()
