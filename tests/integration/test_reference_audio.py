"""Voice cloning from real reference audio, end to end, on the tiny CPU model.

Owns: ``TextFrontEnd.encode_reference`` / ``AsyncEngine.encode_reference`` (K = ceil(n24 /
1920) frames, errors naming the field, no event-loop blocking), ``reference_audio`` +
``reference_text`` on ``POST /v1/audio/speech`` (clone and direction templates, 400s naming
the field) and on the WebSocket ``say`` message.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import math
import time
import wave
from typing import Any

import aiohttp
import numpy as np
import pytest
import soundfile as sf
from breezert import frontend as frontend_module
from breezert.async_engine import AsyncEngine
from breezert.errors import InvalidRequest
from breezert.models.prompt import Prompt
from breezert.request import Reference

from tests.integration._server import (
    FRAMES_PER_TURN,
    SAMPLES_PER_FRAME,
    TURN_BYTES,
    serve,
    wait_idle,
    ws_turn,
)

pytestmark = pytest.mark.integration

AUDIO_TOKEN_ID = 262144


def sine(seconds: float, rate: int, channels: int = 1) -> np.ndarray:
    """A 220 Hz tone plus a little noise, ``[n]`` or ``[n, channels]`` float32."""
    t = np.arange(round(seconds * rate)) / rate
    x = 0.3 * np.sin(2 * np.pi * 220 * t) + 0.02 * np.random.default_rng(0).standard_normal(len(t))
    x = x.astype(np.float32)
    return x if channels == 1 else np.stack([x, 0.5 * x], axis=1)


def wav_b64(samples: np.ndarray, rate: int, subtype: str = "PCM_16") -> str:
    buffer = io.BytesIO()
    sf.write(buffer, samples, rate, subtype=subtype, format="WAV")
    return base64.b64encode(buffer.getvalue()).decode()


def expected_frames(num_samples: int, rate: int) -> int:
    n24 = -(-num_samples * 24000 // rate)
    return math.ceil(n24 / SAMPLES_PER_FRAME)


@pytest.fixture
def prompts(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Prompt, Any]]:
    """Every prompt the engine builds: (text, prompt, reference passed)."""
    seen: list[tuple[str, Prompt, Any]] = []
    real = frontend_module.make_prompt

    def spy(tokenizer: Any, text: str, **kwargs: Any) -> Prompt:
        prompt = real(tokenizer, text, **kwargs)
        seen.append((text, prompt, kwargs.get("reference")))
        return prompt

    monkeypatch.setattr(frontend_module, "make_prompt", spy)
    return seen


def audio_rows(prompt: Prompt) -> int:
    return int((prompt.input_ids == AUDIO_TOKEN_ID).sum())


def segment_prompts(seen: list[tuple[str, Prompt, Any]]) -> list[Prompt]:
    """Prompts of the segments that had a reference (the engine also builds a ``probe`` prompt;
    the server's warm-up request has no reference)."""
    return [p for text, p, ref in seen if text != "probe" and ref is not None]


# ----------------------------------------------------------------------------- engine


def test_engine_encode_reference_frames_and_errors(engine: AsyncEngine) -> None:
    eng = engine.engine.frontend
    assert eng.codec_encoder is not None  # the random tiny model has one
    for samples, rate in ((sine(1.5, 16000), 16000), (sine(1.5, 44100, 2), 44100),
                          ((sine(0.5, 24000) * 32767).astype(np.int16), 24000)):
        ref = eng.encode_reference(samples, rate, "A reference.")
        assert isinstance(ref, Reference) and ref.ref_text == "A reference."
        assert len(ref.ref_codes) == expected_frames(len(samples), rate)
        assert all(len(f) == 16 and all(0 <= c < 2048 for c in f) for f in ref.ref_codes)
    again = eng.encode_reference(sine(1.5, 16000), 16000, "A reference.")
    np.testing.assert_array_equal(
        again.ref_codes, eng.encode_reference(sine(1.5, 16000), 16000, "x").ref_codes)
    with pytest.raises(InvalidRequest, match="samples"):
        eng.encode_reference(np.zeros(0, np.float32), 16000, "x")
    with pytest.raises(InvalidRequest, match="samples"):
        eng.encode_reference(np.zeros(31 * 8000, np.float32), 8000, "x")
    with pytest.raises(InvalidRequest, match="sample_rate"):
        eng.encode_reference(sine(1.0, 16000), 0, "x")
    with pytest.raises(InvalidRequest, match="reference_text"):
        eng.encode_reference(sine(1.0, 16000), 16000, "  ")


def test_engine_without_an_encoder_names_reference_audio(
    engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(engine.engine.frontend, "codec_encoder", None)
    with pytest.raises(InvalidRequest, match="reference_audio"):
        engine.engine.frontend.encode_reference(sine(1.0, 16000), 16000, "x")


async def test_async_encode_reference_keeps_the_loop_running(
    engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = engine.engine.frontend.encode_reference

    def slow(*args: Any) -> Reference:
        time.sleep(0.3)
        return real(*args)

    monkeypatch.setattr(engine.engine.frontend, "encode_reference", slow)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.01)

    task = asyncio.create_task(ticker())
    ref = await engine.encode_reference(sine(1.5, 16000), 16000, "Hello.")
    task.cancel()
    assert len(ref.ref_codes) == 19 and ticks >= 10


# ----------------------------------------------------------------------------- HTTP


@pytest.mark.parametrize("instructions", [None, "Speak slowly."])
async def test_http_speech_with_reference_audio(
    engine: AsyncEngine, prompts: list[tuple[str, Prompt, Any]], instructions: str | None
) -> None:
    samples = sine(1.5, 16000)  # 24000 samples -> 36000 at 24 kHz -> K = 19 frames
    k = expected_frames(len(samples), 16000)
    assert k == 19
    body: dict[str, Any] = {"input": "Hello there.", "reference_audio": wav_b64(samples, 16000),
                            "reference_text": "This is my voice.", "stream": False}
    if instructions:
        body["instructions"] = instructions
    async with serve(engine) as (url, _), aiohttp.ClientSession() as http, \
            http.post(f"{url}/v1/audio/speech", json=body) as r:
        assert r.status == 200, await r.text()
        data = await r.read()
    with wave.open(io.BytesIO(data)) as w:
        assert w.getnframes() == FRAMES_PER_TURN * SAMPLES_PER_FRAME
    (prompt,) = segment_prompts(prompts)
    assert audio_rows(prompt) == k and prompt.ref_codes is not None
    assert tuple(prompt.ref_codes.shape) == (k, 16)
    (reference,) = {id(ref): ref for _, _, ref in prompts if ref is not None}.values()
    assert reference.ref_text == "This is my voice." and len(reference.ref_codes) == k
    if instructions:  # direction template: its CFG negative is the clone prompt
        assert prompt.negative is not None and audio_rows(prompt.negative) == k
    else:  # clone template: no negative
        assert prompt.negative is None
    await wait_idle(engine)


async def test_http_streamed_pcm_with_float_stereo_reference(
    engine: AsyncEngine, prompts: list[tuple[str, Prompt, Any]]
) -> None:
    samples = sine(2.0, 44100, channels=2)
    body = {"input": "Hi.", "stream": True, "reference_text": "Me.",
            "reference_audio": "data:audio/wav;base64," + wav_b64(samples, 44100, "FLOAT")}
    async with serve(engine) as (url, _), aiohttp.ClientSession() as http, \
            http.post(f"{url}/v1/audio/speech", json=body) as r:
        assert r.status == 200, await r.text()
        assert len(await r.read()) == TURN_BYTES
    (prompt,) = segment_prompts(prompts)
    assert audio_rows(prompt) == expected_frames(len(samples), 44100) == 25


async def test_http_thirty_seconds_of_reference_fit_the_body_limit(engine: AsyncEngine) -> None:
    samples = sine(29.9, 24000)  # 1.4 MB of PCM16 -> 1.9 MB of base64: over the app's 1 MiB
    body = {"input": "Hi.", "response_format": "pcm", "reference_text": "Long one.",
            "reference_audio": wav_b64(samples, 24000)}
    async with serve(engine) as (url, _), aiohttp.ClientSession() as http, \
            http.post(f"{url}/v1/audio/speech", json=body) as r:
        assert r.status == 200, await r.text()
        assert len(await r.read()) == TURN_BYTES
    await wait_idle(engine)


def _wav_bytes(samples: np.ndarray, rate: int) -> bytes:
    return base64.b64decode(wav_b64(samples, rate))


def _bad_reference_cases() -> list[tuple[dict[str, Any], str, str]]:
    ok = wav_b64(sine(1.0, 16000), 16000)
    header_only = base64.b64encode(_wav_bytes(np.zeros(0, np.float32), 16000)).decode()
    return [
        ({"reference_audio": ok}, "reference_text", "reference_text"),
        ({"reference_audio": ok, "reference_text": "  "}, "reference_text", "reference_text"),
        ({"reference_audio": ok, "reference_text": 5}, "reference_text", "reference_text"),
        ({"reference_text": "Me."}, "reference_audio", "reference_audio"),
        ({"reference_audio": "not base64!", "reference_text": "Me."}, "reference_audio",
         "base64"),
        ({"reference_audio": 42, "reference_text": "Me."}, "reference_audio", "base64"),
        ({"reference_audio": base64.b64encode(b"hello, not a wav").decode(),
          "reference_text": "Me."}, "reference_audio", "WAV"),
        ({"reference_audio": header_only, "reference_text": "Me."}, "reference_audio",
         "no audio"),
        ({"reference_audio": wav_b64(sine(30.5, 8000), 8000), "reference_text": "Me."},
         "reference_audio", "limit is 30 s"),
    ]


@pytest.mark.parametrize("fields,param,words", _bad_reference_cases())
async def test_http_bad_reference_gets_400_naming_the_field(
    engine: AsyncEngine, fields: dict[str, Any], param: str, words: str
) -> None:
    async with serve(engine) as (url, _), aiohttp.ClientSession() as http, \
            http.post(f"{url}/v1/audio/speech", json={"input": "Hi.", **fields}) as r:
        error = (await r.json())["error"]
    assert r.status == 400 and error["param"] == param, error
    assert param in error["message"] and words in error["message"], error
    await wait_idle(engine)


async def test_http_reference_without_an_encoder_is_400(
    engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(engine.engine.frontend, "codec_encoder", None)
    body = {"input": "Hi.", "reference_audio": wav_b64(sine(1.0, 16000), 16000),
            "reference_text": "Me."}
    async with serve(engine, warmup=False) as (url, _), aiohttp.ClientSession() as http, \
            http.post(f"{url}/v1/audio/speech", json=body) as r:
        error = (await r.json())["error"]
    assert r.status == 400 and error["param"] == "reference_audio"
    assert "encoder" in error["message"]


# ----------------------------------------------------------------------------- WebSocket


async def test_websocket_say_with_reference_audio(
    engine: AsyncEngine, prompts: list[tuple[str, Prompt, Any]]
) -> None:
    samples = sine(1.5, 44100, channels=2)  # 66150 samples -> 36000 at 24 kHz -> 19 frames
    reference = wav_b64(samples, 44100)
    assert len(reference) > 65536  # over the plain message limit: a say with a reference may be
    async with serve(engine) as (url, _), aiohttp.ClientSession() as http:
        ws = await http.ws_connect(f"{url}/v1/audio/speech/stream")
        assert json.loads((await ws.receive()).data)["type"] == "ready"
        await ws.send_json({"type": "say", "text": ["One.", "Two."], "voice": "S1",
                            "reference_audio": reference, "reference_text": "My voice."})
        events, audio = await ws_turn(ws, ("turn_done", "error"))
        assert [e["type"] for e in events] == ["turn_started", "first_audio", "turn_done"]
        assert events[-1]["status"] == "finished" and len(audio) == 2 * TURN_BYTES
        segment = segment_prompts(prompts)
        assert len(segment) == 2 and all(audio_rows(p) == 19 for p in segment)
        # errors name the field and leave the socket usable
        bad = [({"reference_audio": reference}, "missing_field", "reference_text"),
               ({"reference_audio": "%%%", "reference_text": "x"}, "bad_field", "base64"),
               ({"reference_text": "x"}, "missing_field", "reference_audio"),
               ({"reference_audio": wav_b64(sine(31.0, 8000), 8000), "reference_text": "x"},
                "bad_field", "30 s")]
        for fields, code, words in bad:
            await ws.send_json({"type": "say", "text": "Hi.", **fields})
            reply = json.loads((await ws.receive()).data)
            assert reply["type"] == "error" and reply["code"] == code, reply
            assert words in reply["message"]
        # a big message without a reference is still refused
        await ws.send_json({"type": "say", "text": "Hi.", "padding": "x" * 70000})
        assert json.loads((await ws.receive()).data)["code"] == "message_too_large"
        await ws.send_json({"type": "say", "text": "Still here."})
        events, audio = await ws_turn(ws, ("turn_done", "error"))
        assert events[-1]["status"] == "finished" and len(audio) == TURN_BYTES
        await ws.close()
    await wait_idle(engine)
