"""Operator surface on the tiny CPU model: capacity gauges on ``/metrics``, ``Retry-After`` on
every 503, ``/readyz`` start-up progress and draining, the drain (idle sockets closed at once,
running turns finished) and SIGTERM of ``breezert serve`` within ``serving.shutdown_grace_s``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from breezert.async_engine import AsyncEngine
from breezert_bench.ports import free_port
from breezert.config import ServingConfig
from breezert.server import health
from breezert.server.app import create_app

from tests.fake_engine import FakeEngine
from tests.integration._server import CONFIG, REQUEST_OPTIONS, serve, wait_idle, ws_turn

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


def gauges(text: str) -> dict[str, float]:
    """``name{labels}`` -> value of every sample line."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


async def scrape(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with http.get(f"{url}/metrics") as r:
        assert r.status == 200
        return gauges(await r.text())


IDLE = {
    "breezert_running_requests": 0, "breezert_queued_requests": 0,
    'breezert_kv_blocks{state="used"}': 0, 'breezert_codec_slots{state="used"}': 0,
    'breezert_open_turns{kind="websocket"}': 0, 'breezert_open_turns{kind="webrtc"}': 0,
    'breezert_turn_controllers{kind="websocket"}': 0, "breezert_webrtc_peers": 0,
}


async def test_capacity_gauges_follow_an_open_turn(engine: AsyncEngine) -> None:
    async with serve(engine) as (url, _), aiohttp.ClientSession() as http:
        idle = await scrape(http, url)
        for name, value in IDLE.items():
            assert idle[name] == value, name
        assert idle['breezert_kv_blocks{state="free"}'] == idle["breezert_kv_blocks_total"] > 0
        assert idle['breezert_codec_slots{state="free"}'] == 8
        assert idle["process_resident_memory_bytes"] > 10e6
        ws = await http.ws_connect(f"{url}/v1/audio/speech/stream")
        await ws.receive()  # ready
        await ws.send_json({"type": "say", "text": "An open turn", "more": True})
        await ws_turn(ws, final=("first_audio",))
        busy = await scrape(http, url)
        assert busy["breezert_running_requests"] == 1
        assert busy['breezert_kv_blocks{state="used"}'] > 0
        assert busy['breezert_codec_slots{state="used"}'] == 1
        assert busy['breezert_open_turns{kind="websocket"}'] == 1
        assert busy['breezert_turn_controllers{kind="websocket"}'] == 1
        await ws.close()
        await wait_idle(engine)
        for _ in range(100):
            after = await scrape(http, url)
            if all(after[name] == value for name, value in IDLE.items()):
                break
            await asyncio.sleep(0.05)
        for name, value in IDLE.items():
            assert after[name] == value, name


async def test_retry_after_on_overload_not_ready_and_draining(engine: AsyncEngine) -> None:
    async with serve(FakeEngine(is_overloaded=True), warmup=False) as (url, _), \
            aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/audio/speech", json={"input": "Hi"}) as r:
            assert r.status == 503 and r.headers["Retry-After"] == "2"
    # not ready: the engine is still being built
    release = threading.Event()

    def build(progress: Any) -> AsyncEngine:
        for i in range(4):
            progress("capturing graphs", i, 3, f"decode ({i}, 256)")
        release.wait(10)
        return engine

    app = create_app(None, ServingConfig(port=0), request_options=REQUEST_OPTIONS)
    health.build_engine_in_background(app, build)
    server = TestServer(app, host="127.0.0.1", port=0)
    await server.start_server()
    url = str(server.make_url("")).rstrip("/")
    try:
        async with aiohttp.ClientSession() as http:
            for _ in range(100):
                async with http.get(f"{url}/readyz") as r:
                    body = await r.json()
                    assert r.status == 503 and r.headers["Retry-After"] == "2"
                if body.get("done") == 3:
                    break
                await asyncio.sleep(0.02)
            assert body["ready"] is False and body["phase"] == "capturing graphs"
            assert (body["done"], body["total"]) == (3, 3)
            async with http.post(f"{url}/v1/audio/speech", json={"input": "Hi"}) as r:
                assert r.status == 503 and r.headers["Retry-After"] == "2"
                assert (await r.json())["error"]["code"] == "not_ready"
            release.set()
            for _ in range(500):
                async with http.get(f"{url}/readyz") as r:
                    if r.status == 200:
                        break
                    body = await r.json()
                await asyncio.sleep(0.01)
            assert r.status == 200, body
            assert body["phase"] in ("capturing graphs", "warming up")
            async with http.post(f"{url}/v1/audio/speech", json={"input": "Hi"}) as r:
                assert r.status == 200
                await r.read()
            # draining: /readyz and new work get 503 with Retry-After
            app[health.LIFECYCLE].draining = True
            async with http.get(f"{url}/readyz") as r:
                assert r.status == 503 and r.headers["Retry-After"] == "2"
                assert (await r.json())["status"] == "draining"
            async with http.post(f"{url}/v1/audio/speech", json={"input": "Hi"}) as r:
                assert r.status == 503 and r.headers["Retry-After"] == "2"
                assert (await r.json())["error"]["code"] == "draining"
            async with http.get(f"{url}/healthz") as r:
                assert r.status == 200
    finally:
        release.set()
        await server.close()


async def test_drain_closes_idle_sockets_at_once_and_lets_a_turn_finish(
        engine: AsyncEngine) -> None:
    async with serve(engine) as (url, app), aiohttp.ClientSession() as http:
        idle = await http.ws_connect(f"{url}/v1/audio/speech/stream")
        busy = await http.ws_connect(f"{url}/v1/audio/speech/stream")
        await idle.receive()
        await busy.receive()
        await busy.send_json({"type": "say", "text": "Finish this turn."})
        await ws_turn(busy, final=("turn_started",))
        start = time.monotonic()
        drain = asyncio.create_task(health.drain(app, grace_s=20.0))
        closed = await asyncio.wait_for(idle.receive(), 2)
        assert closed.type == aiohttp.WSMsgType.CLOSE and closed.data == 1001
        assert time.monotonic() - start < 1.0
        events, audio = await ws_turn(busy)
        assert events[-1]["status"] == "finished" and audio
        assert (await asyncio.wait_for(busy.receive(), 5)).type == aiohttp.WSMsgType.CLOSE
        summary = await asyncio.wait_for(drain, 5)
        assert summary["closed_idle"] == 2 and not any(summary["left_running"].values())
        await wait_idle(engine)


def test_sigterm_with_an_idle_websocket_exits_within_the_grace() -> None:
    """Before: 47-49 s (aiohttp waited on the open socket). Now the idle socket is closed at
    once (1001) and the whole exit (drain, handler shutdown, engine close) stays under the
    default grace (10 s); the console showed the start-up phases."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO / "runtime"), str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "breezert.cli", "serve", "--config", str(CONFIG),
         "--port", str(port)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)
    url = f"http://127.0.0.1:{port}"

    async def run() -> tuple[float, Any, float]:
        async with aiohttp.ClientSession() as http:
            for _ in range(600):
                try:
                    async with http.get(f"{url}/readyz") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientConnectionError:
                    pass
                await asyncio.sleep(0.1)
            ws = await http.ws_connect(f"{url}/v1/audio/speech/stream")
            await ws.receive()
            start = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            msg = await asyncio.wait_for(ws.receive(), 30)
            closed_after = time.monotonic() - start
            while proc.poll() is None and time.monotonic() - start < 30:
                await asyncio.sleep(0.05)
            return closed_after, msg.type, time.monotonic() - start

    try:
        closed_after, kind, exited_after = asyncio.run(run())
    finally:
        if proc.poll() is None:
            proc.kill()
        output = proc.communicate()[0]
    assert exited_after < 10.0, f"SIGTERM with an idle WebSocket took {exited_after:.1f} s"
    assert kind == aiohttp.WSMsgType.CLOSE and closed_after < 1.0, (kind, closed_after)
    assert proc.returncode == 0, output
    assert "loading weights" in output and "warming up" in output, output
    assert "drained in" in output, output
