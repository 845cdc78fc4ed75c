"""Nothing leaks at 256 running requests (issue 31), on the tiny random model (CPU).

Owns: 256 requests at once on an engine with ``max_running_requests = 256`` and per-step limits
of 256 requests / 512 rows, half of them aborted mid-stream (after their first chunk), the rest
run to their end; and 256 requests under admission by real-time capacity (64 streams' worth:
the rest queue, one more is refused), every one aborted while running or queued. Afterwards
every running slot, KV block and codec (slot-table) slot is free and the engine still serves.
Small ``max_frames`` keep it to seconds on two cores.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from breezert.async_engine import AsyncEngine
from breezert.config import EngineConfig
from breezert.constants import Stage
from breezert.engine import Engine
from breezert.errors import EngineOverloaded, RequestAborted
from breezert.options import SynthesisOptions
from breezert.request import SynthesisRequest

pytestmark = pytest.mark.integration

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny.toml"
STREAMS = 256
FRAMES = 6  # chunks of 1, 2 and 3 frames: an abort after the first lands mid-stream
TIMEOUT_S = 60.0


def _engine(**scheduler: object) -> Engine:
    data = EngineConfig.from_file(CONFIG).model_dump()
    data["cache"]["num_blocks"] = 8192
    data["scheduler"].update(
        max_running_requests=STREAMS, max_queued_requests=0, max_model_len=256,
        max_text_encode_requests=64, max_text_encode_tokens=8192, max_prefill_requests=64,
        max_prefill_tokens=8192, max_decode_requests=STREAMS, max_decode_rows=2 * STREAMS,
        max_depth_requests=STREAMS, max_depth_rows=2 * STREAMS, max_codec_requests=STREAMS,
        max_codec_step_frames=STREAMS * FRAMES, max_startup_codec_step_frames=STREAMS)
    data["scheduler"].update(scheduler)
    return Engine(EngineConfig.from_dict(data))


def _request(i: int, frames: int = FRAMES) -> SynthesisRequest:
    return SynthesisRequest(f"Caller {i} says hi.", options=SynthesisOptions(seed=i),
                            max_frames=frames, ignore_eos=True, request_id=f"r{i}")


async def test_256_streams_with_half_aborted_mid_stream_leave_nothing_behind() -> None:
    engine = _engine()
    async_engine = AsyncEngine(engine, idle_wait_s=0.005)
    start = time.monotonic()
    try:
        submitted = [await async_engine.submit(_request(i)) for i in range(STREAMS)]
        assert engine.scheduler.num_running == STREAMS  # all admitted: slots and KV blocks

        async def consume(i: int) -> tuple[str, int]:
            frames = 0
            stream = async_engine.stream(submitted[i].request_id)
            try:
                async for chunk in stream:
                    frames = chunk.frame_end
                    if i % 2 and frames < FRAMES:  # odd callers hang up mid-stream
                        async_engine.abort(submitted[i].request_id)
            except RequestAborted:
                return "aborted", frames
            return "finished", frames

        outcomes = await asyncio.wait_for(
            asyncio.gather(*(consume(i) for i in range(STREAMS))), TIMEOUT_S)
        for i, (status, frames) in enumerate(outcomes):
            if i % 2:
                assert status == "aborted" and 0 < frames < FRAMES, (i, status, frames)
            else:
                assert (status, frames) == ("finished", FRAMES), (i, status, frames)

        await _assert_idle_and_serving(engine, async_engine)
    finally:
        await async_engine.aclose()
    print(f"256 streams, half aborted: {time.monotonic() - start:.1f} s")


async def _assert_idle_and_serving(engine: Engine, async_engine: AsyncEngine) -> None:
    """Every slot, KV block and codec slot comes back, and the freed slots serve again."""

    async def released() -> None:
        while engine.scheduler.has_work() or engine.runner.slots.num_active:
            await asyncio.sleep(0.01)

    await asyncio.wait_for(released(), TIMEOUT_S)
    capacity = engine.capacity()
    assert (capacity.running, capacity.queued, capacity.codec_slots_used) == (0, 0, 0)
    assert capacity.free_slots == STREAMS
    assert capacity.kv_blocks_free == capacity.kv_blocks_total == 8192
    again = await async_engine.submit(_request(STREAMS))
    chunks = [c async for c in async_engine.stream(again.request_id)]
    assert chunks[-1].frame_end == FRAMES


ADMITTED = 64
"""Streams the real-time capacity admits (64 s/s at full headroom): the engine thread waits at
its first DEPTH step until all are in, so each needs exactly 1 s/s (no frame, no buffer)."""
LONG = 200
"""Frames of each request there: all are aborted mid-stream."""


async def test_256_streams_running_or_queued_for_capacity_all_aborted_leave_nothing() -> None:
    engine = _engine(admission_capacity=float(ADMITTED), admission_headroom=1.0,
                     admission_learn_window_s=0, max_queued_requests=STREAMS - ADMITTED,
                     max_queue_wait_s=None)
    async_engine = AsyncEngine(engine, idle_wait_s=0.005)
    depth = threading.Event()
    engine.runner.fault_hook = lambda stage, _: (
        depth.wait(TIMEOUT_S) if stage is Stage.DEPTH else None)
    start = time.monotonic()
    try:
        submitted = [await async_engine.submit(_request(i, LONG)) for i in range(STREAMS)]
        assert (engine.scheduler.num_running, engine.scheduler.num_waiting) == (
            ADMITTED, STREAMS - ADMITTED)  # capacity, not the 256 slots, stopped admission
        with pytest.raises(EngineOverloaded, match="max_queued_requests") as refused:
            await async_engine.submit(_request(STREAMS + 1, LONG))
        assert refused.value.reason == "queue_full"
        depth.set()
        audio = asyncio.Event()

        async def outcome(request_id: str) -> str:
            try:
                async for _ in async_engine.stream(request_id):
                    audio.set()
            except RequestAborted:
                return "aborted"
            return "finished"

        tasks = [asyncio.create_task(outcome(s.request_id)) for s in submitted]
        await asyncio.wait_for(audio.wait(), TIMEOUT_S)  # the running ones run
        for s in submitted:  # every caller hangs up: running, or still queued for capacity
            async_engine.abort(s.request_id)

        outcomes = await asyncio.wait_for(asyncio.gather(*tasks), TIMEOUT_S)
        assert outcomes == ["aborted"] * STREAMS  # running or queued, none had finished
        await _assert_idle_and_serving(engine, async_engine)
    finally:
        depth.set()
        await async_engine.aclose()
    print(f"256 streams, 64 admitted by capacity, all aborted: {time.monotonic() - start:.1f} s")
