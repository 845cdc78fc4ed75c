"""``AsyncEngine`` on the tiny random model (CPU): concurrent consumers, cancel/abort, failures.

Owns the asyncio contract: chunks stream per request, cancelling or leaving a consumer aborts its
request and frees every resource, failures reach the consumer as ``RequestFailed``, turns grow
through ``append``/``close_input``, and ``aclose`` stops the thread. Must not need a GPU.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from breezert.async_engine import AsyncEngine
from breezert.config import EngineConfig
from breezert.constants import Stage
from breezert.engine import Engine
from breezert.errors import RequestAborted, RequestFailed
from breezert.options import SamplingParams
from breezert.offline import stream_sequential
from breezert.outputs import AudioChunk
from breezert.options import SynthesisOptions
from breezert.request import SynthesisRequest

pytestmark = pytest.mark.integration

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny.toml"
SAMPLING = SamplingParams(temperature=0.9, depth_temperature=0.8)
TIMEOUT_S = 20.0


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(EngineConfig.from_file(CONFIG))


@pytest.fixture
async def aengine(engine: Engine) -> AsyncIterator[AsyncEngine]:
    async_engine = AsyncEngine(engine, idle_wait_s=0.005)
    yield async_engine
    await async_engine.aclose()
    engine.runner.fault_hook = None


def make(request_id: str, frames: int, **kwargs: object) -> SynthesisRequest:
    kwargs.setdefault("text", f"Request {request_id} is speaking now.")
    options = SynthesisOptions(seed=len(request_id) + frames, sampling=SAMPLING)
    return SynthesisRequest(max_frames=frames, ignore_eos=True, request_id=request_id,
                            options=options, **kwargs)  # type: ignore[arg-type]


async def collect(chunks: AsyncIterator[AudioChunk]) -> list[AudioChunk]:
    return [chunk async for chunk in chunks]


async def wait_released(engine: Engine) -> None:
    """Polls until nothing is running and pool, slots and the worker's slot table are free."""
    async def released() -> None:
        while (engine.scheduler.has_work() or engine.runner.slots.num_active
               or engine.block_pool.num_free != engine.block_pool.num_blocks):
            await asyncio.sleep(0.005)

    await asyncio.wait_for(released(), TIMEOUT_S)
    assert engine.scheduler.stats().num_free_slots == engine.config.scheduler.max_running_requests


async def test_eight_concurrent_consumers_complete(aengine: AsyncEngine) -> None:
    requests = [make(f"c{i}", frames=4 + i) for i in range(8)]
    results = await asyncio.wait_for(
        asyncio.gather(*(collect(aengine.synthesize(r)) for r in requests)), TIMEOUT_S)
    for request, chunks in zip(requests, results):
        assert {c.request_id for c in chunks} == {request.request_id}
        assert [c.frame_start for c in chunks[1:]] == [c.frame_end for c in chunks[:-1]]
        assert chunks[0].frame_start == 0 and chunks[-1].frame_end == request.max_frames
        assert chunks[-1].is_final and sum(len(c.pcm) for c in chunks) == 1920 * request.max_frames
    await wait_released(aengine.engine)


async def test_cancelling_the_consumer_aborts_the_request(aengine: AsyncEngine) -> None:
    engine, two_chunks = aengine.engine, asyncio.Event()
    aborted_before = engine.metrics.counters.get("requests_aborted", 0)

    async def consume() -> None:
        async for chunk in aengine.synthesize(make("cancelled", frames=400)):
            if chunk.frame_end >= 3:
                two_chunks.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(two_chunks.wait(), TIMEOUT_S)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_released(engine)
    assert engine.metrics.counters["requests_aborted"] == aborted_before + 1


async def test_breaking_out_early_aborts_the_request(aengine: AsyncEngine) -> None:
    engine = aengine.engine
    aborted_before = engine.metrics.counters.get("requests_aborted", 0)
    async for chunk in aengine.synthesize(make("left", frames=400)):
        assert chunk.frame_start == 0
        break
    # The generator is closed when it is collected (at once in CPython), which aborts.
    await wait_released(engine)
    assert engine.metrics.counters["requests_aborted"] == aborted_before + 1


async def test_failing_request_raises_request_failed(aengine: AsyncEngine) -> None:
    def fault(stage: Stage, request_id: str) -> None:
        if stage is Stage.DEPTH and request_id == "boom":
            raise RuntimeError("injected fault")

    aengine.engine.runner.fault_hook = fault
    healthy = asyncio.ensure_future(collect(aengine.synthesize(make("healthy", frames=6))))
    with pytest.raises(RequestFailed, match="injected fault") as failure:
        await asyncio.wait_for(collect(aengine.synthesize(make("boom", frames=6))), TIMEOUT_S)
    assert failure.value.request_id == "boom" and "depth" in failure.value.reason
    assert (await asyncio.wait_for(healthy, TIMEOUT_S))[-1].frame_end == 6
    await wait_released(aengine.engine)


async def test_append_text_and_close_input_make_a_two_segment_turn(
    aengine: AsyncEngine,
) -> None:
    submitted = await aengine.submit(make("turn", frames=6, text="seg one", input_closed=False))
    request_id = submitted.request_id
    chunks: list[AudioChunk] = []

    async def consume() -> None:
        async for chunk in aengine.stream(request_id):
            if not chunks:
                assert await aengine.append(request_id, "seg two") == 1
                aengine.close_input(request_id)
            chunks.append(chunk)

    await asyncio.wait_for(consume(), TIMEOUT_S)
    assert {c.segment_index for c in chunks} == {0, 1} and chunks[-1].frame_end == 12
    whole = make("turn", frames=6, text=["seg one", "seg two"])
    reference = np.concatenate([c.pcm for c in stream_sequential(aengine.engine.checkpoint, whole)])
    np.testing.assert_allclose(np.concatenate([c.pcm for c in chunks]), reference, atol=1e-5,
                               rtol=0)
    await wait_released(aengine.engine)


async def test_aclose_aborts_open_streams_and_stops_the_thread(aengine: AsyncEngine) -> None:
    first_chunk = asyncio.Event()

    async def consume(chunks: AsyncIterator[AudioChunk]) -> None:
        async for _ in chunks:
            first_chunk.set()

    # An open turn without text (never runnable) and a stream closed right on a chunk, when
    # the engine thread is between two steps.
    idle_turn = await aengine.submit(make("idle", frames=4, text=[], input_closed=False))
    idle = asyncio.ensure_future(collect(aengine.stream(idle_turn.request_id)))
    busy = asyncio.ensure_future(consume(aengine.synthesize(make("busy", frames=400))))
    await asyncio.wait_for(first_chunk.wait(), TIMEOUT_S)
    thread = aengine._thread
    assert thread is not None and aengine.is_running
    await asyncio.wait_for(aengine.aclose(), TIMEOUT_S)
    assert not thread.is_alive() and not aengine.is_running
    for consumer in (idle, busy):  # each hears of it; none waits forever
        with pytest.raises(RequestAborted):
            await asyncio.wait_for(consumer, TIMEOUT_S)
    assert not aengine.engine.has_work()


async def test_abort_before_streaming_drops_the_route(aengine: AsyncEngine) -> None:
    # A caller that submits, then gives up before it streams (a client gone, a barge-in).
    request_id = (await aengine.submit(make("unread", frames=40))).request_id
    aengine.abort(request_id)
    await wait_released(aengine.engine)
    assert request_id not in aengine._routes


async def test_cancelling_submit_during_its_prepare_queues_nothing_and_drops_the_route(
    aengine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The prepare thread queues the request itself: a caller cancelled while that thread
    # tokenizes must not leave the request running with no one to read it.
    import threading

    frontend = aengine.engine.frontend
    entered, release = threading.Event(), threading.Event()
    prepare = frontend.prepare

    def held_prepare(*args: object) -> object:
        entered.set()
        release.wait(TIMEOUT_S)
        return prepare(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(frontend, "prepare", held_prepare)
    added = aengine.engine.metrics.counters.get("requests_added", 0)
    task = asyncio.create_task(aengine.submit(make("withdrawn", frames=40)))
    assert await asyncio.get_running_loop().run_in_executor(None, entered.wait, TIMEOUT_S)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    release.set()
    # the one prepare thread takes requests in order: this one's chunks say it is done with
    # the withdrawn one
    assert await asyncio.wait_for(collect(aengine.synthesize(make("after", frames=2))),
                                  TIMEOUT_S)
    await wait_released(aengine.engine)
    assert aengine.engine.metrics.counters["requests_added"] == added + 1  # "after" alone
    assert "withdrawn" not in aengine._routes


def _submit_from_a_loop_that_closes(aengine: AsyncEngine, request: SynthesisRequest) -> None:
    async def submit() -> None:
        await aengine.submit(request)

    asyncio.run(submit())


async def test_output_for_a_closed_loop_aborts_and_drops_the_route(
    aengine: AsyncEngine,
) -> None:
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, _submit_from_a_loop_that_closes, aengine,
                               make("orphan", frames=40))
    await wait_released(aengine.engine)
    assert "orphan" not in aengine._routes


async def test_engine_fault_fails_every_stream_even_beside_a_closed_loop(
    aengine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    engine = aengine.engine
    is_broken = threading.Event()
    real_step = engine.step

    def step() -> list[object]:
        if is_broken.is_set():
            raise RuntimeError("injected engine fault")
        return real_step()  # type: ignore[return-value]

    monkeypatch.setattr(engine, "step", step)
    # An open turn without text (never produces output) whose consumer's loop has closed.
    await asyncio.get_running_loop().run_in_executor(
        None, _submit_from_a_loop_that_closes, aengine,
        make("closed-loop", frames=4, text=[], input_closed=False))
    consumer = asyncio.ensure_future(collect(aengine.synthesize(make("open-loop", frames=400))))
    while "open-loop" not in aengine._routes:
        await asyncio.sleep(0.005)
    is_broken.set()
    aengine._wake.set()
    try:
        with pytest.raises(RequestFailed):
            await asyncio.wait_for(consumer, TIMEOUT_S)
    finally:
        monkeypatch.undo()
        for request_id in ("closed-loop", "open-loop"):
            engine.abort(request_id)
        engine.step()  # hands the releases to the worker


async def test_the_injected_stall_holds_the_second_chunk_past_the_first_ones_playout(
        aengine: AsyncEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """``BREEZERT_INJECT_STALL_MS`` (the real-time tests' stall, ``make test-stall``): the
    second chunk reaches the consumer no sooner than the first one's audio plus the stall, and
    the audio itself is what the same request gives without it."""
    import time

    async def arrivals(request_id: str) -> tuple[list[float], list[AudioChunk]]:
        times, chunks = [], []
        async for chunk in aengine.synthesize(make(request_id, frames=12)):
            times.append(time.monotonic())
            chunks.append(chunk)
        return times, chunks

    monkeypatch.setenv("BREEZERT_INJECT_STALL_MS", "300")
    times, stalled = await asyncio.wait_for(arrivals("stall"), TIMEOUT_S)
    assert len(stalled) >= 2
    assert times[1] - times[0] >= stalled[0].duration_s + 0.300 - 0.005
    monkeypatch.delenv("BREEZERT_INJECT_STALL_MS")
    _, plain = await asyncio.wait_for(arrivals("stall"), TIMEOUT_S)
    np.testing.assert_array_equal(np.concatenate([c.pcm for c in stalled]),
                                  np.concatenate([c.pcm for c in plain]))
