"""Past capacity over HTTP (tiny CPU engine): a request whose predicted wait for a slot is longer
than ``scheduler.max_queue_wait_s`` gets 503 ``overloaded`` at once, never a queue, with
``Retry-After`` the scheduler's predicted wait (from the running requests' remaining audio), not
the fixed ``serving.retry_after_s``."""

from __future__ import annotations

import contextlib
import math

import aiohttp
import pytest
from breezert.async_engine import AsyncEngine

from tests.integration._server import SAMPLES_PER_FRAME, record_refusals, serve, wait_idle

pytestmark = pytest.mark.integration

LONG = {"max_frames": 300, "ignore_eos": True}
"""Every request: 24 s of audio, so the slot holders are still running when the newcomer comes."""


async def test_past_capacity_a_request_gets_503_at_once_with_the_predicted_wait(
    engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch,
) -> None:
    scheduler = engine.engine.scheduler
    saved = scheduler.config
    slots = saved.max_running_requests
    refusals = record_refusals(engine, monkeypatch)
    scheduler.config = saved.model_copy(update={"max_queue_wait_s": 0.2})
    try:
        async with serve(engine, serving={"retry_after_s": 37}, request_options=LONG) as (
                url, _), aiohttp.ClientSession() as http, contextlib.AsyncExitStack() as holders:
            # an EOS ends a segment only without ignore_eos: the wait needs a learned length
            # there, so every request here runs to its max_frames and its end is known
            for _ in range(slots):
                r = await holders.enter_async_context(http.post(
                    f"{url}/v1/audio/speech", json={"input": "Hold on.",
                                                    "response_format": "pcm"}))
                assert r.status == 200
                await r.content.readexactly(2 * SAMPLES_PER_FRAME)  # it generates
            assert scheduler.num_running == slots
            async with http.post(f"{url}/v1/audio/speech",
                                 json={"input": "Me next.", "response_format": "pcm"}) as r:
                body = await r.json()
                assert r.status == 503 and body["error"]["code"] == "overloaded", body
                assert "predicted wait for a slot" in body["error"]["message"]
                retry_after = r.headers["Retry-After"]
            (refusal,) = refusals  # refused inside add_request: it never queued
            assert refusal.retry_after_s is not None and refusal.retry_after_s > 0.2
            assert retry_after == str(max(1, math.ceil(refusal.retry_after_s)))
            assert scheduler.num_waiting == 0 and scheduler.num_running == slots
    finally:
        scheduler.config = saved
    await wait_idle(engine, timeout_s=10.0)  # the holders' connections closed: all aborted
