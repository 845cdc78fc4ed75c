"""``/healthz`` (the process and engine loop are alive) and ``/readyz`` (warmed up, serving).

Owns: the startup warm-up request that gates readiness. Must not: run anything per probe beyond
reading state; probes are cheap and unauthenticated.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from aiohttp import web

from breezert.request import SynthesisRequest
from breezert.server.state import STATE, ServerState

logger = logging.getLogger("breezert.server")
WARMUP_KEY = web.AppKey("breezert_warmup", asyncio.Task)


def setup(app: web.Application, *, warmup: bool) -> None:
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    if warmup:
        app.cleanup_ctx.append(_warmup_ctx)
    else:
        app[STATE].is_ready = True


async def healthz(request: web.Request) -> web.Response:
    state = request.app[STATE]
    engine_ok = getattr(state.engine, "is_running", True) or not state.is_ready
    if state.warmup_error is not None or not engine_ok:
        reason = state.warmup_error or "the engine loop has stopped"
        return web.json_response({"status": "unhealthy", "reason": reason}, status=503)
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.warmup_error is not None:
        return web.json_response({"status": "failed", "reason": state.warmup_error}, status=503)
    if not state.is_ready:
        return web.json_response({"status": "warming_up"}, status=503)
    if not getattr(state.engine, "is_running", True):
        return web.json_response({"status": "failed", "reason": "engine loop stopped"},
                                 status=503)
    return web.json_response({"status": "ready", "peers": len(state.peers)})


async def warm_up(state: ServerState) -> None:
    """One short request through every stage (text encode, prefill, decode, depth, codec)."""
    request = SynthesisRequest("Warm up.", max_frames=2, ignore_eos=True)
    try:
        async for _ in state.engine.synthesize(request):
            pass
    except Exception as exc:
        state.warmup_error = f"warm-up request failed: {type(exc).__name__}: {exc}"
        logger.exception("warm-up failed")
        return
    state.is_ready = True
    logger.info("engine warmed up; ready")


async def _warmup_ctx(app: web.Application) -> AsyncIterator[None]:
    task = asyncio.create_task(warm_up(app[STATE]), name="breezert-warmup")
    app[WARMUP_KEY] = task
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
