"""The JSON turn protocol spoken over the WebRTC DataChannel and the WebSocket API.

Owns: parsing and validating client messages into small typed objects, the shapes of the
server's messages, and the error codes' taxonomy clients classify errors by. Must not: touch the
engine, sockets or the clock, or import beyond numpy and the standard library (the remote
LiveKit plugin imports it).

Client -> server (one JSON object per message, ``type`` selects the kind)::

    {"type": "say", "text": "Hello.", "voice": "S0"}   # speak; the turn's input is then closed
    {"type": "say", "text": ["First.", "Second."], "more": true}  # input stays open: append/end
    {"type": "append", "text": " More words."}
    {"type": "end"}                  # close the input (a no-op when it is already closed)
    {"type": "cancel"}               # barge-in: stop audio now, abort the engine request
    {"type": "playout", "jitterBufferDelay": 1.23, "jitterBufferEmittedCount": 48000,
     "jitterBufferTargetDelay": 0.9, "concealedSamples": 0, "concealmentEvents": 0,
     "totalSamplesReceived": 96000}  # WebRTC: the receiver's cumulative inbound-rtp stats
    {"type": "playback", "buffered_s": 0.12, "age_s": 0.01, "source": "livekit-source"}
                                     # a client that plays the audio itself reports its buffer

``say`` also takes ``input_closed`` (the opposite of ``more``), ``speaker`` (= ``voice``),
``instructions``, ``seed``, ``cfg_scale``, ``temperature``, ``max_frames``, ``chunk_schedule``,
``priority``, ``request_id`` (the client's id, echoed as ``client_request_id``), on the
WebSocket, ``format``: ``pcm`` (PCM16 24 kHz, default) or ``opus`` (Ogg/Opus), and, to clone a
voice, ``reference_audio`` (base64 of a WAV file, at most 30 s) with ``reference_text`` (its
transcript; required with it). A ``say`` carrying ``reference_audio`` may be up to
``MAX_REFERENCE_MESSAGE_BYTES``; every other message ``MAX_MESSAGE_BYTES``.

Server -> client: ``ready``, ``turn_started``, ``queued``, ``segment``, ``first_audio``,
``turn_done``, ``error``. Asked for in ``say`` (``"queued_events": true``), ``queued``
(``waiting``, ``max_running_requests``) follows ``turn_started`` when the turn waits for a
running slot. Asked for with ``"segment_events": true``, ``segment`` (``index``: the client's
segment, counting the say's non-blank text segments then each ``append``; ``start_frame``,
``start_s``: where its audio starts in the turn's audio, in 80 ms codec frames, exact) comes
before any of that segment's audio.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
import reprlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from breezert.constants import MAX_REFERENCE_S
from breezert.errors import InvalidRequest
from breezert.options import SynthesisOptions

MAX_MESSAGE_BYTES = 65536
MAX_REFERENCE_AUDIO_CHARS = 16 << 20
"""Longest ``reference_audio`` (base64 text): 30 s of 48 kHz stereo float32 WAV fits."""
MAX_REFERENCE_MESSAGE_BYTES = MAX_REFERENCE_AUDIO_CHARS + (1 << 16)
"""Largest ``say`` message that carries ``reference_audio``."""
MAX_REFERENCE_CHANNELS = 8
MAX_JSON_DEPTH = 32
"""Deepest nesting of arrays/objects a client message or request body may have."""
MAX_JSON_INT_DIGITS = 40
"""Longest integer literal accepted (longer ones are reported as out of range)."""


class ProtocolError(Exception):
    """A client message is malformed or cannot be served; ``code`` is machine-readable, the text
    says why; ``field`` names the client field at fault, when one is; ``retry_after_s`` (an
    ``overloaded`` refusal) when the same request may find room, if known."""

    def __init__(self, code: str, message: str, *, field: str | None = None,
                 retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.field = field
        self.retry_after_s = retry_after_s

    def as_event(self) -> str:
        """The ``error`` event: ``code``, ``message``, and ``field`` / ``retry_after_s`` (whole
        seconds, at least 1, as HTTP's ``Retry-After``) when known."""
        extra: dict[str, Any] = {}
        if self.field is not None:
            extra["field"] = self.field
        if self.retry_after_s is not None:
            extra["retry_after_s"] = retry_after_seconds(self.retry_after_s)
        return error_event(self.code, self.message, **extra)


def retry_after_seconds(wait_s: float) -> int:
    """A predicted wait as ``Retry-After`` says it: whole seconds, rounded up, at least 1."""
    return max(1, math.ceil(wait_s))


INVALID_REQUEST_CODES: frozenset[str] = frozenset({
    "invalid_request", "text_too_long", "empty_text", "missing_field", "bad_field", "bad_json",
    "bad_message", "message_too_large", "unknown_type", "unauthorized", "forbidden",
    "body_too_large", "bad_offer", "unsupported_media_type",
})
"""Error codes meaning the request itself is invalid: retrying it unchanged fails again.
``forbidden``: an ``Origin`` or ``Host`` the server refuses (a bad token gets
``unauthorized``)."""
MESSAGE_COMPLAINT_CODES: frozenset[str] = frozenset({
    "bad_field", "bad_json", "bad_message", "unknown_type", "missing_field", "no_open_turn",
})
"""Error codes that, once a turn runs, complain about one message and leave the turn going."""
OVERLOADED_CODE = "overloaded"
"""The engine is at capacity: the same request may succeed later."""


@dataclass(frozen=True, eq=False)
class ReferenceAudio:
    """Decoded reference audio (voice clone / direction) and its transcript."""

    samples: np.ndarray
    """``[num_samples]`` or ``[num_samples, num_channels]`` float32 in [-1, 1]."""
    sample_rate: int
    text: str


@dataclass(frozen=True)
class Say:
    text: tuple[str, ...]
    """Text segments; empty when the text follows in ``append`` messages."""
    more: bool = False
    """The turn's text continues with ``append`` messages until ``end``."""
    format: str | None = None
    """WebSocket only: ``pcm`` (PCM16 24 kHz) or ``opus`` (Ogg/Opus)."""
    client_request_id: str | None = None
    reference: ReferenceAudio | None = None
    """``reference_audio`` + ``reference_text``: encoded by the engine before the turn starts."""
    options: SynthesisOptions = field(default_factory=SynthesisOptions)
    """Voice and sampling the client set (``speaker``/``voice``, ``seed``, ``temperature``...),
    validated here."""
    turn_fields: dict[str, Any] = field(default_factory=dict)
    """Other ``SynthesisRequest`` fields the client set (``max_frames``, ``priority``,
    ``chunk_schedule``); type-checked here, range-checked by ``SynthesisRequest``."""
    segment_events: bool = False
    """The client wants a ``segment`` event before each of its segments' audio."""
    queued_events: bool = False
    """The client wants a ``queued`` event when the turn waits for a running slot."""

    @property
    def num_chars(self) -> int:
        return sum(len(t) for t in self.text)


@dataclass(frozen=True)
class Append:
    text: str


@dataclass(frozen=True)
class End:
    pass


@dataclass(frozen=True)
class Cancel:
    pass


@dataclass(frozen=True)
class Playback:
    """A client's own playback-buffer level (it plays the audio it receives)."""

    buffered_s: float
    age_s: float = 0.0
    """How long ago it was measured."""
    source: str = "client"


@dataclass(frozen=True)
class Playout:
    """Cumulative receiver stats (RTCInboundRtpStreamStats names, seconds and samples)."""

    jitter_buffer_delay: float
    jitter_buffer_emitted_count: float
    jitter_buffer_target_delay: float | None = None
    concealed_samples: float | None = None
    concealment_events: float | None = None
    total_samples_received: float | None = None


Message = Say | Append | End | Cancel | Playout | Playback
_PLAYOUT_FIELDS = {
    "jitterBufferDelay": "jitter_buffer_delay",
    "jitterBufferEmittedCount": "jitter_buffer_emitted_count",
    "jitterBufferTargetDelay": "jitter_buffer_target_delay",
    "concealedSamples": "concealed_samples",
    "concealmentEvents": "concealment_events",
    "totalSamplesReceived": "total_samples_received",
}
_TYPES = ("say", "append", "end", "cancel", "playback", "playout")
# say field -> (SynthesisRequest field, accepted Python types)
_SAY_OPTIONS: dict[str, tuple[str, tuple[type, ...]]] = {
    "voice": ("speaker", (str,)), "speaker": ("speaker", (str,)),
    "instructions": ("instructions", (str,)), "seed": ("seed", (int,)),
    "cfg_scale": ("cfg_scale", (int, float)), "temperature": ("temperature", (int, float)),
    "top_k": ("top_k", (int,)), "top_p": ("top_p", (int, float)),
    "repetition_penalty": ("repetition_penalty", (int, float)),
    "max_frames": ("max_frames", (int,)), "priority": ("priority", (int,)),
    "chunk_schedule": ("chunk_schedule", (list,)),
}


# ----------------------------------------------------------------------------- safe JSON

_SURROGATE = re.compile("[\ud800-\udfff]")
_MAX_INT = 1 << 64
_SHOW = reprlib.Repr()
_SHOW.maxstring, _SHOW.maxother, _SHOW.maxlevel, _SHOW.maxlist, _SHOW.maxdict = 40, 40, 2, 4, 4


def show(value: Any) -> str:
    """A short ``repr`` of a client value for an error message (bounded length and depth)."""
    return _SHOW.repr(value)


class _TooLong(float):
    """An integer literal longer than ``MAX_JSON_INT_DIGITS`` (rejected by ``check_json``)."""


def _parse_int(text: str) -> int | float:
    return int(text) if len(text) <= MAX_JSON_INT_DIGITS else _TooLong("inf")


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON (use a finite number)")


def loads_json(raw: str | bytes) -> Any:
    """Parses client JSON that cannot crash the server: raises ``ProtocolError`` (``bad_json``
    for the text itself, ``bad_field`` naming the top-level field otherwise) for invalid UTF-8,
    NaN/Infinity, nesting deeper than ``MAX_JSON_DEPTH``, numbers out of range (``1e400``,
    integers beyond +-2**64) and lone surrogates (``"\\ud800"``) in any string or key."""
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes | bytearray) else raw
        data = json.loads(text, parse_int=_parse_int, parse_constant=_no_constant)
    except RecursionError:
        raise ProtocolError("bad_json", f"JSON is nested too deeply (the limit is "
                            f"{MAX_JSON_DEPTH} levels)") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError("bad_json", f"not valid JSON: {exc}") from None
    check_json(data)
    return data


def check_json(data: Any) -> None:
    """Raises ``ProtocolError`` if parsed JSON holds what ``loads_json`` rejects; ``field`` is
    the top-level object key under which the fault lies (``None`` at the top level)."""
    stack: list[tuple[Any, int, str | None]] = [(data, 1, None)]
    while stack:
        value, depth, name = stack.pop()
        where = f"{name}: " if name is not None else ""
        if depth > MAX_JSON_DEPTH:
            raise ProtocolError("bad_field" if name else "bad_json",
                                f"{where}JSON is nested too deeply (the limit is "
                                f"{MAX_JSON_DEPTH} levels)", field=name)
        if isinstance(value, str):
            if _SURROGATE.search(value):
                raise ProtocolError("bad_field" if name else "bad_json",
                                    f"{where}string holds a lone UTF-16 surrogate (not valid "
                                    "Unicode text)", field=name)
        elif isinstance(value, float):
            if isinstance(value, _TooLong) or not math.isfinite(value):
                raise ProtocolError("bad_field" if name else "bad_json",
                                    f"{where}number is out of range", field=name)
        elif isinstance(value, int) and not isinstance(value, bool):
            if not -_MAX_INT <= value < _MAX_INT:
                raise ProtocolError("bad_field" if name else "bad_json",
                                    f"{where}number is out of range", field=name)
        elif isinstance(value, dict):
            for key, item in value.items():
                if _SURROGATE.search(key):
                    raise ProtocolError("bad_json", "an object key holds a lone UTF-16 "
                                        "surrogate (not valid Unicode text)", field=name)
                stack.append((item, depth + 1, key if name is None else name))
        elif isinstance(value, list):
            stack.extend((item, depth + 1, name) for item in value)


def parse_message(raw: str | bytes, *, allow_playout: bool = True) -> Message:
    """One client message -> its typed form; raises ``ProtocolError`` naming what is wrong."""
    too_large = ProtocolError("message_too_large",
                              f"message is {len(raw)} bytes; the limit is {MAX_MESSAGE_BYTES} "
                              f"({MAX_REFERENCE_MESSAGE_BYTES} for a say with reference_audio)")
    if len(raw) > MAX_REFERENCE_MESSAGE_BYTES:
        raise too_large
    try:
        data = loads_json(raw)
    except ProtocolError as exc:
        if len(raw) > MAX_MESSAGE_BYTES:
            raise too_large from None
        if exc.code == "bad_json":
            exc.message = f"message: {exc.message}"
        raise ProtocolError(exc.code, exc.message, field=exc.field) from None
    if len(raw) > MAX_MESSAGE_BYTES and not (
        isinstance(data, dict) and data.get("type") == "say" and "reference_audio" in data
    ):
        raise too_large
    if not isinstance(data, dict):
        raise ProtocolError("bad_message", "message must be a JSON object with a 'type' field")
    kind = data.get("type")
    allowed = _TYPES if allow_playout else _TYPES[:-1]
    if kind not in allowed:
        raise ProtocolError("unknown_type",
                            f"type={show(kind)} is unknown; expected one of {', '.join(allowed)}")
    if kind == "say":
        return _say(data)
    if kind == "append":
        return Append(_text(data, "text", required=True))
    if kind == "end":
        return End()
    if kind == "cancel":
        return Cancel()
    if kind == "playback":
        return _playback(data)
    return _playout(data)


def _say(data: dict[str, Any]) -> Say:
    more = _flag(data, "more", False)
    if "input_closed" in data:
        closed = _flag(data, "input_closed", True)
        if "more" in data and closed == more:
            raise ProtocolError("bad_field", "more and input_closed contradict each other",
                                field="input_closed")
        more = not closed
    raw = data.get("text")
    pieces = raw if isinstance(raw, list) else [raw] if raw is not None else []
    if not all(isinstance(p, str) for p in pieces):
        raise ProtocolError("bad_field", "text must be a string or a list of strings",
                            field="text")
    text = tuple(p for p in pieces if p.strip())
    if not text and not more:
        code = "missing_field" if raw is None else "empty_text"
        raise ProtocolError(code, "text is required and must not be empty (or set more=true)",
                            field="text")
    fmt = data.get("format")
    if fmt is not None and fmt not in ("pcm", "opus"):
        raise ProtocolError("bad_field", f"format={show(fmt)} must be 'pcm' or 'opus'",
                            field="format")
    client_id = data.get("request_id")
    if client_id is not None and (not isinstance(client_id, str) or len(client_id) > 128):
        raise ProtocolError("bad_field", "request_id must be a string of up to 128 characters",
                            field="request_id")
    reference = _reference(data)
    options: dict[str, Any] = {}
    for wire, (name, types) in _SAY_OPTIONS.items():
        value = data.get(wire)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, types):
            raise ProtocolError("bad_field", f"{wire}={show(value)} has the wrong type",
                                field=wire)
        if isinstance(value, str) and not value.strip():
            raise ProtocolError("bad_field", f"{wire} must not be empty", field=wire)
        options[name] = tuple(value) if isinstance(value, list) else value
    turn_fields = {n: options.pop(n) for n in _TURN_FIELDS if n in options}
    try:
        voice = SynthesisOptions.from_mapping(options)
    except InvalidRequest as exc:
        raise ProtocolError("invalid_request", str(exc)) from None
    return Say(text=text, more=more, format=fmt, client_request_id=client_id,
               reference=reference, options=voice, turn_fields=turn_fields,
               segment_events=_flag(data, "segment_events", False),
               queued_events=_flag(data, "queued_events", False))


_TURN_FIELDS = ("max_frames", "priority", "chunk_schedule")


def _reference(data: dict[str, Any]) -> ReferenceAudio | None:
    audio, text = data.get("reference_audio"), data.get("reference_text")
    if audio is None and text is None:
        return None
    if audio is None:
        raise ProtocolError("missing_field", "reference_text needs reference_audio (base64 WAV)",
                            field="reference_audio")
    return decode_reference(audio, text)


# ----------------------------------------------------------------------------- reference audio


def decode_reference(audio: Any, text: Any) -> ReferenceAudio:
    """``reference_audio`` (base64 of a WAV file) and ``reference_text`` -> ``ReferenceAudio``.

    Raises ``ProtocolError`` whose ``field`` is ``reference_audio`` or ``reference_text``.
    """
    if text is None:
        raise ProtocolError("missing_field", "reference_text is required with reference_audio: "
                            "the transcript of the reference audio", field="reference_text")
    if not isinstance(text, str) or not text.strip():
        raise ProtocolError("bad_field", "reference_text must be a non-empty string",
                            field="reference_text")
    samples, rate = read_wav_bytes(decode_base64_audio(audio))
    return ReferenceAudio(samples, rate, text)


def decode_base64_audio(audio: Any, name: str = "reference_audio") -> bytes:
    """Base64 text (whitespace and a ``data:...;base64,`` prefix allowed) -> bytes."""
    if not isinstance(audio, str) or not audio.strip():
        raise ProtocolError("bad_field", f"{name} must be a non-empty base64 string (a WAV file)",
                            field=name)
    if len(audio) > MAX_REFERENCE_AUDIO_CHARS:
        raise ProtocolError("bad_field", f"{name} is {len(audio)} characters of base64; "
                            f"the limit is {MAX_REFERENCE_AUDIO_CHARS}", field=name)
    if audio.startswith("data:") and "," in audio[:256]:
        audio = audio.split(",", 1)[1]
    try:
        return base64.b64decode("".join(audio.split()), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ProtocolError("bad_field", f"{name} is not valid base64: {exc}", field=name) \
            from None


_WAVE_PCM, _WAVE_FLOAT, _WAVE_EXTENSIBLE = 0x0001, 0x0003, 0xFFFE


def read_wav_bytes(data: bytes, name: str = "reference_audio") -> tuple[np.ndarray, int]:
    """A RIFF/WAVE file -> (float32 ``[n]`` or ``[n, channels]`` in [-1, 1], sample rate).

    Takes integer PCM (8, 16, 24, 32 bit) and IEEE float (32, 64 bit), plain or
    WAVE_FORMAT_EXTENSIBLE, any rate and 1..8 channels, at most ``MAX_REFERENCE_S`` long. A
    data chunk whose size field overruns the file (a streamed WAV) is read to the end.

    Raises ``ProtocolError`` with ``field=name`` saying what is wrong.
    """
    def bad(why: str) -> ProtocolError:
        return ProtocolError("bad_field", f"{name}: {why}", field=name)

    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise bad("not a WAV file (no RIFF/WAVE header)")
    fmt: bytes | None = None
    pcm: bytes | None = None
    pos = 12
    while pos + 8 <= len(data):
        chunk_id, size = data[pos:pos + 4], int.from_bytes(data[pos + 4:pos + 8], "little")
        body = data[pos + 8:pos + 8 + size]
        if chunk_id == b"fmt ":
            fmt = body
        elif chunk_id == b"data":
            pcm = body
            if fmt is not None:
                break
        pos += 8 + size + (size & 1)
    if fmt is None or len(fmt) < 16:
        raise bad("WAV file has no valid fmt chunk")
    if pcm is None:
        raise bad("WAV file has no data chunk")
    tag = int.from_bytes(fmt[0:2], "little")
    channels = int.from_bytes(fmt[2:4], "little")
    rate = int.from_bytes(fmt[4:8], "little")
    bits = int.from_bytes(fmt[14:16], "little")
    if tag == _WAVE_EXTENSIBLE and len(fmt) >= 26:
        tag = int.from_bytes(fmt[24:26], "little")  # the subformat GUID's first two bytes
    dtypes = {(_WAVE_PCM, 8): "u1", (_WAVE_PCM, 16): "<i2", (_WAVE_PCM, 24): "i3",
              (_WAVE_PCM, 32): "<i4", (_WAVE_FLOAT, 32): "<f4", (_WAVE_FLOAT, 64): "<f8"}
    if (tag, bits) not in dtypes:
        raise bad(f"unsupported WAV encoding (format tag {tag:#06x}, {bits} bits); use PCM "
                  "8/16/24/32-bit or float 32/64-bit")
    if not 1 <= channels <= MAX_REFERENCE_CHANNELS:
        raise bad(f"{channels} channels; 1..{MAX_REFERENCE_CHANNELS} are accepted")
    if not 1000 <= rate <= 768000:
        raise bad(f"sample rate {rate} Hz is out of range (1000..768000)")
    frame_bytes = channels * bits // 8
    num_frames = len(pcm) // frame_bytes
    if num_frames == 0:
        raise bad("WAV file holds no audio (0 samples)")
    if num_frames / rate > MAX_REFERENCE_S:
        raise bad(f"{num_frames / rate:.2f} s of audio; the limit is {MAX_REFERENCE_S:g} s")
    raw = pcm[:num_frames * frame_bytes]
    dtype = dtypes[(tag, bits)]
    if dtype == "u1":
        x = (np.frombuffer(raw, np.uint8).astype(np.float32) - 128.0) / 128.0
    elif dtype == "i3":
        b = np.frombuffer(raw, np.uint8).reshape(-1, 3).astype(np.int32)
        v = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
        x = (np.where(v >= 1 << 23, v - (1 << 24), v) / float(1 << 23)).astype(np.float32)
    elif dtype in ("<i2", "<i4"):
        scale = float(1 << (bits - 1))
        x = (np.frombuffer(raw, dtype).astype(np.float64) / scale).astype(np.float32)
    else:
        x = np.frombuffer(raw, dtype).astype(np.float32)
        if not np.isfinite(x).all():
            raise bad("float WAV contains NaN or infinite samples")
    x = x.reshape(num_frames, channels)
    return (x[:, 0].copy() if channels == 1 else x), rate


def _flag(data: dict[str, Any], name: str, default: bool) -> bool:
    value = data.get(name, default)
    if not isinstance(value, bool):
        raise ProtocolError("bad_field", f"{name}={show(value)} must be true or false",
                            field=name)
    return value


def _number(data: dict[str, Any], name: str, default: float | None = None) -> float:
    value = data.get(name, default)
    if value is None:
        raise ProtocolError("missing_field", f"{name} is required", field=name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value < 0:
        raise ProtocolError("bad_field", f"{name}={show(value)} must be a finite number >= 0",
                            field=name)
    return float(value)


def _playback(data: dict[str, Any]) -> Playback:
    source = data.get("source", "client")
    if not isinstance(source, str) or not 0 < len(source) <= 32:
        raise ProtocolError("bad_field", "source must be a short string", field="source")
    return Playback(_number(data, "buffered_s"), _number(data, "age_s", 0.0), source)


def _playout(data: dict[str, Any]) -> Playout:
    values: dict[str, float | None] = {}
    for wire, name in _PLAYOUT_FIELDS.items():
        value = data.get(wire)
        if value is None:
            values[name] = None
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value) or value < 0:
            raise ProtocolError("bad_field", f"{wire}={show(value)} must be a finite number >= 0",
                                field=wire)
        values[name] = float(value)
    for wire in ("jitterBufferDelay", "jitterBufferEmittedCount"):
        if values[_PLAYOUT_FIELDS[wire]] is None:
            raise ProtocolError("missing_field", f"playout needs {wire}", field=wire)
    return Playout(**values)  # type: ignore[arg-type]


def _text(data: dict[str, Any], name: str, *, required: bool) -> str:
    value = data.get(name)
    if value is None:
        if required:
            raise ProtocolError("missing_field", f"{name} is required", field=name)
        return ""
    if not isinstance(value, str):
        raise ProtocolError("bad_field", f"{name} must be a string", field=name)
    if required and not value.strip():
        raise ProtocolError("empty_text", f"{name} must not be empty", field=name)
    return value


def event(kind: str, **fields: Any) -> str:
    """A server message as JSON text: ``{"type": kind, **fields}``."""
    return json.dumps({"type": kind, **fields})


def error_event(code: str, message: str, **fields: Any) -> str:
    return event("error", code=code, message=message, **fields)
