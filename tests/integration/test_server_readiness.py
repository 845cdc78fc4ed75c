"""``/readyz`` reports the engine's load and turns 503 ``full`` at capacity (tiny CPU engine).

Owns: the ``load`` body of ``/readyz``, the 503 ``full`` while every running slot is taken (and
back to 200 once one frees), ``/v1/`` still taking work meanwhile, and the ``breezert_load``
gauge. Draining and start-up are ``test_server_ops``'s.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
from breezert.async_engine import AsyncEngine
from breezert.request import SynthesisRequest

from tests.integration._server import serve, wait_idle
from tests.integration.test_server_ops import scrape

pytestmark = pytest.mark.integration


async def readyz(http: aiohttp.ClientSession, url: str) -> tuple[int, dict[str, Any]]:
    async with http.get(f"{url}/readyz") as r:
        return r.status, await r.json()


async def hold(engine: AsyncEngine, n: int, tag: str) -> list[str]:
    """``n`` open turns that said one frame: each holds its running slot, then costs no steps
    (a turn with no text yet is not admitted: it would hold nothing)."""
    return [(await engine.submit(SynthesisRequest(
        text=["Hold."], max_frames=1, input_closed=False, request_id=f"{tag}-{i}"))).request_id
            for i in range(n)]


async def test_readyz_reports_load_and_is_503_full_at_capacity(engine: AsyncEngine) -> None:
    slots = engine.max_running_requests
    async with serve(engine) as (url, _), aiohttp.ClientSession() as http:
        status, body = await readyz(http, url)
        assert status == 200 and body["status"] == "ready"
        assert body["load"] == {"fraction": 0.0, "running": 0, "queued": 0,
                                "max_running": slots, "max_queued": 32}
        held = await hold(engine, slots - 1, "part")
        status, body = await readyz(http, url)
        assert status == 200 and body["load"]["running"] == slots - 1
        assert body["load"]["fraction"] == pytest.approx((slots - 1) / slots, abs=1e-4)

        held += await hold(engine, 1, "last")  # every slot taken: route new work elsewhere
        status, body = await readyz(http, url)
        assert status == 503 and body["status"] == "full" and body["ready"] is False
        assert body["load"]["fraction"] == 1.0 and body["load"]["running"] == slots
        assert (await scrape(http, url))["breezert_load"] == 1.0
        async with http.get(f"{url}/readyz") as r:
            assert r.headers["Retry-After"] == "2"
        # readiness steers routing; the engine still admits work (it queues)
        async def speech() -> tuple[int, bytes]:
            async with http.post(f"{url}/v1/audio/speech",
                                 json={"input": "Queued.", "response_format": "pcm"}) as r:
                return r.status, await r.read()

        queued = asyncio.create_task(speech())
        for _ in range(200):
            if engine.num_waiting:
                break
            await asyncio.sleep(0.01)
        assert engine.num_waiting == 1 and not queued.done()
        engine.abort(held.pop())  # a slot frees: the queued request runs
        status, pcm = await asyncio.wait_for(queued, 20)
        assert status == 200 and len(pcm) > 0

        for request_id in held:
            engine.abort(request_id)
        await wait_idle(engine)
        status, body = await readyz(http, url)
        assert status == 200 and body["load"]["fraction"] == 0.0
        assert (await scrape(http, url))["breezert_load"] == 0.0
