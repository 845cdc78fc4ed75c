"""The text front end on the tiny CPU model: every segment's prompt is built once, off the
event loop, and that one build serves the fit check, the request and the ``usage`` count.

Owns: a spy on ``breezert.frontend.make_prompt`` (which text, on which thread) under the HTTP
route (SSE ``usage``, input cut to the token limit), a WebSocket turn with appends, and the
plugin's in-process client. Must not: check audio (the other server tests do).
"""

from __future__ import annotations

import asyncio
import base64
import json
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from breezert import frontend as frontend_module
from breezert.async_engine import AsyncEngine
from breezert.models.prompt import Prompt
from breezert_agent.client import InProcessRuntimeClient, TurnOptions

from tests.integration._server import serve, wait_idle, ws_turn

pytestmark = pytest.mark.integration


@dataclass(frozen=True)
class Build:
    text: str
    thread_id: int
    num_tokens: int


@pytest.fixture
def builds(monkeypatch: pytest.MonkeyPatch) -> list[Build]:
    """Every prompt the front end builds: its text, the thread it ran on, its tokens."""
    seen: list[Build] = []
    real = frontend_module.make_prompt

    def spy(tokenizer: Any, text: str, **kwargs: Any) -> Prompt:
        prompt = real(tokenizer, text, **kwargs)
        seen.append(Build(text, threading.get_ident(), prompt.num_tokens))
        return prompt

    monkeypatch.setattr(frontend_module, "make_prompt", spy)
    return seen


def _after_warmup(builds: list[Build]) -> list[Build]:
    return [b for b in builds if b.text not in ("Warm up.", "probe")]


async def test_http_builds_each_segment_once_off_the_loop_and_counts_usage(
    engine: AsyncEngine, builds: list[Build]
) -> None:
    loop_thread = threading.get_ident()
    async with serve(engine) as (url, _), aiohttp.ClientSession() as http:
        builds.clear()  # the warm-up's
        async with http.post(f"{url}/v1/audio/speech", json={
                "input": "One sentence. And a second one! A third?", "stream_format": "sse",
                "response_format": "pcm"}) as r:
            assert r.status == 200
            events = [json.loads(line.removeprefix(b"data: "))
                      async for line in r.content if line.startswith(b"data: ")]
    done = events[-1]
    assert done["type"] == "speech.audio.done", done
    assert [b.text for b in builds] == ["One sentence.", "And a second one!", "A third?"]
    assert all(b.thread_id != loop_thread for b in builds), "a prompt was built on the loop"
    assert done["usage"]["input_tokens"] == sum(b.num_tokens for b in builds)
    assert sum(len(base64.b64decode(e["audio"])) for e in events[:-1]) > 0
    await wait_idle(engine)


async def test_http_input_over_the_limit_builds_each_piece_once(
    engine: AsyncEngine, builds: list[Build], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fit check measures a piece by building its prompt; a piece that fits is then sent
    with that very prompt, not built again."""
    # 64 tokens a segment: each ~300-character sentence piece is cut in halves until it fits
    monkeypatch.setattr(engine.engine.frontend, "max_seq_len", 66)
    text = ("lorem ipsum dolor sit amet " * 30).strip()
    loop_thread = threading.get_ident()
    async with serve(engine, serving={"max_text_chars": 2000}) as (url, _), \
            aiohttp.ClientSession() as http:
        builds.clear()
        async with http.post(f"{url}/v1/audio/speech",
                             json={"input": text, "stream": False}) as r:
            assert r.status == 200
            await r.read()
    counts = Counter(b.text for b in builds)
    assert len(counts) >= 7 and set(counts.values()) == {1}, counts  # the whole, then halves
    assert max(b.num_tokens for b in builds) > 64 >= min(b.num_tokens for b in builds)
    assert all(b.thread_id != loop_thread for b in builds)
    await wait_idle(engine)


async def test_websocket_turn_builds_each_segment_once_off_the_loop(
    engine: AsyncEngine, builds: list[Build]
) -> None:
    loop_thread = threading.get_ident()
    async with serve(engine) as (url, _), aiohttp.ClientSession() as http:
        ws = await http.ws_connect(f"{url}/v1/audio/speech/stream")
        await ws.receive()  # ready
        builds.clear()
        await ws.send_json({"type": "say", "text": "Hello", "more": True})
        await ws.send_json({"type": "append", "text": " and goodbye."})
        await ws.send_json({"type": "append", "text": " One more."})
        await ws.send_json({"type": "end"})
        events, audio = await ws_turn(ws)
        await ws.close()
    assert events[-1]["status"] == "finished" and audio
    assert [b.text for b in builds] == ["Hello", " and goodbye.", " One more."]
    assert all(b.thread_id != loop_thread for b in builds)
    await wait_idle(engine)


async def test_the_in_process_plugin_builds_prompts_off_the_agents_loop(
    builds: list[Build],
) -> None:
    client = InProcessRuntimeClient()
    await client.get_engine()  # loaded (and warmed up) before the spy counts
    builds.clear()
    loop_thread = threading.get_ident()
    turn = await client.open_turn(["First sentence."], TurnOptions(max_frames=2),
                                  request_id="frontend-plugin", input_closed=False)
    await turn.append("Second sentence.")
    await turn.close_input()
    audio = await asyncio.wait_for(_collect(turn), 20)
    assert audio
    assert [b.text for b in _after_warmup(builds)] == ["First sentence.", "Second sentence."]
    assert all(b.thread_id != loop_thread for b in builds)


async def _collect(turn: Any) -> bytes:
    return b"".join([item async for item in turn.audio() if isinstance(item, bytes)])
