"""``RuntimeClient``: the plugin's only door into the BreezeRT runtime, in-process or remote.

Owns: the process-wide shared ``AsyncEngine`` (one per config, loaded and warmed once), the
client side of ``breezert serve``'s WebSocket ``/v1/audio/speech/stream``, and one ``Turn`` API
over both that yields PCM16 bytes. Must not: import LiveKit, or torch at module level.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from breezert.errors import (
    BreezeRTError,
    EngineOverloaded,
    InvalidRequest,
    RequestAborted,
    RequestFailed,
)
from breezert.server.protocol import INVALID_REQUEST_CODES, MESSAGE_COMPLAINT_CODES, OVERLOADED_CODE

from .log import logger
from .models import DEFAULT_SPEAKER, SAMPLE_RATE, SPEECH_STREAM_PATH

if TYPE_CHECKING:
    import aiohttp

    from breezert.async_engine import AsyncEngine
    from breezert.config import EngineConfig


class RuntimeUnavailable(BreezeRTError):
    """The runtime cannot be reached: connecting failed, or the socket closed mid-turn."""


@dataclass(frozen=True)
class TurnOptions:
    """Voice and generation settings of one turn (one engine request)."""

    speaker: str = DEFAULT_SPEAKER
    instructions: str | None = None
    cfg_scale: float = 1.0
    seed: int | None = None
    temperature: float | None = None
    """Backbone temperature; ``None`` = the checkpoint's default."""
    chunk_schedule: tuple[int, ...] | None = None
    """Frames per chunk, last entry repeating; ``None`` = the engine's default."""
    max_frames: int | None = None
    """Frame limit per segment (80 ms each); ``None`` = the engine's default."""
    priority: int = 0


class Turn(ABC):
    """One running turn: append segments while it plays, then close or abort it."""

    request_id: str

    @abstractmethod
    async def append(self, text: str) -> None:
        """Adds one text segment (a sentence) to the running request."""

    @abstractmethod
    async def close_input(self) -> None:
        """No more segments: the turn ends after the last one."""

    @abstractmethod
    async def abort(self) -> None:
        """Stops the request now and frees its engine resources (idempotent)."""

    @abstractmethod
    def report_playback(self, buffered_s: float, measured_at: float, source: str) -> None:
        """Tells the engine how much of this turn's audio is queued ahead of the playhead.

        ``measured_at`` is ``time.monotonic()`` on this machine. Never raises.
        """

    @abstractmethod
    def audio(self) -> AsyncIterator[bytes]:
        """The turn's audio as PCM16 little-endian mono bytes at ``SAMPLE_RATE``; iterate once.

        Raises the runtime's errors (``RequestFailed``, ``EngineOverloaded``, ...).
        """


class RuntimeClient(ABC):
    """Opens turns on a BreezeRT runtime; ``sample_rate`` is the rate of every turn's audio."""

    sample_rate: int = SAMPLE_RATE

    @abstractmethod
    async def open_turn(
        self,
        texts: Sequence[str],
        options: TurnOptions,
        *,
        request_id: str,
        input_closed: bool,
        timeout: float | None = None,
    ) -> Turn:
        """Submits one request with its first segments.

        Args:
            texts: The segments known now (may be empty only when ``input_closed`` is False).
            options: Voice and generation settings.
            request_id: Unique id for the request (the plugin's LiveKit request id).
            input_closed: False: more segments follow via ``Turn.append``.
            timeout: Seconds allowed to reach the runtime (remote only).
        """

    def prewarm(self) -> None:
        """Starts loading or connecting in the background; never blocks."""

    async def aclose(self) -> None:
        """Releases what this client holds (never the process-wide shared engine)."""


# ----------------------------------------------------------------------------- in-process

class InProcessRuntimeClient(RuntimeClient):
    """Runs turns on the process-wide shared engine of ``config`` (``AsyncEngine.shared``)."""

    def __init__(self, config: str | os.PathLike[str] | EngineConfig | None = None) -> None:
        self._config = config
        self._engine: AsyncEngine | None = None
        self._loading: threading.Thread | None = None

    def prewarm(self) -> None:
        if self._engine is not None or self._loading is not None:
            return
        self._loading = threading.Thread(
            target=self._load_quietly, name="breezert-prewarm", daemon=True
        )
        self._loading.start()

    def _load_quietly(self) -> None:
        try:
            self._engine = _shared_engine(self._config)
        except Exception:  # the first turn loads again and reports the error properly
            logger.exception("breezert prewarm failed")

    async def get_engine(self) -> AsyncEngine:
        """The shared engine; loads it off the event loop the first time."""
        if self._engine is None:
            loop = asyncio.get_running_loop()
            self._engine = await loop.run_in_executor(None, _shared_engine, self._config)
        return self._engine

    async def open_turn(
        self,
        texts: Sequence[str],
        options: TurnOptions,
        *,
        request_id: str,
        input_closed: bool,
        timeout: float | None = None,
    ) -> Turn:
        from breezert.request import SynthesisRequest

        engine = await self.get_engine()
        sampling = None
        if options.temperature is not None:
            sampling = replace(engine.default_sampling, temperature=options.temperature)
        request = SynthesisRequest(
            text=list(texts), speaker=options.speaker, instructions=options.instructions,
            cfg_scale=options.cfg_scale, sampling=sampling, seed=options.seed,
            chunk_schedule=options.chunk_schedule, max_frames=options.max_frames,
            priority=options.priority, request_id=request_id, input_closed=input_closed,
        )
        engine.submit(request)
        return _EngineTurn(engine, request_id)


def _shared_engine(config: str | os.PathLike[str] | EngineConfig | None) -> AsyncEngine:
    from breezert.async_engine import AsyncEngine  # torch: only once a turn runs in-process

    return AsyncEngine.shared(config)


class _EngineTurn(Turn):
    def __init__(self, engine: AsyncEngine, request_id: str) -> None:
        self._engine = engine
        self.request_id = request_id
        self._is_done = False

    async def append(self, text: str) -> None:
        if self._is_done:
            return
        try:
            self._engine.append_text(self.request_id, text)
        except InvalidRequest:
            if self._is_done or not self._engine.is_live(self.request_id):
                return  # the turn already ended (failed or aborted): its stream reports why
            raise

    async def close_input(self) -> None:
        if self._is_done:
            return
        try:
            self._engine.close_input(self.request_id)
        except InvalidRequest:
            if self._engine.is_live(self.request_id):
                raise

    async def abort(self) -> None:
        self._is_done = True
        self._engine.abort(self.request_id)

    def report_playback(self, buffered_s: float, measured_at: float, source: str) -> None:
        if self._is_done:
            return
        try:
            self._engine.report_playback(self.request_id, max(buffered_s, 0.0), measured_at,
                                         source)
        except BreezeRTError:
            pass

    async def audio(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._engine.stream(self.request_id):
                yield chunk.pcm16()
        finally:
            self._is_done = True


# ----------------------------------------------------------------------------- remote


def speech_stream_url(base_url: str) -> str:
    """``http(s)://host:port[/prefix]`` or ``ws(s)://...`` → the turn WebSocket URL."""
    url = base_url.rstrip("/")
    for http, ws in (("https://", "wss://"), ("http://", "ws://")):
        if url.startswith(http):
            url = ws + url[len(http):]
    if not url.startswith(("ws://", "wss://")):
        raise ValueError(f"base_url={base_url!r} must start with http://, https://, ws:// or wss://")
    return url if url.endswith(SPEECH_STREAM_PATH) else url + SPEECH_STREAM_PATH


class RemoteRuntimeClient(RuntimeClient):
    """Runs turns on a ``breezert serve`` over its WebSocket ``/v1/audio/speech/stream``.

    Protocol (one turn at a time per socket; a socket is reused after a clean ``turn_done``):
    client → server JSON text ``say`` (``text`` segments, ``input_closed``, voice options,
    ``request_id``), ``append`` (``text``), ``end``, ``cancel``, ``playback`` (``buffered_s``,
    ``age_s``, ``source``); server → client binary PCM16 24 kHz mono, and JSON ``ready``,
    ``turn_started``, ``first_audio``, ``turn_done`` (``status``: finished, failed, aborted or
    cancelled) and ``error`` (``code``, ``message``). An error before ``turn_started`` rejects
    the turn; after it, only message-level complaints (``bad_field``, ...) let the turn go on.
    """

    def __init__(
        self,
        base_url: str,
        *,
        auth_token: str | None = None,
        http_session: aiohttp.ClientSession | None = None,
        max_idle_sockets: int = 1,
    ) -> None:
        self._url = speech_stream_url(base_url)
        self._auth_token = auth_token
        self._session = http_session
        self._owns_session = http_session is None
        self._idle: list[aiohttp.ClientWebSocketResponse] = []
        self._max_idle = max_idle_sockets
        self._prewarm_task: asyncio.Task[None] | None = None
        self.num_connects = 0

    @property
    def url(self) -> str:
        return self._url

    def _http(self) -> aiohttp.ClientSession:
        import aiohttp

        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession()
            self._owns_session = True
        return self._session

    async def _connect(self, timeout: float | None) -> aiohttp.ClientWebSocketResponse:
        import aiohttp

        headers = {"Authorization": f"Bearer {self._auth_token}"} if self._auth_token else {}
        self.num_connects += 1
        try:
            return await asyncio.wait_for(
                self._http().ws_connect(self._url, headers=headers, max_msg_size=0), timeout
            )
        except aiohttp.WSServerHandshakeError as exc:
            if exc.status in (401, 403):
                raise InvalidRequest(f"breezert serve refused the token (HTTP {exc.status})") \
                    from None
            raise RuntimeUnavailable(f"WebSocket handshake failed: HTTP {exc.status}") from None
        except (aiohttp.ClientError, OSError) as exc:
            raise RuntimeUnavailable(f"cannot reach {self._url}: {type(exc).__name__}") from exc

    def prewarm(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        if self._prewarm_task is None and not self._idle:
            self._prewarm_task = loop.create_task(self._prewarm())

    async def _prewarm(self) -> None:
        try:
            self._release(await self._connect(10.0))
        except (BreezeRTError, asyncio.TimeoutError) as exc:
            logger.warning("breezert prewarm could not connect: %s", exc)

    def _release(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        if not ws.closed and len(self._idle) < self._max_idle:
            self._idle.append(ws)
        else:
            asyncio.ensure_future(ws.close())

    async def open_turn(
        self,
        texts: Sequence[str],
        options: TurnOptions,
        *,
        request_id: str,
        input_closed: bool,
        timeout: float | None = None,
    ) -> Turn:
        if self._prewarm_task is not None and not self._prewarm_task.done():
            await asyncio.wait([self._prewarm_task], timeout=timeout)
        say = _say_message(texts, options, request_id, input_closed)
        while self._idle:  # a pooled socket may have been closed by the server meanwhile
            ws = self._idle.pop()
            if ws.closed:
                continue
            try:
                return await _RemoteTurn.start(self, ws, request_id, say)
            except RuntimeUnavailable:
                continue
        ws = await self._connect(timeout)
        return await _RemoteTurn.start(self, ws, request_id, say)

    async def aclose(self) -> None:
        if self._prewarm_task is not None:
            await _cancel(self._prewarm_task)
        idle, self._idle = self._idle, []
        for ws in idle:
            await ws.close()
        if self._owns_session and self._session is not None:
            await self._session.close()
        self._session = None


async def _cancel(task: asyncio.Future[Any]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def _say_message(
    texts: Sequence[str], options: TurnOptions, request_id: str, input_closed: bool
) -> dict[str, Any]:
    message: dict[str, Any] = {"type": "say", "request_id": request_id, "text": list(texts),
                               "input_closed": input_closed, "format": "pcm"}
    for name in ("speaker", "instructions", "cfg_scale", "seed", "temperature", "max_frames",
                 "priority"):
        value = getattr(options, name)
        if value is not None:
            message[name] = value
    if options.chunk_schedule is not None:
        message["chunk_schedule"] = list(options.chunk_schedule)
    return message


def _error_from_event(event: dict[str, Any], request_id: str) -> BreezeRTError:
    code = str(event.get("code", ""))
    message = str(event.get("message") or event.get("error") or "error")[:200]
    if code in INVALID_REQUEST_CODES:
        return InvalidRequest(f"{code}: {message}")
    if code == OVERLOADED_CODE:
        return EngineOverloaded(message)
    return RequestFailed(request_id, f"{code or 'failed'}: {message}")


class _RemoteTurn(Turn):
    def __init__(
        self, client: RemoteRuntimeClient, ws: aiohttp.ClientWebSocketResponse, request_id: str
    ) -> None:
        self._client = client
        self._ws = ws
        self.request_id = request_id
        self.server_request_id: str | None = None
        self._send_lock = asyncio.Lock()
        self._is_done = False
        self._is_server_done = False  # the server ended the turn (done, error or closed)
        self._is_started = False
        self._use_playback = True
        self._playback_task: asyncio.Future[None] | None = None

    @classmethod
    async def start(
        cls,
        client: RemoteRuntimeClient,
        ws: aiohttp.ClientWebSocketResponse,
        request_id: str,
        say: dict[str, Any],
    ) -> _RemoteTurn:
        turn = cls(client, ws, request_id)
        await turn._send(say)
        return turn

    async def _send(self, message: dict[str, Any]) -> None:
        try:
            async with self._send_lock:
                await self._ws.send_str(json.dumps(message))
        except (ConnectionError, RuntimeError, OSError) as exc:  # aiohttp: closing transport
            raise RuntimeUnavailable(f"WebSocket send failed: {type(exc).__name__}") from exc

    async def append(self, text: str) -> None:
        if not self._is_done:
            await self._send({"type": "append", "text": text})

    async def close_input(self) -> None:
        if not self._is_done:
            await self._send({"type": "end"})

    async def abort(self) -> None:
        if not self._is_done:
            await self._shutdown(send_cancel=True)

    async def _shutdown(self, *, send_cancel: bool) -> None:
        """Ends the turn on our side; the socket is never reused (it may still carry audio)."""
        self._is_done = True
        if send_cancel and not self._ws.closed:
            try:
                await asyncio.wait_for(self._send({"type": "cancel"}), 1.0)
            except (RuntimeUnavailable, asyncio.TimeoutError):
                pass
        await self._ws.close()

    def report_playback(self, buffered_s: float, measured_at: float, source: str) -> None:
        if self._is_done or not self._use_playback:
            return
        if self._playback_task is not None and not self._playback_task.done():
            return  # one in flight: drop this sample rather than queue stale ones
        message = {"type": "playback", "buffered_s": round(max(buffered_s, 0.0), 4),
                   "age_s": round(max(time.monotonic() - measured_at, 0.0), 4),
                   "source": source}
        self._playback_task = asyncio.ensure_future(self._send_quietly(message))

    async def _send_quietly(self, message: dict[str, Any]) -> None:
        try:
            await self._send(message)
        except RuntimeUnavailable:
            pass

    async def audio(self) -> AsyncIterator[bytes]:
        import aiohttp

        is_clean = False
        try:
            while True:
                msg = await self._ws.receive()
                if msg.type is aiohttp.WSMsgType.BINARY:
                    yield bytes(msg.data)
                    continue
                if msg.type is not aiohttp.WSMsgType.TEXT:  # closed, closing or error
                    self._is_server_done = True
                    raise RuntimeUnavailable("WebSocket closed mid-turn")
                if self._on_event(msg.data):
                    is_clean = True
                    return
        finally:
            if self._playback_task is not None:
                await _cancel(self._playback_task)
            if is_clean:
                self._is_done = True
                self._client._release(self._ws)
            elif not self._is_done:  # cancelled or failed: tell the server unless it told us
                await self._shutdown(send_cancel=not self._is_server_done)

    def _on_event(self, raw: str) -> bool:
        """Handles one JSON event; True when the turn is done, raises when it failed."""
        try:
            event = json.loads(raw)
            kind = event.get("type")
        except (ValueError, AttributeError):
            logger.warning("breezert serve sent a malformed event; ignored")
            return False
        if kind == "turn_started":
            self._is_started = True
            self.server_request_id = event.get("request_id")
        elif kind == "turn_done":
            self._is_server_done = True
            status = event.get("status", "finished")
            if status in ("aborted", "cancelled"):
                raise RequestAborted(self.request_id)
            if status != "finished":
                raise _error_from_event(event, self.request_id)
            return True
        elif kind == "error":
            error = _error_from_event(event, self.request_id)
            if not self._is_started or event.get("code") not in MESSAGE_COMPLAINT_CODES:
                self._is_server_done = True
                raise error
            # NOTE: once the turn runs, these codes complain about one message (e.g. a server
            # that does not know ``playback``); the turn goes on, playback reports stop.
            self._use_playback = False
            logger.warning("breezert serve complained mid-turn: %s", error)
        return False
