"""One conversation's turns: say/append/end/cancel -> engine requests -> an audio sink.

Owns: the turn lifecycle shared by the DataChannel and the WebSocket (one turn at a time per
connection), text limits, mapping engine errors to protocol errors, the client segment each
engine segment belongs to (the engine's text front end cuts one that does not fit:
``Split.FIT``), and the server's ``turn_started`` / ``first_audio`` / ``turn_done`` messages.
Must not: know the transport or the audio format (a ``TurnSink`` turns chunks into frames or
bytes, ``send`` delivers messages), or tokenize on the event loop (the engine does, off it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from breezert.audio import ENGINE_SAMPLE_RATE
from breezert.constants import FRAME_S
from breezert.engine_client import EngineClient
from breezert.errors import EngineOverloaded, InvalidRequest, RequestAborted, RequestFailed
from breezert.outputs import AudioChunk
from breezert.request import Reference, SynthesisRequest
from breezert.server.protocol import (
    OVERLOADED_CODE,
    Append,
    Cancel,
    End,
    Message,
    Playback,
    ProtocolError,
    Say,
    event,
)
from breezert.text import Split

logger = logging.getLogger("breezert.server")


class PlayoutMarks(Protocol):
    """What a sink reports about a turn's playout (``webrtc_track.TurnPlayout``)."""

    first_frame: asyncio.Event
    first_frame_time: float | None
    num_starved_frames: int


class TurnSink(Protocol):
    """Where a turn's audio goes: a WebRTC track or a WebSocket."""

    def begin(self, turn_id: str, sample_rate: int, say: Say) -> PlayoutMarks: ...
    async def write(self, turn_id: str, chunk: AudioChunk) -> None: ...
    async def finish(self, turn_id: str) -> None:
        """The engine is done: flush and return once the turn's audio has been sent."""
    def cancel(self, turn_id: str) -> None:
        """Barge-in: drop the turn's queued audio at once."""


@dataclass(eq=False)
class _Turn:
    request_id: str
    client_request_id: str | None
    say_time: float
    is_input_open: bool
    num_chars: int
    marks: PlayoutMarks | None = None
    task: asyncio.Task[None] | None = field(default=None, repr=False)
    status: str | None = None  # set once turn_done is sent
    concealment_events: int = 0
    idle_timer: asyncio.TimerHandle | None = field(default=None, repr=False)
    """Closes the input when no append/end comes in time (``idle_timeout_s``)."""
    reason: str | None = None
    """Why the server closed the turn's input (``idle_timeout``), reported in ``turn_done``."""
    error_code: str | None = None
    """``turn_done``'s ``code`` for a failure a client maps to a type (``overloaded``)."""
    segment_owners: list[int] = field(default_factory=list)
    """The client's segment (say text, then each append) of each engine segment: the server
    cuts a segment whose prompt does not fit into several."""
    segment_events: bool = False
    """The client asked for ``segment`` events."""
    num_client_segments: int = 0
    next_segment: int = 0
    """First client segment whose ``segment`` event has not been sent."""


class TurnController:
    """Runs one connection's turns against the engine, one at a time.

    Args:
        engine: The engine (the shared ``AsyncEngine`` in production).
        sink: Receives each turn's chunks.
        send: Delivers a server message (JSON text) to the client.
        max_text_chars: Characters per turn over ``say`` and all ``append``s.
        idle_timeout_s: An open turn (``more``) that gets no ``append``/``end`` for this long
            has its input closed (its text is still spoken); ``None`` = wait forever.
        request_options: Extra ``SynthesisRequest`` fields for every turn (server policy).
        clock: Monotonic time source, the same one the sink stamps playout with.
    """

    def __init__(
        self,
        engine: EngineClient,
        sink: TurnSink,
        send: Callable[[str], Awaitable[None]],
        *,
        max_text_chars: int,
        idle_timeout_s: float | None = None,
        request_options: Mapping[str, Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_first_audio: Callable[[float], None] | None = None,
    ) -> None:
        self.engine = engine
        self.sink = sink
        self._send = send
        self._max_text_chars = max_text_chars
        self._idle_timeout_s = idle_timeout_s
        self._request_options = dict(request_options or {})
        self._clock = clock
        self._on_first_audio = on_first_audio
        self.active: _Turn | None = None

    async def handle(self, message: Message) -> None:
        """Applies one client message; raises ``ProtocolError`` when it cannot apply."""
        if isinstance(message, Say):
            await self._say(message)
        elif isinstance(message, Append):
            await self._append(message.text)
        elif isinstance(message, End):
            turn = self.active
            if turn is None:
                raise ProtocolError("no_open_turn", "end needs a turn started with say")
            if turn.is_input_open:  # ending an already closed turn is harmless: a no-op
                turn.is_input_open = False
                self._disarm(turn)
                with _engine_errors():
                    self.engine.close_input(turn.request_id)
        elif isinstance(message, Cancel):
            await self.cancel()
        elif isinstance(message, Playback):
            self.report_playback(message.buffered_s, self._clock() - message.age_s,
                                 message.source)
        else:  # playout is the transport's business
            raise ProtocolError("unknown_type", f"{type(message).__name__} is not a turn message")

    def report_playback(self, buffered_s: float, measured_at: float, source: str) -> None:
        """Forwards the listener's buffer level for the active turn (ignored between turns)."""
        turn = self.active
        if turn is None:
            return
        # InvalidRequest: the request just finished; telemetry may race the turn's end.
        with contextlib.suppress(InvalidRequest):
            self.engine.report_playback(turn.request_id, buffered_s, measured_at, source)

    async def cancel(self) -> None:
        """Barge-in: silence at once, abort the engine request, report ``turn_done``."""
        turn = self.active
        if turn is None:
            return
        self.sink.cancel(turn.request_id)
        self.engine.abort(turn.request_id)
        if turn.task is not None:
            turn.task.cancel()
            await asyncio.gather(turn.task, return_exceptions=True)
        await self._done(turn, "cancelled")

    async def aclose(self) -> None:
        await self.cancel()

    # ------------------------------------------------------------------ turns
    async def _say(self, say: Say) -> None:
        if self.active is not None:
            raise ProtocolError("turn_active",
                                "a turn is already playing; send cancel first (barge-in)")
        self._check_chars(say.num_chars, 0)
        say_time = self._clock()
        request = self._request(say)  # every cheap check before encoding the reference
        if say.reference is not None:
            reference = await self._encode_reference(say)
            if self.active is not None:  # NOTE: the transports handle messages in order
                raise ProtocolError("turn_active", "a turn started while the reference audio "
                                    "was being encoded; send cancel first (barge-in)")
            try:
                request = replace(request, reference=reference)
            except InvalidRequest as exc:
                raise ProtocolError("invalid_request", str(exc)) from None
        with _engine_errors():  # each say segment whole when it fits, else cut (off the loop)
            submitted = await self.engine.submit(request, split=Split.FIT)
        request_id = submitted.request_id
        turn = _Turn(request_id, say.client_request_id, say_time, say.more, say.num_chars,
                     num_client_segments=len(request.segments),
                     segment_events=say.segment_events,
                     segment_owners=list(submitted.segment_owners))
        try:
            turn.marks = self.sink.begin(request_id, ENGINE_SAMPLE_RATE, say)
            self.active = turn
            await self._send(event("turn_started", **self._ids(turn)))
            if say.queued_events and submitted.is_queued:
                capacity = self.engine.capacity()  # lengths: no engine lock on the loop
                await self._send(event("queued", **self._ids(turn), waiting=capacity.queued,
                                       max_running_requests=capacity.max_running))
        except BaseException:  # nobody will consume the request: free it now
            self.engine.abort(request_id)
            self.active = None
            raise
        turn.task = asyncio.create_task(self._run(turn), name=f"turn-{request_id}")
        self._arm(turn)

    async def _encode_reference(self, say: Say) -> Reference:
        """The say's reference audio -> ``breezert.request.Reference`` (off the event loop)."""
        assert say.reference is not None
        ref = say.reference
        try:
            return await self.engine.encode_reference(ref.samples, ref.sample_rate, ref.text)
        except InvalidRequest as exc:
            raise ProtocolError("invalid_request", reference_message(str(exc))) from None

    def _request(self, say: Say) -> SynthesisRequest:
        try:
            return SynthesisRequest(text=say.text, options=say.options,
                                    input_closed=not say.more,
                                    **{**self._request_options, **say.turn_fields})
        except (InvalidRequest, TypeError) as exc:
            raise ProtocolError("invalid_request", str(exc)) from None

    @staticmethod
    def _ids(turn: _Turn) -> dict[str, Any]:
        ids: dict[str, Any] = {"turn_id": turn.request_id, "request_id": turn.request_id}
        if turn.client_request_id is not None:
            ids["client_request_id"] = turn.client_request_id
        return ids

    async def _append(self, text: str) -> None:
        turn = self._open_turn("append")
        self._check_chars(len(text), turn.num_chars)
        if text.strip():  # whitespace-only pieces carry nothing to say
            self._disarm(turn)  # the idle timer must not close the input under the append
            try:
                with _engine_errors():  # whole when it fits, else cut (off the event loop)
                    num_segments = await self.engine.append(turn.request_id, text,
                                                            split=Split.FIT)
            finally:
                self._arm(turn)
            turn.segment_owners.extend([turn.num_client_segments] * num_segments)
        turn.num_client_segments += 1
        turn.num_chars += len(text)
        self._arm(turn)

    def _arm(self, turn: _Turn) -> None:
        """(Re)starts the idle timer of an open turn: it has just received text."""
        self._disarm(turn)
        if turn.is_input_open and self._idle_timeout_s is not None:
            turn.idle_timer = asyncio.get_running_loop().call_later(
                self._idle_timeout_s, self._close_idle, turn)

    @staticmethod
    def _disarm(turn: _Turn) -> None:
        if turn.idle_timer is not None:
            turn.idle_timer.cancel()
            turn.idle_timer = None

    def _close_idle(self, turn: _Turn) -> None:
        """No append/end in time: close the input so the turn ends once its text is spoken
        and its running slot goes to the next caller."""
        turn.idle_timer = None
        if self.active is not turn or not turn.is_input_open or turn.status is not None:
            return
        turn.is_input_open = False
        turn.reason = "idle_timeout"
        logger.info("turn %s: no append or end for %g s; input closed", turn.request_id,
                    self._idle_timeout_s)
        # InvalidRequest: the request ended meanwhile (its outcome reaches _run anyway).
        with contextlib.suppress(InvalidRequest):
            self.engine.close_input(turn.request_id)

    async def _run(self, turn: _Turn) -> None:
        status, error = "finished", None
        first = asyncio.create_task(self._report_first_audio(turn))
        try:
            async with contextlib.aclosing(
                    self.engine.stream(turn.request_id, segments=True)) as chunks:
                async for item in chunks:
                    if not isinstance(item, AudioChunk):  # the engine's SegmentStarted
                        await self._announce(turn, item.segment_index, item.start_frame)
                        continue
                    await self._announce(turn, item.segment_index, item.frame_start)
                    await self.sink.write(turn.request_id, item)
            await self.sink.finish(turn.request_id)
        except RequestAborted:
            status = "aborted"
        except RequestFailed as exc:
            status, error = "failed", exc.reason
        except EngineOverloaded as exc:  # it waited past max_queue_wait_s for a slot
            status, error, turn.error_code = "failed", str(exc), OVERLOADED_CODE
        except asyncio.CancelledError:
            first.cancel()
            raise
        except Exception as exc:  # a sink fault ends this turn only
            logger.exception("turn %s failed in its sink", turn.request_id)
            self.engine.abort(turn.request_id)
            status, error = "failed", f"{type(exc).__name__}: {exc}"
        if status != "finished":
            self.sink.cancel(turn.request_id)  # drop what is left; releases the sink's turn
        assert turn.marks is not None
        if turn.marks.first_frame.is_set():
            await first  # first_audio goes out before turn_done
        first.cancel()
        await self._done(turn, status, error)

    async def _announce(self, turn: _Turn, engine_segment: int, start_frame: int) -> None:
        """``segment`` events for the client segments that start by engine segment
        ``engine_segment`` at ``start_frame`` (the engine's ``SegmentStarted`` marks, exact),
        before any of their audio goes out."""
        if not turn.segment_events:
            return
        owners = turn.segment_owners
        index = owners[engine_segment] if engine_segment < len(owners) else engine_segment
        while turn.next_segment <= index:
            await self._send(event("segment", **self._ids(turn), index=turn.next_segment,
                                   start_frame=start_frame,
                                   start_s=round(start_frame * FRAME_S, 3)))
            turn.next_segment += 1

    async def _report_first_audio(self, turn: _Turn) -> None:
        assert turn.marks is not None
        await turn.marks.first_frame.wait()
        if turn.marks.first_frame_time is None or turn.status is not None:
            return
        first_audio_s = turn.marks.first_frame_time - turn.say_time
        if self._on_first_audio is not None:
            self._on_first_audio(first_audio_s)
        await self._send(event("first_audio", **self._ids(turn),
                               server_ms=round(first_audio_s * 1000, 1)))

    async def _done(self, turn: _Turn, status: str, error: str | None = None) -> None:
        if turn.status is not None:
            return
        turn.status = status
        self._disarm(turn)
        if self.active is turn:
            self.active = None
        fields: dict[str, Any] = {**self._ids(turn), "status": status}
        if error is not None:
            fields["error"] = error
        if turn.error_code is not None:
            fields["code"] = turn.error_code
        if turn.marks is not None:
            fields["starved_frames"] = turn.marks.num_starved_frames
        fields["concealment_events"] = turn.concealment_events
        if turn.reason == "idle_timeout":
            fields["reason"] = turn.reason
            fields["message"] = (f"no append or end for {self._idle_timeout_s:g} s "
                                 "(serving.turn_idle_timeout_s): the server closed the turn's "
                                 "input and spoke the text it had")
        await self._send(event("turn_done", **fields))

    # ------------------------------------------------------------------ helpers
    def _open_turn(self, kind: str) -> _Turn:
        turn = self.active
        if turn is not None and turn.reason == "idle_timeout":
            raise ProtocolError("no_open_turn", f"{kind}: the turn's input was closed after "
                                f"{self._idle_timeout_s:g} s without append or end "
                                "(serving.turn_idle_timeout_s); start a new turn with say")
        if turn is None or not turn.is_input_open:
            raise ProtocolError("no_open_turn", f"{kind} needs a turn started with say and "
                                "more=true (or input_closed=false)")
        return turn

    def _check_chars(self, num_new: int, num_before: int) -> None:
        if num_new + num_before > self._max_text_chars:
            raise ProtocolError(
                "text_too_long",
                f"the turn's text would be {num_new + num_before} characters; the limit is "
                f"{self._max_text_chars}",
            )



@contextlib.contextmanager
def _engine_errors() -> Iterator[None]:
    """An engine's refusal as the protocol error the client gets."""
    try:
        yield
    except InvalidRequest as exc:
        raise ProtocolError("invalid_request", prompt_message(str(exc))) from None
    except EngineOverloaded as exc:
        raise ProtocolError(OVERLOADED_CODE, f"the engine is at capacity, retry later: {exc}",
                            retry_after_s=exc.retry_after_s) from None


_SPLIT_ADVICE = "; split the text into segments"


def prompt_message(message: str) -> str:
    """An engine message about a prompt over the token limit, for a server client: the server
    has already cut the text as far as it goes, so what is left to shorten is the rest."""
    if message.startswith("text: the prompt is") and message.endswith(_SPLIT_ADVICE):
        return (message.removesuffix(_SPLIT_ADVICE) + " even for the shortest piece of text: "
                "shorten instructions or the reference audio and its reference_text")
    return message


def reference_message(message: str) -> str:
    """An ``encode_reference`` error in the client's field names (``samples: ...`` ->
    ``reference_audio: ...``)."""
    head = message.split("=", 1)[0].split(":", 1)[0].strip()
    if head in ("samples", "sample_rate"):
        return f"reference_audio: {message}"
    return message
