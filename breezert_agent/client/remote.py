"""``RemoteRuntimeClient``: turns on a ``breezert serve`` over its WebSocket.

Owns: the client side of ``/v1/audio/speech/stream`` (messages out, PCM16 and events in, error
codes mapped to the runtime's errors) and the pool of sockets reused between turns. Must not:
import torch or the engine: a remote-only agent installs neither.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

from livekit.agents.utils import ConnectionPool

from breezert.errors import (
    BreezeRTError,
    EngineOverloaded,
    InvalidRequest,
    RequestAborted,
    RequestFailed,
)
from breezert.server.protocol import INVALID_REQUEST_CODES, MESSAGE_COMPLAINT_CODES, OVERLOADED_CODE

from ..log import logger
from ..models import (
    DEFAULT_HEARTBEAT_S,
    DEFAULT_MAX_SESSION_S,
    CLOSE_TIMEOUT_S,
    RECEIVE_POLL_S,
    SPEECH_STREAM_PATH,
)
from .base import RuntimeClient, RuntimeUnavailable, SegmentStart, Turn, TurnOptions, log_queued

if TYPE_CHECKING:
    import aiohttp


def speech_stream_url(base_url: str) -> str:
    """``http(s)://host:port[/prefix]`` or ``ws(s)://...`` → the turn WebSocket URL."""
    url = base_url.rstrip("/")
    for http, ws in (("https://", "wss://"), ("http://", "ws://")):
        if url.startswith(http):
            url = ws + url[len(http):]
    if not url.startswith(("ws://", "wss://")):
        raise ValueError(
            f"base_url={base_url!r} must start with http://, https://, ws:// or wss://")
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

    Timeouts (``timeout`` of ``open_turn``, the plugin's ``conn_options.timeout``): connecting,
    and every wait for the server while it owes the turn something (the first audio, a segment
    that was sent but has not started, ``turn_done`` once the input is closed), raise
    ``asyncio.TimeoutError`` after ``timeout`` seconds of silence plus the audio already
    received ahead of real time (the listener still has that much to play, and a server that
    paces generation may legitimately wait that long). An open turn whose segments have all
    started may wait for the next ``append`` unbounded: the server then owes nothing. Pooled
    sockets are replaced after ``max_session_duration`` and kept alive with WebSocket pings
    every ``heartbeat`` seconds (a missing pong closes the socket).
    """

    def __init__(
        self,
        base_url: str,
        *,
        auth_token: str | None = None,
        http_session: aiohttp.ClientSession | None = None,
        max_session_duration: float | None = DEFAULT_MAX_SESSION_S,
        heartbeat: float | None = DEFAULT_HEARTBEAT_S,
    ) -> None:
        self._url = speech_stream_url(base_url)
        self._auth_token = auth_token
        self._session = http_session
        self._owns_session = http_session is None
        self._heartbeat = heartbeat
        self._pool: ConnectionPool[aiohttp.ClientWebSocketResponse] = ConnectionPool(
            connect_cb=self._connect, close_cb=_close_socket, connect_timeout=10.0,
            max_session_duration=max_session_duration,
        )  # sockets idle between turns; connect_timeout bounds the prewarm connect

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
        try:
            return await asyncio.wait_for(
                self._http().ws_connect(
                    self._url, headers=headers, max_msg_size=0, heartbeat=self._heartbeat,
                    # a frozen server never answers our close frame: do not wait 10 s for it
                    timeout=aiohttp.ClientWSTimeout(ws_receive=None, ws_close=CLOSE_TIMEOUT_S)),
                timeout,
            )
        except TimeoutError:
            # NOTE: before OSError: on Python 3.11 TimeoutError (= asyncio.TimeoutError, and
            # aiohttp's ServerTimeoutError) is an OSError, and a timeout is no connection error.
            raise asyncio.TimeoutError(f"connecting to {self._url} took over {timeout} s") \
                from None
        except aiohttp.WSServerHandshakeError as exc:
            if exc.status in (401, 403):
                raise InvalidRequest(f"breezert serve refused the token (HTTP {exc.status})") \
                    from None
            raise RuntimeUnavailable(f"WebSocket handshake failed: HTTP {exc.status}") from None
        except (aiohttp.ClientError, OSError) as exc:
            raise RuntimeUnavailable(f"cannot reach {self._url}: {type(exc).__name__}") from exc

    def prewarm(self) -> None:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return  # no event loop to connect from: the first turn connects
        self._pool.prewarm()

    def _reuse(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        """Back to the pool after a clean ``turn_done`` (the only way a socket is reused)."""
        if ws.closed:
            self._pool.remove(ws)
        else:
            self._pool.put(ws)

    def _discard(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        """Never reused: the turn on it failed or was cut short (it may still carry audio)."""
        self._pool.remove(ws)

    async def open_turn(
        self,
        texts: Sequence[str],
        options: TurnOptions,
        *,
        request_id: str,
        input_closed: bool,
        timeout: float | None = None,
    ) -> Turn:
        say = _say_message(texts, options, request_id, input_closed)
        while True:
            # None: no limit, as for asyncio.wait_for (the pool's type says float)
            ws = await self._pool.get(timeout=timeout)  # type: ignore[arg-type]
            is_reused = self._pool.last_connection_reused
            if is_reused and ws.closed:  # the server closed the idle socket meanwhile
                self._discard(ws)
                continue
            try:
                turn = await _RemoteTurn.start(self, ws, request_id, say, timeout=timeout)
            except RuntimeUnavailable:
                self._discard(ws)
                if not is_reused:
                    raise
                continue
            turn.connection_reused = is_reused
            turn.acquire_time = self._pool.last_acquire_time
            return turn

    async def aclose(self) -> None:
        await self._pool.aclose()
        if self._owns_session and self._session is not None:
            await self._session.close()
        self._session = None


async def _close_socket(ws: aiohttp.ClientWebSocketResponse) -> None:
    await ws.close()


async def _cancel(task: asyncio.Future[Any]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def _say_message(
    texts: Sequence[str], options: TurnOptions, request_id: str, input_closed: bool
) -> dict[str, Any]:
    message: dict[str, Any] = {"type": "say", "request_id": request_id, "text": list(texts),
                               "input_closed": input_closed, "format": "pcm",
                               "segment_events": True, "queued_events": True,
                               **options.voice.to_mapping(), "priority": options.priority}
    if options.max_frames is not None:
        message["max_frames"] = options.max_frames
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
        self, client: RemoteRuntimeClient, ws: aiohttp.ClientWebSocketResponse, request_id: str,
        *, timeout: float | None = None,
    ) -> None:
        self._client = client
        self._ws = ws
        self.request_id = request_id
        self._timeout = timeout
        self._num_sent_segments = 0
        self._num_started_segments = 0  # ``segment`` events seen
        self._has_segment_events = False  # this server announces segments
        self._is_input_closed = False
        self._first_audio_time: float | None = None
        self._audio_s = 0.0  # received so far
        self._idle_since = time.monotonic()  # last message in, or last text out
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
        *,
        timeout: float | None = None,
    ) -> _RemoteTurn:
        turn = cls(client, ws, request_id, timeout=timeout)
        await turn._send(say)
        turn._num_sent_segments = len(say["text"])
        turn._is_input_closed = bool(say["input_closed"])
        turn._idle_since = time.monotonic()
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
            was_owed = self._is_owed()
            self._num_sent_segments += 1
            self._owe_from(was_owed)

    async def close_input(self) -> None:
        if not self._is_done:
            await self._send({"type": "end"})
            was_owed = self._is_owed()
            self._is_input_closed = True
            self._owe_from(was_owed)

    def _owe_from(self, was_owed: bool) -> None:
        """Text just went out: if the server owed us nothing before, its silence counts from
        now (if it did owe, the clock keeps running from its last message)."""
        if not was_owed:
            self._idle_since = time.monotonic()

    def _is_owed(self) -> bool:
        """Whether the server owes this turn a message: the first audio, ``turn_done`` once
        the input is closed, or the start of a segment we sent (servers that announce them)."""
        if self._first_audio_time is None or self._is_input_closed:
            return True
        return self._has_segment_events and self._num_started_segments < self._num_sent_segments

    def idle_bound_s(self, now: float) -> float | None:
        """How long the server may stay silent from ``_idle_since`` on; ``None`` = unbounded
        (an open turn whose segments have all started waits for our next ``append``)."""
        if self._timeout is None or not self._is_owed():
            return None
        lead = 0.0
        if self._first_audio_time is not None:
            lead = max(self._audio_s - (now - self._first_audio_time), 0.0)
        return self._timeout + lead

    async def _receive(self) -> aiohttp.WSMessage:
        """The next message; ``asyncio.TimeoutError`` when the server owes us something and
        stays silent past ``idle_bound_s``."""
        receiving = asyncio.ensure_future(self._ws.receive())
        try:
            while True:
                now = time.monotonic()
                bound = self.idle_bound_s(now)
                wait = RECEIVE_POLL_S
                if bound is not None:
                    left = self._idle_since + bound - now
                    if left <= 0:
                        raise asyncio.TimeoutError(
                            f"breezert serve sent nothing for {now - self._idle_since:.1f} s "
                            f"(timeout {self._timeout} s)")
                    wait = min(wait, left)
                done, _ = await asyncio.wait({receiving}, timeout=wait)
                if done:
                    self._idle_since = time.monotonic()
                    return receiving.result()
        finally:
            if not receiving.done():
                await _cancel(receiving)

    async def abort(self) -> None:
        if not self._is_done:
            await self._shutdown(send_cancel=True)

    async def _shutdown(self, *, send_cancel: bool) -> None:
        """Ends the turn on our side; the socket is never reused (it may still carry audio)."""
        self._is_done = True
        self._client._discard(self._ws)
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

    async def audio(self) -> AsyncIterator[bytes | SegmentStart]:
        import aiohttp

        is_clean = False
        try:
            while True:
                msg = await self._receive()
                if msg.type is aiohttp.WSMsgType.BINARY:
                    data = bytes(msg.data)
                    if self._first_audio_time is None:
                        self._first_audio_time = time.monotonic()
                    self._audio_s += len(data) / (2 * self._client.sample_rate)
                    yield data
                    continue
                if msg.type is not aiohttp.WSMsgType.TEXT:  # closed, closing or error
                    self._is_server_done = True
                    if isinstance(msg.data, TimeoutError):  # heartbeat: no pong in time
                        raise asyncio.TimeoutError("breezert serve did not answer a ping")
                    raise RuntimeUnavailable("WebSocket closed mid-turn")
                outcome = self._on_event(msg.data)
                if isinstance(outcome, SegmentStart):
                    yield outcome
                elif outcome:
                    is_clean = True
                    return
        finally:
            if self._playback_task is not None:
                await _cancel(self._playback_task)
            if is_clean:
                self._is_done = True
                self._client._reuse(self._ws)
            elif not self._is_done:  # cancelled or failed: tell the server unless it told us
                await self._shutdown(send_cancel=not self._is_server_done)

    def _on_event(self, raw: str) -> bool | SegmentStart:
        """Handles one JSON event; True when the turn is done, a ``SegmentStart`` for a
        ``segment`` event, raises when it failed."""
        try:
            event = json.loads(raw)
            kind = event.get("type")
        except (ValueError, AttributeError):
            logger.warning("breezert serve sent a malformed event; ignored")
            return False
        if kind == "segment":
            try:
                start = SegmentStart(int(event["index"]), float(event["start_s"]))
            except (KeyError, TypeError, ValueError):
                logger.warning("breezert serve sent a malformed segment event; ignored")
                return False
            self._has_segment_events = True
            self._num_started_segments = max(self._num_started_segments, start.index + 1)
            return start
        if kind == "queued":
            self._client.num_queued_turns += 1
            log_queued(self.request_id, event.get("waiting"), event.get("max_running_requests"))
        elif kind == "turn_started":
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
