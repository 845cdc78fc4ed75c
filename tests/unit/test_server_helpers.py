"""Pure pieces of the server: PCM helpers, the turn protocol, playout deltas, ICE scope, metrics.

Owns: the parsing/validation rules of control messages, the error codes (each one the server
sends is in API.md; ``protocol`` imports with numpy and the stdlib only), the jitter-buffer delta
arithmetic, loopback candidate selection and the Prometheus text shape. Must not: start an
engine, a server or a peer connection.
"""

from __future__ import annotations

import ast
import io
import json
import subprocess
import sys
import wave
from pathlib import Path

import aioice.ice
import numpy as np
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from breezert.options import SynthesisOptions
from breezert import audio
from breezert.config import ServingConfig
from breezert.server import ice, protocol
from breezert.server.health import Lifecycle
from breezert.server.metrics_export import Scrape, register
from breezert.server.playout import PlayoutTracker
from breezert.server.protocol import (
    INVALID_REQUEST_CODES,
    MESSAGE_COMPLAINT_CODES,
    OVERLOADED_CODE,
    Append,
    Cancel,
    End,
    Playback,
    Playout,
    ProtocolError,
    Say,
    parse_message,
    retry_after_seconds,
)
from breezert.server.state import ServerState

from tests.fake_engine import FakeEngine

pytestmark = pytest.mark.unit
SERVER_DIR = Path(protocol.__file__).parent


# ----------------------------------------------------------------------------- audio helpers


def test_samples_per_frame_and_framing() -> None:
    assert audio.samples_per_frame(48000, 10) == 480
    assert audio.samples_per_frame(8000, 20) == 160
    with pytest.raises(ValueError, match="frame_ms=1"):
        audio.samples_per_frame(44100, 1)


def test_pcm16_round_trip_and_clipping() -> None:
    pcm = np.array([0.0, 0.5, -0.5, 1.5, -1.5], np.float32)
    data = audio.float_to_pcm16(pcm)
    assert len(data) == 10
    back = np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768.0
    assert np.allclose(back, np.clip(pcm, -1, 1), atol=1e-4)


def test_wav_is_readable_by_the_stdlib() -> None:
    data = audio.encode_wav(np.zeros(2400, np.float32), 24000)
    with wave.open(io.BytesIO(data)) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate(), w.getnframes()) == \
            (1, 2, 24000, 2400)
    assert len(audio.wav_header(24000, None)) == 44


@pytest.mark.parametrize("out_rate", [48000, 8000, 24000])
def test_streaming_resampler_keeps_the_duration(out_rate: int) -> None:
    resampler = audio.new_resampler(24000, out_rate)
    assert (resampler is None) == (out_rate == 24000)
    pieces = [audio.resample_chunk(resampler, np.ones(1920, np.float32)) for _ in range(5)]
    pieces.append(audio.resample_chunk(resampler, np.zeros(0, np.float32), last=True))
    assert sum(len(p) for p in pieces) == 5 * 1920 * out_rate // 24000


# ----------------------------------------------------------------------------- protocol


def test_parse_turn_messages() -> None:
    assert parse_message('{"type": "say", "text": "Hi", "voice": "S1"}') == \
        Say(text=("Hi",), options=SynthesisOptions(speaker="S1"))
    assert parse_message('{"type": "say", "more": true}') == Say(text=(), more=True)
    assert parse_message('{"type": "append", "text": " more"}') == Append(" more")
    assert parse_message('{"type": "end"}') == End()
    assert parse_message(b'{"type": "cancel"}') == Cancel()
    playout = parse_message(json.dumps({"type": "playout", "jitterBufferDelay": 1.5,
                                        "jitterBufferEmittedCount": 48000}))
    assert isinstance(playout, Playout) and playout.jitter_buffer_delay == 1.5
    assert parse_message('{"type": "playback", "buffered_s": 0.2, "source": "livekit-source"}') \
        == Playback(0.2, 0.0, "livekit-source")


def test_say_takes_segments_engine_options_and_either_flag() -> None:
    say = parse_message(json.dumps({
        "type": "say", "request_id": "c-1", "text": ["One.", "  ", "Two."], "speaker": "[S2]",
        "instructions": "calm", "seed": 3, "cfg_scale": 1.5, "temperature": 0.7,
        "max_frames": 40, "priority": 1, "chunk_schedule": [2, 4], "input_closed": False,
        "format": "opus",
    }))
    assert isinstance(say, Say)
    assert say.text == ("One.", "Two.") and say.num_chars == 8 and say.more
    assert say.client_request_id == "c-1" and say.format == "opus"
    assert say.options == SynthesisOptions(speaker="[S2]", instructions="calm", seed=3,
                                           cfg_scale=1.5, temperature=0.7)
    assert say.turn_fields == {"max_frames": 40, "priority": 1, "chunk_schedule": (2, 4)}
    with pytest.raises(ProtocolError, match="^temperature=-1") as info:
        parse_message('{"type": "say", "text": "x", "temperature": -1}')
    assert info.value.code == "invalid_request"
    with pytest.raises(ProtocolError, match="contradict"):
        parse_message('{"type": "say", "text": "x", "more": true, "input_closed": true}')


@pytest.mark.parametrize("raw,code", [
    ("{not json", "bad_json"),
    ("[1, 2]", "bad_message"),
    ('{"type": "dance"}', "unknown_type"),
    ('{"type": "say"}', "missing_field"),
    ('{"type": "say", "text": 5}', "bad_field"),
    ('{"type": "say", "text": ["a", 1]}', "bad_field"),
    ('{"type": "say", "text": "x", "more": "yes"}', "bad_field"),
    ('{"type": "say", "text": "x", "max_frames": 1.5}', "bad_field"),
    ('{"type": "say", "text": "x", "cfg_scale": true}', "bad_field"),
    ('{"type": "playback"}', "missing_field"),
    ('{"type": "playback", "buffered_s": 0.1, "age_s": -1}', "bad_field"),
    ('{"type": "say", "text": "  "}', "empty_text"),
    ('{"type": "say", "text": "x", "seed": "7"}', "bad_field"),
    ('{"type": "say", "text": "x", "voice": 3}', "bad_field"),
    ('{"type": "say", "text": "x", "format": "mp3"}', "bad_field"),
    ('{"type": "append"}', "missing_field"),
    ('{"type": "playout", "jitterBufferDelay": 1}', "missing_field"),
    ('{"type": "playout", "jitterBufferDelay": -1, "jitterBufferEmittedCount": 1}', "bad_field"),
    ("x" * 70000, "message_too_large"),
])
def test_bad_messages_name_the_problem(raw: str, code: str) -> None:
    with pytest.raises(ProtocolError) as info:
        parse_message(raw)
    assert info.value.code == code and info.value.message


def test_websocket_does_not_take_playout() -> None:
    with pytest.raises(ProtocolError, match="unknown"):
        parse_message('{"type": "playout", "jitterBufferDelay": 0, '
                      '"jitterBufferEmittedCount": 0}', allow_playout=False)


def _emitted_codes() -> dict[str, str]:
    """Every error code the server's source sends -> where (``file:line``): the first argument
    of ``ProtocolError(...)`` / ``error_event(...)`` and ``json_error(..., code=...)``."""
    def strings(node: ast.expr) -> set[str]:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return {node.value}
        if isinstance(node, ast.IfExp):
            return strings(node.body) | strings(node.orelse)
        return set()

    found: dict[str, str] = {}
    for path in sorted(SERVER_DIR.glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        bound: dict[str, set[str]] = {}  # names assigned string constants (``code = "a" if ...``)
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and len(node.targets) == 1 \
                    and isinstance(node.targets[0], ast.Name):
                bound.setdefault(node.targets[0].id, set()).update(strings(node.value))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
            if name in ("ProtocolError", "error_event") and node.args:
                arg: ast.expr | None = node.args[0]
            elif name == "json_error":
                arg = next((k.value for k in node.keywords if k.arg == "code"), None)
            else:
                continue
            where = f"{path.name}:{node.lineno}"
            if arg is None or (isinstance(arg, ast.Attribute) and arg.attr == "code"):
                continue  # no code, or a caught ProtocolError's (collected where it is raised)
            if isinstance(arg, ast.Name) and isinstance(getattr(protocol, arg.id, None), str):
                codes = {getattr(protocol, arg.id)}
            elif isinstance(arg, ast.Name):
                codes = bound.get(arg.id, set())
            else:
                codes = strings(arg)
            assert codes, f"{where}: cannot tell which error code {ast.unparse(arg)} is"
            for code in codes:
                found.setdefault(code, where)
    return found


def test_an_error_event_says_the_field_and_the_wait_in_whole_seconds() -> None:
    assert [retry_after_seconds(s) for s in (0.01, 1.0, 1.01, 29.2)] == [1, 1, 2, 30]
    assert json.loads(ProtocolError("bad_field", "no", field="text").as_event()) == {
        "type": "error", "code": "bad_field", "message": "no", "field": "text"}
    assert json.loads(ProtocolError(OVERLOADED_CODE, "full", retry_after_s=2.3).as_event()) == {
        "type": "error", "code": "overloaded", "message": "full", "retry_after_s": 3}
    assert "retry_after_s" not in json.loads(ProtocolError(OVERLOADED_CODE, "full").as_event())


def test_every_error_code_the_server_sends_is_documented() -> None:
    emitted = _emitted_codes()
    assert {"bad_json", "turn_active", "overloaded", "unauthorized", "bad_offer"} <= set(emitted)
    api = (SERVER_DIR / "API.md").read_text()
    undocumented = {code: where for code, where in emitted.items() if f"`{code}`" not in api}
    assert not undocumented, f"error codes missing from API.md: {undocumented}"
    # The taxonomy clients import names only codes the server sends (forbidden: see its doc).
    taxonomy = INVALID_REQUEST_CODES | MESSAGE_COMPLAINT_CODES | {OVERLOADED_CODE}
    assert taxonomy - {"forbidden"} <= set(emitted)


def test_protocol_imports_with_numpy_and_the_stdlib_only() -> None:
    # The remote LiveKit plugin (no torch, maybe no aiortc) imports it for the error codes.
    code = (
        "import sys\n"
        "for name in ('torch', 'aiortc', 'av', 'aiohttp', 'aioice', 'soxr'):\n"
        "    sys.modules[name] = None\n"
        "import breezert.server.protocol\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60, check=False)
    assert result.returncode == 0, result.stderr


# ----------------------------------------------------------------------------- playout


def _stats(delay: float, emitted: float, events: float = 0, target: float | None = None) -> Playout:
    return Playout(jitter_buffer_delay=delay, jitter_buffer_emitted_count=emitted,
                   jitter_buffer_target_delay=target, concealment_events=events)


def test_playout_tracker_uses_deltas_not_lifetime_averages() -> None:
    tracker = PlayoutTracker()
    first = tracker.update(_stats(delay=48000 * 0.3, emitted=48000, target=48000 * 0.2))
    assert first.jitter_buffer_s == pytest.approx(0.3) and first.new_concealment_events == 0
    # The next 4800 samples each waited 60 ms: the current delay, not the lifetime mean.
    now = tracker.update(_stats(48000 * 0.3 + 4800 * 0.06, 52800, events=2,
                                target=48000 * 0.2 + 4800 * 0.05))
    assert now.jitter_buffer_s == pytest.approx(0.06) and now.target_s == pytest.approx(0.05)
    assert now.new_concealment_events == 2
    same = tracker.update(_stats(48000 * 0.3 + 4800 * 0.06, 52800, events=2))
    assert same.jitter_buffer_s == pytest.approx(0.06) and same.new_concealment_events == 0
    restarted = tracker.update(_stats(480 * 0.1, 480))  # counters went backwards: new receiver
    assert restarted.jitter_buffer_s == pytest.approx(0.1)


# ----------------------------------------------------------------------------- ICE scope


def test_loopback_bind_adds_loopback_candidates() -> None:
    assert ice.scope_for("127.0.0.1") == ice.HostAddresses(extra=("127.0.0.1",))
    assert ice.scope_for("::1") == ice.HostAddresses(extra=("::1",))
    assert ice.scope_for("0.0.0.0") == ice.HostAddresses()
    assert ice.scope_for("127.0.0.1", ["10.0.0.5"]) == ice.HostAddresses(only=("10.0.0.5",))


def test_scoped_host_addresses_only_apply_inside_the_scope() -> None:
    ice.install()
    default = aioice.ice.get_host_addresses(True, False)
    assert "127.0.0.1" not in default  # aioice's own rule
    with ice.host_addresses(ice.HostAddresses(extra=("127.0.0.1",))):
        assert aioice.ice.get_host_addresses(True, False) == default + ["127.0.0.1"]
    with ice.host_addresses(ice.HostAddresses(only=("127.0.0.1", "::1"))):
        assert aioice.ice.get_host_addresses(True, False) == ["127.0.0.1"]
        assert aioice.ice.get_host_addresses(True, True) == ["127.0.0.1", "::1"]
    assert aioice.ice.get_host_addresses(True, False) == default


# ----------------------------------------------------------------------------- metrics


def test_prometheus_text_from_a_snapshot() -> None:
    snapshot = {
        "counters": {"requests_added": 3, "requests_finished": 2, "requests_aborted": 1,
                     "chunks_emitted": 9},
        "stages": {"decode": {"step_s": {"count": 4, "mean": 0.002, "p50": 0.002, "p95": 0.003,
                                         "p99": 0.004, "max": 0.004}, "rows": {"count": 4}}},
        "ttfb_s": {"count": 2, "mean": 0.05},
        "ttfb_histogram": {"buckets_s": [0.01, 0.1], "counts": [0, 1, 1]},
        "active_requests": 1,
    }
    engine = FakeEngine(max_running=4)
    engine.metrics = lambda: snapshot  # type: ignore[method-assign]
    state = ServerState(engine=engine, serving=ServingConfig(), request_options={},
                        ice=ice.HostAddresses(), underruns_total=4)
    register(state)
    state.first_audio.observe(0.05)
    text = generate_latest(Scrape(state, Lifecycle())).decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    for name, labels, value in (
        ("breezert_ttfb_seconds_bucket", {"le": "0.01"}, 0),
        ("breezert_ttfb_seconds_bucket", {"le": "0.1"}, 1),
        ("breezert_ttfb_seconds_bucket", {"le": "+Inf"}, 2),
        ("breezert_ttfb_seconds_sum", {}, 0.1), ("breezert_ttfb_seconds_count", {}, 2),
        ("breezert_first_audio_seconds_bucket", {"le": "0.02"}, 0),
        ("breezert_first_audio_seconds_bucket", {"le": "0.06"}, 1),
        ("breezert_first_audio_seconds_count", {}, 1),
        ("breezert_underruns_total", {}, 4), ("breezert_active_streams", {}, 1),
        ("breezert_queue_depth", {}, 0),
        ("breezert_stage_step_seconds", {"stage": "decode", "quantile": "0.95"}, 0.003),
        ("breezert_stage_step_seconds_count", {"stage": "decode"}, 4),
        ("breezert_requests_finished_total", {"status": "aborted"}, 1),
        ("breezert_requests_added_total", {}, 3),
        ("breezert_connections", {"kind": "webrtc"}, 0),
        ("breezert_slots", {"state": "free"}, 4), ("breezert_codec_slots", {"state": "used"}, 0),
        ("breezert_ready", {}, 0), ("breezert_draining", {}, 0),
    ):
        assert samples[(name, tuple(sorted(labels.items())))] == pytest.approx(value), name
    assert ("process_resident_memory_bytes", ()) in samples  # prometheus_client's collector
    for line in text.splitlines():  # every sample line is "name{labels} number"
        if line and not line.startswith("#"):
            float(line.rsplit(" ", 1)[1])
