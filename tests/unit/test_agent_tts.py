"""``breezert_agent.TTS`` against ``FakeRuntimeClient``: the LiveKit plugin contract, no engine.

Owns: the pluggable sentence tokenizer (the default and LiveKit's own), one request per turn
with segments in order, flush/end_input, TTFB metrics, ``synthesize``, frame size, options
snapshots, error mapping and retries, and abort on ``aclose``. Must not: load a model, import
torch or need a LiveKit server.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import pytest
from livekit.agents import APIConnectOptions, APIError, APIStatusError, tokenize
from livekit.agents.metrics import TTSMetrics

from breezert.errors import EngineOverloaded, InvalidRequest, RequestAborted, RequestFailed
from breezert_agent import TTS
from breezert.options import SynthesisOptions
from breezert_agent.client import RuntimeClient, Turn, TurnOptions
from breezert_agent.tokenizer import SentenceTokenizer

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("virtual_clock")]

SAMPLE_RATE = 24000
NO_RETRY = APIConnectOptions(max_retry=0, timeout=5.0)


# ----------------------------------------------------------------------------- fake runtime


def segment_pcm(index: int, num_samples: int) -> bytes:
    """PCM16 whose every sample is ``1000 * (index + 1)``: frames tell their segment."""
    return np.full(num_samples, 1000 * (index + 1), dtype="<i2").tobytes()


def segment_of(sample: int) -> int:
    return sample // 1000 - 1


@dataclass
class FakeTurn(Turn):
    client: FakeRuntimeClient
    request_id: str
    options: TurnOptions
    segments: list[str]
    input_closed: bool
    is_aborted: bool = False
    reports: list[tuple[float, float, str]] = field(default_factory=list)
    events: list[tuple[float, str]] = field(default_factory=list)
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    async def append(self, text: str) -> None:
        assert not self.input_closed, "append after close_input"
        self.segments.append(text)
        self.events.append((time.monotonic(), f"append:{text}"))
        self._changed.set()

    async def close_input(self) -> None:
        self.input_closed = True
        self.events.append((time.monotonic(), "close"))
        self._changed.set()

    async def abort(self) -> None:
        self.is_aborted = True
        self._changed.set()

    def report_playback(self, buffered_s: float, measured_at: float, source: str) -> None:
        self.reports.append((buffered_s, measured_at, source))

    async def audio(self) -> AsyncIterator[bytes]:
        client, index, num_chunks = self.client, 0, 0
        while True:
            while index < len(self.segments):
                for _ in range(client.chunks_per_segment):
                    await asyncio.sleep(client.chunk_delay_s)
                    if self.is_aborted:
                        raise RequestAborted(self.request_id)
                    if client.fail_after_chunks is not None and num_chunks >= \
                            client.fail_after_chunks:
                        raise RequestFailed(self.request_id, "injected")
                    num_chunks += 1
                    yield segment_pcm(index, client.samples_per_chunk)
                index += 1
            if self.input_closed:
                return
            if self.is_aborted:
                raise RequestAborted(self.request_id)
            await self._changed.wait()
            self._changed.clear()


class FakeRuntimeClient(RuntimeClient):
    """Records every turn; each segment becomes ``chunks_per_segment`` chunks of PCM16."""

    def __init__(
        self,
        *,
        chunks_per_segment: int = 2,
        samples_per_chunk: int = 1200,
        chunk_delay_s: float = 0.005,
        fail_after_chunks: int | None = None,
        open_errors: Sequence[Exception] = (),
    ) -> None:
        self.chunks_per_segment = chunks_per_segment
        self.samples_per_chunk = samples_per_chunk
        self.chunk_delay_s = chunk_delay_s
        self.fail_after_chunks = fail_after_chunks
        self.open_errors = list(open_errors)
        self.turns: list[FakeTurn] = []
        self.num_opens = 0
        self.is_prewarmed = False

    async def open_turn(
        self,
        texts: Sequence[str],
        options: TurnOptions,
        *,
        request_id: str,
        input_closed: bool,
        timeout: float | None = None,
    ) -> Turn:
        self.num_opens += 1
        if self.open_errors:
            raise self.open_errors.pop(0)
        turn = FakeTurn(self, request_id, options, list(texts), input_closed)
        turn.events.append((time.monotonic(), "open"))
        self.turns.append(turn)
        return turn

    def prewarm(self) -> None:
        self.is_prewarmed = True

    def segment_s(self) -> float:
        return self.chunks_per_segment * self.samples_per_chunk / SAMPLE_RATE


async def _collect(stream: AsyncIterator) -> list:
    return [ev async for ev in stream]


def _samples(events: list) -> np.ndarray:
    return np.concatenate([np.frombuffer(ev.frame.data, dtype="<i2") for ev in events])


# ----------------------------------------------------------------------------- tokenizer

class SemicolonTokenizer(tokenize.SentenceTokenizer):
    """A LiveKit tokenizer that cuts at ``;`` only (the default never does)."""

    @staticmethod
    def _split(text: str) -> list[str]:
        return [piece.strip() for piece in text.split(";") if piece.strip()]

    def tokenize(self, text: str, *, language: str | None = None) -> list[str]:
        return self._split(text)

    def stream(self, *, language: str | None = None) -> tokenize.SentenceStream:
        return tokenize.BufferedSentenceStream(tokenizer=self._split, min_token_len=1,
                                               min_ctx_len=1)


async def test_default_tokenizer_hands_each_sentence_on_inside_push_text() -> None:
    tokenizer = SentenceTokenizer()
    assert isinstance(tokenizer, tokenize.SentenceTokenizer)
    stream = tokenizer.stream()
    stream.push_text("Hi!")  # complete: out before any later text comes
    first = await asyncio.wait_for(stream.__anext__(), 0.1)
    assert first.token == "Hi!"
    stream.push_text(" Ok.")  # "Ok." could still be "Ok.5": held for the next word
    stream.push_text(" Next")
    stream.flush()
    stream.push_text("After the flush.")
    stream.end_input()
    rest = [data async for data in stream]
    assert [d.token for d in rest] == ["Ok.", "Next", "After the flush."]
    assert first.segment_id == rest[0].segment_id == rest[1].segment_id != rest[2].segment_id
    text = "Hi! Ok. Next"
    assert tokenizer.tokenize(text) == ["Hi!", "Ok.", "Next"]
    with pytest.raises(RuntimeError, match="closed"):
        stream.push_text("late")


async def test_a_livekit_tokenizer_cuts_the_turns_segments() -> None:
    client = FakeRuntimeClient()
    tts = TTS(client=client, tokenizer=SemicolonTokenizer())
    async with tts.stream(conn_options=NO_RETRY) as stream:
        for piece in ("one. two", "; three!", " four;", " five"):
            stream.push_text(piece)
        stream.end_input()
        await _collect(stream)
    await tts.synthesize("Mr. Smith; Bye. Now", conn_options=NO_RETRY).collect()
    assert [turn.segments for turn in client.turns] == [
        ["one. two", "three! four", "five"], ["Mr. Smith", "Bye. Now"]]
    assert all(turn.input_closed for turn in client.turns)
    await tts.aclose()


async def test_blingfire_tokenizer_plugs_in() -> None:
    client = FakeRuntimeClient()
    tts = TTS(client=client, tokenizer=tokenize.blingfire.SentenceTokenizer(
        min_sentence_len=1, stream_context_len=1))
    async with tts.stream(conn_options=NO_RETRY) as stream:
        for word in "Hello there. How are you? I am fine".split(" "):
            stream.push_text(word + " ")
        stream.end_input()
        await _collect(stream)
    assert client.turns[0].segments == ["Hello there.", "How are you?", "I am fine"]
    await tts.aclose()


# ----------------------------------------------------------------------------- stream()

async def test_stream_one_request_per_turn_segments_in_order_and_metrics() -> None:
    client = FakeRuntimeClient()
    tts = TTS(client=client)
    metrics: list[TTSMetrics] = []
    tts.on("metrics_collected", metrics.append)
    pieces = ["Hello", " there.", " How are", " you", " today?", " I am", " fine"]
    async with tts.stream(conn_options=NO_RETRY) as stream:
        for piece in pieces:
            stream.push_text(piece)
            await asyncio.sleep(0.01)
        stream.end_input()
        events = await _collect(stream)
    await asyncio.sleep(0)  # the metrics task emits after the final frame

    assert client.num_opens == 1 and len(client.turns) == 1
    turn = client.turns[0]
    assert turn.segments == ["Hello there.", "How are you today?", "I am fine"]
    assert turn.input_closed and not turn.is_aborted
    samples = _samples(events)
    assert len(samples) == 3 * client.chunks_per_segment * client.samples_per_chunk
    order = [segment_of(s) for s in samples]
    assert order == sorted(order) and set(order) == {0, 1, 2}
    assert all(ev.request_id == turn.request_id for ev in events)
    assert events[-1].is_final and not any(ev.is_final for ev in events[:-1])
    assert len(metrics) == 1 and 0 < metrics[0].ttfb < 1.0
    assert metrics[0].audio_duration == pytest.approx(3 * client.segment_s(), abs=1e-3)
    await tts.aclose()


async def test_sentences_reach_engine_while_the_llm_is_still_writing() -> None:
    client = FakeRuntimeClient()
    tts = TTS(client=client)
    stream = tts.stream(conn_options=NO_RETRY)
    stream.push_text("First sentence!")
    await asyncio.sleep(0.05)
    assert len(client.turns) == 1 and client.turns[0].segments == ["First sentence!"]
    stream.push_text(" Second one is")
    await asyncio.sleep(0.05)
    assert client.turns[0].segments == ["First sentence!"]  # incomplete: not sent yet
    stream.push_text(" here.")
    stream.end_input()
    await _collect(stream)
    assert client.turns[0].segments == ["First sentence!", "Second one is here."]
    await tts.aclose()


async def test_flush_ends_a_segment_and_end_input_closes_the_turn() -> None:
    client = FakeRuntimeClient()
    tts = TTS(client=client)
    stream = tts.stream(conn_options=NO_RETRY)
    stream.push_text("no punctuation yet")
    stream.flush()
    await asyncio.sleep(0.05)
    turn = client.turns[0]
    assert turn.segments == ["no punctuation yet"] and not turn.input_closed
    stream.end_input()
    events = await _collect(stream)
    assert turn.input_closed and len(events) > 0
    await tts.aclose()


async def test_ttfb_counts_from_the_first_text_sent() -> None:
    client = FakeRuntimeClient(chunk_delay_s=0.02)
    tts = TTS(client=client)
    metrics: list[TTSMetrics] = []
    tts.on("metrics_collected", metrics.append)
    stream = tts.stream(conn_options=NO_RETRY)
    await asyncio.sleep(0.5)  # the LLM thinks; the TTS must not count this
    stream.push_text("Now!")
    stream.end_input()
    await _collect(stream)
    await asyncio.sleep(0)
    assert len(metrics) == 1 and 0.02 <= metrics[0].ttfb < 0.45
    await stream.aclose()
    await tts.aclose()


async def test_empty_turn_opens_no_request() -> None:
    client = FakeRuntimeClient()
    tts = TTS(client=client)
    stream = tts.stream(conn_options=NO_RETRY)
    stream.push_text("  ")
    stream.end_input()
    assert await _collect(stream) == []
    assert client.num_opens == 0
    await tts.aclose()


async def test_segments_with_nothing_speakable_are_not_sent() -> None:
    client = FakeRuntimeClient()
    tts = TTS(client=client)
    stream = tts.stream(conn_options=NO_RETRY)
    stream.push_text("Hello. ... —")
    stream.flush()  # the splitter hands "... —" over as a piece of its own
    stream.push_text("!? ")
    stream.end_input()
    await _collect(stream)
    turn, = client.turns
    assert turn.segments == ["Hello."]
    for text in ("...", "—", "!?", " … ! "):  # one frame of silence, no request
        frame = await tts.synthesize(text, conn_options=NO_RETRY).collect()
        assert frame.duration == pytest.approx(0.02) and not any(frame.data)
    assert client.num_opens == 1
    await tts.synthesize("Hi. ... —", conn_options=NO_RETRY).collect()
    assert client.turns[-1].segments == ["Hi."]
    await tts.aclose()


@pytest.mark.parametrize("frame_size_ms", [10, 20])
async def test_frames_are_small(frame_size_ms: int) -> None:
    client = FakeRuntimeClient(samples_per_chunk=2400)
    tts = TTS(client=client, frame_size_ms=frame_size_ms)
    stream = tts.stream(conn_options=NO_RETRY)
    stream.push_text("One. Two.")
    stream.end_input()
    events = await _collect(stream)
    frame_samples = SAMPLE_RATE * frame_size_ms // 1000
    # the emitter holds back a 10 ms tail per segment to mark is_final
    sizes = {ev.frame.samples_per_channel for ev in events[:-1]}
    assert sizes <= {frame_samples, frame_samples - 240} and frame_samples in sizes
    assert all(ev.frame.sample_rate == SAMPLE_RATE for ev in events)
    await tts.aclose()


@pytest.mark.parametrize("frame_size_ms", [10, 20])
async def test_sample_rate_8000_resamples_each_turn_once_to_telephony_frames(
        frame_size_ms: int) -> None:
    client = FakeRuntimeClient(samples_per_chunk=2400)  # 2 segments x 2 chunks x 100 ms
    tts = TTS(client=client, frame_size_ms=frame_size_ms, sample_rate=8000)
    assert tts.sample_rate == 8000
    stream = tts.stream(conn_options=NO_RETRY)
    stream.push_text("One. Two.")
    stream.end_input()
    events = await _collect(stream)
    assert all(ev.frame.sample_rate == 8000 for ev in events)
    frame_samples = 8000 * frame_size_ms // 1000
    assert frame_samples in {ev.frame.samples_per_channel for ev in events}
    samples = _samples(events)
    assert samples.size == pytest.approx(4 * 2400 // 3, abs=frame_samples)  # 0.4 s at 8 kHz
    # one resampler for the turn: the segments' levels (1000, 2000) come through, the step
    # between them smoothed by the filter rather than a restart's silence
    assert np.median(samples[:600]) == pytest.approx(1000, abs=2)
    assert np.median(samples[-600:]) == pytest.approx(2000, abs=3)
    assert samples[100:-100].min() > 900
    frame = await tts.synthesize("...", conn_options=NO_RETRY).collect()  # one silent frame
    assert frame.sample_rate == 8000 and frame.duration == pytest.approx(frame_size_ms / 1000)
    await tts.aclose()


def test_resampling_keeps_the_telephone_band_and_removes_what_8_khz_cannot_carry() -> None:
    from breezert_agent.tts import _Resampler

    t = np.arange(24000) / 24000
    def level(tone_hz: float) -> float:
        pcm = (8000 * np.sin(2 * np.pi * tone_hz * t)).astype("<i2").tobytes()
        resampler = _Resampler(24000, 8000)
        out = b"".join(resampler.push(pcm[i:i + 3840]) for i in range(0, len(pcm), 3840))
        x = np.frombuffer(out + resampler.flush(), dtype="<i2")[800:-800].astype(np.float64)
        return float(np.sqrt(np.mean(x * x)) / (8000 / np.sqrt(2)))
    assert level(1000.0) == pytest.approx(1.0, abs=0.02)  # passband
    assert level(6000.0) < 0.01  # above 4 kHz: filtered, not folded back to 2 kHz
    assert _Resampler(24000, 24000).push(b"\x01\x00") == b"\x01\x00"  # same rate: as is


def test_sample_rate_must_make_whole_frames() -> None:
    for bad in (0, -8000, 8050, "8k"):
        with pytest.raises(ValueError, match="sample_rate"):
            TTS(client=FakeRuntimeClient(), sample_rate=bad)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- synthesize()

async def test_synthesize_returns_the_whole_utterance_in_one_request() -> None:
    client = FakeRuntimeClient()
    tts = TTS(client=client)
    frame = await tts.synthesize("One sentence. And another one!",
                                 conn_options=NO_RETRY).collect()
    assert client.num_opens == 1
    turn = client.turns[0]
    assert turn.segments == ["One sentence.", "And another one!"] and turn.input_closed
    assert frame.duration == pytest.approx(2 * client.segment_s(), abs=1e-3)
    await tts.aclose()


# ----------------------------------------------------------------------------- options

async def test_options_are_snapshotted_per_stream() -> None:
    client = FakeRuntimeClient()
    tts = TTS(client=client, speaker="[S1]", max_frames=30, chunk_schedule=[1, 4])
    before = tts.stream(conn_options=NO_RETRY)
    tts.update_options(speaker="[S2]", temperature=0.5)
    after = tts.stream(conn_options=NO_RETRY)
    for stream in (before, after):
        stream.push_text("Hi!")
        stream.end_input()
        await _collect(stream)
    first, second = (turn.options for turn in client.turns)
    assert first == TurnOptions(voice=SynthesisOptions(speaker="[S1]"), max_frames=30,
                                chunk_schedule=(1, 4))
    assert second.voice == SynthesisOptions(speaker="[S2]", temperature=0.5)
    assert second.max_frames == 30
    with pytest.raises(ValueError, match="frame_size_ms"):
        tts.update_options(frame_size_ms=15)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match="^speaker='S10' is unknown"):
        tts.update_options(speaker="S10")
    with pytest.raises(InvalidRequest, match="^temperature="):
        tts.update_options(speaker="[S3]", temperature=-1.0)
    assert tts._opts.turn.voice.speaker == "[S2]"  # a refused update changes nothing
    await tts.aclose()


def test_constructor_validates_the_voice() -> None:
    with pytest.raises(InvalidRequest, match="^speaker='S10' is unknown"):
        TTS(client=FakeRuntimeClient(), speaker="S10")
    with pytest.raises(InvalidRequest, match="^cfg_scale="):
        TTS(client=FakeRuntimeClient(), cfg_scale=-2.0)


def test_constructor_rejects_conflicting_placements() -> None:
    with pytest.raises(ValueError, match="at most one"):
        TTS(base_url="http://127.0.0.1:1", client=FakeRuntimeClient())
    tts = TTS(client=FakeRuntimeClient())
    assert tts.capabilities.streaming and tts.sample_rate == SAMPLE_RATE
    assert tts.provider == "breezert" and tts.model == "breeze-tts-2"
    tts.prewarm()
    assert tts.client.is_prewarmed  # type: ignore[attr-defined]


def test_prewarm_builds_the_transcript_pacing_once_per_process_off_the_loop(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """RoomIO's transcript synchronizer counts syllables with livekit's ``hyphenate_word``,
    whose table is built on its first call; ``prewarm`` builds it on a thread of its own, once
    however many sessions start."""
    import threading

    from livekit.agents import tokenize

    import breezert_agent.tts as tts_module

    calls: list[tuple[str, str]] = []
    release = threading.Event()

    def hyphenate(word: str) -> list[str]:
        calls.append((word, threading.current_thread().name))
        release.wait(5)  # slow, as the first build is: prewarm must not wait for it
        return [word]

    monkeypatch.setattr(tokenize.basic, "hyphenate_word", hyphenate)
    monkeypatch.setattr(tts_module, "_pacing_thread", None)
    first, second = TTS(client=FakeRuntimeClient()), TTS(client=FakeRuntimeClient())
    first.prewarm()
    second.prewarm()
    thread = tts_module.warm_transcript_pacing()
    assert thread.is_alive()  # both prewarms returned while the build still ran
    release.set()
    thread.join(5)
    assert calls == [("prewarm", "breezert-warm-pacing")]


def test_prewarm_freezes_the_start_up_heap_once_per_process(monkeypatch) -> None:
    """``TTS.prewarm`` moves what the process tracked then into the collector's permanent
    generation, once per process (every session prewarms): later full passes skip it."""
    import gc

    import breezert_agent.tts as tts_module

    freezes: list[int] = []
    monkeypatch.setattr(gc, "freeze", lambda: freezes.append(len(freezes)))
    monkeypatch.setattr(tts_module, "_heap_frozen", False)
    TTS(client=FakeRuntimeClient()).prewarm()
    TTS(client=FakeRuntimeClient()).prewarm()
    assert freezes == [0]
    assert tts_module.freeze_startup_heap() is False  # already done in this process


# ----------------------------------------------------------------------------- errors

async def test_overload_before_audio_is_retried() -> None:
    client = FakeRuntimeClient(open_errors=[EngineOverloaded("queue full")])
    tts = TTS(client=client)
    errors: list = []
    tts.on("error", errors.append)
    stream = tts.stream(conn_options=APIConnectOptions(max_retry=1, retry_interval=0.01))
    stream.push_text("Hello!")
    stream.end_input()
    events = await _collect(stream)
    assert client.num_opens == 2 and len(events) > 0
    assert len(errors) == 1 and errors[0].recoverable
    assert isinstance(errors[0].error, APIStatusError) and errors[0].error.retryable
    await tts.aclose()


async def test_failure_after_audio_is_not_retried() -> None:
    client = FakeRuntimeClient(fail_after_chunks=1)
    tts = TTS(client=client)
    stream = tts.stream(conn_options=APIConnectOptions(max_retry=2, retry_interval=0.01))
    stream.push_text("Hello there! More text.")
    stream.end_input()
    with pytest.raises(APIError) as info:
        await _collect(stream)
    assert not info.value.retryable and "injected" in str(info.value)
    assert client.num_opens == 1
    await tts.aclose()


async def test_invalid_request_is_not_retryable_and_hides_the_text() -> None:
    secret = "my card number is 1234"
    client = FakeRuntimeClient(open_errors=[InvalidRequest("speaker='[S42]' is unknown")] * 3)
    tts = TTS(client=client)
    stream = tts.synthesize(secret, conn_options=APIConnectOptions(max_retry=2))
    with pytest.raises(APIStatusError) as info:
        await stream.collect()
    assert info.value.status_code == 400 and not info.value.retryable
    assert client.num_opens == 1 and secret not in str(info.value)
    await tts.aclose()


async def test_aclose_mid_turn_aborts_the_request() -> None:
    client = FakeRuntimeClient(chunks_per_segment=50, chunk_delay_s=0.01)
    tts = TTS(client=client)
    stream = tts.stream(conn_options=NO_RETRY)
    stream.push_text("A long sentence that plays for a while!")
    received = 0
    async for _ in stream:
        received += 1
        if received == 3:
            break
    await asyncio.wait_for(tts.aclose(), 5.0)  # closes every stream it created
    assert client.turns[0].is_aborted
