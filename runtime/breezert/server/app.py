"""The aiohttp application: ``create_app`` wires every endpoint module, the cross-site checks
and bearer-token auth.

Owns: building one app (its ``ServerState`` under ``state.STATE``, the index page, each
concern's ``setup``), the middleware in front of every route (on a loopback bind a ``Host``
that is not loopback is refused: DNS rebinding; an ``Origin`` off the allow-list is refused),
in front of ``/v1/`` (a body must be ``application/json``; the bearer token), and keeping
tokens out of the access log. Must not: implement an endpoint (each lives in its own module)
or hold state the handlers share (``state.py`` does).
"""

from __future__ import annotations

import hmac
import logging
import re
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from aiohttp import web

from breezert.config import ServingConfig, is_loopback_host
from breezert.engine_client import EngineClient
from breezert.server import health, http_api, metrics_export, webrtc_api, ws_api
from breezert.server.ice import scope_for
from breezert.server.state import STATE, ServerState, json_error

STATIC_DIR = Path(__file__).parent / "static"


POLICY_FIELDS = frozenset({"max_frames", "ignore_eos", "chunk_schedule", "priority"})
"""``SynthesisRequest`` fields a server may set for every request (``request_options``)."""


def create_app(
    engine: EngineClient | None,
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
        engine: The engine (started lazily; the caller closes it); ``None`` until
            ``health.build_engine_in_background`` builds it.
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
    _redact_access_log()
    app = web.Application(middlewares=[_cross_site_middleware, _auth_middleware],
                          client_max_size=1 << 20)
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


# ----------------------------------------------------------------------------- cross-site

BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


def _host_problem(request: web.Request) -> str | None:
    """On a loopback bind: why the ``Host`` header is not this server's loopback name."""
    host = request.headers.get("Host", "")
    name, port = _split_host(host)
    if name is None or not is_loopback_host(name):
        return (f"Host {host[:100]!r} is not a loopback name: this server is bound to loopback "
                "and answers only localhost, 127.0.0.0/8 or [::1] (DNS rebinding)")
    sockname = request.transport.get_extra_info("sockname") if request.transport else None
    local_port = sockname[1] if isinstance(sockname, tuple) and len(sockname) >= 2 else None
    if local_port is not None and (port if port is not None else 80) != local_port:
        return f"Host {host[:100]!r} names another port than this server's ({local_port})"
    return None


def _split_host(host: str) -> tuple[str | None, int | None]:
    """``name[:port]`` / ``[v6][:port]`` -> (name, port); (None, None) when malformed."""
    match = re.fullmatch(r"(\[[0-9A-Fa-f:.]+\]|[^:\[\]]+)(?::(\d{1,5}))?", host.strip())
    if match is None:
        return None, None
    return match.group(1), int(match.group(2)) if match.group(2) else None


def _origin_ok(request: web.Request, allowed: tuple[str, ...]) -> bool:
    origin = request.headers.get("Origin")
    if origin is None:  # not a browser (browsers send Origin on every cross-site request)
        return True
    origin = origin.strip().lower()
    if "*" in allowed or origin in (o.lower() for o in allowed):
        return True
    if origin == f"{request.scheme}://{request.host}".lower():  # same origin
        return True
    scheme, sep, rest = origin.partition("://")
    name, _ = _split_host(rest)
    return bool(sep) and scheme in ("http", "https") and name is not None \
        and is_loopback_host(name)


@web.middleware
async def _cross_site_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    serving = request.app[STATE].serving
    if serving.is_loopback and (problem := _host_problem(request)) is not None:
        return json_error(403, problem, param="Host", code="forbidden")
    if not _origin_ok(request, serving.allowed_origins):
        return json_error(
            403, f"Origin {request.headers['Origin'][:100]!r} is not allowed: add it to "
            "serving.allowed_origins (same-origin and loopback pages are always allowed)",
            param="Origin", code="forbidden")
    if (request.path.startswith("/v1/") and request.method in BODY_METHODS
            and request.content_type != "application/json"):
        return json_error(415, f"Content-Type must be application/json (got "
                          f"{request.headers.get('Content-Type', 'none')[:100]!r})",
                          param="Content-Type", code="unsupported_media_type")
    return await handler(request)


# ----------------------------------------------------------------------------- auth


def _token_ok(request: web.Request, expected: str) -> bool:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.strip().partition(" ")
    token = token.strip()
    if scheme.lower() == "bearer" and token and hmac.compare_digest(token.encode(),
                                                                    expected.encode()):
        return True
    # Browsers cannot set headers on a WebSocket: accept the token as a query parameter there.
    query = request.query.get("access_token")
    return (bool(query) and request.path.endswith("/stream")
            and hmac.compare_digest(query.encode(), expected.encode()))


_TOKEN_IN_URL = re.compile(r"(access_token=)[^&\s\"]*", re.IGNORECASE)


class _RedactTokens(logging.Filter):
    """Rewrites ``access_token=<token>`` to ``access_token=REDACTED`` in a log record (its
    message and any string ``extra`` aiohttp's access logger attaches)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.args:
            record.msg, record.args = record.getMessage(), None
        if isinstance(record.msg, str):
            record.msg = _TOKEN_IN_URL.sub(r"\1REDACTED", record.msg)
        for key, value in list(vars(record).items()):
            if isinstance(value, str) and key != "msg" and "access_token=" in value.lower():
                setattr(record, key, _TOKEN_IN_URL.sub(r"\1REDACTED", value))
        return True


def _redact_access_log() -> None:
    """Tokens never reach the access log (idempotent)."""
    access = logging.getLogger("aiohttp.access")
    if not any(isinstance(f, _RedactTokens) for f in access.filters):
        access.addFilter(_RedactTokens())


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
