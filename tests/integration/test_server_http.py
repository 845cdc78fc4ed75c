"""``POST /v1/audio/speech``, the WebSocket stream, health, metrics and auth, on the tiny CPU model.

Owns: the HTTP/WS contract: WAV and PCM bodies, a streamed response that arrives chunk by chunk
(one HTTP chunk per engine chunk), every bad request answered 4xx with a message, the bearer
token, readiness after warm-up, and WS turns (say/append/end/cancel, PCM16 and Ogg/Opus).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import time
import wave
from typing import Any

import aiohttp
import av
import pytest
from aiohttp import web
from breezert.async_engine import AsyncEngine
from breezert.outputs import AudioChunk

from tests.integration._server import (
    FRAMES_PER_TURN,
    SAMPLES_PER_FRAME,
    TURN_BYTES,
    serve,
    state_of,
    wait_idle,
    ws_turn,
)

pytestmark = pytest.mark.integration

# ----------------------------------------------------------------------------- HTTP


async def test_wav_response(engine: AsyncEngine) -> None:
    """A WAV file with its exact length takes ``stream: false``; by default (as OpenAI) the
    WAV streams, its header saying the length is unknown."""
    request = {"model": "breeze-tts-2", "input": "Hello.", "voice": "S1", "stream": False}
    async with serve(engine) as (url, _), aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/audio/speech", json=request) as r:
            assert r.status == 200 and r.content_type == "audio/wav"
            body = await r.read()
        del request["stream"]
        async with http.post(f"{url}/v1/audio/speech", json=request) as r:
            streamed = await r.read()
    with wave.open(io.BytesIO(body)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (24000, 1, 2)
        assert w.getnframes() == FRAMES_PER_TURN * SAMPLES_PER_FRAME
    assert streamed[:4] == b"RIFF" and streamed[40:44] == b"\xdb\xff\xff\xff"  # unknown size
    assert len(streamed) == len(body)


async def test_streamed_pcm_arrives_chunk_by_chunk(
    engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One HTTP chunk per engine chunk, in order, the first one alone (the chunks' sizes are
    the Predictor's: the profile's first-chunk cover may make the first one longer than the
    schedule's one frame on a slow box)."""
    made: list[int] = []  # each engine chunk's PCM16 bytes, as the server receives it
    real_stream = engine.stream

    async def stream(request_id: str, **kwargs: Any) -> Any:
        async for item in real_stream(request_id, **kwargs):
            if isinstance(item, AudioChunk):
                made.append(len(item.pcm) * 2)
            yield item

    monkeypatch.setattr(engine, "stream", stream)
    async with serve(engine) as (url, _), aiohttp.ClientSession() as http:
        made.clear()  # the warm-up's request went through the same engine
        start = time.monotonic()
        async with http.post(f"{url}/v1/audio/speech",
                             json={"input": "Hello there.", "stream": True}) as r:
            assert r.status == 200 and r.headers["X-Sample-Rate"] == "24000"
            pieces: list[tuple[float, int]] = []
            buffer = b""
            async for data, end_of_chunk in r.content.iter_chunks():
                buffer += data
                if end_of_chunk and buffer:  # (not the body's zero-length last chunk)
                    pieces.append((time.monotonic() - start, len(buffer)))
                    buffer = b""
    sizes = [n for _, n in pieces]
    assert sizes == made, (sizes, made)
    assert all(n % (SAMPLES_PER_FRAME * 2) == 0 for n in sizes), sizes  # whole frames
    assert len(sizes) >= 3 and sum(sizes) == TURN_BYTES
    first_s, last_s = pieces[0][0], pieces[-1][0]
    print(f"\nHTTP stream: first chunk ({sizes[0] // (SAMPLES_PER_FRAME * 2)} frames) after "
          f"{first_s * 1000:.0f} ms, last after {last_s * 1000:.0f} ms, {len(sizes)} chunks")
    assert first_s < last_s


async def test_client_leaving_mid_stream_aborts_the_request(engine: AsyncEngine) -> None:
    long_turn = {"max_frames": 200, "ignore_eos": True}
    async with serve(engine, request_options=long_turn) as (url, _), \
            aiohttp.ClientSession() as http:
        r = await http.post(f"{url}/v1/audio/speech", json={"input": "Long.", "stream": True})
        await r.content.readexactly(SAMPLES_PER_FRAME * 2)
        r.close()
        await wait_idle(engine, timeout_s=2.0)


async def test_client_gone_before_the_stream_opens_aborts_the_request(
    engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_prepare = web.StreamResponse.prepare

    async def prepare(self: web.StreamResponse, request: web.BaseRequest) -> Any:
        if type(self) is web.StreamResponse:  # the streamed body: the client left already
            raise ConnectionResetError("client gone")
        return await real_prepare(self, request)

    long_turn = {"max_frames": 400, "ignore_eos": True}
    async with serve(engine, request_options=long_turn) as (url, _), \
            aiohttp.ClientSession() as http:
        monkeypatch.setattr(web.StreamResponse, "prepare", prepare)
        with contextlib.suppress(aiohttp.ClientError):
            async with http.post(f"{url}/v1/audio/speech",
                                 json={"input": "Long.", "stream": True}) as r:
                await r.read()
        monkeypatch.undo()
        await wait_idle(engine, timeout_s=2.0)
    assert not engine._routes


async def test_raw_pcm_and_streamed_wav(engine: AsyncEngine) -> None:
    async with serve(engine) as (url, _), aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/audio/speech",
                             json={"input": "Hi.", "response_format": "pcm"}) as r:
            assert r.status == 200 and len(await r.read()) == TURN_BYTES
        async with http.post(f"{url}/v1/audio/speech",
                             json={"input": "Hi.", "response_format": "wav", "stream": True}) as r:
            body = await r.read()
            assert r.status == 200 and body[:4] == b"RIFF" and len(body) == 44 + TURN_BYTES


@pytest.mark.parametrize("body,status,param", [
    ({}, 400, "input"),
    ({"input": ""}, 400, "input"),
    ({"input": "   "}, 400, "input"),
    ({"input": 42}, 400, "input"),
    ({"input": "Hi", "voice": "alloy"}, 400, "voice"),
    ({"input": "Hi", "response_format": "mp3"}, 400, "response_format"),
    ({"input": "Hi", "speed": 1.5}, 400, "speed"),
    ({"input": "Hi", "stream": "yes"}, 400, "stream"),
    ({"input": "x" * 2001}, 413, "input"),
    ({"input": "Hi", "reference_text": "Me."}, 400, "reference_audio"),
    ({"input": "Hi", "reference_audio": "@@@", "reference_text": "Me."}, 400, "reference_audio"),
    ({"input": "Hi", "reference_audio": "UklGRg=="}, 400, "reference_text"),
    ({"input": "Hi", "reference_audio": "UklGRg==", "reference_text": "Me."}, 400,
     "reference_audio"),
])
async def test_bad_requests_get_4xx_with_a_message(
    engine: AsyncEngine, body: dict[str, Any], status: int, param: str
) -> None:
    async with serve(engine, serving={"max_text_chars": 2000}) as (url, _), \
            aiohttp.ClientSession() as http, http.post(f"{url}/v1/audio/speech", json=body) as r:
        error = (await r.json())["error"]
    assert r.status == status and error["param"] == param and len(error["message"]) > 10
    await wait_idle(engine)


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b""])
async def test_body_that_is_not_a_json_object(engine: AsyncEngine, raw: bytes) -> None:
    async with serve(engine) as (url, _), aiohttp.ClientSession() as http, \
            http.post(f"{url}/v1/audio/speech", data=raw,
                      headers={"Content-Type": "application/json"}) as r:
        assert r.status == 400 and "JSON" in (await r.json())["error"]["message"]


async def test_bearer_token_is_enforced_when_set(engine: AsyncEngine) -> None:
    async with serve(engine, serving={"auth_token": "s3cret"}) as (url, _), \
            aiohttp.ClientSession() as http:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            async with http.post(f"{url}/v1/audio/speech", json={"input": "Hi"},
                                 headers=headers) as r:
                assert r.status == 401 and "bearer token" in (await r.json())["error"]["message"]
        async with http.post(f"{url}/v1/audio/speech", json={"input": "Hi"},
                             headers={"Authorization": "Bearer s3cret"}) as r:
            assert r.status == 200
        async with http.get(f"{url}/healthz") as r:  # probes stay open
            assert r.status == 200
        with pytest.raises(aiohttp.WSServerHandshakeError):
            await http.ws_connect(f"{url}/v1/audio/speech/stream")
        ws = await http.ws_connect(f"{url}/v1/audio/speech/stream?access_token=s3cret")
        assert json.loads((await ws.receive()).data)["type"] == "ready"
        await ws.close()


async def test_ready_only_after_warmup_and_metrics(engine: AsyncEngine) -> None:
    async with serve(engine, warmup=True) as (url, _), aiohttp.ClientSession() as http:
        statuses = []
        for _ in range(200):
            async with http.get(f"{url}/readyz") as r:
                statuses.append(r.status)
            if r.status == 200:
                break
            await asyncio.sleep(0.01)
        assert statuses[-1] == 200 and set(statuses) <= {200, 503}
        async with http.get(f"{url}/healthz") as r:
            assert r.status == 200
        async with http.post(f"{url}/v1/audio/speech", json={"input": "Hi"}) as r:
            await r.read()
        async with http.get(f"{url}/metrics") as r:
            assert r.status == 200 and r.content_type == "text/plain"
            text = await r.text()
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
    assert float(samples["breezert_ttfb_seconds_count"]) >= 2  # warm-up + the request
    for name in ("breezert_underruns_total", "breezert_active_streams", "breezert_queue_depth",
                 'breezert_stage_step_seconds_count{stage="decode"}'):
        assert name in samples, name


# ----------------------------------------------------------------------------- WebSocket


async def test_websocket_pcm_turn_and_streamed_text(engine: AsyncEngine) -> None:
    async with serve(engine) as (url, _), aiohttp.ClientSession() as http:
        ws = await http.ws_connect(f"{url}/v1/audio/speech/stream")
        assert json.loads((await ws.receive()).data)["type"] == "ready"
        await ws.send_json({"type": "say", "text": "Hello there.", "voice": "S2"})
        events, audio = await ws_turn(ws)
        kinds = [e["type"] for e in events]
        assert kinds == ["turn_started", "first_audio", "turn_done"]
        assert events[-1]["status"] == "finished" and len(audio) == TURN_BYTES
        # A streamed turn: two text pieces, each its own segment of FRAMES_PER_TURN frames.
        await ws.send_json({"type": "say", "text": "Hello", "more": True})
        await ws.send_json({"type": "append", "text": " and goodbye."})
        await ws.send_json({"type": "end"})
        events, audio = await ws_turn(ws)
        assert events[-1]["status"] == "finished" and len(audio) == 2 * TURN_BYTES
        await ws.close()
    await wait_idle(engine)


async def test_websocket_plugin_style_turn_with_playback(engine: AsyncEngine, monkeypatch) -> None:
    """What ``breezert_agent``'s remote client sends: segments, its own id, end, playback."""
    reports: list[tuple[str, float, str]] = []

    def record(request_id: str, buffered_s: float, measured_at: float, source: str) -> None:
        reports.append((request_id, buffered_s, source))

    monkeypatch.setattr(engine, "report_playback", record)
    async with serve(engine) as (url, _), aiohttp.ClientSession() as http:
        ws = await http.ws_connect(f"{url}/v1/audio/speech/stream")
        await ws.receive()
        await ws.send_json({"type": "say", "request_id": "mine-1", "text": ["One.", "Two."],
                            "speaker": "[S3]", "seed": 5})
        await ws.send_json({"type": "end"})  # the input is already closed: a no-op
        started = json.loads((await ws.receive()).data)
        assert started["type"] == "turn_started" and started["client_request_id"] == "mine-1"
        await ws.send_json({"type": "playback", "buffered_s": 0.25, "age_s": 0.01,
                            "source": "livekit-source"})
        events, audio = await ws_turn(ws)
        await ws.close()
    assert [e["type"] for e in events if e["type"] == "error"] == []
    assert events[-1]["status"] == "finished" and len(audio) == 2 * TURN_BYTES
    assert reports == [(started["request_id"], 0.25, "livekit-source")]


async def test_websocket_ogg_opus_turn(engine: AsyncEngine) -> None:
    async with serve(engine) as (url, _), aiohttp.ClientSession() as http:
        ws = await http.ws_connect(f"{url}/v1/audio/speech/stream")
        await ws.receive()
        await ws.send_json({"type": "say", "text": "Hello.", "format": "opus"})
        events, audio = await ws_turn(ws)
        await ws.close()
    assert audio[:4] == b"OggS" and events[-1]["status"] == "finished"
    with av.open(io.BytesIO(audio)) as container:
        samples = sum(frame.samples for frame in container.decode(audio=0))
    assert samples == FRAMES_PER_TURN * SAMPLES_PER_FRAME * 2  # decoded at 48 kHz


async def test_websocket_errors_keep_the_socket_usable(engine: AsyncEngine) -> None:
    async with serve(engine, serving={"max_text_chars": 40}) as (url, _), \
            aiohttp.ClientSession() as http:
        ws = await http.ws_connect(f"{url}/v1/audio/speech/stream")
        await ws.receive()
        bad = [("{oops", "bad_json"), ('{"type": "jump"}', "unknown_type"),
               ('{"type": "append", "text": "x"}', "no_open_turn"),
               ('{"type": "say", "text": "' + "x" * 41 + '"}', "text_too_long"),
               ('{"type": "say", "text": "Hi", "voice": "nobody"}', "invalid_request")]
        for raw, code in bad:
            await ws.send_str(raw)
            reply = json.loads((await ws.receive()).data)
            assert reply["type"] == "error" and reply["code"] == code and reply["message"]
        await ws.send_bytes(b"\x00\x01")
        assert json.loads((await ws.receive()).data)["code"] == "bad_message"
        await ws.send_json({"type": "say", "text": "Still here."})
        await ws.send_json({"type": "say", "text": "Again."})  # one turn at a time
        events, audio = await ws_turn(ws)
        assert [e["code"] for e in events if e["type"] == "error"] == ["turn_active"]
        assert events[-1]["status"] == "finished" and len(audio) == TURN_BYTES
        await ws.close()
    await wait_idle(engine)


async def test_websocket_cancel_aborts_the_request(engine: AsyncEngine) -> None:
    long_turn = {"max_frames": 200, "ignore_eos": True}
    async with serve(engine, request_options=long_turn) as (url, _), \
            aiohttp.ClientSession() as http:
        ws = await http.ws_connect(f"{url}/v1/audio/speech/stream")
        await ws.receive()
        await ws.send_json({"type": "say", "text": "A long story."})
        while (await ws.receive()).type != aiohttp.WSMsgType.BINARY:
            pass
        await ws.send_json({"type": "cancel"})
        events, audio = await ws_turn(ws)
        assert events[-1]["status"] == "cancelled"
        assert len(audio) < 200 * SAMPLES_PER_FRAME * 2 // 2
        await wait_idle(engine)
        await ws.close()


@pytest.mark.parametrize("leave", ["drop_connection", "close_right_after_say"])
async def test_websocket_client_leaving_mid_turn_ends_the_session_cleanly(
    engine: AsyncEngine, leave: str
) -> None:
    long_turn = {"max_frames": 400, "ignore_eos": True}
    async with serve(engine, request_options=long_turn) as (url, app):
        http = aiohttp.ClientSession()
        ws = await http.ws_connect(f"{url}/v1/audio/speech/stream")
        await ws.receive()
        await ws.send_json({"type": "say", "text": "A long story."})
        if leave == "drop_connection":  # no close frame: the TCP connection just goes
            while (await ws.receive()).type != aiohttp.WSMsgType.BINARY:
                pass
            await http.close()
        else:
            await ws.close()
            await http.close()
        await wait_idle(engine, timeout_s=2.0)
        for _ in range(100):
            if state_of(app).num_ws_sessions == 0:
                break
            await asyncio.sleep(0.02)
        assert state_of(app).num_ws_sessions == 0
    assert not engine._routes
