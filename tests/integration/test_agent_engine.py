"""``breezert_agent.TTS`` on the real in-process ``AsyncEngine`` (embedded tiny model, CPU).

Owns: one engine request per turn with segments appended, ``synthesize``, interruption freeing
every engine resource, ``AgentSession.say`` through a real ``rtc.AudioSource`` with its queue
reaching the engine as playback feedback, and the shared engine of ``TTS()``. Must not: need a
LiveKit server, weights or a GPU.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

import pytest
from breezert.errors import InvalidRequest
from livekit.agents import Agent, AgentSession, APIConnectOptions, APIStatusError
from livekit.agents.metrics import TTSMetrics

from breezert.async_engine import AsyncEngine
from breezert.profiles import resolve_config
from breezert_agent import TTS
from breezert_agent.client import InProcessRuntimeClient, Turn, TurnOptions
from breezert_agent.playout import AudioSourceOutput
from tests import latency
from tests.latency import LatencyMiss
from tests.realtime import retried_when_starved

pytestmark = pytest.mark.integration

NO_RETRY = APIConnectOptions(max_retry=0, timeout=30.0)
FRAME_S = 0.08  # one codec frame


@pytest.fixture(scope="module")
def engine() -> AsyncEngine:
    """The process-wide engine that ``TTS()`` uses (embedded default config), loaded once."""
    return AsyncEngine.shared()


class SpyClient(InProcessRuntimeClient):
    """The real in-process client, recording each turn's segments as they are sent."""

    def __init__(self) -> None:
        super().__init__()
        self.turns: list[dict[str, Any]] = []

    async def open_turn(
        self, texts: Sequence[str], options: TurnOptions, *, request_id: str,
        input_closed: bool, timeout: float | None = None,
    ) -> Turn:
        turn = await super().open_turn(texts, options, request_id=request_id,
                                       input_closed=input_closed, timeout=timeout)
        record = {"request_id": request_id, "segments": list(texts), "closed": input_closed}
        self.turns.append(record)
        append, close = turn.append, turn.close_input

        async def spy_append(text: str) -> None:
            record["segments"].append(text)
            await append(text)

        async def spy_close() -> None:
            record["closed"] = True
            await close()

        turn.append, turn.close_input = spy_append, spy_close  # type: ignore[method-assign]
        return turn


async def _pieces(stream: Any, pieces: Sequence[str]) -> None:
    for piece in pieces:
        stream.push_text(piece)
        await asyncio.sleep(0.005)
    stream.end_input()


async def _wait_idle(engine: AsyncEngine, timeout_s: float = 10.0) -> None:
    core = engine.engine
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if core.block_pool.num_free == core.block_pool.num_blocks \
                and core.scheduler.num_running == 0 and core.runner.slots.num_active == 0:
            return
        await asyncio.sleep(0.02)


async def test_default_tts_shares_the_process_engine(engine: AsyncEngine) -> None:
    tts = TTS(max_frames=2, seed=0)
    client = tts.client
    assert isinstance(client, InProcessRuntimeClient)
    assert await client.get_engine() is engine  # no second model load
    tts.prewarm()  # already loaded: returns at once
    await tts.aclose()
    assert engine.is_running or engine.engine is not None  # aclose leaves the shared engine


@retried_when_starved(LatencyMiss)
async def test_stream_one_request_per_turn_with_segments_in_order(engine: AsyncEngine) -> None:
    client = SpyClient()
    tts = TTS(client=client, max_frames=3, seed=0)
    metrics: list[TTSMetrics] = []
    tts.on("metrics_collected", metrics.append)
    stream = tts.stream(conn_options=NO_RETRY)
    pieces = ["Hello", " there.", " How are", " you", " today?", " Bye"]
    feeder = asyncio.create_task(_pieces(stream, pieces))
    events = [ev async for ev in stream]
    await feeder
    await asyncio.sleep(0)

    assert len(client.turns) == 1
    turn = client.turns[0]
    assert turn["segments"] == ["Hello there.", "How are you today?", "Bye"] and turn["closed"]
    duration_s = sum(ev.frame.duration for ev in events)
    assert 0 < duration_s <= 3 * 3 * FRAME_S + 1e-6
    assert {ev.frame.samples_per_channel for ev in events[:-1]} <= {480, 240}  # 20 ms frames
    assert len(metrics) == 1 and metrics[0].ttfb > 0
    print(f"agent stream TTFB {metrics[0].ttfb * 1000:.0f} ms")
    latency.check("agent_stream_ttfb", metrics[0].ttfb)
    await stream.aclose()
    await tts.aclose()
    await _wait_idle(engine)


async def test_synthesize_returns_the_whole_utterance(engine: AsyncEngine) -> None:
    client = SpyClient()
    tts = TTS(client=client, max_frames=3, seed=1, frame_size_ms=10, temperature=0.7)
    frame = await tts.synthesize("First sentence. Second one!", conn_options=NO_RETRY).collect()
    assert client.turns == [{"request_id": client.turns[0]["request_id"],
                             "segments": ["First sentence.", "Second one!"], "closed": True}]
    assert 0 < frame.duration <= 2 * 3 * FRAME_S + 1e-6
    assert frame.sample_rate == 24000
    await tts.aclose()
    await _wait_idle(engine)


async def test_aclose_mid_turn_aborts_and_frees_the_engine(engine: AsyncEngine) -> None:
    core = engine.engine
    client = SpyClient()
    tts = TTS(client=client, max_frames=150)  # 12 s of audio: still running when closed
    stream = tts.stream(conn_options=NO_RETRY)
    stream.push_text("A long answer that nobody will hear to the end!")
    num_frames = 0
    async for _ in stream:
        num_frames += 1
        if num_frames == 5:
            break
    request_id = client.turns[0]["request_id"]
    assert core.scheduler.get_request(request_id) is not None  # mid-turn
    await asyncio.wait_for(tts.aclose(), 5.0)
    assert core.scheduler.get_request(request_id) is None  # aborted at once
    await _wait_idle(engine)
    assert core.block_pool.num_free == core.block_pool.num_blocks
    assert core.scheduler.num_running == 0
    assert core.runner.slots.num_active == 0


async def test_agent_session_say_feeds_the_source_queue_back_to_the_engine(
    engine: AsyncEngine,
) -> None:
    core = engine.engine
    client = SpyClient()
    tts = TTS(client=client, max_frames=8, seed=2, feedback_interval_s=0.02)
    played: list[float] = []
    output = AudioSourceOutput(on_frame=lambda frame: played.append(frame.duration))
    assert tts.attach_audio_output(output)
    finished: list[Any] = []
    output.on("playback_finished", finished.append)
    session = AgentSession(tts=tts)
    session.output.audio = output
    await session.start(Agent(instructions="offline"))
    seen: list[tuple[float, str]] = []

    async def watch_engine() -> None:  # what the engine holds for our request right now
        while True:
            for turn in client.turns:
                request = core.scheduler.get_request(turn["request_id"])
                if request is not None and request.playback is not None:
                    seen.append((request.playback.buffered_s, request.playback.source))
            await asyncio.sleep(0.005)

    watcher = asyncio.create_task(watch_engine())
    await asyncio.wait_for(session.say("One sentence here. And a second one!"), 30.0)
    watcher.cancel()
    await asyncio.gather(watcher, return_exceptions=True)

    assert len(client.turns) == 1 and len(client.turns[0]["segments"]) == 2
    assert finished and not finished[0].interrupted
    assert finished[0].playback_position == pytest.approx(sum(played), abs=0.011)
    assert seen and all(source == "livekit-source" for _, source in seen)
    assert max(buffered for buffered, _ in seen) > 0.0
    await session.aclose()
    await output.aclose()
    await tts.aclose()
    await _wait_idle(engine)



async def test_invalid_voice_is_refused_at_construction_and_a_refused_turn_is_a_400(
    engine: AsyncEngine,
) -> None:
    with pytest.raises(InvalidRequest, match=r"^speaker='\[S42\]' is unknown"):
        TTS(speaker="[S42]")
    tts = TTS(instructions="Speak calmly. " * 400)  # a prompt past the model's token limit
    with pytest.raises(APIStatusError) as info:
        await tts.synthesize("Hello.", conn_options=APIConnectOptions(max_retry=2)).collect()
    assert info.value.status_code == 400 and not info.value.retryable
    assert "Hello" not in str(info.value) and "calmly" not in str(info.value)
    await tts.aclose()


async def test_shared_engine_builds_once_for_concurrent_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A config of its own (fewer blocks), so that this engine is not the shared default one.
    cfg = resolve_config(None).model_copy(deep=True)
    cfg = cfg.model_copy(update={"cache": cfg.cache.model_copy(update={"num_blocks": 512})})
    num_builds = 0
    build = AsyncEngine.from_config

    def counting_build(config: object) -> AsyncEngine:
        nonlocal num_builds
        num_builds += 1
        return build(config)  # type: ignore[arg-type]

    monkeypatch.setattr(AsyncEngine, "from_config", staticmethod(counting_build))
    gc.unfreeze()  # what an earlier test froze; this build must freeze its own heap
    engines: list[AsyncEngine] = []
    threads = [threading.Thread(
        target=lambda: engines.append(AsyncEngine.shared(cfg, warmup=False))) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert num_builds == 1 and len(engines) == 3 and len({id(e) for e in engines}) == 1
    # its start-up heap is out of the collector's full passes (runtime_setup.freeze_startup_heap)
    assert gc.get_freeze_count() > 0
    assert not any(o is engines[0].engine for o in gc.get_objects())
    await AsyncEngine.aclose_shared(cfg)  # closed and forgotten: the next call builds anew
    again = AsyncEngine.shared(cfg, warmup=False)
    assert num_builds == 2 and again is not engines[0]
    await AsyncEngine.aclose_shared(cfg)


async def test_a_closed_shared_engine_is_collected_though_shared_froze_its_heap(
    engine: AsyncEngine,
) -> None:
    """``shared`` freezes the heap with the engine in it (``runtime_setup.freeze_startup_heap``):
    ``aclose_shared`` gives it back to the collector, so that what of the dropped engine sits in
    reference cycles (its scheduler does) is freed, and the engines still shared (``engine``, the
    default one) are frozen again."""
    cfg = resolve_config(None).model_copy(deep=True)
    cfg = cfg.model_copy(update={"cache": cfg.cache.model_copy(update={"num_blocks": 384})})
    dropped = AsyncEngine.shared(cfg, warmup=False)
    scheduler = weakref.ref(dropped.engine.scheduler)
    del dropped
    await AsyncEngine.aclose_shared(cfg)
    gc.collect()
    assert scheduler() is None, "the closed engine stays frozen out of the collector"
    assert gc.get_freeze_count() > 0  # the default engine is still shared: frozen again
    assert not any(o is engine.engine for o in gc.get_objects())


# ----------------------------------------------------------------------------- issue 15

async def test_engine_marks_each_segment_start_exactly(engine: AsyncEngine) -> None:
    """Chunks of 4 frames over segments of up to 3: a chunk carries the end of one segment and
    the start of the next, and only the engine's frame counts tell where the boundary is."""
    from breezert.outputs import AudioChunk, SegmentStarted
    from breezert.request import SynthesisRequest

    request_id = (await engine.submit(SynthesisRequest(
        text=["One.", "Two.", "Three."], max_frames=3, chunk_schedule=(4,),
        request_id="marks-1"))).request_id
    items = [item async for item in engine.stream(request_id, segments=True)]
    marks = [i for i in items if isinstance(i, SegmentStarted)]
    chunks = [i for i in items if isinstance(i, AudioChunk)]
    assert [m.segment_index for m in marks] == [0, 1, 2]
    total = chunks[-1].frame_end
    starts = [m.start_frame for m in marks]
    assert starts[0] == 0 and starts == sorted(starts) and starts[-1] < total
    if total == 9:  # every segment ran to max_frames (the random model rarely ends one early)
        assert starts == [0, 3, 6]
        assert any(c.frame_start < b < c.frame_end for c in chunks for b in (3, 6))  # spans one
    for mark in marks:  # each mark comes before the chunk that carries its first frame
        carrier = next(i for i, c in enumerate(items)
                       if isinstance(c, AudioChunk) and c.frame_end > mark.start_frame)
        assert items.index(mark) < carrier
    assert [i for i in items if not isinstance(i, AudioChunk)] == marks
    plain = [c async for c in engine.synthesize(SynthesisRequest(
        text=["One.", "Two."], max_frames=2, request_id="marks-2"))]
    assert all(isinstance(c, AudioChunk) for c in plain)  # only asked-for marks
    await _wait_idle(engine)


async def test_in_process_turn_has_a_timed_transcript_per_sentence(engine: AsyncEngine) -> None:
    tts = TTS(max_frames=3, chunk_schedule=[4], seed=0)
    assert tts.capabilities.aligned_transcript
    stream = tts.stream(conn_options=NO_RETRY)
    await _pieces(stream, ["One. Two.", " Three."])
    events = [ev async for ev in stream]
    timed = [t for ev in events for t in ev.frame.userdata.get("lk.timed_transcripts", [])]
    assert [str(t) for t in timed] == ["One. ", "Two. ", "Three. "]
    starts = [t.start_time for t in timed]
    assert starts[0] == 0 and starts == sorted(starts)
    assert all(abs(s / FRAME_S - round(s / FRAME_S)) < 1e-6 for s in starts)  # whole frames
    duration_s = sum(ev.frame.duration for ev in events)
    assert starts[-1] < duration_s
    if duration_s == pytest.approx(9 * FRAME_S):
        assert starts == pytest.approx([0, 3 * FRAME_S, 6 * FRAME_S])
    await tts.aclose()
    await _wait_idle(engine)


async def test_turn_queued_behind_the_running_limit_is_logged_and_counted(
    engine: AsyncEngine, caplog: pytest.LogCaptureFixture
) -> None:
    from breezert.request import SynthesisRequest

    holders = [(await engine.submit(SynthesisRequest(
        text=["Hold."], input_closed=False, max_frames=1, request_id=f"holder-{i}"))).request_id
               for i in range(engine.max_running_requests)]  # open turns hold every slot
    metrics: list[TTSMetrics] = []
    before = engine.metrics()["counters"].get("queued_requests", 0)
    tts = TTS(max_frames=2, seed=0)
    tts.on("metrics_collected", metrics.append)
    with caplog.at_level("INFO"):
        turn = asyncio.ensure_future(tts.synthesize("Queued.", conn_options=NO_RETRY).collect())
        for _ in range(200):
            if any("is queued" in r.getMessage() for r in caplog.records):
                break
            await asyncio.sleep(0.01)
        assert not turn.done()
        for request_id in holders:
            engine.abort(request_id)
        frame = await asyncio.wait_for(turn, 30)
    assert frame.duration > 0
    line, = [r.getMessage() for r in caplog.records if r.name == "breezert_agent"
             and "is queued" in r.getMessage()]
    assert f"{engine.max_running_requests} running-request slots are all taken" in line
    assert engine.metrics()["counters"]["queued_requests"] == before + 1
    assert tts.num_queued_turns == 1
    await asyncio.sleep(0.05)
    assert metrics and metrics[-1].connection_reused  # the shared engine was loaded already
    await tts.aclose()
    await _wait_idle(engine)
