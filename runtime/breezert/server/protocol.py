"""The JSON turn protocol spoken over the WebRTC DataChannel and the WebSocket API.

Owns: parsing and validating client messages into small typed objects, and the shapes of the
server's messages. Must not: touch the engine, sockets or the clock.

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
``priority``, ``request_id`` (the client's id, echoed as ``client_request_id``) and, on the
WebSocket, ``format``: ``pcm`` (PCM16 24 kHz, default) or ``opus`` (Ogg/Opus).

Server -> client: ``ready``, ``turn_started``, ``first_audio``, ``turn_done``, ``error``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

MAX_MESSAGE_BYTES = 65536


class ProtocolError(Exception):
    """A client message is malformed; ``code`` is machine-readable, the text says why."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class Say:
    text: tuple[str, ...]
    """Text segments; empty when the text follows in ``append`` messages."""
    more: bool = False
    """The turn's text continues with ``append`` messages until ``end``."""
    format: str | None = None
    """WebSocket only: ``pcm`` (PCM16 24 kHz) or ``opus`` (Ogg/Opus)."""
    client_request_id: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    """``SynthesisRequest`` fields the client set (``speaker``, ``seed``, ...) plus
    ``temperature``; type-checked here, range-checked by the engine."""

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
    "max_frames": ("max_frames", (int,)), "priority": ("priority", (int,)),
    "chunk_schedule": ("chunk_schedule", (list,)),
}


def parse_message(raw: str | bytes, *, allow_playout: bool = True) -> Message:
    """One client message -> its typed form; raises ``ProtocolError`` naming what is wrong."""
    if len(raw) > MAX_MESSAGE_BYTES:
        raise ProtocolError("message_too_large",
                            f"message is {len(raw)} bytes; the limit is {MAX_MESSAGE_BYTES}")
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError("bad_json", f"message is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ProtocolError("bad_message", "message must be a JSON object with a 'type' field")
    kind = data.get("type")
    allowed = _TYPES if allow_playout else _TYPES[:-1]
    if kind not in allowed:
        raise ProtocolError("unknown_type",
                            f"type={kind!r} is unknown; expected one of {', '.join(allowed)}")
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
            raise ProtocolError("bad_field", "more and input_closed contradict each other")
        more = not closed
    raw = data.get("text")
    pieces = raw if isinstance(raw, list) else [raw] if raw is not None else []
    if not all(isinstance(p, str) for p in pieces):
        raise ProtocolError("bad_field", "text must be a string or a list of strings")
    text = tuple(p for p in pieces if p.strip())
    if not text and not more:
        code = "missing_field" if raw is None else "empty_text"
        raise ProtocolError(code, "text is required and must not be empty (or set more=true)")
    fmt = data.get("format")
    if fmt is not None and fmt not in ("pcm", "opus"):
        raise ProtocolError("bad_field", f"format={fmt!r} must be 'pcm' or 'opus'")
    client_id = data.get("request_id")
    if client_id is not None and (not isinstance(client_id, str) or len(client_id) > 128):
        raise ProtocolError("bad_field", "request_id must be a string of up to 128 characters")
    options: dict[str, Any] = {}
    for wire, (name, types) in _SAY_OPTIONS.items():
        value = data.get(wire)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, types):
            raise ProtocolError("bad_field", f"{wire}={value!r} has the wrong type")
        if isinstance(value, str) and not value.strip():
            raise ProtocolError("bad_field", f"{wire} must not be empty")
        options[name] = tuple(value) if isinstance(value, list) else value
    return Say(text=text, more=more, format=fmt, client_request_id=client_id, options=options)


def _flag(data: dict[str, Any], name: str, default: bool) -> bool:
    value = data.get(name, default)
    if not isinstance(value, bool):
        raise ProtocolError("bad_field", f"{name}={value!r} must be true or false")
    return value


def _number(data: dict[str, Any], name: str, default: float | None = None) -> float:
    value = data.get(name, default)
    if value is None:
        raise ProtocolError("missing_field", f"{name} is required")
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value < 0:
        raise ProtocolError("bad_field", f"{name}={value!r} must be a finite number >= 0")
    return float(value)


def _playback(data: dict[str, Any]) -> Playback:
    source = data.get("source", "client")
    if not isinstance(source, str) or not 0 < len(source) <= 32:
        raise ProtocolError("bad_field", "source must be a short string")
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
            raise ProtocolError("bad_field", f"{wire}={value!r} must be a finite number >= 0")
        values[name] = float(value)
    for wire in ("jitterBufferDelay", "jitterBufferEmittedCount"):
        if values[_PLAYOUT_FIELDS[wire]] is None:
            raise ProtocolError("missing_field", f"playout needs {wire}")
    return Playout(**values)  # type: ignore[arg-type]


def _text(data: dict[str, Any], name: str, *, required: bool) -> str:
    value = data.get(name)
    if value is None:
        if required:
            raise ProtocolError("missing_field", f"{name} is required")
        return ""
    if not isinstance(value, str):
        raise ProtocolError("bad_field", f"{name} must be a string")
    if required and not value.strip():
        raise ProtocolError("empty_text", f"{name} must not be empty")
    return value


def event(kind: str, **fields: Any) -> str:
    """A server message as JSON text: ``{"type": kind, **fields}``."""
    return json.dumps({"type": kind, **fields})


def error_event(code: str, message: str, **fields: Any) -> str:
    return event("error", code=code, message=message, **fields)
