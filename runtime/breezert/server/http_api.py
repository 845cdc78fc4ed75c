"""``POST /v1/audio/speech``: OpenAI-compatible text to speech over plain HTTP.

Owns: validating the OpenAI request fields (plus ``reference_audio`` / ``reference_text`` for
voice cloning, encoded off the event loop) and answering with a WAV file, raw PCM16, or (with
``stream: true``) a chunked response that carries each engine chunk as soon as it exists. Must
not: buffer a streamed response or hold the engine request after the client has gone.
"""

from __future__ import annotations

import math
from contextlib import aclosing
from typing import Any

import numpy as np
from aiohttp import web

from breezert.audio import ENGINE_SAMPLE_RATE, encode_wav, float_to_pcm16, wav_header
from breezert.errors import EngineOverloaded, InvalidRequest, RequestAborted, RequestFailed
from breezert.options import SynthesisOptions
from breezert.request import SynthesisRequest
from breezert.server.protocol import (
    MAX_REFERENCE_MESSAGE_BYTES,
    OVERLOADED_CODE,
    ProtocolError,
    ReferenceAudio,
    decode_reference,
)
from breezert.server.state import STATE, ServerState, json_error, read_json_object
from breezert.server.turns import prompt_fits, prompt_message, reference_message
from breezert.text import split_text

FORMATS = ("wav", "pcm")
MAX_SPEECH_BODY_BYTES = MAX_REFERENCE_MESSAGE_BYTES
"""Largest request body of this route (a 30 s reference WAV in base64 fits)."""


def setup(app: web.Application) -> None:
    app.router.add_post("/v1/audio/speech", speech)


async def speech(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    # NOTE: the app's body limit (1 MiB) is too small for reference audio; this route's is
    # sized for 30 s of base64 WAV.
    body = await read_json_object(request.clone(client_max_size=MAX_SPEECH_BODY_BYTES))
    if isinstance(body, web.Response):
        return body
    parsed = _parse(body, state)
    if isinstance(parsed, web.Response):
        return parsed
    text, options, reference, fmt, stream = parsed
    encoded = None
    if reference is not None:
        encoded = await _encode_reference(state, reference)
        if isinstance(encoded, web.Response):
            return encoded
    # Sentences, each cut further until its prompt fits the token limit: HTTP has no way to
    # send segments, so the server makes them (as the plugin does for in-process turns).
    fits = prompt_fits(state.engine, options, encoded)
    try:
        synth = SynthesisRequest(text=split_text(text, fits), options=options, reference=encoded,
                                 **state.request_options)
        request_id = state.engine.submit(synth)
    except InvalidRequest as exc:
        message = prompt_message(str(exc))
        return json_error(400, message, param=_param_of(message))
    except EngineOverloaded as exc:
        return json_error(503, f"the engine is at capacity, retry later: {exc}",
                          type="overloaded_error", code=OVERLOADED_CODE)
    if stream:
        return await _stream(request, state, request_id, fmt)
    return await _whole(state, request_id, fmt)


def _parse(body: dict[str, Any], state: ServerState) \
        -> tuple[str, SynthesisOptions, ReferenceAudio | None, str, bool] | web.Response:
    """(text, voice options, reference, format, stream) or a 4xx response; every field is
    checked here, before the (costly) reference encoding."""
    text = body.get("input")
    if "input" not in body:
        return json_error(400, "input is required: the text to speak", param="input")
    if not isinstance(text, str) or not text.strip():
        return json_error(400, "input must be a non-empty string", param="input")
    limit = state.serving.max_text_chars
    if len(text) > limit:
        return json_error(413, f"input is {len(text)} characters; the limit is {limit}",
                          param="input", code="text_too_long")
    for name in ("model", "voice", "instructions"):
        value = body.get(name)
        if value is not None and (not isinstance(value, str) or not value.strip()):
            return json_error(400, f"{name} must be a non-empty string", param=name)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        return json_error(400, f"stream={stream!r} must be true or false", param="stream")
    fmt = body.get("response_format", "pcm" if stream else "wav")
    if fmt not in FORMATS:
        return json_error(400, f"response_format={fmt!r} is not supported; use one of "
                          f"{', '.join(FORMATS)}", param="response_format")
    speed = body.get("speed", 1.0)
    if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not math.isfinite(speed):
        return json_error(400, f"speed={speed!r} must be a number", param="speed")
    if speed != 1.0:
        return json_error(400, f"speed={speed} is not supported; only 1.0", param="speed")
    try:
        options = SynthesisOptions.from_mapping(
            {"speaker": body.get("voice"), "instructions": body.get("instructions"),
             "seed": body.get("seed")})
    except InvalidRequest as exc:
        return json_error(400, str(exc), param=_param_of(str(exc)))
    reference = None
    if body.get("reference_audio") is not None or body.get("reference_text") is not None:
        if body.get("reference_audio") is None:
            return json_error(400, "reference_text needs reference_audio (base64 of a WAV file)",
                              param="reference_audio")
        try:
            reference = decode_reference(body["reference_audio"], body.get("reference_text"))
        except ProtocolError as exc:
            return json_error(400, exc.message, param=exc.field)
    return text, options, reference, fmt, stream


async def _encode_reference(state: ServerState, reference: ReferenceAudio) -> Any:
    """``breezert.request.Reference`` of the decoded audio, or a 400 naming the field."""
    encode = getattr(state.engine, "encode_reference", None)
    if encode is None:
        return json_error(400, "reference_audio is not supported by this engine",
                          param="reference_audio")
    try:
        return await encode(reference.samples, reference.sample_rate, reference.text)
    except InvalidRequest as exc:
        message = reference_message(str(exc))
        param = "reference_text" if message.startswith("reference_text") else "reference_audio"
        return json_error(400, message, param=param)


async def _stream(request: web.Request, state: ServerState, request_id: str,
                  fmt: str) -> web.StreamResponse:
    response = web.StreamResponse(headers=_audio_headers(fmt))
    response.enable_chunked_encoding()
    state.num_http_streams += 1
    try:
        await response.prepare(request)
        if fmt == "wav":
            await response.write(wav_header(ENGINE_SAMPLE_RATE, None))
        async with aclosing(state.engine.stream(request_id)) as chunks:
            async for chunk in chunks:
                await response.write(float_to_pcm16(chunk.pcm))  # leaves now: no buffering
    except (RequestFailed, RequestAborted, ConnectionError):
        # Headers are gone: cutting the chunked body short is how the client learns. A client
        # that left (ConnectionError) has its request aborted by closing the stream above.
        if request.transport is not None:
            request.transport.close()
        return response
    finally:
        state.num_http_streams -= 1
        # NOTE: a client gone before the stream opened (prepare/header write) never started
        # it, so nothing above aborted the request; a no-op for one that already finished.
        state.engine.abort(request_id)
    await response.write_eof()
    return response


async def _whole(state: ServerState, request_id: str, fmt: str) -> web.Response:
    pieces: list[np.ndarray] = []
    try:
        async with aclosing(state.engine.stream(request_id)) as chunks:
            async for chunk in chunks:
                pieces.append(chunk.pcm)
    except RequestFailed as exc:
        return json_error(500, f"synthesis failed: {exc.reason}", type="server_error",
                          code="request_failed")
    except RequestAborted:
        return json_error(503, "synthesis was aborted", type="server_error", code="aborted")
    audio = np.concatenate(pieces) if pieces else np.zeros(0, np.float32)
    data = encode_wav(audio, ENGINE_SAMPLE_RATE) if fmt == "wav" else float_to_pcm16(audio)
    return web.Response(body=data, headers=_audio_headers(fmt))


def _audio_headers(fmt: str) -> dict[str, str]:
    if fmt == "wav":
        return {"Content-Type": "audio/wav"}
    return {"Content-Type": "audio/pcm", "X-Sample-Rate": str(ENGINE_SAMPLE_RATE),
            "X-Sample-Format": "s16le", "X-Channels": "1"}


def _param_of(message: str) -> str | None:
    """The OpenAI field an engine validation message names (``speaker=...`` -> ``voice``)."""
    head = message.split("=", 1)[0].split(":", 1)[0].strip()
    return {"speaker": "voice", "text": "input", "instructions": "instructions",
            "seed": "seed", "reference.ref_text": "reference_text",
            "reference.ref_codes": "reference_audio"}.get(head)
