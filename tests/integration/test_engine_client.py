"""``EngineClient`` conformance: the same checks against ``AsyncEngine`` (the tiny CPU model) and
the one test fake (``tests.fake_engine.FakeEngine``), so a server test on the fake proves what it
would on the engine.

Owns: the protocol's members (same names, same sync/async kinds on both), submit and its
``Submitted`` (owners, prompt tokens, queueing), the three ``Split`` modes, open turns (append,
close), abort, typed errors for bad input, reference audio, health and metrics; and that the
protocol imports without torch. Must not: check audio content (the golden tests do).
"""

from __future__ import annotations

import asyncio
import inspect
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator

import numpy as np
import pytest
from breezert.async_engine import AsyncEngine
from breezert.engine_client import EngineClient, Submitted
from breezert.errors import InvalidRequest, RequestAborted
from breezert.outputs import AudioChunk, SegmentStarted
from breezert.request import SynthesisRequest
from breezert.sched.load import EngineLoad
from breezert.text import Split

from tests.fake_engine import FakeEngine

pytestmark = pytest.mark.integration

LONG = "lorem ipsum dolor sit amet " * 60  # 1,620 ASCII characters: over one prompt's limit
TIMEOUT_S = 20.0


@pytest.fixture(params=["engine", "fake"])
def client(request: pytest.FixtureRequest, engine: AsyncEngine) -> EngineClient:
    if request.param == "engine":
        return engine
    return FakeEngine(first_chunk_s=0.0, speedup=100.0,
                      max_prompt_tokens=engine.engine.frontend.max_prompt_tokens,
                      max_running=engine.max_running_requests)


def make(text: str | list[str], frames: int = 2, **kwargs: object) -> SynthesisRequest:
    request_id = f"conform-{uuid.uuid4().hex[:8]}"
    return SynthesisRequest(text=text, max_frames=frames, ignore_eos=True,  # type: ignore[arg-type]
                            request_id=request_id, **kwargs)


async def drain(items: AsyncIterator[AudioChunk | SegmentStarted]) \
        -> list[AudioChunk | SegmentStarted]:
    return await asyncio.wait_for(_collect(items), TIMEOUT_S)


async def _collect(items: AsyncIterator[AudioChunk | SegmentStarted]) \
        -> list[AudioChunk | SegmentStarted]:
    return [item async for item in items]


async def wait_idle(client: EngineClient) -> None:
    """Until no request holds a slot, a block or a codec slot (the worker frees its codec slot
    on the engine thread, a step after the request ends)."""
    for _ in range(500):
        capacity = client.capacity()
        if capacity.running == capacity.queued == capacity.codec_slots_used == 0 \
                and capacity.kv_blocks_free == capacity.kv_blocks_total:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"still busy: {client.capacity()}")


def _members(cls: type) -> dict[str, str]:
    kinds = {}
    for name, value in vars(cls).items():
        if name.startswith("_"):
            continue
        if isinstance(value, property):
            kinds[name] = "property"
        elif inspect.isasyncgenfunction(value):
            kinds[name] = "stream"
        elif inspect.iscoroutinefunction(value):
            kinds[name] = "async"
        else:
            kinds[name] = "sync"
    return kinds


def test_both_have_every_member_of_the_protocol_of_the_same_kind() -> None:
    protocol = _members(EngineClient)
    assert {"submit", "append", "abort", "stream", "load", "metrics"} <= set(protocol)
    protocol["stream"] = "stream"  # declared as a plain method returning an AsyncIterator
    for implementation in (AsyncEngine, FakeEngine):
        kinds = _members(implementation)
        for name, kind in protocol.items():
            assert kinds.get(name) == kind, (implementation.__name__, name, kinds.get(name))


def test_the_protocol_and_its_callers_import_without_torch() -> None:
    code = ("import sys, breezert.engine_client, breezert.server.app, breezert_agent.client, "
            "tests.fake_engine; assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


async def test_submit_streams_one_segment_to_its_final_chunk(client: EngineClient) -> None:
    request = make("Hello there.", frames=4)
    submitted = await client.submit(request)
    assert isinstance(submitted, Submitted) and submitted.request_id == request.request_id
    assert submitted.segment_owners == (0,) and submitted.num_prompt_tokens > 2
    assert not submitted.is_queued
    items = await drain(client.stream(submitted.request_id, segments=True))
    assert items[0] == SegmentStarted(submitted.request_id, 0, 0)
    chunks = [i for i in items if isinstance(i, AudioChunk)]
    assert [c.frame_start for c in chunks] == [0] + [c.frame_end for c in chunks[:-1]]
    assert chunks[-1].frame_end == 4 and chunks[-1].is_final
    assert not any(c.is_final for c in chunks[:-1])
    assert not client.is_live(submitted.request_id)
    await wait_idle(client)


async def test_split_modes_cut_text_and_say_whose_each_segment_is(client: EngineClient) -> None:
    for split, owners in ((Split.NONE, (0, 1)), (Split.SENTENCES, (0, 0, 1)),
                          (Split.FIT, (0, 1))):
        submitted = await client.submit(make(["One. Two.", "Three."], frames=1), split=split)
        assert submitted.segment_owners == owners, split
        items = await drain(client.stream(submitted.request_id, segments=True))
        marks = [i.segment_index for i in items if isinstance(i, SegmentStarted)]
        assert marks == list(range(len(owners))), split
        plain = await client.submit(make(["One. Two.", "Three."], frames=1), split=split)
        assert all(isinstance(i, AudioChunk) for i in await drain(client.stream(
            plain.request_id)))  # marks only when asked for
    await wait_idle(client)


async def test_text_over_the_token_limit_is_cut_or_refused(client: EngineClient) -> None:
    with pytest.raises(InvalidRequest, match="over the context limit"):
        await client.submit(make(LONG))
    short = await client.submit(make(["Short."], frames=1), split=Split.FIT)
    submitted = await client.submit(make(["Short.", LONG], frames=1), split=Split.FIT)
    owners = submitted.segment_owners
    assert owners[0] == 0 and owners.count(0) == 1 and owners.count(1) >= 2
    assert submitted.num_prompt_tokens > short.num_prompt_tokens * len(owners) // 2
    for request_id in (short.request_id, submitted.request_id):
        await drain(client.stream(request_id))
    await wait_idle(client)


async def test_an_open_turn_takes_text_until_its_input_closes(client: EngineClient) -> None:
    submitted = await client.submit(make(["First."], input_closed=False))
    request_id = submitted.request_id
    consumer = asyncio.ensure_future(drain(client.stream(request_id, segments=True)))
    assert await client.append(request_id, "Second. Third.", split=Split.SENTENCES) == 2
    assert await client.append(request_id, "Fourth.") == 1
    client.close_input(request_id)
    items = await consumer
    marks = [i.segment_index for i in items if isinstance(i, SegmentStarted)]
    chunks = [i for i in items if isinstance(i, AudioChunk)]
    assert marks == [0, 1, 2, 3] and chunks[-1].frame_end == 8 and chunks[-1].is_final
    with pytest.raises(InvalidRequest):
        await client.append(request_id, "Too late.")
    await wait_idle(client)


async def test_abort_ends_the_stream_and_frees_the_request(client: EngineClient) -> None:
    submitted = await client.submit(make("A long one to cut short.", frames=400))
    stream = client.stream(submitted.request_id)
    first = await asyncio.wait_for(anext(stream), TIMEOUT_S)
    assert isinstance(first, AudioChunk)
    client.abort(submitted.request_id)
    with pytest.raises(RequestAborted):
        await asyncio.wait_for(_collect(stream), TIMEOUT_S)
    assert not client.is_live(submitted.request_id)
    client.abort(submitted.request_id)  # again: a no-op
    await wait_idle(client)


async def test_bad_input_is_a_typed_error_naming_the_field(client: EngineClient) -> None:
    with pytest.raises(InvalidRequest, match="not running"):
        await client.append("no-such-request", "Hello.")
    submitted = await client.submit(make("Hello.", frames=1))
    with pytest.raises(InvalidRequest, match="buffered_s"):
        client.report_playback(submitted.request_id, -1.0, 0.0, "test")
    await drain(client.stream(submitted.request_id))
    tone = np.sin(np.arange(24000) / 16000 * 2 * np.pi * 220).astype(np.float32)
    with pytest.raises(InvalidRequest, match="reference_text"):
        await client.encode_reference(tone, 16000, "  ")
    reference = await client.encode_reference(tone, 16000, "A reference.")
    assert reference.ref_text == "A reference." and reference.num_frames == 19
    await wait_idle(client)


async def test_health_capacity_and_metrics(client: EngineClient) -> None:
    before = client.metrics()["counters"].get("requests_added", 0)
    submitted = await client.submit(make("Counted.", frames=1))
    await drain(client.stream(submitted.request_id))
    await wait_idle(client)
    assert client.is_running
    snapshot = client.metrics()
    assert snapshot["counters"]["requests_added"] == before + 1
    assert snapshot["counters"]["requests_finished"] >= 1
    assert sum(snapshot["ttfb_histogram"]["counts"]) == snapshot["ttfb_s"]["count"] >= 1
    capacity = client.capacity()
    assert capacity.free_slots == capacity.max_running > 0 and capacity.codec_slots_used == 0
    assert capacity.kv_blocks_free == capacity.kv_blocks_total > 0
    load = client.load()
    assert isinstance(load, EngineLoad) and load.fraction == 0.0
    assert load.max_running == capacity.max_running
