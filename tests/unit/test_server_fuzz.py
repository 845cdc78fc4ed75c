"""Property-based abuse of the server's parsers: any HTTP body, WebSocket message or SDP offer
gets a 4xx or an ``error`` event, never a 5xx, never a dropped socket (issue 16, item 1).

Owns: one app per module over ``FakeEngine`` (like the real tokenizer, it rejects text that is
not valid Unicode; its token limit is small, so long input reaches the server's cutting of text
into segments that fit), driven by hypothesis with bounded examples. Must not: synthesise real
audio (a valid request yields one replayed frame per segment) or take more than a few seconds
per property.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from breezert.config import ServingConfig
from breezert.server.app import create_app
from breezert.server.state import STATE
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.fake_engine import TEMPLATE_TOKENS, FakeEngine
from tests.integration._server import recvonly_offer

pytestmark = pytest.mark.unit

FUZZ = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


MAX_PROMPT_TOKENS = 48
"""The fake's token limit: any input over about 40 bytes is cut into segments (``Split``)."""


def _engine() -> FakeEngine:
    return FakeEngine(num_frames=1, first_chunk_s=0.0, speedup=1000.0,
                      max_prompt_tokens=MAX_PROMPT_TOKENS)


# ----------------------------------------------------------------------------- strategies

SPECIAL_STRINGS = st.sampled_from(["\ud800", "\udfff", "a\udc80b", "\x00", "", " ", "S0",
                                   "wav", "pcm", "opus", "say", "offer", "x" * 5000])
SPECIAL_NUMBERS = st.sampled_from([0, -1, 1 << 64, -(1 << 70), 10 ** 30, 1e308, -0.0, 0.5])
SCALARS = (st.none() | st.booleans() | st.integers() | SPECIAL_NUMBERS
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20)
           | SPECIAL_STRINGS)
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.text(max_size=8) | SPECIAL_STRINGS, inner,
                                        max_size=4), max_leaves=12)
RAW_TEXTS = st.sampled_from([
    "[" * 100_000, "{\"a\":" * 50_000, "1e400", "-1e400", "NaN", "Infinity", "-Infinity",
    "1" * 5000, "\"\\ud800\"", "{\"input\": \"\\udfff\"}", "{\"input\": 1e999}",
    "{\"input\": \"hi\", \"seed\": " + "9" * 5000 + "}", "{\"input\": \"hi\", \"seed\": NaN}",
    "{\"input\": \"hi\", \"speed\": Infinity}", "{", "", "null", "[]", "\"text\"", "{\"\\ud800\": 1}",
])

HTTP_FIELDS = ("input", "model", "voice", "instructions", "response_format", "stream", "speed",
               "seed", "reference_audio", "reference_text")
WS_FIELDS = ("text", "more", "input_closed", "voice", "speaker", "instructions", "seed",
             "cfg_scale", "temperature", "top_k", "top_p", "repetition_penalty", "max_frames",
             "priority", "chunk_schedule", "request_id", "format", "reference_audio",
             "reference_text", "buffered_s", "age_s", "source")
WS_TYPES = ("say", "append", "end", "cancel", "playback", "playout", "bogus")


def _objects(fields: tuple[str, ...], base: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries(base, optional={f: VALUES for f in fields if f not in base})


def _document(objects: st.SearchStrategy[Any]) -> st.SearchStrategy[bytes]:
    """JSON text (NaN/Infinity literals and lone-surrogate escapes included), raw texts, bytes."""
    encoded = (objects | VALUES).map(lambda v: json.dumps(v).encode())
    return encoded | RAW_TEXTS.map(str.encode) | st.binary(max_size=64)


HTTP_BODIES = _document(_objects(HTTP_FIELDS, {"input": VALUES | st.just("Hello.")}))
WS_MESSAGES = _document(_objects(WS_FIELDS, {"type": st.sampled_from(WS_TYPES) | VALUES}))


# ----------------------------------------------------------------------------- the app


class Harness:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.engine = _engine()
        self.app = create_app(self.engine, ServingConfig(port=0, max_peers=1000),
                              request_options={"max_frames": 1}, warmup=False,
                              ice_addresses=["127.0.0.1"])
        self.server = TestServer(self.app, host="127.0.0.1", port=0)
        self.run(self.server.start_server())
        self.url = str(self.server.make_url("")).rstrip("/")
        self.http = self.run(self._session())
        self.ws: aiohttp.ClientWebSocketResponse | None = None

    async def _session(self) -> aiohttp.ClientSession:
        return aiohttp.ClientSession()

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(asyncio.wait_for(coro, 30))

    async def post(self, path: str, body: bytes) -> tuple[int, Any]:
        async with self.http.post(f"{self.url}{path}", data=body,
                                  headers={"Content-Type": "application/json"}) as r:
            data = await r.read()
            return r.status, (json.loads(data) if r.content_type == "application/json" else None)

    def close(self) -> None:
        async def close() -> None:
            if self.ws is not None:
                await self.ws.close()
            await self.http.close()
            await self.server.close()
        self.run(close())
        self.loop.close()


@pytest.fixture(scope="module")
def harness() -> Iterator[Harness]:
    h = Harness()
    yield h
    h.close()


def _assert_4xx_names_what(status: int, body: Any) -> None:
    assert status < 500, (status, body)
    if status >= 400:
        error = body["error"]
        assert isinstance(error["message"], str) and error["message"], body


# ----------------------------------------------------------------------------- properties


@FUZZ
@given(body=HTTP_BODIES)
@example(body=b'{"input": "\\ud800"}')
@example(body=b'{"input": "Hi", "instructions": "\\udfff"}')
@example(body=b"[" * 100_000)
@example(body=b'{"input": "Hi", "seed": 1e400}')
@example(body=b'{"input": "Hi", "seed": ' + b"1" * 5000 + b"}")
@example(body=b'{"input": "Hi", "speed": NaN}')
@example(body=b'{"input": "\xff\xfe"}')
@example(body=json.dumps({"input": "lorem ipsum dolor " * 30}).encode())
@example(body=json.dumps({"input": "x" * 300, "stream_format": "sse"}).encode())
@example(body=json.dumps({"input": "Hi.", "instructions": "Speak slowly. " * 5}).encode())
def test_any_speech_body_gets_a_4xx_or_audio(harness: Harness, body: bytes) -> None:
    status, data = harness.run(harness.post("/v1/audio/speech", body))
    _assert_4xx_names_what(status, data)


@FUZZ
@given(message=WS_MESSAGES)
@example(message=b'{"type": "say", "text": "\\ud800"}')
@example(message=b'{"type": "say", "text": "Hi", "more": true}')
@example(message=b'{"type": "append", "text": "\\ud800"}')
@example(message=json.dumps({"type": "say", "text": "lorem ipsum dolor " * 30}).encode())
@example(message=b"[" * 50_000)
@example(message=b'{"type": "say", "text": "Hi", "seed": ' + b"9" * 5000 + b"}")
@example(message=b'{"type": "say", "text": "Hi", "temperature": 1e400}')
def test_any_websocket_message_keeps_the_socket(harness: Harness, message: bytes) -> None:
    async def exchange() -> list[dict[str, Any]]:
        if harness.ws is None:
            harness.ws = await harness.http.ws_connect(
                f"{harness.url}/v1/audio/speech/stream")
            assert json.loads((await harness.ws.receive()).data)["type"] == "ready"
        ws = harness.ws
        try:
            await ws.send_str(message.decode())
        except UnicodeDecodeError:
            await ws.send_bytes(message)
        await ws.send_str('{"type": "cancel"}')
        await ws.send_str('{"type": "ping-sentinel"}')
        events = []
        while True:
            msg = await asyncio.wait_for(ws.receive(), 10)
            assert msg.type in (aiohttp.WSMsgType.TEXT, aiohttp.WSMsgType.BINARY), msg
            if msg.type == aiohttp.WSMsgType.BINARY:
                continue
            events.append(json.loads(msg.data))
            if events[-1].get("code") == "unknown_type" and "ping-sentinel" in \
                    events[-1]["message"]:
                return events
    events = harness.run(exchange())
    assert not [e for e in events if e.get("code") == "internal"], events
    harness.run(harness.ws.send_str('{"type": "end"}'))  # close any open turn


def test_long_input_is_cut_into_segments_that_fit(harness: Harness) -> None:
    """The path the examples above reach: input over the token limit is spoken whole, cut
    into segments each within it; what cannot fit at all is a 400 in tokens."""
    text = "lorem ipsum dolor " * 30  # 540 bytes: over ten times the limit
    status, _ = harness.run(harness.post("/v1/audio/speech", json.dumps(
        {"input": text, "stream": False}).encode()))
    submitted = harness.engine.submissions[-1]
    assert status == 200 and len(submitted.segment_owners) >= 540 // MAX_PROMPT_TOKENS
    assert set(submitted.segment_owners) == {0}
    assert submitted.num_prompt_tokens >= len(text.strip()) + TEMPLATE_TOKENS
    status, body = harness.run(harness.post("/v1/audio/speech", json.dumps(
        {"input": "Hi.", "instructions": "Speak slowly. " * 5}).encode()))
    assert status == 400 and body["error"]["param"] == "input", body
    assert f"context limit of {MAX_PROMPT_TOKENS} tokens" in body["error"]["message"]


_OFFER: list[str] = []


def _valid_offer(harness: Harness) -> str:
    if not _OFFER:
        _OFFER.append(harness.run(recvonly_offer()))
    return _OFFER[0]


@st.composite
def _mutated_sdp(draw: st.DrawFn, base: str) -> str:
    lines = base.split("\r\n")
    for _ in range(draw(st.integers(0, 4))):
        i = draw(st.integers(0, len(lines) - 1))
        action = draw(st.sampled_from(["drop", "dup", "garble", "cut", "replace"]))
        if action == "drop" and len(lines) > 1:
            del lines[i]
        elif action == "dup":
            lines.insert(i, lines[i])
        elif action == "garble":
            lines[i] = lines[i][:2] + draw(st.text(max_size=30) | SPECIAL_STRINGS)
        elif action == "cut":
            lines[i] = lines[i][: draw(st.integers(0, len(lines[i])))]
        else:
            lines[i] = draw(st.sampled_from(lines)) + draw(st.sampled_from(["", " 0", " x",
                                                                            " 99999999999"]))
    return "\r\n".join(lines)


@FUZZ
@given(data=st.data())
def test_any_offer_gets_a_4xx_or_an_answer(harness: Harness, data: st.DataObject) -> None:
    sdp = data.draw(_mutated_sdp(_valid_offer(harness)) | VALUES)
    body = data.draw(st.fixed_dictionaries({"sdp": st.just(sdp)}, optional={
        "type": st.just("offer") | VALUES, "frame_ms": st.sampled_from([10, 20]) | VALUES}))
    raw = data.draw(st.just(json.dumps(body).encode()) | RAW_TEXTS.map(str.encode))

    async def offer_then_close() -> tuple[int, Any]:
        try:
            return await harness.post("/v1/webrtc/offer", raw)
        finally:
            peers = list(harness.app[STATE].peers)
            await asyncio.gather(*(p.close() for p in peers))
    status, answer = harness.run(offer_then_close())
    _assert_4xx_names_what(status, answer)


@pytest.mark.parametrize("raw", [
    b"[" * 100_000, b'{"sdp": "\\ud800"}', b'{"sdp": "v=0", "frame_ms": 20.0}',
    b'{"sdp": "v=0", "frame_ms": true}', b'{"sdp": "v=0", "type": ["offer"]}',
    b'{"sdp": "v=0", "frame_ms": 1e400}', b'{"sdp": "v=0", "frame_ms": ' + b"2" * 5000 + b"}",
])
def test_offer_edge_cases_get_a_4xx(harness: Harness, raw: bytes) -> None:
    status, body = harness.run(harness.post("/v1/webrtc/offer", raw))
    assert 400 <= status < 500 and body["error"]["message"], (status, body)
