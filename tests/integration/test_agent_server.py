"""The plugin's server events on a real ``breezert serve`` (embedded tiny engine, CPU):
``segment`` (exact segment starts, asked for with ``segment_events``) and ``queued`` (asked
for with ``queued_events``), ``TTS(base_url=...)``'s timed transcript and queued-turn count
from them, and the queued requests on ``/metrics``.

Must not: need a LiveKit server, weights or a GPU.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from livekit.agents import APIConnectOptions

from breezert.async_engine import AsyncEngine
from breezert_agent import TTS
from tests.integration._server import SAMPLES_PER_FRAME, close_engine, make_engine, serve

pytestmark = pytest.mark.integration

FRAMES = 3  # per segment: max_frames with ignore_eos, so every boundary is known
OPTIONS = {"max_frames": FRAMES, "ignore_eos": True, "chunk_schedule": (2,)}
FRAME_BYTES = SAMPLES_PER_FRAME * 2


@pytest.fixture(scope="module")
def engine() -> Iterator[AsyncEngine]:
    engine = make_engine()
    yield engine
    close_engine(engine)


async def _turn(ws: aiohttp.ClientWebSocketResponse) -> list[Any]:
    """Events (dicts) and audio sizes (ints), in arrival order, up to ``turn_done``."""
    items: list[Any] = []
    while True:
        msg = await asyncio.wait_for(ws.receive(), 20)
        if msg.type == aiohttp.WSMsgType.BINARY:
            items.append(len(msg.data))
            continue
        items.append(json.loads(msg.data))
        if items[-1]["type"] == "turn_done":
            return items


async def test_segment_events_come_before_their_audio_and_are_exact(engine: AsyncEngine) -> None:
    async with serve(engine, request_options=OPTIONS) as (url, _), aiohttp.ClientSession() as http:
        ws = await http.ws_connect(f"{url}/v1/audio/speech/stream")
        await ws.receive()  # ready
        await ws.send_json({"type": "say", "text": ["One.", "Two."], "more": True,
                            "segment_events": True})
        await ws.send_json({"type": "append", "text": "Three."})
        await ws.send_json({"type": "end"})
        items = await _turn(ws)
        segments = [(i, e) for i, e in enumerate(items)
                    if isinstance(e, dict) and e["type"] == "segment"]
        assert [e["index"] for _, e in segments] == [0, 1, 2]
        assert [e["start_frame"] for _, e in segments] == [0, FRAMES, 2 * FRAMES]
        assert [e["start_s"] for _, e in segments] == [0.0, 0.24, 0.48]
        for position, e in segments:  # no audio of the segment before its event
            sent = sum(n for n in items[:position] if isinstance(n, int))
            assert sent <= e["start_frame"] * FRAME_BYTES
        assert sum(n for n in items if isinstance(n, int)) == 3 * FRAMES * FRAME_BYTES

        await ws.send_json({"type": "say", "text": ["One.", "Two."]})  # not asked: none
        items = await _turn(ws)
        assert not [e for e in items if isinstance(e, dict) and e["type"] == "segment"]
        await ws.close()


async def _hold_every_slot(http: aiohttp.ClientSession, url: str,
                           num: int) -> list[aiohttp.ClientWebSocketResponse]:
    """``num`` open turns (``more: true``): each holds a running slot until its ``end``."""
    holders = []
    for _ in range(num):
        ws = await http.ws_connect(f"{url}/v1/audio/speech/stream")
        await ws.receive()
        await ws.send_json({"type": "say", "text": "Hold.", "more": True})
        holders.append(ws)
    return holders


async def test_queued_event_when_every_running_slot_is_held(engine: AsyncEngine) -> None:
    async with serve(engine, request_options=OPTIONS) as (url, _), aiohttp.ClientSession() as http:
        holders = await _hold_every_slot(http, url, engine.max_running_requests)
        ws = await http.ws_connect(f"{url}/v1/audio/speech/stream")
        await ws.receive()
        await ws.send_json({"type": "say", "text": "Wait.", "queued_events": True})
        started = json.loads((await asyncio.wait_for(ws.receive(), 10)).data)
        queued = json.loads((await asyncio.wait_for(ws.receive(), 10)).data)
        assert started["type"] == "turn_started" and queued["type"] == "queued"
        assert queued["max_running_requests"] == engine.max_running_requests
        assert queued["waiting"] >= 1
        for holder in holders:
            await holder.send_json({"type": "end"})
        items = await _turn(ws)
        assert items[-1]["status"] == "finished"
        for holder in [*holders, ws]:
            await holder.close()


def _sample(text: str, name: str) -> float:
    """The value of the sample line ``name value`` (Prometheus text; ``1.0`` or ``1``)."""
    return next(float(line.split()[-1]) for line in text.splitlines()
                if line.startswith(f"{name} "))


def _queued_total(text: str) -> float:
    return _sample(text, "breezert_requests_queued_total")


async def test_a_queued_turn_is_counted_on_metrics_and_by_the_remote_plugin(
        engine: AsyncEngine) -> None:
    async with serve(engine, request_options=OPTIONS) as (url, _), aiohttp.ClientSession() as http:
        async with http.get(f"{url}/metrics") as r:
            before = _queued_total(await r.text())
        holders = await _hold_every_slot(http, url, engine.max_running_requests)
        tts = TTS(base_url=url)
        turn = asyncio.ensure_future(tts.synthesize(
            "Wait.", conn_options=APIConnectOptions(max_retry=0, timeout=20)).collect())
        for _ in range(200):
            if tts.num_queued_turns:
                break
            await asyncio.sleep(0.02)
        async with http.get(f"{url}/metrics") as r:
            text = await r.text()
        assert tts.num_queued_turns == 1
        assert _queued_total(text) == before + 1
        assert _sample(text, "breezert_queued_requests") == 1  # the gauge, while it waits
        for holder in holders:
            await holder.send_json({"type": "end"})
        assert (await asyncio.wait_for(turn, 20)).duration > 0
        for holder in holders:
            await holder.close()
        await tts.aclose()


async def test_remote_tts_times_each_sentence_from_the_server(engine: AsyncEngine) -> None:
    async with serve(engine, request_options=OPTIONS) as (url, _):
        tts = TTS(base_url=url)
        stream = tts.stream(conn_options=APIConnectOptions(max_retry=0, timeout=20))
        stream.push_text("One. Two. Three.")
        stream.end_input()
        events = [ev async for ev in stream]
        timed = [(str(t), t.start_time) for ev in events
                 for t in ev.frame.userdata.get("lk.timed_transcripts", [])]
        assert timed == [("One. ", 0.0), ("Two. ", 0.24), ("Three. ", 0.48)]
        await tts.aclose()
