"""Admission by real-time capacity over HTTP (tiny CPU engine, ``scheduler.admission_capacity``
fixed at one stream): past capacity a request gets 503 ``overloaded`` at once, naming the
real-time capacity, with ``Retry-After`` its predicted wait (when the running stream finishes
generating), while free slots stand by, and a WebSocket ``say`` an ``overloaded`` error event with
``retry_after_s``; meanwhile ``/readyz`` says ``full`` and ``/metrics`` the demand against its
limit; the admitted stream completes; afterwards every slot, KV block and codec slot
is free and the engine admits again."""

from __future__ import annotations

import asyncio
import json
import math
import threading
from collections import Counter
from collections.abc import Iterator

import aiohttp
import pytest
from breezert.async_engine import AsyncEngine
from breezert.config import EngineConfig
from breezert.constants import Stage
from breezert.errors import EngineOverloaded

from tests.integration._server import (
    CONFIG,
    SAMPLES_PER_FRAME,
    close_engine,
    record_refusals,
    serve,
    wait_idle,
)
from tests.integration.test_server_ops import gauges

pytestmark = pytest.mark.integration

FRAMES = 24
"""Each request: 1.92 s of audio."""
HELD_AT = 4
"""The holder's DEPTH item at which the engine thread waits until the checks are done: the
holder stays mid-generation (its real-time demand and its wait frozen), however fast the box."""


class Hold:
    """A fault hook that holds the engine thread at a request's ``HELD_AT``-th DEPTH item until
    ``release`` (at most ``TIMEOUT_S``); requests, loads and scrapes go on meanwhile (they take
    the engine lock, which a running step does not hold)."""

    TIMEOUT_S = 30.0

    def __init__(self) -> None:
        self._gate = threading.Event()
        self._depth_items: Counter[str] = Counter()

    def __call__(self, stage: Stage, request_id: str) -> None:
        if stage is Stage.DEPTH:
            self._depth_items[request_id] += 1
            if self._depth_items[request_id] == HELD_AT:
                self._gate.wait(self.TIMEOUT_S)

    def release(self) -> None:
        self._gate.set()


@pytest.fixture(scope="module")
def engine() -> Iterator[AsyncEngine]:
    data = EngineConfig.from_file(CONFIG).model_dump()
    # one stream's worth of capacity, fixed (the learned figure would follow this machine's
    # load); any predicted wait is too long: every request past capacity is refused at once
    data["scheduler"].update(admission_capacity=1.0, admission_headroom=1.0,
                             admission_learn_window_s=0, max_queue_wait_s=0.001)
    engine = AsyncEngine.from_config(EngineConfig.from_dict(data), idle_wait_s=0.005)
    yield engine
    close_engine(engine)


async def test_past_real_time_capacity_a_request_gets_503_while_the_admitted_one_completes(
    engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch,
) -> None:
    refusals = record_refusals(engine, monkeypatch)
    hold = Hold()
    try:
        await _overload_and_recover(engine, hold, refusals)
    finally:
        hold.release()
        engine.engine.runner.fault_hook = None
    assert len(refusals) == 2
    assert engine.engine.metrics.counters["requests_refused_capacity"] == 2


async def _overload_and_recover(engine: AsyncEngine, hold: Hold,
                                refusals: list[EngineOverloaded]) -> None:
    scheduler = engine.engine.scheduler
    speech = {"input": "Hold on.", "response_format": "pcm"}
    async with serve(engine, request_options={"max_frames": FRAMES, "ignore_eos": True}) as (
            url, _), aiohttp.ClientSession() as http:
        engine.engine.runner.fault_hook = hold  # after the warm-up request
        async with http.post(f"{url}/v1/audio/speech", json=speech) as holder:
            assert holder.status == 200
            first = await holder.content.readexactly(2 * SAMPLES_PER_FRAME)  # it generates,
            # then waits at its HELD_AT-th frame
            assert scheduler.num_running == 1
            async with http.post(f"{url}/v1/audio/speech", json=speech) as late:
                body = await late.json()
                assert late.status == 503 and body["error"]["code"] == "overloaded", body
                assert "real-time capacity" in body["error"]["message"], body
                retry_after = late.headers["Retry-After"]
            (refusal,) = refusals  # refused inside add_request: it never queued
            assert refusal.reason == "capacity" and refusal.retry_after_s is not None
            assert retry_after == str(max(1, math.ceil(refusal.retry_after_s)))
            # a WebSocket turn is refused alike: an error event with the wait in whole seconds
            ws = await http.ws_connect(f"{url}/v1/audio/speech/stream")
            assert json.loads((await ws.receive()).data)["type"] == "ready"
            await ws.send_json({"type": "say", "text": "Me too."})
            error = json.loads((await ws.receive()).data)
            await ws.close()
            assert (error["type"], error["code"]) == ("error", "overloaded"), error
            assert "real-time capacity" in error["message"]
            assert len(refusals) == 2 and refusals[1].retry_after_s is not None
            assert error["retry_after_s"] == max(1, math.ceil(refusals[1].retry_after_s))
            assert scheduler.num_waiting == 0
            assert scheduler.stats().num_free_slots == scheduler.config.max_running_requests - 1
            # readiness steers new callers away meanwhile, and the gauges say why
            async with http.get(f"{url}/readyz") as ready:
                body = await ready.json()
            assert ready.status == 503 and body["status"] == "full", body
            assert body["load"]["realtime_limit"] == 1.0 and body["load"]["realtime_demand"] > 0
            metrics = gauges(await (await http.get(f"{url}/metrics")).text())
            assert metrics['breezert_realtime_audio{kind="limit"}'] == 1.0
            assert metrics['breezert_realtime_audio{kind="demand"}'] > 0
            hold.release()
            rest = await holder.content.read()  # the admitted stream runs to its end
        assert len(first) + len(rest) == FRAMES * SAMPLES_PER_FRAME * 2
        await wait_idle(engine, timeout_s=10.0)
        for _ in range(500):  # the worker hears of the release with the idle loop's next turn
            if not engine.engine.runner.slots.num_active:
                break
            await asyncio.sleep(0.02)
        capacity = engine.engine.capacity()
        assert (capacity.running, capacity.queued, capacity.codec_slots_used) == (0, 0, 0)
        assert capacity.free_slots == capacity.max_running
        assert capacity.kv_blocks_free == capacity.kv_blocks_total
        metrics = gauges(await (await http.get(f"{url}/metrics")).text())
        assert metrics['breezert_realtime_audio{kind="demand"}'] == 0.0
        async with http.post(f"{url}/v1/audio/speech", json=speech) as again:
            assert again.status == 200  # room again: admitted
            assert len(await again.read()) == FRAMES * SAMPLES_PER_FRAME * 2
