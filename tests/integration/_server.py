"""Shared helpers of the server tests: one tiny CPU engine per module, an app on a real port.

Owns: the engine fixture factory, ``serve`` (the aiohttp app on a random port through aiohttp's
test server), ``wait_idle`` (the engine's slots and KV blocks all free again) and
``record_refusals`` (the scheduler's ``EngineOverloaded`` refusals, as raised); the stand-in
engine for transport-only checks is ``tests.fake_engine.FakeEngine``. Not a test module; the
server test modules import it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from breezert.async_engine import AsyncEngine
from breezert.config import EngineConfig, ServingConfig
from breezert.engine_client import EngineClient
from breezert.errors import EngineOverloaded
from breezert.profiles import EMBEDDED_PROFILE, profile_path
from breezert.server.app import create_app
from breezert.server.state import STATE, ServerState

CONFIG = profile_path(EMBEDDED_PROFILE)
FRAMES_PER_TURN = 12
"""Every test turn is exactly this many codec frames (80 ms each): 0.96 s of audio."""
REQUEST_OPTIONS = {"max_frames": FRAMES_PER_TURN, "ignore_eos": True}
SAMPLES_PER_FRAME = 1920  # 24 kHz
TURN_BYTES = FRAMES_PER_TURN * SAMPLES_PER_FRAME * 2  # one turn of 16-bit PCM


def make_engine() -> AsyncEngine:
    return AsyncEngine.from_config(EngineConfig.from_file(CONFIG), idle_wait_s=0.005)


def close_engine(engine: AsyncEngine) -> None:
    asyncio.run(engine.aclose())


@contextlib.asynccontextmanager
async def serve(
    engine: EngineClient,
    *,
    host: str = "127.0.0.1",
    serving: Mapping[str, Any] | None = None,
    request_options: Mapping[str, Any] | None = None,
    warmup: bool = True,
    **kwargs: Any,
) -> AsyncIterator[tuple[str, web.Application]]:
    """Runs the app on ``host`` and a free port; yields (base URL, app) once it is ready."""
    config = ServingConfig(host=host, port=0, **dict(serving or {}))
    options = REQUEST_OPTIONS if request_options is None else request_options
    app = create_app(engine, config, request_options=options, warmup=warmup, **kwargs)
    server = TestServer(app, host=host, port=0)
    await server.start_server()
    for _ in range(500):
        if app[STATE].is_ready or app[STATE].warmup_error:
            break
        await asyncio.sleep(0.01)
    assert app[STATE].is_ready, app[STATE].warmup_error or "warm-up took over 5 s"
    try:
        yield str(server.make_url("")).rstrip("/"), app
    finally:
        await server.close()


def state_of(app: web.Application) -> ServerState:
    return app[STATE]


async def wait_idle(engine: AsyncEngine, timeout_s: float = 5.0) -> None:
    """Waits until no request holds a slot or a KV block (raises on timeout)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        stats = engine.engine.scheduler.stats()
        max_slots = engine.engine.config.scheduler.max_running_requests
        if (stats.num_running == 0 and stats.num_waiting == 0
                and stats.num_free_blocks == stats.num_blocks
                and stats.num_free_slots == max_slots):
            return
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"engine still busy after {timeout_s} s: {stats}")
        await asyncio.sleep(0.02)


def record_refusals(engine: AsyncEngine,
                    monkeypatch: pytest.MonkeyPatch) -> list[EngineOverloaded]:
    """The refusals ``engine``'s scheduler raises from ``add_request`` from now on (each
    re-raised: the caller still gets it), to compare with what a client was told."""
    scheduler = engine.engine.scheduler
    refusals: list[EngineOverloaded] = []
    add_request = scheduler.add_request

    def recording_add_request(request, now):  # type: ignore[no-untyped-def]
        try:
            add_request(request, now)
        except EngineOverloaded as exc:
            refusals.append(exc)
            raise

    monkeypatch.setattr(scheduler, "add_request", recording_add_request)
    return refusals


async def recvonly_offer() -> str:
    """A browser-like offer SDP (recvonly audio, a ``control`` DataChannel, loopback candidates)
    from a peer closed at once: the server's answer is never applied, so it never connects."""
    from aiortc import RTCConfiguration, RTCPeerConnection
    from breezert.server.ice import HostAddresses, host_addresses

    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    pc.addTransceiver("audio", direction="recvonly")
    pc.createDataChannel("control")
    with host_addresses(HostAddresses(only=("127.0.0.1",))):
        await pc.setLocalDescription(await pc.createOffer())
    sdp = pc.localDescription.sdp
    await pc.close()
    return sdp


async def ws_turn(
    ws: aiohttp.ClientWebSocketResponse, final: tuple[str, ...] = ("turn_done",)
) -> tuple[list[dict[str, Any]], bytes]:
    """A WebSocket turn's JSON events and binary audio, up to the first event of a type in
    ``final`` (20 s per message at most)."""
    events: list[dict[str, Any]] = []
    audio = b""
    while True:
        msg = await asyncio.wait_for(ws.receive(), 20)
        if msg.type == aiohttp.WSMsgType.BINARY:
            audio += msg.data
            continue
        events.append(json.loads(msg.data))
        if events[-1]["type"] in final:
            return events, audio
