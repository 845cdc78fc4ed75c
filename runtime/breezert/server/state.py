"""What every handler of one app shares: ``ServerState`` under the ``STATE`` app key, and the
JSON error/body helpers of the HTTP routes.

Owns: the per-app state (the engine as an ``EngineClient``, serving config, live peers,
counters, the metrics registry and its first-audio histogram) and the OpenAI-style error body.
Must not: import any handler module or ``app.py``; handlers import this, ``app.py`` imports the
handlers.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from aiohttp import web
from prometheus_client import CollectorRegistry, Histogram

from breezert.config import ServingConfig
from breezert.engine_client import EngineClient
from breezert.server.ice import HostAddresses
from breezert.server.protocol import ProtocolError, loads_json

if TYPE_CHECKING:
    from breezert.server.turns import TurnController

TTFA_BUCKETS_S = (0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0)


class Peer(Protocol):
    """A connected WebRTC peer (``webrtc_api.PeerSession``), as the drain and gauges see it."""

    controller: TurnController

    async def close(self) -> None: ...


@dataclass
class ServerState:
    """Everything the handlers of one app share."""

    engine: EngineClient | None
    """``None`` while the engine is still being built (``health.build_engine_in_background``);
    handlers behind the readiness gate read ``client``."""
    serving: ServingConfig
    request_options: dict[str, Any]
    """Extra ``SynthesisRequest`` fields for every request (server policy, e.g. max_frames)."""
    ice: HostAddresses
    frame_ms: int = 20
    """Default WebRTC frame duration (an offer may ask for 10 or 20)."""
    clock: Callable[[], float] = time.monotonic
    peers: set[Peer] = field(default_factory=set)
    num_ws_sessions: int = 0
    websockets: dict[Any, TurnController] = field(default_factory=dict)
    """Open WebSocket sessions: socket -> its ``TurnController`` (gauges; the drain closes idle
    ones)."""
    num_http_streams: int = 0
    underruns_total: int = 0
    """Concealment events reported by WebRTC receivers while a turn was playing."""
    starved_frames_total: int = 0
    """Frames our tracks sent as silence inside a turn because audio had not arrived."""
    is_ready: bool = False
    warmup_error: str | None = None
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    """What ``/metrics`` exposes (``metrics_export`` adds the engine's and the process's)."""
    first_audio: Histogram = field(init=False)
    """``say`` -> first audio frame sent, seconds (server side)."""

    def __post_init__(self) -> None:
        self.first_audio = Histogram(
            "breezert_first_audio_seconds", "say to first audio frame sent on the connection "
            "(WebRTC, WebSocket).", buckets=TTFA_BUCKETS_S, registry=self.registry)

    @property
    def client(self) -> EngineClient:
        """The engine, for the handlers behind the readiness gate (built by then); a 503 if a
        request gets here before."""
        if self.engine is None:
            raise web.HTTPServiceUnavailable(text="the engine is still starting")
        return self.engine


STATE = web.AppKey("breezert_state", ServerState)


def json_error(
    status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
    code: str | None = None, headers: Mapping[str, str] | None = None,
) -> web.Response:
    """An OpenAI-style error body: ``{"error": {"message", "type", "param", "code"}}``."""
    body = {"error": {"message": message, "type": type, "param": param, "code": code}}
    return web.json_response(body, status=status, headers=headers)


async def read_json_object(request: web.Request) -> dict[str, Any] | web.Response:
    """The request's JSON object body, or a 400/413 response saying what is wrong.

    Parsed by ``protocol.loads_json``: invalid UTF-8, NaN/Infinity, deep nesting, numbers out
    of range and lone surrogates are a 400 whose ``param`` names the top-level field."""
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge as exc:
        return json_error(413, f"request body is too large: {exc.text}", code="body_too_large")
    try:
        data = loads_json(raw or b"null")
    except ProtocolError as exc:
        return json_error(400, f"request body: {exc.message}", param=exc.field, code=exc.code)
    if not isinstance(data, dict):
        return json_error(400, "request body must be a JSON object", code="bad_json")
    return data
