"""``RemoteRuntimeClient``: turns on a ``breezert serve`` over its WebSocket.

Owns: the client side of ``/v1/audio/speech/stream`` (messages out, PCM16 and events in, error
codes mapped to the runtime's errors), the pool of sockets reused between turns, and, given
several replicas, the choice of one per turn from their ``/readyz`` and the failover before a
turn's first audio. Must not: import torch or the engine: a remote-only agent installs neither.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from livekit.agents.utils import ConnectionPool

from breezert.errors import (
    BreezeRTError,
    EngineOverloaded,
    InvalidRequest,
    RequestAborted,
    RequestFailed,
)
from breezert.sched.load import EngineLoad
from breezert.server.protocol import INVALID_REQUEST_CODES, MESSAGE_COMPLAINT_CODES, OVERLOADED_CODE

from ..log import logger
from ..models import (
    DEFAULT_HEARTBEAT_S,
    DEFAULT_MAX_SESSION_S,
    DEFAULT_READINESS_INTERVAL_S,
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


def readiness_url(base_url: str) -> str:
    """The replica's ``/readyz`` (``http(s)://host:port[/prefix]/readyz``) for a ``base_url``
    as ``speech_stream_url`` takes it."""
    url = speech_stream_url(base_url)[: -len(SPEECH_STREAM_PATH)]
    return url.replace("wss://", "https://", 1).replace("ws://", "http://", 1) + "/readyz"


_RANK = {"ready": 0, "full": 1, "unknown": 2}
"""Preference by readiness status; anything else (draining, warming_up, failed, down) last."""


@dataclass
class _Readiness:
    """What this process knows of one replica (shared by every client of the process: LiveKit
    runs each job's ``TTS`` on its own event loop, and their turns must spread together)."""

    status: str = "unknown"
    load: EngineLoad | None = None
    checked_at: float = 0.0
    opened_since: int = 0
    """Turns this process sent there after the sample (the sample does not show them yet)."""

    def key(self) -> tuple[int, float, int]:
        fraction = 0.0
        if self.load is not None:
            fraction = self.load.fraction + self.opened_since / max(self.load.max_running, 1)
        return _RANK.get(self.status, 3), fraction, self.opened_since


_readiness: dict[str, _Readiness] = {}
_readiness_lock = threading.Lock()
_tie_breaker = itertools.count()


class _Replica:
    """One ``breezert serve``: its socket pool (this client's) and its readiness (the
    process's)."""

    def __init__(self, base_url: str, connect: Any, max_session_duration: float | None) -> None:
        self.url = speech_stream_url(base_url)
        self.base_url = readiness_url(base_url)[: -len("/readyz")]
        self.readyz = self.base_url + "/readyz"
        with _readiness_lock:
            self.readiness = _readiness.setdefault(self.readyz, _Readiness())
        self.pool: ConnectionPool[aiohttp.ClientWebSocketResponse] = ConnectionPool(
            connect_cb=lambda timeout: connect(self, timeout), close_cb=_close_socket,
            connect_timeout=10.0, max_session_duration=max_session_duration,
        )  # sockets idle between turns; connect_timeout bounds the prewarm connect

    def update(self, status: str, load: EngineLoad | None) -> None:
        with _readiness_lock:
            r = self.readiness
            r.status, r.load, r.checked_at, r.opened_since = status, load, time.monotonic(), 0

    def opened(self) -> None:
        with _readiness_lock:
            self.readiness.opened_since += 1


class RemoteRuntimeClient(RuntimeClient):
    """Runs turns on ``breezert serve`` replicas over their WebSocket ``/v1/audio/speech/stream``.

    Protocol (one turn at a time per socket; a socket is reused after a clean ``turn_done``):
    client → server JSON text ``say`` (``text`` segments, ``input_closed``, voice options,
    ``request_id``), ``append`` (``text``), ``end``, ``cancel``, ``playback`` (``buffered_s``,
    ``age_s``, ``source``); server → client binary PCM16 24 kHz mono, and JSON ``ready``,
    ``turn_started``, ``first_audio``, ``turn_done`` (``status``: finished, failed, aborted or
    cancelled) and ``error`` (``code``, ``message``). An error before ``turn_started`` rejects
    the turn; after it, only message-level complaints (``bad_field``, ...) let the turn go on.

    Several replicas (``base_url`` a list): their ``/readyz`` is polled every
    ``readiness_interval`` seconds while the client is in use, and each turn goes to the least
    loaded one (ready before full before unknown before draining or down; then the lowest
    ``load.fraction`` counting the turns this process sent since the sample). A turn whose
    replica cannot be reached, refuses it (``overloaded``, a 503 while draining) or drops the
    socket before the turn's first audio is sent again, with every text it has so far, to the
    next replica; once audio has come, a lost replica ends the turn with
    ``RuntimeUnavailable`` (never replayed elsewhere: that audio already played).

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
        base_url: str | Sequence[str],
        *,
        auth_token: str | None = None,
        http_session: aiohttp.ClientSession | None = None,
        max_session_duration: float | None = DEFAULT_MAX_SESSION_S,
        heartbeat: float | None = DEFAULT_HEARTBEAT_S,
        readiness_interval: float = DEFAULT_READINESS_INTERVAL_S,
    ) -> None:
        urls = [base_url] if isinstance(base_url, str) else list(base_url)
        if not urls:
            raise ValueError("base_url: give at least one breezert serve URL")
        self._replicas = [_Replica(url, self._connect, max_session_duration) for url in urls]
        self._auth_token = auth_token
        self._session = http_session
        self._owns_session = http_session is None
        self._heartbeat = heartbeat
        self._readiness_interval = readiness_interval
        self._poller: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        """The (first) replica's turn WebSocket URL."""
        return self._replicas[0].url

    @property
    def urls(self) -> list[str]:
        return [replica.url for replica in self._replicas]

    def _http(self) -> aiohttp.ClientSession:
        import aiohttp

        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession()
            self._owns_session = True
        return self._session

    async def _connect(self, replica: _Replica,
                       timeout: float | None) -> aiohttp.ClientWebSocketResponse:
        import aiohttp

        url = replica.url
        headers = {"Authorization": f"Bearer {self._auth_token}"} if self._auth_token else {}
        try:
            return await asyncio.wait_for(
                self._http().ws_connect(
                    url, headers=headers, max_msg_size=0, heartbeat=self._heartbeat,
                    # a frozen server never answers our close frame: do not wait 10 s for it
                    timeout=aiohttp.ClientWSTimeout(ws_receive=None, ws_close=CLOSE_TIMEOUT_S)),
                timeout,
            )
        except TimeoutError:
            # NOTE: before OSError: on Python 3.11 TimeoutError (= asyncio.TimeoutError, and
            # aiohttp's ServerTimeoutError) is an OSError, and a timeout is no connection error.
            raise asyncio.TimeoutError(f"connecting to {url} took over {timeout} s") from None
        except aiohttp.WSServerHandshakeError as exc:
            if exc.status in (401, 403):
                raise InvalidRequest(f"breezert serve refused the token (HTTP {exc.status})") \
                    from None
            raise RuntimeUnavailable(f"WebSocket handshake with {url} failed: HTTP "
                                     f"{exc.status}") from None
        except (aiohttp.ClientError, OSError) as exc:
            raise RuntimeUnavailable(f"cannot reach {url}: {type(exc).__name__}") from exc

    def prewarm(self) -> None:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return  # no event loop to connect from: the first turn connects
        if len(self._replicas) == 1:
            self._replicas[0].pool.prewarm()
        else:  # which replica the first turn takes is not known yet: read their readiness
            self._ensure_polling()

    # ------------------------------------------------------------------ replicas
    def _ensure_polling(self) -> None:
        if len(self._replicas) > 1 and (self._poller is None or self._poller.done()):
            self._poller = asyncio.ensure_future(self._poll_forever())

    async def _poll_forever(self) -> None:
        while True:
            await self.poll_readiness(max_age=self._readiness_interval / 2)
            await asyncio.sleep(self._readiness_interval)

    async def poll_readiness(self, max_age: float = 0.0) -> None:
        """Reads ``/readyz`` of every replica whose sample is older than ``max_age`` s."""
        now = time.monotonic()
        stale = [r for r in self._replicas if now - r.readiness.checked_at >= max_age]
        await asyncio.gather(*(self._probe(r) for r in stale))

    async def _probe(self, replica: _Replica) -> None:
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=max(min(self._readiness_interval * 2, 2.0), 0.2))
        try:
            async with self._http().get(replica.readyz, timeout=timeout) as reply:
                try:
                    body = await reply.json(content_type=None)
                except ValueError:
                    body = None
                status = "ready" if reply.status == 200 else "unready"
                if isinstance(body, dict):
                    status = str(body.get("status", status))
                    load = EngineLoad.from_json(body.get("load"))
                else:
                    load = None
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
            status, load = "down", None
        replica.update(status, load)

    def _choose(self, tried: set[_Replica]) -> _Replica | None:
        """The replica for a turn (or its failover): the best readiness not tried yet."""
        left = [r for r in self._replicas if r not in tried]
        if not left:
            return None
        if len(self._replicas) == 1:
            return left[0]
        turn = next(_tie_breaker)  # equal replicas take turns
        with _readiness_lock:
            keys = {id(r): r.readiness.key() for r in left}
        order = sorted(range(len(left)), key=lambda i: (keys[id(left[i])],
                                                        (i - turn) % len(left)))
        choice = left[order[0]]
        choice.opened()
        return choice

    def _choose_left(self, tried: set[_Replica | None]) -> _Replica | None:
        """Any replica not in ``tried`` (no preference, nothing counted)."""
        return next((r for r in self._replicas if r not in tried), None)

    def _reuse(self, replica: _Replica, ws: aiohttp.ClientWebSocketResponse) -> None:
        """Back to the pool after a clean ``turn_done`` (the only way a socket is reused)."""
        if ws.closed:
            replica.pool.remove(ws)
        else:
            replica.pool.put(ws)

    def _discard(self, replica: _Replica, ws: aiohttp.ClientWebSocketResponse) -> None:
        """Never reused: the turn on it failed or was cut short (it may still carry audio)."""
        replica.pool.remove(ws)

    async def open_turn(
        self,
        texts: Sequence[str],
        options: TurnOptions,
        *,
        request_id: str,
        input_closed: bool,
        timeout: float | None = None,
    ) -> Turn:
        if len(self._replicas) > 1:
            self._ensure_polling()
            if all(r.readiness.checked_at == 0.0 for r in self._replicas):
                await self.poll_readiness()  # the first turn: no sample yet
        turn = _RemoteTurn(self, request_id, _say_message(texts, options, request_id,
                                                          input_closed), timeout=timeout)
        await turn.open()
        return turn

    async def aclose(self) -> None:
        if self._poller is not None:
            await _cancel(self._poller)
            self._poller = None
        for replica in self._replicas:
            await replica.pool.aclose()
        if self._owns_session and self._session is not None:
            await self._session.close()
        self._session = None


async def _close_socket(ws: aiohttp.ClientWebSocketResponse) -> None:
    await ws.close()


async def _send_on(ws: aiohttp.ClientWebSocketResponse, message: dict[str, Any]) -> None:
    try:
        await ws.send_str(json.dumps(message))
    except (ConnectionError, RuntimeError, OSError) as exc:  # aiohttp: closing transport
        raise RuntimeUnavailable(f"WebSocket send failed: {type(exc).__name__}") from exc


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
        retry = event.get("retry_after_s")
        known = isinstance(retry, (int, float)) and not isinstance(retry, bool) and retry > 0
        return EngineOverloaded(message, float(retry) if known else None)
    return RequestFailed(request_id, f"{code or 'failed'}: {message}")


class _RemoteTurn(Turn):
    def __init__(
        self, client: RemoteRuntimeClient, request_id: str, say: dict[str, Any],
        *, timeout: float | None = None,
    ) -> None:
        self._client = client
        self.request_id = request_id
        self._say = say
        self._texts: list[str] = list(say["text"])  # every segment sent so far, in order
        self._is_input_closed = bool(say["input_closed"])
        self._timeout = timeout
        self._tried: set[_Replica] = set()
        self._replica: _Replica | None = None
        self._ws: aiohttp.ClientWebSocketResponse = None  # type: ignore[assignment]  # open()
        self._send_lock = asyncio.Lock()
        self._has_yielded = False  # audio or a segment mark went to the plugin
        self._is_done = False
        self._use_playback = True
        self._playback_task: asyncio.Future[None] | None = None
        self._reset_socket_state()

    def _reset_socket_state(self) -> None:
        """What one socket's part of the turn knows (a failover starts it again)."""
        self._num_sent_segments = len(self._texts)
        self._num_started_segments = 0  # ``segment`` events seen
        self._has_segment_events = False  # this server announces segments
        self._first_audio_time: float | None = None
        self._audio_s = 0.0  # received so far
        self._idle_since = time.monotonic()  # last message in, or last text out
        self.server_request_id: str | None = None
        self._is_server_done = False  # the server ended the turn (done, error or closed)
        self._is_started = False

    async def open(self) -> None:
        """Sends the turn (every text so far) to the best replica not tried yet; one that
        cannot be reached is marked down and the next is tried."""
        async with self._send_lock:
            while True:
                replica = self._client._choose(self._tried)
                if replica is None:
                    raise RuntimeUnavailable("no breezert serve replica is left to try")
                try:
                    await self._start_on(replica)
                    return
                except (RuntimeUnavailable, asyncio.TimeoutError):
                    self._tried.add(replica)
                    replica.update("down", None)
                    if self._client._choose_left(self._tried) is None:
                        raise

    async def _start_on(self, replica: _Replica) -> None:
        say = {**self._say, "text": list(self._texts), "input_closed": self._is_input_closed}
        while True:
            # None: no limit, as for asyncio.wait_for (the pool's type says float)
            ws = await replica.pool.get(timeout=self._timeout)  # type: ignore[arg-type]
            is_reused = replica.pool.last_connection_reused
            if is_reused and ws.closed:  # the server closed the idle socket meanwhile
                self._client._discard(replica, ws)
                continue
            try:
                await _send_on(ws, say)
            except RuntimeUnavailable:
                self._client._discard(replica, ws)
                if not is_reused:
                    raise
                continue
            self._replica, self._ws, self.base_url = replica, ws, replica.base_url
            self.connection_reused = is_reused
            self.acquire_time = replica.pool.last_acquire_time
            self._reset_socket_state()
            return

    def _may_fail_over(self) -> bool:
        """Before any audio, with a replica left to try: the turn can move without a trace."""
        return (not self._has_yielded and not self._is_done
                and self._client._choose_left(self._tried | {self._replica}) is not None)

    async def _fail_over(self, reason: Exception) -> None:
        assert self._replica is not None
        logger.warning("breezert turn %s moves to another replica before its first audio: %s",
                       self.request_id, reason, extra={"request_id": self.request_id})
        self._tried.add(self._replica)
        status = "full" if isinstance(reason, EngineOverloaded) else "down"
        self._replica.update(status, None)
        self._client._discard(self._replica, self._ws)
        await self._ws.close()
        await self.open()

    async def _send(self, message: dict[str, Any]) -> None:
        async with self._send_lock:
            await _send_on(self._ws, message)

    async def _send_text(self, message: dict[str, Any]) -> None:
        """``append`` / ``end``: a send to a replica that died before the first audio is no
        error (the failover sends every text again)."""
        try:
            await self._send(message)
        except RuntimeUnavailable:
            if not self._may_fail_over():
                raise

    async def append(self, text: str) -> None:
        if not self._is_done:
            self._texts.append(text)
            await self._send_text({"type": "append", "text": text})
            was_owed = self._is_owed()
            self._num_sent_segments += 1
            self._owe_from(was_owed)

    async def close_input(self) -> None:
        if not self._is_done:
            self._is_input_closed = True
            await self._send_text({"type": "end"})
            was_owed = self._is_owed()
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
        if self._replica is not None:
            self._client._discard(self._replica, self._ws)
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
        is_clean = False
        try:
            while True:
                try:
                    item = await self._next_item()
                except (RuntimeUnavailable, EngineOverloaded) as exc:
                    if not self._may_fail_over():
                        raise
                    await self._fail_over(exc)
                    continue
                if item is None:
                    is_clean = True
                    return
                if isinstance(item, bytes) or isinstance(item, SegmentStart):
                    self._has_yielded = True
                    yield item
        finally:
            if self._playback_task is not None:
                await _cancel(self._playback_task)
            if is_clean:
                self._is_done = True
                assert self._replica is not None
                self._client._reuse(self._replica, self._ws)
            elif not self._is_done:  # cancelled or failed: tell the server unless it told us
                await self._shutdown(send_cancel=not self._is_server_done)

    async def _next_item(self) -> bytes | SegmentStart | bool | None:
        """The next audio or segment mark; ``None`` once the turn is done; False for an
        event that carries neither. Raises the turn's failure."""
        import aiohttp

        msg = await self._receive()
        if msg.type is aiohttp.WSMsgType.BINARY:
            data = bytes(msg.data)
            if self._first_audio_time is None:
                self._first_audio_time = time.monotonic()
            self._audio_s += len(data) / (2 * self._client.sample_rate)
            return data
        if msg.type is not aiohttp.WSMsgType.TEXT:  # closed, closing or error
            self._is_server_done = True
            if isinstance(msg.data, TimeoutError):  # heartbeat: no pong in time
                raise asyncio.TimeoutError("breezert serve did not answer a ping")
            if self._first_audio_time is None:
                raise RuntimeUnavailable(f"{self.base_url} closed the WebSocket before the "
                                         "turn's first audio")
            raise RuntimeUnavailable(
                f"{self.base_url} closed the WebSocket mid-turn after {self._audio_s:.2f} s of "
                "audio; the turn is not replayed on another replica (that audio already "
                "played)")
        outcome = self._on_event(msg.data)
        if outcome is True:
            return None
        return outcome

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
