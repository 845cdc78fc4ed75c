"""``POST /v1/audio/speech`` against the stock ``openai`` SDK, on the tiny CPU model.

Owns: OpenAI conformance: ``with_streaming_response`` gets its first byte at engine TTFB, long
before the synthesis ends (``wav`` with a streaming header, ``pcm``, Ogg ``opus``);
``stream_format: "sse"`` gives ``speech.audio.delta`` / ``speech.audio.done`` events; every
unsupported format, voice, speed or field is a 400 that lists what is supported.
"""

from __future__ import annotations

import base64
import io
import json
import time

import aiohttp
import av
import openai
import pytest
from breezert.async_engine import AsyncEngine

from tests.integration._server import SAMPLES_PER_FRAME, TURN_BYTES, serve, wait_idle

pytestmark = pytest.mark.integration

LONG_FRAMES = 100  # 8 s of audio: several seconds of synthesis on a CPU
LONG_TURN = {"max_frames": LONG_FRAMES, "ignore_eos": True}


def _client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize("fmt", ["wav", "pcm"])
async def test_sdk_streaming_response_starts_at_engine_ttfb(engine: AsyncEngine, fmt: str) -> None:
    async with serve(engine, request_options=LONG_TURN) as (url, _):
        client = _client(url)
        start = time.monotonic()
        first_s, data = None, b""
        async with client.audio.speech.with_streaming_response.create(
                model="breeze-tts-2", voice="S1", input="Hello there.",
                response_format=fmt) as response:
            async for piece in response.iter_bytes():
                if first_s is None and piece:
                    first_s = time.monotonic() - start
                data += piece
        total_s = time.monotonic() - start
        await client.close()
    header = 44 if fmt == "wav" else 0
    assert len(data) == header + LONG_FRAMES * SAMPLES_PER_FRAME * 2
    if fmt == "wav":
        assert data[:4] == b"RIFF" and data[36:40] == b"data"
    print(f"\nopenai SDK {fmt}: first byte after {first_s * 1000:.0f} ms of {total_s * 1000:.0f}")
    assert first_s is not None and first_s < 0.3 * total_s, (first_s, total_s)
    await wait_idle(engine)


async def test_ogg_opus_streams_and_decodes(engine: AsyncEngine) -> None:
    async with serve(engine) as (url, _):
        client = _client(url)
        async with client.audio.speech.with_streaming_response.create(
                model="tts-1", voice="S0", input="Hello.", response_format="opus") as response:
            assert response.headers["content-type"] == "audio/ogg"
            data = await response.read()
        await client.close()
    with av.open(io.BytesIO(data)) as container:
        samples = sum(frame.samples for frame in container.decode(audio=0))
    assert data[:4] == b"OggS" and samples == TURN_BYTES  # 48 kHz: twice the 24 kHz samples


async def test_sse_events_as_openai(engine: AsyncEngine) -> None:
    async with serve(engine) as (url, _), aiohttp.ClientSession() as http, \
            http.post(f"{url}/v1/audio/speech",
                      json={"model": "gpt-4o-mini-tts", "input": "Hello.", "voice": "S2",
                            "response_format": "pcm", "stream_format": "sse"}) as r:
        assert r.status == 200 and r.content_type == "text/event-stream"
        raw = (await r.read()).decode()
    events = [json.loads(block.removeprefix("data: "))
              for block in raw.split("\n\n") if block.strip()]
    kinds = [e["type"] for e in events]
    assert set(kinds[:-1]) == {"speech.audio.delta"} and kinds[-1] == "speech.audio.done"
    audio = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    assert len(audio) == TURN_BYTES
    usage = events[-1]["usage"]
    assert usage["input_tokens"] > 0 and usage["output_tokens"] == TURN_BYTES // 2 // 1920
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    await wait_idle(engine)


@pytest.mark.parametrize("kwargs,param,listed", [
    ({"response_format": "mp3"}, "response_format", "wav, pcm, opus"),
    ({"response_format": "flac"}, "response_format", "wav, pcm, opus"),
    ({"response_format": "aac"}, "response_format", "wav, pcm, opus"),
    ({"voice": "alloy"}, "voice", "S0, S1"),
    ({"speed": 1.25}, "speed", "1.0"),
    ({"stream_format": "json"}, "stream_format", "audio, sse"),
    ({"extra_body": {"temperature": 0.5}}, "temperature", "input, model, voice"),
])
async def test_unsupported_options_list_what_is_supported(
    engine: AsyncEngine, kwargs: dict, param: str, listed: str
) -> None:
    request = {"model": "tts-1", "voice": "S0", "input": "Hi.", **kwargs}
    async with serve(engine) as (url, _):
        client = _client(url)
        with pytest.raises(openai.BadRequestError) as caught:
            await client.audio.speech.create(**request)
        await client.close()
    error = caught.value.body
    assert error["param"] == param and listed in error["message"], error
    await wait_idle(engine)
