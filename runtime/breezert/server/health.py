"""``/healthz`` (the process and engine loop are alive) and ``/readyz`` (warmed up, serving and
below capacity, with the engine's load), start-up progress, the readiness/drain gate in front of
``/v1/`` and the SIGTERM drain.

Owns: the startup warm-up request that gates readiness, the ``Lifecycle`` under ``LIFECYCLE``
(start-up phase and progress, draining), the gate middleware (``/v1/`` gets 503 with
``Retry-After`` before ready and while draining; every 503 gets ``Retry-After``) and ``drain``.
Must not: run anything per probe beyond reading state; probes are cheap and unauthenticated.
A full engine (``/readyz`` 503 ``full``) still takes ``/v1/`` work: readiness steers routing,
admission stays the engine's (``max_queued_requests``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

from aiohttp import web

from breezert.engine_client import EngineClient
from breezert.request import SynthesisRequest
from breezert.server.state import STATE, ServerState, json_error

logger = logging.getLogger("breezert.server")
WARMUP_KEY = web.AppKey("breezert_warmup", asyncio.Task)

PHASE_WARMUP = "warming up"
"""The last start-up phase: one short request through every stage (on CPU the only one after
loading; on a GPU it follows ``capturing graphs``)."""


@dataclass
class Lifecycle:
    """Start-up progress and shutdown state of one app (``app[LIFECYCLE]``).

    ``progress(phase, done, total, detail)`` is the callback the start-up code calls (engine
    build on a worker thread, graph capture per bucket, the warm-up request); ``/readyz`` shows
    the latest call and ``console`` (when set) prints it.
    """

    phase: str = "starting"
    done: int = 0
    total: int = 0
    detail: str = ""
    started_at: float = field(default_factory=time.monotonic)
    draining: bool = False
    engine_built: asyncio.Event = field(default_factory=asyncio.Event)
    """Set once ``state.engine`` is the engine (at once unless built in the background)."""
    console: ConsoleProgress | None = None

    def progress(self, phase: str, done: int = 0, total: int = 0, detail: str = "") -> None:
        self.phase, self.done, self.total, self.detail = phase, done, total, detail
        if self.console is not None:
            self.console(phase, done, total, detail)

    def as_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"phase": self.phase}
        if self.total:
            body.update(done=self.done, total=self.total)
        if self.detail:
            body["detail"] = self.detail
        body["elapsed_s"] = round(time.monotonic() - self.started_at, 1)
        return body


LIFECYCLE = web.AppKey("breezert_lifecycle", Lifecycle)


class ConsoleProgress:
    """Prints start-up progress: one line per phase and, for counted phases (graph capture), a
    progress bar redrawn in place on a terminal, or a line per tenth elsewhere (logs)."""

    def __init__(self, stream: TextIO | None = None, width: int = 30) -> None:
        self.stream = stream or sys.stderr
        self.width = width
        self._phase: str | None = None
        self._last_tenth = -1
        self._start = time.monotonic()
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def __call__(self, phase: str, done: int, total: int, detail: str) -> None:
        elapsed = time.monotonic() - self._start
        if phase != self._phase:
            if self._tty and self._phase is not None and self._last_tenth >= 0:
                self.stream.write("\n")
            self._phase, self._last_tenth = phase, -1
            extra = f" ({detail})" if detail and not total else ""
            self._write(f"breezert: [{elapsed:6.1f} s] {phase}{extra}\n")
        if not total:
            return
        tenth = done * 10 // total
        filled = self.width * done // total
        bar = f"[{'#' * filled}{'.' * (self.width - filled)}] {done}/{total}"
        if self._tty:
            self._write(f"\r  {phase} {bar} {detail[:40]:<40}")
            self._last_tenth = tenth
            if done == total:
                self._write("\n")
                self._last_tenth = -1
        elif tenth != self._last_tenth or done == total:
            self._last_tenth = tenth
            self._write(f"breezert: [{elapsed:6.1f} s]   {phase} {bar} {detail}\n")

    def _write(self, text: str) -> None:
        with contextlib.suppress(Exception):  # a closed console must not break start-up
            self.stream.write(text)
            self.stream.flush()


def setup(app: web.Application, *, warmup: bool) -> None:
    lifecycle = Lifecycle()
    lifecycle.engine_built.set()
    app[LIFECYCLE] = lifecycle
    app.middlewares.append(_gate_middleware)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    if warmup:
        app.cleanup_ctx.append(_warmup_ctx)
    else:
        app[STATE].is_ready = True
        lifecycle.progress("ready")


def build_engine_in_background(
    app: web.Application, build: Callable[[Callable[..., None]], EngineClient]
) -> None:
    """Builds the engine after the server listens (so ``/readyz`` shows the start-up), on a
    worker thread: ``build(progress)`` returns the engine, which becomes ``state.engine``; the
    warm-up request waits for it. A failure is a ``warmup_error`` (``/healthz`` 503)."""
    lifecycle = app[LIFECYCLE]
    lifecycle.engine_built.clear()

    async def ctx(app: web.Application) -> AsyncIterator[None]:
        state = app[STATE]
        loop = asyncio.get_running_loop()

        def progress(phase: str, done: int = 0, total: int = 0, detail: str = "") -> None:
            loop.call_soon_threadsafe(lifecycle.progress, phase, done, total, detail)

        async def run() -> None:
            try:
                state.engine = await loop.run_in_executor(None, build, progress)
            except Exception as exc:
                state.warmup_error = f"engine start-up failed: {type(exc).__name__}: {exc}"
                logger.exception("engine start-up failed")
                lifecycle.progress("failed", detail=state.warmup_error)
                return
            await asyncio.sleep(0)  # let the last progress call land first
            lifecycle.engine_built.set()

        task = asyncio.create_task(run(), name="breezert-build-engine")
        yield
        # NOTE: a build thread cannot be cancelled; an exit during it waits for it.
        with contextlib.suppress(Exception):
            await task

    app.cleanup_ctx.insert(0, ctx)


async def healthz(request: web.Request) -> web.Response:
    state = request.app[STATE]
    engine_ok = not state.is_ready or (state.engine is not None and state.engine.is_running)
    if state.warmup_error is not None or not engine_ok:
        reason = state.warmup_error or "the engine loop has stopped"
        return web.json_response({"status": "unhealthy", "reason": reason}, status=503)
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    state = request.app[STATE]
    lifecycle = request.app[LIFECYCLE]
    if state.warmup_error is not None:
        return web.json_response({"ready": False, "status": "failed",
                                  "reason": state.warmup_error}, status=503)
    if lifecycle.draining:
        return web.json_response({"ready": False, "status": "draining"}, status=503)
    if not state.is_ready:
        return web.json_response({"ready": False, "status": "warming_up",
                                  **lifecycle.as_json()}, status=503)
    engine = state.client  # ready: built
    if not engine.is_running:
        return web.json_response({"ready": False, "status": "failed",
                                  "reason": "engine loop stopped"}, status=503)
    load = engine.load()
    body: dict[str, Any] = {"ready": True, "status": "ready", "peers": len(state.peers),
                            "load": load.as_json()}
    if load.is_full:  # every running slot taken, or behind real time: route elsewhere
        return web.json_response({**body, "ready": False, "status": "full"}, status=503)
    return web.json_response(body)


async def warm_up(state: ServerState, lifecycle: Lifecycle | None = None) -> None:
    """One short request through every stage (text encode, prefill, decode, depth, codec)."""
    lifecycle = lifecycle or Lifecycle()
    await lifecycle.engine_built.wait()
    if state.warmup_error is not None:
        return
    lifecycle.progress(PHASE_WARMUP, 0, 1, "one short request through every stage")
    request = SynthesisRequest("Warm up.", max_frames=2, ignore_eos=True)
    try:
        engine = state.client
        submitted = await engine.submit(request)
        async for _ in engine.stream(submitted.request_id):
            pass
    except Exception as exc:
        state.warmup_error = f"warm-up request failed: {type(exc).__name__}: {exc}"
        logger.exception("warm-up failed")
        lifecycle.progress("failed", detail=state.warmup_error)
        return
    lifecycle.progress(PHASE_WARMUP, 1, 1)
    state.is_ready = True
    lifecycle.progress("ready")
    logger.info("engine warmed up; ready")


async def _warmup_ctx(app: web.Application) -> AsyncIterator[None]:
    task = asyncio.create_task(warm_up(app[STATE], app[LIFECYCLE]), name="breezert-warmup")
    app[WARMUP_KEY] = task
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


# ----------------------------------------------------------------------------- gate


@web.middleware
async def _gate_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """``/v1/`` is 503 before ready and while draining; every 503 carries ``Retry-After``."""
    state = request.app[STATE]
    lifecycle = request.app[LIFECYCLE]
    retry = str(state.serving.retry_after_s)
    if request.path.startswith("/v1/"):
        if lifecycle.draining:
            return json_error(503, "the server is shutting down; retry on another instance",
                              type="overloaded_error", code="draining",
                              headers={"Retry-After": retry})
        if not state.is_ready:
            return json_error(503, f"the server is starting ({lifecycle.phase}); retry later",
                              type="overloaded_error", code="not_ready",
                              headers={"Retry-After": retry})
    try:
        response = await handler(request)
    except web.HTTPServiceUnavailable as exc:
        exc.headers.setdefault("Retry-After", retry)
        raise
    if response.status == 503 and not response.prepared:
        response.headers.setdefault("Retry-After", retry)
    return response


# ----------------------------------------------------------------------------- drain


def _busy(state: ServerState) -> dict[str, int]:
    """What still runs: HTTP streams, turns in progress, requests in the engine."""
    in_engine = 0
    if state.engine is not None:
        capacity = state.engine.capacity()
        in_engine = capacity.running + capacity.queued
    turns = sum(ctl.active is not None for ctl in state.websockets.values())
    turns += sum(peer.controller.active is not None for peer in state.peers)
    return {"http_streams": state.num_http_streams, "turns": turns, "in_engine": in_engine}


async def _close_idle(state: ServerState) -> int:
    """Closes every WebSocket and WebRTC peer with no turn in progress; returns how many."""
    closing: list[Awaitable[Any]] = []
    for ws, controller in list(state.websockets.items()):
        if controller.active is None and not ws.closed:
            closing.append(ws.close(code=1001, message=b"server shutting down"))
    for peer in list(state.peers):
        if peer.controller.active is None:
            closing.append(peer.close())
    await asyncio.gather(*closing, return_exceptions=True)
    return len(closing)


async def drain(app: web.Application, grace_s: float, *, poll_s: float = 0.05) -> dict[str, Any]:
    """Stops taking work (``/v1/`` and ``/readyz`` get 503), closes idle sockets at once and
    waits up to ``grace_s`` for running turns and streams (each socket closes as its turn
    ends). Returns what happened; the caller then shuts the server down."""
    state, lifecycle = app[STATE], app[LIFECYCLE]
    lifecycle.draining = True
    start = time.monotonic()
    closed = 0
    while True:
        closed += await _close_idle(state)
        busy = _busy(state)
        if not any(busy.values()) or time.monotonic() - start >= grace_s:
            break
        await asyncio.sleep(poll_s)
    summary = {"drain_s": round(time.monotonic() - start, 3), "closed_idle": closed,
               "left_running": busy}
    logger.info("drained in %.2f s: %s", summary["drain_s"], summary)
    return summary
