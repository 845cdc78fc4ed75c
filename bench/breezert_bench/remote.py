"""The benchmark's network edge: the same load driven at a running ``breezert serve``.

Owns: ``RemoteSpeech``, a stand-in for ``AsyncEngine`` in the runner's load loops that runs each
request as one WebSocket turn (``/v1/audio/speech/stream``: ``say`` with the text, the seed and
the frame count, binary PCM16 back, ``playback`` reports from the simulated listener), timing
every chunk by its arrival at this client; the server's own first-audio time of each turn
(``first_audio.server_ms``) beside it; and the server's ``/metrics`` gauges before and after a
run. Must not: build engines or read the server's internals (only its public protocol).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp

from breezert.engine_client import Submitted
from breezert.errors import EngineOverloaded, RequestFailed

SAMPLE_RATE = 24_000
SAMPLES_PER_FRAME = 1920


@dataclass(frozen=True)
class ArrivedChunk:
    """One binary message as the client got it (``created_time``: its arrival)."""

    created_time: float
    duration_s: float
    num_frames: int


class RemoteSpeech:
    """``submit`` / ``stream`` / ``report_playback`` of ``AsyncEngine``, over the server's
    WebSocket; one socket per request, closed when its turn ends."""

    def __init__(self, base_url: str, session: aiohttp.ClientSession,
                 token: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.session = session
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._sockets: dict[str, asyncio.Task[aiohttp.ClientWebSocketResponse]] = {}
        self.server_ttfb_s: dict[str, float] = {}
        """``first_audio.server_ms`` per request, in seconds (the server's say -> first audio)."""

    @property
    def ws_url(self) -> str:
        scheme, rest = self.base_url.split("://", 1)
        return f"{'wss' if scheme == 'https' else 'ws'}://{rest}/v1/audio/speech/stream"

    async def submit(self, request: Any) -> Submitted:
        """Opens the request's socket and sends its ``say`` (in a task; ``stream`` awaits it)."""
        request_id = str(request.request_id)
        self._sockets[request_id] = asyncio.create_task(self._open(request))
        return Submitted(request_id, tuple(range(len(request.segments))), 0, False)

    async def _open(self, request: Any) -> aiohttp.ClientWebSocketResponse:
        ws = await self.session.ws_connect(self.ws_url, headers=self.headers, heartbeat=None)
        ready = await ws.receive_json()
        if ready.get("type") != "ready":
            await ws.close()
            raise RequestFailed(str(request.request_id), f"no ready from the server: {ready}")
        say = {"type": "say", "text": "".join(request.segments), "format": "pcm",
               "request_id": str(request.request_id)}
        if request.options.seed is not None:
            say["seed"] = request.options.seed
        if request.max_frames is not None:
            say["max_frames"] = request.max_frames
        await ws.send_json(say)
        return ws

    async def stream(self, request_id: str) -> AsyncIterator[ArrivedChunk]:
        """The turn's audio as it arrives; raises on a failed turn."""
        ws = await self._sockets[request_id]
        try:
            async for message in ws:
                now = time.monotonic()
                if message.type == aiohttp.WSMsgType.BINARY:
                    samples = len(message.data) // 2
                    yield ArrivedChunk(now, samples / SAMPLE_RATE,
                                       round(samples / SAMPLES_PER_FRAME))
                    continue
                if message.type != aiohttp.WSMsgType.TEXT:
                    raise RequestFailed(request_id, f"socket closed ({message.type.name})")
                data = message.json()
                kind = data.get("type")
                if kind == "first_audio" and data.get("server_ms") is not None:
                    self.server_ttfb_s[request_id] = float(data["server_ms"]) / 1000
                elif kind == "error" or (kind == "turn_done"
                                          and data.get("status") != "finished"):
                    if data.get("code") == "overloaded":
                        wait = data.get("retry_after_s")
                        raise EngineOverloaded(str(data.get("message") or data.get("error")),
                                               retry_after_s=None if wait is None else float(wait))
                    raise RequestFailed(request_id, str(data.get("error")
                                                        or data.get("message") or data))
                elif kind == "turn_done":
                    return
            raise RequestFailed(request_id, "the socket closed before turn_done")
        finally:
            self._sockets.pop(request_id, None)
            await ws.close()

    def report_playback(self, request_id: str, buffered_s: float, measured_at: float,
                        source: str) -> None:
        """Sends the listener's buffer (``age_s``: how old the measurement is)."""
        task = self._sockets.get(request_id)
        if task is None or not task.done() or task.exception() is not None:
            raise RuntimeError(f"{request_id} has no open socket")
        ws = task.result()
        message = {"type": "playback", "buffered_s": round(buffered_s, 4),
                   "age_s": round(max(0.0, time.monotonic() - measured_at), 4), "source": source}
        asyncio.get_running_loop().create_task(ws.send_json(message))

    async def server_metrics(self) -> dict[str, float]:
        """The server's ``/metrics`` samples without labels (``breezert_*`` gauges and
        counters) as ``{name: value}``; ``{}`` when it does not answer."""
        try:
            async with self.session.get(f"{self.base_url}/metrics", headers=self.headers,
                                        timeout=aiohttp.ClientTimeout(total=10)) as response:
                text = await response.text()
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return {}
        values: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("breezert_") and "{" not in line:
                name, _, value = line.partition(" ")
                try:
                    values[name] = float(value)
                except ValueError:
                    continue
        return values
