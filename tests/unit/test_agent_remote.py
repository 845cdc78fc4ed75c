"""``RemoteRuntimeClient`` + ``TTS(base_url=...)`` against a tiny in-test WebSocket server that
speaks ``breezert serve``'s ``/v1/audio/speech/stream`` protocol.

Owns: the client side of the protocol (say/append/end/cancel/playback out; PCM16, turn events
and errors in), socket reuse, and error mapping. Must not: import the real server or an engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from aiohttp import WSMsgType, web
from livekit.agents import (
    APIConnectionError,
    APIConnectOptions,
    APIError,
    APIStatusError,
    APITimeoutError,
)
from livekit.agents import tts as lk_tts
from livekit.agents.metrics import TTSMetrics

from breezert_agent import TTS
from breezert_agent.client import RemoteRuntimeClient, speech_stream_url

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("virtual_clock")]

SAMPLE_RATE = 24000
NO_RETRY = APIConnectOptions(max_retry=0, timeout=5.0)
SAMPLES_PER_SEGMENT = 2400


@dataclass
class FakeServe:
    """Per segment: two binary PCM16 messages whose samples are ``1000 * (segment + 1)``."""

    url: str = ""
    messages: list[dict[str, Any]] = field(default_factory=list)
    num_connections: int = 0
    headers: list[dict[str, str]] = field(default_factory=list)
    reject_says: list[str] = field(default_factory=list)  # error codes for the next says
    retry_after_s: object = None  # the rejections' retry_after_s, when not None
    fail_after_segments: int | None = None
    close_after_segments: int | None = None
    complain_mid_turn: bool = False
    chunk_delay_s: float = 0.005
    required_token: str | None = None
    freeze: bool = False  # a frozen server: takes says, answers nothing
    freeze_after_segments: int | None = None  # ... or goes silent mid-turn
    handshake_delay_s: float = 0.0  # a server that accepts TCP but answers the upgrade late
    queue_says: bool = False  # say the turn waits for a running slot

    def of_type(self, kind: str) -> list[dict[str, Any]]:
        return [m for m in self.messages if m["type"] == kind]

    async def handler(self, request: web.Request) -> web.StreamResponse:
        if self.required_token and request.headers.get("Authorization") != \
                f"Bearer {self.required_token}":
            return web.Response(status=401)
        self.num_connections += 1
        self.headers.append(dict(request.headers))
        if self.handshake_delay_s:
            await asyncio.sleep(self.handshake_delay_s)
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        await ws.send_str(json.dumps({"type": "ready", "sample_rate": SAMPLE_RATE}))
        turn: dict[str, Any] | None = None
        async for msg in ws:
            if msg.type is not WSMsgType.TEXT:
                continue
            message = json.loads(msg.data)
            self.messages.append(message)
            kind = message["type"]
            if kind == "say" and self.freeze:
                continue
            if kind == "say":
                if self.reject_says:
                    code = self.reject_says.pop(0)
                    error = {"type": "error", "code": code, "message": f"{code} now"}
                    if self.retry_after_s is not None:
                        error["retry_after_s"] = self.retry_after_s
                    await ws.send_str(json.dumps(error))
                    continue
                turn = {"segments": list(message["text"]),
                        "closed": message.get("input_closed", True),
                        "changed": asyncio.Event(), "id": "srv-" + message["request_id"]}
                await ws.send_str(json.dumps({"type": "turn_started", "request_id": turn["id"],
                                              "client_request_id": message["request_id"]}))
                turn["segment_events"] = message.get("segment_events", False)
                if self.queue_says and message.get("queued_events"):
                    await ws.send_str(json.dumps({"type": "queued", "waiting": 3,
                                                  "max_running_requests": 8}))
                turn["task"] = asyncio.create_task(self._play(ws, turn))
            elif kind == "append" and turn is not None:
                turn["segments"].append(message["text"])
                turn["changed"].set()
            elif kind == "end" and turn is not None:
                turn["closed"] = True
                turn["changed"].set()
            elif kind == "cancel" and turn is not None:
                turn["task"].cancel()
                await ws.send_str(json.dumps({"type": "turn_done", "status": "cancelled"}))
                turn = None
        return ws

    async def _play(self, ws: web.WebSocketResponse, turn: dict[str, Any]) -> None:
        index = 0
        while True:
            while index < len(turn["segments"]):
                if index == self.fail_after_segments:
                    await ws.send_str(json.dumps({"type": "error", "code": "internal",
                                                  "message": "depth step failed"}))
                    await ws.send_str(json.dumps({"type": "turn_done", "status": "failed",
                                                  "error": "depth step failed"}))
                    return
                if index == self.close_after_segments:
                    await ws.close()
                    return
                if index == self.freeze_after_segments:
                    await asyncio.sleep(3600)
                if turn["segment_events"]:
                    start_s = index * SAMPLES_PER_SEGMENT / SAMPLE_RATE
                    await ws.send_str(json.dumps({"type": "segment", "index": index,
                                                  "start_frame": round(start_s / 0.08),
                                                  "start_s": start_s}))
                pcm = np.full(SAMPLES_PER_SEGMENT // 2, 1000 * (index + 1), dtype="<i2")
                for _ in range(2):
                    await asyncio.sleep(self.chunk_delay_s)
                    await ws.send_bytes(pcm.tobytes())
                if self.complain_mid_turn and index == 0:
                    await ws.send_str(json.dumps({"type": "error", "code": "bad_field",
                                                  "message": "source must be a short string"}))
                index += 1
            if turn["closed"]:
                await ws.send_str(json.dumps({"type": "turn_done", "status": "finished",
                                              "request_id": turn["id"]}))
                return
            turn["changed"].clear()
            await turn["changed"].wait()


@pytest.fixture
async def serve() -> AsyncIterator[FakeServe]:
    async for fake in _serve():
        yield fake


@pytest.fixture
async def healthy() -> AsyncIterator[FakeServe]:
    """A second server, for fallbacks."""
    async for fake in _serve():
        yield fake


async def _serve(fake: FakeServe | None = None,
                 **routes: Any) -> AsyncIterator[FakeServe]:
    """Serves ``fake`` (a new ``FakeServe``) on loopback, plus GET ``/<name>`` -> handler."""
    fake = fake or FakeServe()
    app = web.Application()
    app.router.add_get("/v1/audio/speech/stream", fake.handler)
    for name, handler in routes.items():
        app.router.add_get(f"/{name}", handler)
    runner = web.AppRunner(app, shutdown_timeout=1.0)  # a failed test leaves sockets open
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    fake.url = f"http://127.0.0.1:{port}"
    yield fake
    await runner.cleanup()


async def _collect(stream: Any) -> list[Any]:
    return [ev async for ev in stream]


def _segments_of(events: list[Any]) -> list[int]:
    samples = np.concatenate([np.frombuffer(ev.frame.data, dtype="<i2") for ev in events])
    return [int(s) // 1000 - 1 for s in samples]


def test_speech_stream_url() -> None:
    assert speech_stream_url("http://h:8080") == "ws://h:8080/v1/audio/speech/stream"
    assert speech_stream_url("https://h/api/") == "wss://h/api/v1/audio/speech/stream"
    assert speech_stream_url("ws://h:1/v1/audio/speech/stream") == \
        "ws://h:1/v1/audio/speech/stream"
    with pytest.raises(ValueError, match="base_url"):
        speech_stream_url("h:8080")


async def test_stream_turn_over_the_socket(serve: FakeServe) -> None:
    tts = TTS(base_url=serve.url, speaker="[S1]", max_frames=40)
    stream = tts.stream(conn_options=NO_RETRY)
    for piece in ("Hello", " there.", " How are", " you?", " Bye"):
        stream.push_text(piece)
        await asyncio.sleep(0.01)
    stream.end_input()
    events = await _collect(stream)

    say, = serve.of_type("say")
    assert say["text"] == ["Hello there."] and say["input_closed"] is False
    assert say["speaker"] == "[S1]" and say["max_frames"] == 40 and say["format"] == "pcm"
    assert [m["text"] for m in serve.of_type("append")] == ["How are you?", "Bye"]
    assert len(serve.of_type("end")) == 1
    order = _segments_of(events)
    assert len(order) == 3 * SAMPLES_PER_SEGMENT and order == sorted(order)
    await tts.aclose()


async def test_synthesize_sends_one_closed_say_and_reuses_the_socket(serve: FakeServe) -> None:
    tts = TTS(base_url=serve.url)
    for _ in range(2):
        frame = await tts.synthesize("One. Two!", conn_options=NO_RETRY).collect()
        assert frame.samples_per_channel == 2 * SAMPLES_PER_SEGMENT
    says = serve.of_type("say")
    assert [s["text"] for s in says] == [["One.", "Two!"]] * 2
    assert all(s["input_closed"] for s in says) and serve.of_type("end") == []
    assert serve.num_connections == 1  # the idle socket served the second turn
    await tts.aclose()


async def test_socket_is_reused_only_after_a_clean_turn_done(serve: FakeServe) -> None:
    tts = TTS(base_url=serve.url)
    serve.fail_after_segments = 0
    with pytest.raises(APIError):
        await tts.synthesize("One.", conn_options=NO_RETRY).collect()
    serve.fail_after_segments = None
    for _ in range(2):
        await tts.synthesize("Two.", conn_options=NO_RETRY).collect()
    assert serve.num_connections == 2  # a new socket after the failed turn, then that one again
    await tts.aclose()


async def test_rejected_say_is_retried_when_overloaded(serve: FakeServe) -> None:
    serve.reject_says = ["overloaded"]
    tts = TTS(base_url=serve.url)
    stream = tts.stream(conn_options=APIConnectOptions(max_retry=1, retry_interval=0.01))
    stream.push_text("Hello!")
    stream.end_input()
    events = await _collect(stream)
    assert len(events) > 0 and len(serve.of_type("say")) == 2
    await tts.aclose()


@pytest.mark.parametrize(("sent", "told"), [(3, 3.0), (0, None), ("soon", None), (True, None)])
async def test_an_overloaded_say_tells_the_plugin_the_servers_predicted_wait(
        serve: FakeServe, sent: object, told: float | None) -> None:
    serve.reject_says, serve.retry_after_s = ["overloaded"], sent
    tts = TTS(base_url=serve.url)
    with pytest.raises(APIStatusError) as info:
        await tts.synthesize("Hi.", conn_options=NO_RETRY).collect()
    # LiveKit's retryable 503; the wait (a number > 0 only) in its body and message
    assert info.value.status_code == 503 and info.value.retryable
    assert info.value.body == (None if told is None else {"retry_after_s": told})
    assert ("retry after 3.0 s" in str(info.value)) is (told is not None)
    assert "overloaded now" in str(info.value)  # the server's reason (which check refused)
    await tts.aclose()


async def test_invalid_say_is_not_retried(serve: FakeServe) -> None:
    serve.reject_says = ["text_too_long"] * 3
    tts = TTS(base_url=serve.url)
    with pytest.raises(APIStatusError) as info:
        await tts.synthesize("Hi.", conn_options=APIConnectOptions(max_retry=2)).collect()
    assert info.value.status_code == 400 and not info.value.retryable
    assert len(serve.of_type("say")) == 1
    await tts.aclose()


async def test_failure_after_audio_is_final(serve: FakeServe) -> None:
    serve.fail_after_segments = 1
    tts = TTS(base_url=serve.url)
    stream = tts.stream(conn_options=APIConnectOptions(max_retry=2, retry_interval=0.01))
    stream.push_text("One. Two. Three.")
    stream.end_input()
    with pytest.raises(APIError) as info:
        await _collect(stream)
    assert not info.value.retryable and "depth step failed" in str(info.value)
    assert len(serve.of_type("say")) == 1
    await tts.aclose()


async def test_socket_closed_mid_turn_is_a_connection_error(serve: FakeServe) -> None:
    serve.close_after_segments = 1
    tts = TTS(base_url=serve.url)
    stream = tts.stream(conn_options=APIConnectOptions(max_retry=2, retry_interval=0.01))
    stream.push_text("One. Two.")
    stream.end_input()
    with pytest.raises(APIConnectionError) as info:
        await _collect(stream)
    assert not info.value.retryable  # audio was already played
    await tts.aclose()


async def test_unreachable_server_is_a_retryable_connection_error() -> None:
    tts = TTS(base_url="http://127.0.0.1:9")  # discard port: nothing listens
    errors: list[Any] = []
    tts.on("error", errors.append)
    with pytest.raises(APIConnectionError):
        await tts.synthesize("Hi.", conn_options=APIConnectOptions(
            max_retry=1, retry_interval=0.01, timeout=2.0)).collect()
    assert [e.recoverable for e in errors] == [True, False]
    await tts.aclose()


async def test_aclose_mid_turn_sends_cancel(serve: FakeServe) -> None:
    serve.chunk_delay_s = 0.05
    tts = TTS(base_url=serve.url)
    stream = tts.stream(conn_options=NO_RETRY)
    stream.push_text("One! Two! Three! Four!")
    async for _ in stream:
        break
    await asyncio.wait_for(tts.aclose(), 5.0)
    for _ in range(100):
        if serve.of_type("cancel"):
            break
        await asyncio.sleep(0.01)
    assert len(serve.of_type("cancel")) == 1


class _Source:
    queued_duration = 0.25


async def test_playback_feedback_is_sent_and_complaints_stop_it(serve: FakeServe) -> None:
    serve.chunk_delay_s = 0.03
    tts = TTS(base_url=serve.url, feedback_interval_s=0.01)
    tts.attach_audio_source(_Source())  # type: ignore[arg-type]
    frame = await tts.synthesize("One. Two. Three.", conn_options=NO_RETRY).collect()
    assert frame.samples_per_channel == 3 * SAMPLES_PER_SEGMENT
    playback = serve.of_type("playback")
    assert playback and all(m["source"] == "livekit-source" for m in playback)
    assert all(m["buffered_s"] == 0.25 and 0 <= m["age_s"] < 1 for m in playback)

    serve.messages.clear()
    serve.complain_mid_turn = True  # a server that rejects our playback messages
    frame = await tts.synthesize("One. Two. Three.", conn_options=NO_RETRY).collect()
    assert frame.samples_per_channel == 3 * SAMPLES_PER_SEGMENT  # the turn went on
    complained_at = next(i for i, m in enumerate(serve.messages) if m["type"] == "playback")
    assert len(serve.of_type("playback")) <= complained_at + 3
    await tts.aclose()


async def test_auth_token_is_sent_as_bearer(serve: FakeServe) -> None:
    serve.required_token = "s3cret"
    tts = TTS(base_url=serve.url, auth_token="s3cret")
    await tts.synthesize("Hi.", conn_options=NO_RETRY).collect()
    assert serve.headers[0]["Authorization"] == "Bearer s3cret"
    await tts.aclose()
    bad = TTS(base_url=serve.url, auth_token="wrong")
    with pytest.raises(APIStatusError) as info:
        await bad.synthesize("Hi.", conn_options=APIConnectOptions(max_retry=2)).collect()
    assert not info.value.retryable and "s3cret" not in str(info.value)
    await bad.aclose()


# ----------------------------------------------------------------------------- timeouts

QUICK = APIConnectOptions(max_retry=0, timeout=0.5)


async def test_frozen_server_on_the_pooled_socket_is_a_timeout(serve: FakeServe) -> None:
    tts = TTS(base_url=serve.url)
    await tts.synthesize("Warm.", conn_options=NO_RETRY).collect()  # the socket is pooled
    serve.freeze = True
    start = time.monotonic()
    with pytest.raises(APITimeoutError) as info:
        await tts.synthesize("Hello.", conn_options=QUICK).collect()
    assert time.monotonic() - start < QUICK.timeout + 1.5
    assert info.value.retryable  # nothing was played yet
    assert serve.num_connections == 1
    serve.freeze = False
    await tts.synthesize("Again.", conn_options=NO_RETRY).collect()  # a fresh socket works
    assert serve.num_connections == 2
    await tts.aclose()


async def test_server_frozen_mid_audio_times_out_after_the_lead(serve: FakeServe) -> None:
    serve.freeze_after_segments = 1
    tts = TTS(base_url=serve.url)
    start = time.monotonic()
    with pytest.raises(APITimeoutError) as info:
        await tts.synthesize("One. Two.", conn_options=QUICK).collect()
    assert not info.value.retryable  # audio was already pushed
    assert time.monotonic() - start < QUICK.timeout + 0.1 + 1.5  # 0.1 s of audio ahead
    await tts.aclose()


async def test_late_handshake_is_a_timeout_not_a_connection_error(serve: FakeServe) -> None:
    serve.handshake_delay_s = 5.0
    tts = TTS(base_url=serve.url)
    start = time.monotonic()
    with pytest.raises(APITimeoutError):
        await tts.synthesize("Hello.", conn_options=QUICK).collect()
    assert time.monotonic() - start < QUICK.timeout + 1.5
    await tts.aclose()


async def test_open_turn_waiting_for_text_is_not_a_timeout(serve: FakeServe) -> None:
    tts = TTS(base_url=serve.url)
    stream = tts.stream(conn_options=QUICK)
    stream.push_text("First sentence. ")
    await asyncio.sleep(3 * QUICK.timeout)  # the LLM is slow: the server owes nothing
    stream.push_text("Second one.")
    stream.end_input()
    events = await _collect(stream)
    assert len(_segments_of(events)) == 2 * SAMPLES_PER_SEGMENT
    await tts.aclose()


async def test_fallback_adapter_moves_on_within_the_timeout(
    serve: FakeServe, healthy: FakeServe
) -> None:
    serve.freeze = True
    remote, backup = TTS(base_url=serve.url), TTS(base_url=healthy.url)
    fallback = lk_tts.FallbackAdapter([remote, backup], max_retry_per_tts=0)
    start = time.monotonic()
    frame = await fallback.synthesize("Hello.", conn_options=QUICK).collect()
    assert time.monotonic() - start < QUICK.timeout + 2.0
    assert frame.samples_per_channel == SAMPLES_PER_SEGMENT
    assert len(healthy.of_type("say")) == 1

    stream = fallback.stream(conn_options=QUICK)  # streamed: the same
    start = time.monotonic()
    stream.push_text("One. Two.")
    stream.end_input()
    events = await _collect(stream)
    assert time.monotonic() - start < QUICK.timeout + 2.0
    assert len(_segments_of(events)) == 2 * SAMPLES_PER_SEGMENT
    await fallback.aclose()
    await remote.aclose()
    await backup.aclose()


async def test_pooled_socket_has_a_max_age_and_survives_heartbeats(serve: FakeServe) -> None:
    client = RemoteRuntimeClient(serve.url, heartbeat=0.1, max_session_duration=None)
    tts = TTS(client=client)
    await tts.synthesize("One.", conn_options=NO_RETRY).collect()
    await asyncio.sleep(0.6)  # several pings while idle in the pool
    await tts.synthesize("Two.", conn_options=NO_RETRY).collect()
    assert serve.num_connections == 1
    await tts.aclose()
    await client.aclose()

    aged = RemoteRuntimeClient(serve.url, max_session_duration=0.2)
    tts = TTS(client=aged)
    await tts.synthesize("One.", conn_options=NO_RETRY).collect()
    await asyncio.sleep(0.4)
    await tts.synthesize("Two.", conn_options=NO_RETRY).collect()
    assert serve.num_connections == 3  # the old socket was too old to reuse
    await tts.aclose()
    await aged.aclose()


async def test_metrics_tell_connection_reuse_and_acquire_time(serve: FakeServe) -> None:
    tts = TTS(base_url=serve.url)
    metrics: list[TTSMetrics] = []
    tts.on("metrics_collected", metrics.append)
    await tts.synthesize("One.", conn_options=NO_RETRY).collect()
    stream = tts.stream(conn_options=NO_RETRY)
    stream.push_text("Two.")
    stream.end_input()
    await _collect(stream)
    await asyncio.sleep(0.05)
    assert [m.connection_reused for m in metrics] == [False, True]
    assert metrics[0].acquire_time > 0 and metrics[1].acquire_time == 0
    await tts.aclose()


async def test_appended_segment_that_never_starts_is_a_timeout(serve: FakeServe) -> None:
    """With ``segment`` events the client knows the server owes it the appended sentence."""
    serve.freeze_after_segments = 1
    tts = TTS(base_url=serve.url)
    stream = tts.stream(conn_options=QUICK)
    stream.push_text("One. T")  # "One." is complete once the next word starts
    events: list[Any] = []

    async def feed() -> None:  # (livekit-agents 1.8.9 drops text pushed after a flush)
        await asyncio.sleep(0.3)
        stream.push_text("wo. And")  # "Two." is appended; the input stays open

    feeder = asyncio.create_task(feed())
    start = time.monotonic()
    with pytest.raises(APITimeoutError):
        async for ev in stream:
            events.append(ev)
    assert time.monotonic() - start < 0.3 + QUICK.timeout + 0.1 + 1.5
    assert events  # the first sentence played
    await feeder
    await tts.aclose()


def _timed(events: list[Any]) -> list[tuple[str, float]]:
    return [(str(t), t.start_time) for ev in events
            for t in ev.frame.userdata.get("lk.timed_transcripts", [])]


async def test_segment_events_give_each_sentence_its_start(serve: FakeServe) -> None:
    tts = TTS(base_url=serve.url)
    assert tts.capabilities.aligned_transcript
    stream = tts.stream(conn_options=NO_RETRY)
    stream.push_text("One. Two. Three.")
    stream.end_input()
    events = await _collect(stream)
    say, = serve.of_type("say")
    assert say["segment_events"] is True and say["queued_events"] is True
    segment_s = SAMPLES_PER_SEGMENT / SAMPLE_RATE
    assert _timed(events) == [("One. ", 0.0), ("Two. ", segment_s), ("Three. ", 2 * segment_s)]

    frame_events = await _collect(tts.synthesize("Four. Five.", conn_options=NO_RETRY))
    assert _timed(frame_events) == [("Four. ", 0.0), ("Five. ", segment_s)]
    await tts.aclose()


async def test_queued_event_is_logged(serve: FakeServe, caplog: pytest.LogCaptureFixture) -> None:
    serve.queue_says = True
    tts = TTS(base_url=serve.url)
    with caplog.at_level(logging.INFO, logger="breezert_agent"):
        await tts.synthesize("One.", conn_options=NO_RETRY).collect()
    line, = [r.getMessage() for r in caplog.records if "queued" in r.getMessage()]
    assert "8 running-request slots are all taken" in line and "3 waiting" in line
    await tts.aclose()
