"""``/v1/audio/speech/stream``: turns over a WebSocket, JSON text in, audio bytes out.

Owns: the socket loop (JSON control messages in, ``say`` ... ``end``/``cancel`` as in
``protocol.py``) and the audio sink that sends each chunk as one binary message: PCM16 24 kHz
(``format: "pcm"``, default) or Ogg/Opus (``"opus"``, one Ogg stream per turn). Must not: pace
audio; the client plays it as it arrives, and errors leave the socket open.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

from aiohttp import WSMsgType, web

from breezert.audio import ENGINE_SAMPLE_RATE, float_to_pcm16
from breezert.outputs import AudioChunk
from breezert.server.ogg_opus import OggOpusWriter
from breezert.server.protocol import (
    MAX_REFERENCE_MESSAGE_BYTES,
    ProtocolError,
    Say,
    error_event,
    event,
    parse_message,
)
from breezert.server.state import STATE, ServerState
from breezert.server.turns import TurnController
from breezert.server.webrtc_track import TurnPlayout

logger = logging.getLogger("breezert.server")


def setup(app: web.Application) -> None:
    app.router.add_get("/v1/audio/speech/stream", speech_stream)


@dataclass(eq=False)
class _WsTurn:
    marks: TurnPlayout
    ogg: OggOpusWriter | None


class WebSocketSink:
    """Sends each engine chunk as a binary message (PCM16 or Ogg/Opus pages)."""

    def __init__(self, ws: web.WebSocketResponse, state: ServerState) -> None:
        self._ws = ws
        self._state = state
        self._turns: dict[str, _WsTurn] = {}

    def begin(self, turn_id: str, sample_rate: int, say: Say) -> TurnPlayout:
        ogg = OggOpusWriter(sample_rate) if say.format == "opus" else None
        turn = _WsTurn(TurnPlayout(turn_id), ogg)
        self._turns[turn_id] = turn
        return turn.marks

    async def write(self, turn_id: str, chunk: AudioChunk) -> None:
        turn = self._turns.get(turn_id)
        if turn is None:
            return
        data = turn.ogg.write(chunk.pcm) if turn.ogg is not None else float_to_pcm16(chunk.pcm)
        await self._send(turn, data)

    async def finish(self, turn_id: str) -> None:
        turn = self._turns.pop(turn_id, None)
        if turn is not None and turn.ogg is not None:
            await self._send(turn, turn.ogg.close())
        if turn is not None:
            turn.marks.first_frame.set()  # a turn without audio: release the waiter

    def cancel(self, turn_id: str) -> None:
        turn = self._turns.pop(turn_id, None)
        if turn is not None:
            turn.marks.first_frame.set()

    async def _send(self, turn: _WsTurn, data: bytes) -> None:
        if not data or self._ws.closed:
            return
        await self._ws.send_bytes(data)
        if turn.marks.first_frame_time is None:
            turn.marks.first_frame_time = self._state.clock()
            turn.marks.first_frame.set()


async def speech_stream(request: web.Request) -> web.WebSocketResponse:
    state = request.app[STATE]
    # NOTE: a say with reference_audio may be large; parse_message holds every other message
    # to MAX_MESSAGE_BYTES.
    ws = web.WebSocketResponse(heartbeat=30.0, max_msg_size=MAX_REFERENCE_MESSAGE_BYTES)
    await ws.prepare(request)
    state.num_ws_sessions += 1
    sink = WebSocketSink(ws, state)

    async def send(text: str) -> None:
        if not ws.closed:
            with contextlib.suppress(ConnectionError):  # the client left: nobody to tell
                await ws.send_str(text)

    controller = TurnController(
        state.client, sink, send, max_text_chars=state.serving.max_text_chars,
        idle_timeout_s=state.serving.turn_idle_timeout_s,
        request_options=state.request_options, clock=state.clock,
        on_first_audio=state.first_audio.observe,
    )
    state.websockets[ws] = controller
    try:
        await send(event("ready", sample_rate=ENGINE_SAMPLE_RATE, formats=["pcm", "opus"]))
        async for msg in ws:
            if msg.type == WSMsgType.TEXT:
                await _handle(controller, msg.data, send)
            elif msg.type == WSMsgType.BINARY:
                await send(error_event("bad_message", "binary messages are not accepted; send "
                                       "JSON text"))
            elif msg.type == WSMsgType.ERROR:
                logger.info("websocket closed with error: %s", ws.exception())
    finally:
        # NOTE: aiohttp cancels this handler when the client leaves; count it out first.
        state.num_ws_sessions -= 1
        state.websockets.pop(ws, None)
        await asyncio.shield(controller.aclose())
    return ws


async def _handle(controller: TurnController, raw: str, send) -> None:  # type: ignore[no-untyped-def]
    """One text message; whatever it holds, the socket stays open (an ``error`` event says
    what was wrong, with ``field`` when one field is at fault)."""
    try:
        message = parse_message(raw, allow_playout=False)
        await controller.handle(message)
    except ProtocolError as exc:
        await send(exc.as_event())
    except Exception as exc:  # noqa: BLE001 - one bad message must not drop the socket
        logger.exception("websocket message failed")
        await send(error_event("internal", f"{type(exc).__name__}: the message could not be "
                               "handled"))
