"""LiveKit Agents TTS over BreezeRT: ``TTS``, ``ChunkedStream``, ``SynthesizeStream``.

Owns: turning LLM tokens into engine segments with a LiveKit ``tokenize.SentenceTokenizer``
(default: ``tokenizer.SentenceTokenizer``, the runtime's splitter; one engine request per turn,
one segment per sentence), the options snapshot per stream, audio out
through the ``AudioEmitter`` in 10/20 ms frames at the plugin's rate (resampled once per turn
with soxr when that is not the runtime's 24 kHz, e.g. 8 kHz for telephony), reporting playback
(``playout.PlayoutFeedback``) while a turn plays, and the mapping of runtime errors to the
``APIError`` family, and warming what a first turn would otherwise build in the agent's loop
(``warm_transcript_pacing``) or collect there (``freeze_startup_heap``). Must not: import
torch, log synthesized text, or reach the runtime other than through ``client.RuntimeClient``.
"""

from __future__ import annotations

import asyncio
import gc
import os
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from livekit import rtc
from livekit.agents.types import TimedString
from livekit.agents import (
    DEFAULT_API_CONNECT_OPTIONS,
    NOT_GIVEN,
    APIConnectionError,
    APIConnectOptions,
    APIError,
    APIStatusError,
    APITimeoutError,
    NotGivenOr,
    tokenize,
    tts,
    utils,
)

from breezert.audio import float_to_pcm16, new_resampler, resample_chunk, samples_per_frame
from breezert.options import SynthesisOptions
from breezert.errors import (
    BreezeRTError,
    EngineOverloaded,
    InvalidRequest,
    RequestAborted,
    RequestFailed,
)

from .client import (
    InProcessRuntimeClient,
    RemoteRuntimeClient,
    RuntimeClient,
    RuntimeUnavailable,
    SegmentStart,
    Turn,
    TurnOptions,
)
from .log import logger
from .playout import PlayoutFeedback
from .tokenizer import SentenceTokenizer
from .models import (
    DEFAULT_FEEDBACK_INTERVAL_S,
    DEFAULT_FRAME_SIZE_MS,
    DEFAULT_MODEL,
    DEFAULT_SPEAKER,
    NUM_CHANNELS,
    SAMPLE_RATE,
    FrameSizeMs,
    TTSSpeakers,
)

if TYPE_CHECKING:
    import aiohttp
    from livekit.agents.voice import io

    from breezert.config import EngineConfig

# ----------------------------------------------------------------------------- plugin


@dataclass(frozen=True)
class _TTSOptions:
    turn: TurnOptions
    frame_size_ms: int
    sample_rate: int
    tokenizer: tokenize.SentenceTokenizer


def _check_frame_size(frame_size_ms: int) -> int:
    if frame_size_ms not in (10, 20):
        raise ValueError(f"frame_size_ms={frame_size_ms!r} must be 10 or 20")
    return frame_size_ms


def _check_sample_rate(sample_rate: int) -> int:
    """A rate whose 10 and 20 ms frames are whole samples (a multiple of 100 Hz)."""
    try:
        samples_per_frame(int(sample_rate), 10)
    except (TypeError, ValueError):
        raise ValueError(f"sample_rate={sample_rate!r} must be a positive multiple of 100 Hz "
                         "(8000 for telephony)") from None
    return int(sample_rate)


class _Resampler:
    """One turn's audio from the runtime's rate to the plugin's (``soxr`` through
    ``breezert.audio``, streaming, so the turn is resampled once and continuously; ``None``
    inside when the rates match: a passthrough)."""

    def __init__(self, in_rate: int, out_rate: int) -> None:
        self._soxr = new_resampler(in_rate, out_rate)

    def push(self, pcm: bytes) -> bytes:
        if self._soxr is None:
            return pcm
        samples = np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32767.0
        return float_to_pcm16(resample_chunk(self._soxr, samples))

    def flush(self) -> bytes:
        """The audio soxr still holds (end of the turn)."""
        if self._soxr is None:
            return b""
        return float_to_pcm16(resample_chunk(self._soxr, np.zeros(0, np.float32), last=True))


class TTS(tts.TTS[Literal["metrics_collected", "error"]]):  # no events of its own
    def __init__(
        self,
        *,
        base_url: str | Sequence[str] | None = None,
        config: str | os.PathLike[str] | EngineConfig | None = None,
        client: RuntimeClient | None = None,
        auth_token: str | None = None,
        speaker: TTSSpeakers | str = DEFAULT_SPEAKER,
        instructions: str | None = None,
        cfg_scale: float = 1.0,
        seed: int | None = None,
        temperature: float | None = None,
        chunk_schedule: Sequence[int] | None = None,
        max_frames: int | None = None,
        priority: int = 0,
        frame_size_ms: FrameSizeMs = DEFAULT_FRAME_SIZE_MS,
        sample_rate: int = SAMPLE_RATE,
        feedback_interval_s: float = DEFAULT_FEEDBACK_INTERVAL_S,
        tokenizer: NotGivenOr[tokenize.SentenceTokenizer] = NOT_GIVEN,
        http_session: aiohttp.ClientSession | None = None,
    ) -> None:
        """BreezeRT text-to-speech: one engine request per turn, streamed sentence by sentence.

        With no arguments it runs the embedded default profile (tiny random model, CPU)
        in-process, on the engine that every ``TTS`` of the process with the same config shares
        (``breezert.async_engine.AsyncEngine.shared``).

        Args:
            base_url: A ``breezert serve`` (``http://host:8080``): run turns remotely over its
                WebSocket; or a list of replicas: each turn goes to the least loaded by their
                ``/readyz``, and moves to another only before its first audio
                (``RemoteRuntimeClient``). Exclusive with ``config`` and ``client``.
            config: ``EngineConfig``, TOML path or packaged profile name (``cpu-tiny``) for the
                in-process engine.
            client: Any ``RuntimeClient`` (tests, custom transports); not closed by ``aclose``.
            auth_token: Bearer token for ``base_url`` (default: ``BREEZERT_AUTH_TOKEN``).
            speaker: ``[S0]``..``[S9]``.
            instructions: Voice direction text, or ``None``.
            cfg_scale: Classifier-free guidance scale (1 = off).
            seed: Seed of each turn's sampling; ``None`` = random per turn.
            temperature: Backbone temperature; ``None`` = the checkpoint's default.
            chunk_schedule: Frames per engine chunk (last repeats); ``None`` = engine default.
            max_frames: Frame limit per sentence (80 ms each); ``None`` = engine default.
            priority: Engine priority of this agent's turns.
            frame_size_ms: Duration of each emitted ``rtc.AudioFrame`` (10 or 20).
            sample_rate: Rate of the emitted audio. The runtime's is 24000; any other (8000
                for a phone call) is resampled here, once per turn as one stream, with soxr.
                Match the agent's output to it (``room_io.AudioOutputOptions(sample_rate=...)``),
                or livekit-agents resamples it again.
            feedback_interval_s: Playback feedback period while a turn plays.
            tokenizer: Cuts the LLM's text into sentences, each one engine segment (default:
                ``breezert_agent.tokenizer.SentenceTokenizer``, which hands a sentence on the
                moment it is complete; LiveKit's own, e.g. ``tokenize.blingfire``, wait for the
                next one to start). A remote ``breezert serve`` cuts a segment further where
                its prompt would not fit; in-process such a segment fails the turn (HTTP 400).
            http_session: aiohttp session for ``base_url`` (default: one of its own).
        """
        super().__init__(
            capabilities=tts.TTSCapabilities(streaming=True, aligned_transcript=True),
            sample_rate=_check_sample_rate(sample_rate),
            num_channels=NUM_CHANNELS,
        )
        if sum(x is not None for x in (base_url, config, client)) > 1:
            raise ValueError("give at most one of base_url, config and client")
        if not feedback_interval_s > 0:
            raise ValueError(f"feedback_interval_s={feedback_interval_s!r} must be > 0")
        voice = SynthesisOptions(speaker=speaker, instructions=instructions,
                                 cfg_scale=cfg_scale, seed=seed, temperature=temperature)
        self._opts = _TTSOptions(
            turn=TurnOptions(
                voice=voice, max_frames=max_frames, priority=priority,
                chunk_schedule=tuple(chunk_schedule) if chunk_schedule is not None else None),
            frame_size_ms=_check_frame_size(frame_size_ms),
            sample_rate=self.sample_rate,
            tokenizer=tokenizer if utils.is_given(tokenizer) else SentenceTokenizer(),
        )
        self._owns_client = client is None
        if client is not None:
            self._client: RuntimeClient = client
        elif base_url is not None:
            self._client = RemoteRuntimeClient(
                base_url, auth_token=auth_token or os.environ.get("BREEZERT_AUTH_TOKEN"),
                http_session=http_session,
            )
        else:
            self._client = InProcessRuntimeClient(config)
        self._feedback_interval_s = feedback_interval_s
        self._playout = PlayoutFeedback()
        self._streams: weakref.WeakSet[SynthesizeStream | ChunkedStream] = weakref.WeakSet()

    @property
    def model(self) -> str:
        return DEFAULT_MODEL

    @property
    def provider(self) -> str:
        return "breezert"

    @property
    def client(self) -> RuntimeClient:
        return self._client

    @property
    def num_queued_turns(self) -> int:
        """Turns of this TTS's client that waited for one of the runtime's running slots (each
        also logged; in-process the engine counts them as ``queued_requests`` too, remotely the
        server's ``/metrics`` has ``breezert_requests_queued_total``)."""
        return self._client.num_queued_turns

    @property
    def playout(self) -> PlayoutFeedback:
        """Playback feedback state (what is reported to the engine, and from where)."""
        return self._playout

    def update_options(
        self,
        *,
        speaker: NotGivenOr[TTSSpeakers | str] = NOT_GIVEN,
        instructions: NotGivenOr[str | None] = NOT_GIVEN,
        cfg_scale: NotGivenOr[float] = NOT_GIVEN,
        seed: NotGivenOr[int | None] = NOT_GIVEN,
        temperature: NotGivenOr[float | None] = NOT_GIVEN,
        chunk_schedule: NotGivenOr[Sequence[int] | None] = NOT_GIVEN,
        max_frames: NotGivenOr[int | None] = NOT_GIVEN,
        priority: NotGivenOr[int] = NOT_GIVEN,
        frame_size_ms: NotGivenOr[FrameSizeMs] = NOT_GIVEN,
    ) -> None:
        """Changes the options of streams created from now on (running ones keep theirs).

        Raises:
            InvalidRequest: a value is invalid (nothing changes then).
        """
        voice = {name: value for name, value in (
            ("speaker", speaker), ("instructions", instructions), ("cfg_scale", cfg_scale),
            ("seed", seed), ("temperature", temperature)) if utils.is_given(value)}
        turn: dict[str, Any] = {name: value for name, value in (
            ("max_frames", max_frames), ("priority", priority)) if utils.is_given(value)}
        if utils.is_given(chunk_schedule):
            turn["chunk_schedule"] = tuple(chunk_schedule) if chunk_schedule else None
        frame = self._opts.frame_size_ms
        if utils.is_given(frame_size_ms):
            frame = _check_frame_size(frame_size_ms)
        old = self._opts.turn
        self._opts = replace(
            self._opts, turn=replace(old, voice=replace(old.voice, **voice), **turn),
            frame_size_ms=frame)

    def synthesize(
        self, text: str, *, conn_options: APIConnectOptions = DEFAULT_API_CONNECT_OPTIONS
    ) -> ChunkedStream:
        stream = ChunkedStream(tts=self, input_text=text, conn_options=conn_options)
        self._streams.add(stream)
        return stream

    def stream(
        self, *, conn_options: APIConnectOptions = DEFAULT_API_CONNECT_OPTIONS
    ) -> SynthesizeStream:
        stream = SynthesizeStream(tts=self, conn_options=conn_options)
        self._streams.add(stream)
        return stream

    def prewarm(self) -> None:
        """Loads (in-process) or connects (remote) in the background, builds the agent's
        transcript pacing once per process (``warm_transcript_pacing``) and takes the
        process's start-up heap out of the collector's full passes (``freeze_startup_heap``);
        never blocks the loop."""
        freeze_startup_heap()
        self._client.prewarm()
        warm_transcript_pacing()

    def attach_audio_source(
        self, source: rtc.AudioSource, *, pending_s: Callable[[], float] | None = None
    ) -> None:
        """Reports ``source.queued_duration`` to the engine while a turn plays."""
        self._playout.attach_audio_source(source, pending_s=pending_s)

    def attach_audio_output(self, output: io.AudioOutput | None) -> bool:
        """Same, finding the source behind ``session.output.audio`` (RoomIO); True if found.
        A turn's first audio then waits for RoomIO's subscriber (``PlayoutFeedback.
        wait_for_listener``)."""
        return self._playout.attach_audio_output(output)

    def listen_room(self, room: rtc.Room) -> None:
        """Uses the listener's jitter buffer from ``examples/playout_reporter.js`` too."""
        self._playout.listen_room(room)

    async def aclose(self) -> None:
        for stream in list(self._streams):
            await stream.aclose()
        self._streams.clear()
        self._playout.detach()
        if self._owns_client:
            await self._client.aclose()


# ----------------------------------------------------------------------------- the process


_pacing_lock = threading.Lock()
_pacing_thread: threading.Thread | None = None
_heap_lock = threading.Lock()
_heap_frozen = False


def freeze_startup_heap() -> bool:
    """Once per process: moves every object the cyclic collector tracks now (livekit-agents',
    livekit's and the plugin's imports: ~160k objects in a remote-engine agent) into its
    permanent generation (``gc.freeze``), so that full passes walk only what came after.
    Each full pass over that heap holds the GIL: 40-60 ms on two idle cores, and 150-200 ms
    in the agents of 7 Dec's rooms at N=64 (16 processes of 4 rooms on 16 loaded cores), where
    livekit-agents' loop monitor put every loop stall over 100 ms on such a pass
    (``gc_time`` = the stall) and the rooms of each process went silent together in their
    first turns (bench/README.md, 7 Dec, fourteenth session). No pass runs here (``gc.freeze``
    only relinks the generations), so the loop is not held; what is frozen is never collected,
    which is what start-up made and lives as long as the process, plus whatever cyclic
    garbage was pending then (once per process). An in-process engine froze its own
    start-up already (``AsyncEngine.shared``); freezing again costs nothing. Returns whether
    this call froze."""
    global _heap_frozen
    with _heap_lock:
        if _heap_frozen:
            return False
        gc.freeze()
        _heap_frozen = True
        return True


def warm_transcript_pacing() -> threading.Thread:
    """Builds, on a thread of its own and once per process, the table of livekit-agents'
    ``tokenize.basic.hyphenate_word``, which RoomIO's transcript synchronizer (on by default)
    uses to pace each turn's text and otherwise builds on its first call: inside a job's loop
    as a first turn's audio starts (py-spy saw it there), 13 ms on two cores holding the GIL
    while every room of the process waits. On two cores with 4 rooms the first turns' loop lag
    was within the noise either way (bench/README.md, 7 Dec); the rooms at N=128, 8 to a
    process, are where it may show. Returns that thread (the same one on later calls)."""
    global _pacing_thread
    with _pacing_lock:
        if _pacing_thread is None:
            _pacing_thread = threading.Thread(
                target=tokenize.basic.hyphenate_word, args=("prewarm",),
                name="breezert-warm-pacing", daemon=True)
            _pacing_thread.start()
        return _pacing_thread


# ----------------------------------------------------------------------------- one turn


def _api_error(exc: Exception, *, audio_pushed: bool) -> APIError:
    """The ``APIError`` for a runtime failure; retryable only before any audio was pushed."""
    retryable = not audio_pushed
    if isinstance(exc, InvalidRequest):
        return APIStatusError(f"breezert rejected the request: {exc}", status_code=400,
                              retryable=False)
    if isinstance(exc, EngineOverloaded):  # the runtime's refusal: its predicted wait, if said
        retry = exc.retry_after_s
        return APIStatusError(
            "breezert engine is overloaded" + (f" (retry after {retry:.1f} s)" if retry else "")
            + f": {exc}",  # the engine's reason (which gate: cycle, capacity, starting, queue)
            status_code=503, body=None if retry is None else {"retry_after_s": retry},
            retryable=retryable)
    if isinstance(exc, RuntimeUnavailable):
        return APIConnectionError(f"breezert runtime unavailable: {exc}", retryable=retryable)
    if isinstance(exc, asyncio.TimeoutError):
        return APITimeoutError("breezert runtime did not answer in time", retryable=retryable)
    if isinstance(exc, RequestAborted):
        return APIError("breezert request was aborted", retryable=False)
    if isinstance(exc, RequestFailed):
        return APIError(f"breezert request failed: {exc.reason}", retryable=retryable)
    if isinstance(exc, BreezeRTError):
        return APIError(f"breezert error: {exc}", retryable=retryable)
    return APIError(f"breezert plugin error: {type(exc).__name__}", retryable=False)


class _TurnRunner:
    """One attempt of one turn: opens the engine request, pumps its audio into the emitter,
    reports playback while it plays, and aborts the request unless it finished."""

    def __init__(
        self, owner: TTS, opts: _TTSOptions, emitter: tts.AudioEmitter, request_id: str,
        timeout: float, stream: tts.ChunkedStream | tts.SynthesizeStream,
    ) -> None:
        self._tts, self._opts, self._emitter, self._stream = owner, opts, emitter, stream
        self._request_id, self._timeout = request_id, timeout
        self.turn: Turn | None = None
        self.texts: list[str] = []  # the turn's segments, in order
        self.is_audio_pushed = False
        self._is_finished = False
        self._is_ready = asyncio.Event()  # a turn is open, or none will be
        self._feedback_task: asyncio.Task[None] | None = None

    async def open(self, texts: Sequence[str], *, input_closed: bool) -> None:
        self.turn = await self._tts.client.open_turn(
            texts, self._opts.turn, request_id=self._request_id,
            input_closed=input_closed, timeout=self._timeout,
        )
        # NOTE: TTSMetrics reads these two (livekit-agents has no public setter for them)
        self._stream._connection_reused = self.turn.connection_reused
        self._stream._acquire_time = self.turn.acquire_time
        self.texts.extend(texts)
        self._is_ready.set()

    async def send(self, text: str) -> None:
        """The turn's next segment: the first opens the request, later ones are appended."""
        if self.turn is None:
            await self.open([text], input_closed=False)
        else:
            await self.turn.append(text)
            self.texts.append(text)

    async def close_input(self) -> None:
        if self.turn is not None:
            await self.turn.close_input()
        self._is_ready.set()

    async def pump(self) -> None:
        """Pushes every chunk into the emitter as it arrives (no buffering here but the
        resampler's, when the plugin's rate is not the runtime's), from the first one that
        the attached output's listener is ready for (``PlayoutFeedback.wait_for_listener``)."""
        await self._is_ready.wait()
        if self.turn is None:
            return
        resampler = _Resampler(self._tts.client.sample_rate, self._opts.sample_rate)
        async for pcm in self.turn.audio():
            if isinstance(pcm, SegmentStart):
                self._push_transcript(pcm)
                continue
            if not self.is_audio_pushed:
                await self._tts.playout.wait_for_listener()  # RoomIO: a subscriber, settled
                self.is_audio_pushed = True
                self._tts.playout.begin(self.turn)
                self._feedback_task = asyncio.create_task(self._feedback_loop(self.turn))
            self._push(resampler.push(pcm))
        self._push(resampler.flush())
        self._is_finished = True

    def _push(self, pcm: bytes) -> None:
        if pcm:  # soxr holds back the start of a turn until it has a block
            self._emitter.push(pcm)

    def _push_transcript(self, start: SegmentStart) -> None:
        """The sentence whose audio starts here, timed from the stream's start (exact to one
        80 ms frame; its end is the next sentence's start, or the end of the audio)."""
        if 0 <= start.index < len(self.texts):
            self._emitter.push_timed_transcript(
                TimedString(self.texts[start.index] + " ", start_time=start.start_s))

    async def _feedback_loop(self, turn: Turn) -> None:
        while True:
            self._tts.playout.report(turn, time.monotonic())
            await asyncio.sleep(self._tts._feedback_interval_s)

    async def aclose(self) -> None:
        if self._feedback_task is not None:
            await utils.aio.cancel_and_wait(self._feedback_task)
        if self.turn is not None:
            self._tts.playout.end(self.turn)
            if not self._is_finished:
                await self.turn.abort()


async def _run_guarded(runner: _TurnRunner, body: Callable[[], Awaitable[None]]) -> None:
    """Runs ``body`` and maps failures to ``APIError``; always closes the runner."""
    try:
        await body()
    except APIError:
        raise
    except (BreezeRTError, asyncio.TimeoutError) as exc:
        raise _api_error(exc, audio_pushed=runner.is_audio_pushed) from None
    except Exception as exc:
        logger.exception("breezert turn failed", extra={"request_id": runner._request_id})
        raise _api_error(exc, audio_pushed=runner.is_audio_pushed) from exc
    finally:
        await runner.aclose()


def _initialize(output_emitter: tts.AudioEmitter, opts: _TTSOptions, *, stream: bool) -> str:
    """Starts the emitter with small frames (10/20 ms, never the 200 ms default) and returns
    the request id."""
    request_id = utils.shortuuid()
    output_emitter.initialize(
        request_id=request_id, sample_rate=opts.sample_rate, num_channels=NUM_CHANNELS,
        mime_type="audio/pcm", frame_size_ms=opts.frame_size_ms, stream=stream,
    )
    return request_id


def _is_speakable(piece: str) -> bool:
    """Whether a piece has something to say: a letter or digit (``"..."``, ``"—"`` or ``"!?"``
    alone would only cost the engine a request or a segment of noise)."""
    return any(ch.isalnum() for ch in piece)


class ChunkedStream(tts.ChunkedStream):
    """``TTS.synthesize``: a whole text as one engine request, one segment per sentence."""

    def __init__(self, *, tts: TTS, input_text: str, conn_options: APIConnectOptions) -> None:
        super().__init__(tts=tts, input_text=input_text, conn_options=conn_options)
        self._tts: TTS = tts
        self._opts = replace(tts._opts)

    async def _run(self, output_emitter: tts.AudioEmitter) -> None:
        request_id = _initialize(output_emitter, self._opts, stream=False)
        segments = [piece for piece in self._opts.tokenizer.tokenize(self._input_text)
                    if _is_speakable(piece)]
        if not segments:
            if self._input_text.strip():  # livekit-agents wants audio for any text: a frame
                output_emitter.push(bytes(2 * self._opts.sample_rate * self._opts.frame_size_ms
                                          // 1000))
            return
        runner = _TurnRunner(self._tts, self._opts, output_emitter, request_id,
                             self._conn_options.timeout, self)

        async def body() -> None:
            await runner.open(segments, input_closed=True)
            await runner.pump()

        await _run_guarded(runner, body)


class SynthesizeStream(tts.SynthesizeStream):
    """``TTS.stream``: one turn = one engine request; each sentence is appended as a segment
    the moment it is complete, while earlier ones are already playing."""

    def __init__(self, *, tts: TTS, conn_options: APIConnectOptions) -> None:
        super().__init__(tts=tts, conn_options=conn_options)
        self._tts: TTS = tts
        self._opts = replace(tts._opts)

    async def _run(self, output_emitter: tts.AudioEmitter) -> None:
        request_id = _initialize(output_emitter, self._opts, stream=True)
        runner = _TurnRunner(self._tts, self._opts, output_emitter, request_id,
                             self._conn_options.timeout, self)
        sentences = self._opts.tokenizer.stream()

        async def input_task() -> None:
            async for data in self._input_ch:
                if isinstance(data, self._FlushSentinel):
                    sentences.flush()  # flush ends a segment now
                else:
                    sentences.push_text(data)
            sentences.end_input()

        async def send_task() -> None:
            async for sentence in sentences:
                if not _is_speakable(sentence.token):
                    continue
                if runner.turn is None:
                    self._mark_started()  # TTFB counts from the first text sent
                    output_emitter.start_segment(segment_id=request_id)
                await runner.send(sentence.token)
            await runner.close_input()  # end_input closes the turn

        async def body() -> None:
            tasks = [asyncio.create_task(input_task()), asyncio.create_task(send_task()),
                     asyncio.create_task(runner.pump())]
            try:
                await asyncio.gather(*tasks)
            finally:
                await utils.aio.gracefully_cancel(*tasks)
                await sentences.aclose()
            if runner.turn is not None:
                output_emitter.end_segment()

        await _run_guarded(runner, body)
