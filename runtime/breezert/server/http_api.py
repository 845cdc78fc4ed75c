"""``POST /v1/audio/speech``: OpenAI-compatible text to speech over plain HTTP.

Owns: validating the OpenAI request fields (plus ``reference_audio`` / ``reference_text`` for
voice cloning, encoded off the event loop, and ``seed``), submitting ``input`` to be cut into
sentences that fit the prompt (``Split.SENTENCES``: the engine's text front end does it once,
off the event loop, and counts the prompt tokens for ``usage``), and answering as OpenAI does:
the audio streamed in the requested format (``wav`` with a streaming header, ``pcm``, ``opus``
in Ogg) as each engine chunk exists, or with ``stream_format: "sse"`` as ``speech.audio.delta``
/ ``speech.audio.done`` events; ``stream: false`` buffers one whole file. Must not: buffer a
streamed response, hold the engine request after the client has gone, or do more between a
chunk and its bytes than encode them (the ``usage`` figure is known before the first chunk).
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import numpy as np
from aiohttp import web

from breezert.audio import ENGINE_SAMPLE_RATE, encode_wav, float_to_pcm16, wav_header
from breezert.constants import SPEAKER_TOKEN_IDS
from breezert.errors import EngineOverloaded, InvalidRequest, RequestAborted, RequestFailed
from breezert.options import SynthesisOptions
from breezert.outputs import AudioChunk
from breezert.request import Reference, SynthesisRequest
from breezert.server.ogg_opus import OggOpusWriter
from breezert.server.protocol import (
    MAX_REFERENCE_MESSAGE_BYTES,
    OVERLOADED_CODE,
    ProtocolError,
    ReferenceAudio,
    decode_reference,
    retry_after_seconds,
)
from breezert.server.state import STATE, ServerState, json_error, read_json_object
from breezert.server.turns import prompt_message, reference_message
from breezert.text import Split

FORMATS = ("wav", "pcm", "opus")
"""``response_format`` values; OpenAI's ``mp3``, ``aac`` and ``flac`` get a 400 listing these."""
STREAM_FORMATS = ("audio", "sse")
VOICES = tuple(f"S{i}" for i in range(len(SPEAKER_TOKEN_IDS)))
FIELDS = ("input", "model", "voice", "instructions", "response_format", "speed",
          "stream_format", "stream", "seed", "reference_audio", "reference_text")
"""Every body field this route reads; any other gets a 400 listing these."""
MAX_SPEECH_BODY_BYTES = MAX_REFERENCE_MESSAGE_BYTES
"""Largest request body of this route (a 30 s reference WAV in base64 fits)."""
_CONTENT_TYPES = {"wav": "audio/wav", "pcm": "audio/pcm", "opus": "audio/ogg"}


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
    text, options, reference, fmt, mode = parsed
    engine = state.client
    encoded = None
    if reference is not None:
        encoded = await _encode_reference(state, reference)
        if isinstance(encoded, web.Response):
            return encoded
    # Sentences, each cut further until its prompt fits the token limit: HTTP has no way to
    # send segments, so the server asks the engine for them.
    try:
        synth = SynthesisRequest(text=text, options=options, reference=encoded,
                                 **state.request_options)
        submitted = await engine.submit(synth, split=Split.SENTENCES)
    except InvalidRequest as exc:
        message = prompt_message(str(exc))
        return json_error(400, message, param=_param_of(message))
    except EngineOverloaded as exc:
        return overloaded_error(exc)
    request_id = submitted.request_id
    async with aclosing(engine.stream(request_id)) as chunks:
        # NOTE: headers wait for the first chunk (engine TTFB), so a request that fails before
        # any audio still gets a JSON error with its status.
        first = await _first_chunk(chunks)
        if isinstance(first, web.Response):
            return first
        if mode == "whole":
            return await _whole(chunks, first, fmt)
        return await _stream(request, state, request_id, chunks, first, fmt, mode,
                             submitted.num_prompt_tokens)


def _parse(body: dict[str, Any], state: ServerState) \
        -> tuple[str, SynthesisOptions, ReferenceAudio | None, str, str] | web.Response:
    """(text, voice options, reference, format, mode) or a 4xx response; mode is ``audio``,
    ``sse`` or ``whole``. Every field is checked here, before the (costly) reference
    encoding."""
    unknown = sorted(set(body) - set(FIELDS))
    if unknown:
        return json_error(400, f"{unknown[0]} is not a supported field; supported: "
                          f"{', '.join(FIELDS)}", param=unknown[0])
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
    voice = body.get("voice")
    if voice is not None and voice.strip().strip("[]") not in VOICES:
        return json_error(400, f"voice={voice!r} is not supported; supported voices: "
                          f"{', '.join(VOICES)}", param="voice")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        return json_error(400, f"stream={stream!r} must be true or false", param="stream")
    stream_format = body.get("stream_format") or "audio"
    if stream_format not in STREAM_FORMATS:
        return json_error(400, f"stream_format={stream_format!r} is not supported; supported: "
                          f"{', '.join(STREAM_FORMATS)}", param="stream_format")
    if stream is False and body.get("stream_format") is not None:
        return json_error(400, "stream_format needs a streamed response; drop stream=false",
                          param="stream_format")
    fmt = body.get("response_format") or ("pcm" if stream else "wav")
    if fmt not in FORMATS:
        return json_error(400, f"response_format={fmt!r} is not supported; supported: "
                          f"{', '.join(FORMATS)}", param="response_format")
    speed = body.get("speed", 1.0)
    if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not math.isfinite(speed):
        return json_error(400, f"speed={speed!r} must be a number", param="speed")
    if speed != 1.0:
        return json_error(400, f"speed={speed} is not supported; supported: 1.0", param="speed")
    try:
        options = SynthesisOptions.from_mapping(
            {"speaker": voice, "instructions": body.get("instructions"),
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
    mode = "whole" if stream is False else stream_format
    return text, options, reference, fmt, mode


async def _encode_reference(state: ServerState,
                            reference: ReferenceAudio) -> Reference | web.Response:
    """``breezert.request.Reference`` of the decoded audio, or a 400 naming the field."""
    try:
        return await state.client.encode_reference(reference.samples, reference.sample_rate,
                                                   reference.text)
    except InvalidRequest as exc:
        message = reference_message(str(exc))
        param = "reference_text" if message.startswith("reference_text") else "reference_audio"
        return json_error(400, message, param=param)


async def _first_chunk(chunks: AsyncIterator[AudioChunk]) -> AudioChunk | None | web.Response:
    """The stream's first chunk (``None``: no audio at all), or the error response."""
    try:
        return await anext(chunks, None)
    except RequestFailed as exc:
        return json_error(500, f"synthesis failed: {exc.reason}", type="server_error",
                          code="request_failed")
    except RequestAborted:
        return json_error(503, "synthesis was aborted", type="server_error", code="aborted")
    except EngineOverloaded as exc:  # it waited past max_queue_wait_s for a slot
        return overloaded_error(exc)


def overloaded_error(exc: EngineOverloaded) -> web.Response:
    """503 ``overloaded`` with ``Retry-After`` the predicted wait (whole seconds) when known."""
    headers = ({"Retry-After": str(retry_after_seconds(exc.retry_after_s))}
               if exc.retry_after_s is not None else None)
    return json_error(503, f"the engine is at capacity, retry later: {exc}",
                      type="overloaded_error", code=OVERLOADED_CODE, headers=headers)


class _Encoder:
    """Engine PCM -> bytes of one ``response_format``, as the stream goes."""

    def __init__(self, fmt: str) -> None:
        self._ogg = OggOpusWriter(ENGINE_SAMPLE_RATE) if fmt == "opus" else None
        self.header = wav_header(ENGINE_SAMPLE_RATE, None) if fmt == "wav" else b""
        """Streamed WAV: the largest sizes the format allows, as OpenAI's streamed WAV has."""

    def write(self, pcm: np.ndarray) -> bytes:
        return self._ogg.write(pcm) if self._ogg is not None else float_to_pcm16(pcm)

    def close(self) -> bytes:
        return self._ogg.close() if self._ogg is not None else b""


async def _stream(request: web.Request, state: ServerState, request_id: str,
                  chunks: AsyncIterator[AudioChunk], first: AudioChunk | None, fmt: str,
                  mode: str, input_tokens: int) -> web.StreamResponse:
    """The audio as it is made: raw bytes of ``fmt`` (``audio``) or SSE events (``sse``)."""
    is_sse = mode == "sse"
    headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"} if is_sse \
        else _audio_headers(fmt)
    response = web.StreamResponse(headers=headers)
    response.enable_chunked_encoding()
    encoder = _Encoder(fmt)
    num_frames = 0

    async def send(data: bytes) -> None:
        if not data:
            return
        if is_sse:
            data = _sse({"type": "speech.audio.delta",
                         "audio": base64.b64encode(data).decode("ascii")})
        await response.write(data)  # leaves now: no buffering

    state.num_http_streams += 1
    try:
        await response.prepare(request)
        pending = encoder.header
        chunk = first
        while chunk is not None:
            num_frames += chunk.frame_end - chunk.frame_start
            await send(pending + encoder.write(chunk.pcm))
            pending = b""
            chunk = await anext(chunks, None)
        await send(pending + encoder.close())
        if is_sse:
            await response.write(_sse({"type": "speech.audio.done", "usage": {
                "input_tokens": input_tokens, "output_tokens": num_frames,
                "total_tokens": input_tokens + num_frames}}))
    except (RequestFailed, RequestAborted) as exc:
        # Headers are gone: an SSE client gets an error event; a raw audio body is cut short,
        # which is how its client learns.
        if not is_sse or request.transport is None or request.transport.is_closing():
            if request.transport is not None:
                request.transport.close()
            return response
        reason = exc.reason if isinstance(exc, RequestFailed) else "aborted"
        await response.write(_sse({"type": "error", "error": {
            "message": f"synthesis failed: {reason}", "type": "server_error",
            "code": "request_failed" if isinstance(exc, RequestFailed) else "aborted"}}))
    except ConnectionError:
        # The client left: closing the engine stream (the caller's ``aclosing``) aborts it.
        return response
    finally:
        state.num_http_streams -= 1
        # NOTE: a client gone before the stream opened (prepare/header write) never read on,
        # so nothing above aborted the request; a no-op for one that already finished.
        state.client.abort(request_id)
    await response.write_eof()
    return response


def _sse(event: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(event)}\n\n".encode()


async def _whole(chunks: AsyncIterator[AudioChunk], first: AudioChunk | None,
                 fmt: str) -> web.Response:
    """``stream: false``: the whole file in one body (a WAV with its exact length)."""
    pieces = [] if first is None else [first.pcm]
    try:
        async for chunk in chunks:
            pieces.append(chunk.pcm)
    except RequestFailed as exc:
        return json_error(500, f"synthesis failed: {exc.reason}", type="server_error",
                          code="request_failed")
    except RequestAborted:
        return json_error(503, "synthesis was aborted", type="server_error", code="aborted")
    audio = np.concatenate(pieces) if pieces else np.zeros(0, np.float32)
    if fmt == "wav":
        data = encode_wav(audio, ENGINE_SAMPLE_RATE)
    else:
        encoder = _Encoder(fmt)
        data = encoder.write(audio) + encoder.close()
    return web.Response(body=data, headers=_audio_headers(fmt))


def _audio_headers(fmt: str) -> dict[str, str]:
    headers = {"Content-Type": _CONTENT_TYPES[fmt]}
    if fmt == "pcm":
        headers.update({"X-Sample-Rate": str(ENGINE_SAMPLE_RATE), "X-Sample-Format": "s16le",
                        "X-Channels": "1"})
    return headers


def _param_of(message: str) -> str | None:
    """The OpenAI field an engine validation message names (``speaker=...`` -> ``voice``)."""
    head = message.split("=", 1)[0].split(":", 1)[0].strip()
    return {"speaker": "voice", "text": "input", "instructions": "instructions",
            "seed": "seed", "reference.ref_text": "reference_text",
            "reference.ref_codes": "reference_audio"}.get(head)
