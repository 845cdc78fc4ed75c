"""The aiohttp application: routes, bearer-token auth, JSON errors and shared server state.

Owns: ``create_app`` (wiring every concern's routes), the per-app ``ServerState`` (engine,
serving config, live peers and counters) and the error/auth helpers all handlers use. Must not:
implement an endpoint itself; each lives in its own module.
"""

from __future__ import annotations

import hmac
import json
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from breezert.config import ServingConfig
from breezert.server.ice import HostAddresses, scope_for

STATIC_DIR = Path(__file__).parent / "static"
TTFA_BUCKETS_S = (0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0)


@dataclass
class Histogram:
    """A Prometheus histogram: non-cumulative bucket counts (last = +Inf), sum and count."""

    buckets_s: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets_s) + 1)

    def observe(self, value: float) -> None:
        index = next((i for i, b in enumerate(self.buckets_s) if value <= b), -1)
        self.counts[index] += 1
        self.total += value
        self.count += 1


@dataclass
class ServerState:
    """Everything the handlers of one app share."""

    engine: Any  # breezert.AsyncEngine (typed loosely so tests can pass a fake)
    serving: ServingConfig
    request_options: dict[str, Any]
    """Extra ``SynthesisRequest`` fields for every request (server policy, e.g. max_frames)."""
    ice: HostAddresses
    frame_ms: int = 20
    """Default WebRTC frame duration (an offer may ask for 10 or 20)."""
    clock: Callable[[], float] = time.monotonic
    peers: set[Any] = field(default_factory=set)
    num_ws_sessions: int = 0
    num_http_streams: int = 0
    underruns_total: int = 0
    """Concealment events reported by WebRTC receivers while a turn was playing."""
    starved_frames_total: int = 0
    """Frames our tracks sent as silence inside a turn because audio had not arrived."""
    first_audio: Histogram = field(default_factory=lambda: Histogram(TTFA_BUCKETS_S))
    """``say`` -> first audio frame sent, seconds (server side)."""
    is_ready: bool = False
    warmup_error: str | None = None


STATE = web.AppKey("breezert_state", ServerState)


def create_app(
    engine: Any,
    serving: ServingConfig,
    *,
    request_options: Mapping[str, Any] | None = None,
    ice_addresses: Sequence[str] | None = None,
    frame_ms: int = 20,
    warmup: bool = True,
    clock: Callable[[], float] = time.monotonic,
) -> web.Application:
    """The BreezeRT HTTP/WebSocket/WebRTC app over a shared ``AsyncEngine``.

    Args:
        engine: The engine (started lazily; the caller closes it).
        serving: Bind address, peer/text limits and the optional bearer token.
        request_options: ``SynthesisRequest`` fields applied to every request.
        ice_addresses: Gather WebRTC candidates on exactly these addresses; default: every
            interface, plus loopback when ``serving.host`` is a loopback address.
        frame_ms: Default WebRTC frame duration, 10 or 20.
        warmup: Run one short request at startup; ``/readyz`` is 503 until it finishes.
        clock: Monotonic time source for pacing and first-audio timing.
    """
    from breezert.server import health, http_api, metrics_export, webrtc_api, ws_api

    app = web.Application(middlewares=[_auth_middleware], client_max_size=1 << 20)
    app[STATE] = ServerState(
        engine=engine, serving=serving, request_options=dict(request_options or {}),
        ice=scope_for(serving.host, ice_addresses), frame_ms=frame_ms, clock=clock,
    )
    app.router.add_get("/", _index)
    health.setup(app, warmup=warmup)
    metrics_export.setup(app)
    http_api.setup(app)
    ws_api.setup(app)
    webrtc_api.setup(app)
    return app


async def _index(request: web.Request) -> web.FileResponse:
    return web.FileResponse(STATIC_DIR / "index.html")


# ----------------------------------------------------------------------------- errors and auth


def json_error(
    status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
    code: str | None = None, headers: Mapping[str, str] | None = None,
) -> web.Response:
    """An OpenAI-style error body: ``{"error": {"message", "type", "param", "code"}}``."""
    body = {"error": {"message": message, "type": type, "param": param, "code": code}}
    return web.json_response(body, status=status, headers=headers)


async def read_json_object(request: web.Request) -> dict[str, Any] | web.Response:
    """The request's JSON object body, or a 400/413 response saying what is wrong."""
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge as exc:
        return json_error(413, f"request body is too large: {exc.text}", code="body_too_large")
    try:
        data = json.loads(raw or b"null")
    except (ValueError, UnicodeDecodeError) as exc:
        return json_error(400, f"request body is not valid JSON: {exc}", code="bad_json")
    if not isinstance(data, dict):
        return json_error(400, "request body must be a JSON object", code="bad_json")
    return data


def _token_ok(request: web.Request, expected: str) -> bool:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(),
                                                          expected.encode()):
        return True
    # Browsers cannot set headers on a WebSocket: accept the token as a query parameter there.
    query = request.query.get("access_token")
    return (query is not None and request.path.endswith("/stream")
            and hmac.compare_digest(query.encode(), expected.encode()))


@web.middleware
async def _auth_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    secret = request.app[STATE].serving.auth_token
    if (secret is not None and request.path.startswith("/v1/")
            and not _token_ok(request, secret.get_secret_value())):
        return json_error(
            401, "missing or invalid bearer token: send 'Authorization: Bearer <token>'",
            type="authentication_error", code="unauthorized",
            headers={"WWW-Authenticate": 'Bearer realm="breezert"'},
        )
    return await handler(request)
