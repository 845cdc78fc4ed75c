"""The aiohttp application: ``create_app`` wires every endpoint module and bearer-token auth.

Owns: building one app (its ``ServerState`` under ``state.STATE``, the index page, each
concern's ``setup``) and the auth middleware in front of ``/v1/``. Must not: implement an
endpoint (each lives in its own module) or hold state the handlers share (``state.py`` does).
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from aiohttp import web

from breezert.config import ServingConfig
from breezert.server import health, http_api, metrics_export, webrtc_api, ws_api
from breezert.server.ice import scope_for
from breezert.server.state import STATE, ServerState, json_error

STATIC_DIR = Path(__file__).parent / "static"


POLICY_FIELDS = frozenset({"max_frames", "ignore_eos", "chunk_schedule", "priority"})
"""``SynthesisRequest`` fields a server may set for every request (``request_options``)."""


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
        request_options: Server policy applied to every request: ``SynthesisRequest`` fields
            that are not the caller's voice options (``max_frames``, ``ignore_eos``,
            ``chunk_schedule``, ``priority``).
        ice_addresses: Gather WebRTC candidates on exactly these addresses; default: every
            interface, plus loopback when ``serving.host`` is a loopback address.
        frame_ms: Default WebRTC frame duration, 10 or 20.
        warmup: Run one short request at startup; ``/readyz`` is 503 until it finishes.
        clock: Monotonic time source for pacing and first-audio timing.
    """
    unknown = set(request_options or {}) - POLICY_FIELDS
    if unknown:
        raise ValueError(f"request_options: {sorted(unknown)} are not server policy fields "
                         f"(allowed: {sorted(POLICY_FIELDS)})")
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


# ----------------------------------------------------------------------------- auth


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
