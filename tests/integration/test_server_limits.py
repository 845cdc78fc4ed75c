"""Limits of the serving front on the tiny CPU model: idle open turns and text length.

Owns: an open turn left idle (``more: true``, no ``end``) is ended after
``serving.turn_idle_timeout_s`` so ``max_running_requests`` idle turns cannot starve the next
caller; long text is split by the server into segments that fit the prompt's token limit, so
``max_text_chars`` really holds (ASCII and CJK), and what does not fit is refused in tokens.
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest
from breezert.async_engine import AsyncEngine
from breezert.errors import InvalidRequest
from breezert.text import Split

from tests import latency
from tests.integration._server import SAMPLES_PER_FRAME, TURN_BYTES, serve, wait_idle, ws_turn
from tests.latency import LatencyMiss
from tests.realtime import retried_when_starved

pytestmark = pytest.mark.integration

IDLE_TIMEOUT_S = 1.0  # turn_idle_timeout_s of the idle-turn test

# ----------------------------------------------------------------------------- idle turns


async def _open_idle_turn(http: aiohttp.ClientSession, url: str) -> aiohttp.ClientWebSocketResponse:
    """A WebSocket turn that said one sentence with ``more: true`` and then went quiet."""
    ws = await http.ws_connect(f"{url}/v1/audio/speech/stream")
    assert json.loads((await ws.receive()).data)["type"] == "ready"
    await ws.send_json({"type": "say", "text": "Hello.", "more": True})
    return ws


@retried_when_starved(LatencyMiss)
async def test_idle_open_turns_do_not_starve_the_next_caller(engine: AsyncEngine) -> None:
    slots = engine.engine.config.scheduler.max_running_requests
    async with serve(engine, serving={"turn_idle_timeout_s": IDLE_TIMEOUT_S}) as (url, _), \
            aiohttp.ClientSession() as http:
        sockets = [await _open_idle_turn(http, url) for _ in range(slots)]
        start = time.monotonic()
        async with http.post(f"{url}/v1/audio/speech",
                             json={"input": "Me next.", "response_format": "pcm"}) as r:
            assert r.status == 200
            first = await asyncio.wait_for(r.content.readexactly(2 * SAMPLES_PER_FRAME), 30.0)
        first_s = time.monotonic() - start
        print(f"first audio behind {slots} idle turns: {first_s * 1000:.0f} ms, "
              f"{(first_s - IDLE_TIMEOUT_S) * 1000:.0f} ms after their idle timeout")
        assert first
        # what the server adds to the idle timeout: ending the idle turns, the new request's TTFB
        latency.check("first_audio_after_idle_timeout", first_s - IDLE_TIMEOUT_S)
        # Each idle turn was ended, audio kept, with turn_done saying why.
        for ws in sockets:
            events, audio = await ws_turn(ws)
            done = events[-1]
            assert done["status"] == "finished" and done["reason"] == "idle_timeout", done
            assert "turn_idle_timeout_s" in done["message"] and len(audio) == TURN_BYTES
            # the input is closed now: an append says so
            await ws.send_json({"type": "append", "text": " late"})
            reply = json.loads((await ws.receive()).data)
            assert reply["code"] == "no_open_turn"
            await ws.close()
    await wait_idle(engine)


async def test_a_turn_that_keeps_appending_is_not_idle(engine: AsyncEngine) -> None:
    async with serve(engine, serving={"turn_idle_timeout_s": 0.6}) as (url, _), \
            aiohttp.ClientSession() as http:
        ws = await _open_idle_turn(http, url)
        for _ in range(3):
            await asyncio.sleep(0.4)
            await ws.send_json({"type": "append", "text": "And more."})
        await ws.send_json({"type": "end"})
        events, audio = await ws_turn(ws)
        assert events[-1]["status"] == "finished" and "reason" not in events[-1]
        assert len(audio) == 4 * TURN_BYTES
        await ws.close()
    await wait_idle(engine)


async def _until_every_turn_is_quiet(scheduler, slots: int, timeout_s: float = 30.0) -> None:
    """Waits until ``slots`` requests run and every segment they have has ended."""
    deadline = time.monotonic() + timeout_s
    while True:
        running = list(scheduler._running.values())
        if len(running) == slots and all(seg.is_ended for r in running for seg in r.segments):
            return
        assert time.monotonic() < deadline, "the open turns never went quiet"
        await asyncio.sleep(0.02)


async def test_a_caller_queued_past_max_queue_wait_gets_503_not_a_silent_wait(
    engine: AsyncEngine,
) -> None:
    """Every slot held by an open turn: an HTTP request is refused with 503 ``overloaded`` and
    a WebSocket turn ends ``failed`` with ``code: overloaded`` after ``max_queue_wait_s``,
    both freeing everything."""
    scheduler = engine.engine.scheduler
    saved = scheduler.config
    scheduler.config = saved.model_copy(update={"max_queue_wait_s": 0.5})
    slots = saved.max_running_requests
    try:
        async with serve(engine, serving={"turn_idle_timeout_s": 30.0}) as (url, _), \
                aiohttp.ClientSession() as http:
            sockets = [await _open_idle_turn(http, url) for _ in range(slots)]
            # Quiet turns hold every slot. While one still speaks, its frames left predict when
            # its slot frees (sched/slot_wait.py) and a wait past max_queue_wait_s is refused
            # at once: a race this test lost now and then before it waited for the quiet.
            await _until_every_turn_is_quiet(scheduler, slots)
            start = time.monotonic()
            async with http.post(f"{url}/v1/audio/speech",
                                 json={"input": "Me next.", "response_format": "pcm"}) as r:
                body = await r.json()
                assert r.status == 503 and body["error"]["code"] == "overloaded", body
                assert "max_queue_wait_s" in body["error"]["message"]
                assert int(r.headers["Retry-After"]) >= 1
            assert 0.4 < time.monotonic() - start < 5.0
            ws = await http.ws_connect(f"{url}/v1/audio/speech/stream")
            assert json.loads((await ws.receive()).data)["type"] == "ready"
            await ws.send_json({"type": "say", "text": "Me too."})
            events, audio = await ws_turn(ws)
            assert events[-1]["status"] == "failed" and events[-1]["code"] == "overloaded"
            assert audio == b""
            assert scheduler.num_waiting == 0
            async with http.get(f"{url}/metrics") as r:  # both waited for a slot, counted
                queued = [line for line in (await r.text()).splitlines()
                          if line.startswith("breezert_requests_queued_total ")]
            assert queued and float(queued[0].split()[1]) >= 2, queued
            for sock in [ws, *sockets]:
                await sock.close()
    finally:
        scheduler.config = saved
    await wait_idle(engine)


# ----------------------------------------------------------------------------- text limits

ASCII_2000 = ("lorem ipsum dolor sit amet " * 80)[:2000]  # no sentence end: word cuts only
CJK_LONG = "今天天氣很好我們一起去公園散步吧" * 40  # 640 characters, no punctuation at all
SEGMENT_BYTES = TURN_BYTES  # every segment is FRAMES_PER_TURN frames (ignore_eos)


@pytest.mark.parametrize("text", [ASCII_2000, CJK_LONG], ids=["ascii-2000", "cjk-640"])
async def test_http_input_up_to_max_text_chars_is_spoken(engine: AsyncEngine, text: str) -> None:
    """Over one prompt's token limit (1,022 tokens on this profile: about 1,020 ASCII or 340
    CJK characters), within ``max_text_chars``: the server cuts it into segments."""
    frontend = engine.engine.frontend
    with pytest.raises(InvalidRequest, match="over the context limit"):  # not as one segment
        frontend.prepare_text([text], _options(), None)
    assert len(frontend.prepare_text([text], _options(), None, Split.SENTENCES).segments) >= 2
    async with serve(engine, serving={"max_text_chars": 2000}) as (url, _), \
            aiohttp.ClientSession() as http, \
            http.post(f"{url}/v1/audio/speech",
                      json={"input": text, "response_format": "pcm"}) as r:
        body = await r.read()
        assert r.status == 200, body[:300]
    assert len(body) >= 2 * SEGMENT_BYTES and len(body) % SEGMENT_BYTES == 0
    await wait_idle(engine)


async def test_websocket_segment_over_the_token_limit_is_cut_by_the_server(
    engine: AsyncEngine,
) -> None:
    async with serve(engine, serving={"max_text_chars": 2000}) as (url, _), \
            aiohttp.ClientSession() as http:
        ws = await http.ws_connect(f"{url}/v1/audio/speech/stream")
        await ws.receive()
        await ws.send_json({"type": "say", "text": CJK_LONG[:400], "more": True})
        await ws.send_json({"type": "append", "text": ASCII_2000[:1500]})
        await ws.send_json({"type": "end"})
        events, audio = await ws_turn(ws)
        await ws.close()
    assert [e for e in events if e["type"] == "error"] == []
    assert events[-1]["status"] == "finished" and len(audio) >= 4 * SEGMENT_BYTES
    await wait_idle(engine)


async def test_a_prompt_that_cannot_fit_is_refused_in_tokens(engine: AsyncEngine) -> None:
    """Instructions that fill the context leave no room for any text: a 400 with the figures,
    not advice to split (HTTP cannot send segments)."""
    body = {"input": "Hi.", "instructions": "Speak slowly. " * 80}
    async with serve(engine) as (url, _), aiohttp.ClientSession() as http, \
            http.post(f"{url}/v1/audio/speech", json=body) as r:
        error = (await r.json())["error"]
    assert r.status == 400 and error["param"] == "input", error
    limit = engine.engine.frontend.max_prompt_tokens
    assert f"context limit of {limit} tokens" in error["message"]
    assert "split the text" not in error["message"] and "instructions" in error["message"]
    await wait_idle(engine)


def _options():  # type: ignore[no-untyped-def]
    from breezert.options import SynthesisOptions

    return SynthesisOptions()
