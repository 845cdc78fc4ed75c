"""``POST /v1/webrtc/offer``: one aiortc peer per offer, its audio track and "control" channel.

Owns: SDP offer -> answer (no STUN, host candidates per ``ice.py``, codec bound to the track),
the peer registry and its ``max_peers`` limit, the DataChannel loop (turn messages to the
``TurnController``, ``playout`` stats to ``report_playback``) and closing peers cleanly. Must
not: frame or pace audio (``EngineAudioTrack`` does) or block on one peer's work.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from typing import Any

from aioice import stun
from aiohttp import web
from aiortc import RTCConfiguration, RTCPeerConnection, RTCRtpSender, RTCSessionDescription
from aiortc.sdp import SessionDescription

from breezert.audio import FRAME_MS_CHOICES
from breezert.outputs import AudioChunk
from breezert.server.ice import host_addresses
from breezert.server.playout import PlayoutTracker
from breezert.server.protocol import (
    Playout,
    ProtocolError,
    Say,
    error_event,
    event,
    parse_message,
    show,
)
from breezert.server.state import STATE, ServerState, json_error, read_json_object
from breezert.server.turns import TurnController
from breezert.server.webrtc_track import SUPPORTED_CODECS, EngineAudioTrack, TurnPlayout

logger = logging.getLogger("breezert.server")
CONTROL_LABEL = "control"
MAX_INBOX = 256  # control messages waiting to be handled; a flood past this is dropped
CONSENT_PROBE_INTERVAL_S = 1.0  # a liveness probe a second (fewer if the bound is shorter)
CONSENT_PROBE_RETRANSMISSIONS = 2  # sent at 0, 0.5, 1.5 s, given up at 3.5 s: RTTs up to ~2 s


def setup(app: web.Application) -> None:
    app.router.add_post("/v1/webrtc/offer", offer)
    app.on_shutdown.append(_close_all)


async def offer(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await read_json_object(request)
    if isinstance(body, web.Response):
        return body
    sdp, frame_ms = body.get("sdp"), body.get("frame_ms", state.frame_ms)
    if body.get("type", "offer") != "offer":
        return json_error(400, f"type={show(body.get('type'))}: only an 'offer' is accepted",
                          param="type")
    if not isinstance(sdp, str) or not sdp.strip():
        return json_error(400, "sdp is required: the offer's SDP text", param="sdp")
    if isinstance(frame_ms, bool) or not isinstance(frame_ms, int) \
            or frame_ms not in FRAME_MS_CHOICES:
        return json_error(400, f"frame_ms={show(frame_ms)} must be one of {FRAME_MS_CHOICES}",
                          param="frame_ms")
    if len(state.peers) >= state.serving.max_peers:
        return json_error(503, f"too many peers: {len(state.peers)} of "
                          f"{state.serving.max_peers} are connected; retry later",
                          type="overloaded_error", code="too_many_peers")
    peer = PeerSession(state, frame_ms)
    try:
        answer = await peer.answer(sdp)
    except OfferError as exc:
        await peer.close()
        return json_error(400, str(exc), param="sdp", code="bad_offer")
    except Exception:
        await peer.close()
        raise
    return web.json_response({"type": "answer", "sdp": answer, "peer_id": peer.peer_id,
                              "codec": peer.track.codec, "frame_ms": frame_ms})


class OfferError(ValueError):
    """The offer cannot be answered; the message says why."""


class TrackSink:
    """Plays turns on the peer's ``EngineAudioTrack``."""

    def __init__(self, track: EngineAudioTrack, state: ServerState) -> None:
        self.track = track
        self._state = state
        self._turns: dict[str, TurnPlayout] = {}

    def begin(self, turn_id: str, sample_rate: int, say: Say) -> TurnPlayout:
        turn = self.track.begin_turn(turn_id, sample_rate)
        self._turns[turn_id] = turn
        return turn

    async def write(self, turn_id: str, chunk: AudioChunk) -> None:
        self.track.push(turn_id, chunk.pcm)

    async def finish(self, turn_id: str) -> None:
        self.track.end_turn(turn_id)
        turn = self._turns.get(turn_id)
        if turn is not None:
            await turn.drained.wait()
            self._forget(turn_id)

    def cancel(self, turn_id: str) -> None:
        self.track.clear()
        self._forget(turn_id)

    def _forget(self, turn_id: str) -> None:
        turn = self._turns.pop(turn_id, None)
        if turn is not None:
            self._state.starved_frames_total += turn.num_starved_frames


class PeerSession:
    """One browser or telephony peer: a peer connection, its track, its control channel."""

    def __init__(self, state: ServerState, frame_ms: int) -> None:
        self.peer_id = uuid.uuid4().hex
        self.state = state
        self.pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))  # no STUN: host candidates
        self.track = EngineAudioTrack(frame_ms=frame_ms, clock=state.clock)
        self.controller = TurnController(
            state.client, TrackSink(self.track, state), self._send,
            max_text_chars=state.serving.max_text_chars, request_options=state.request_options,
            idle_timeout_s=state.serving.turn_idle_timeout_s,
            clock=state.clock, on_first_audio=state.first_audio.observe,
        )
        self.playout = PlayoutTracker()
        self.channel: Any = None
        self.transceiver: Any = None  # the audio transceiver, once ``answer`` has added it
        self._inbox: asyncio.Queue[str | bytes | None] = asyncio.Queue(MAX_INBOX)
        self._connected = asyncio.Event()
        self._tasks = [asyncio.create_task(self._serve_inbox()),
                       asyncio.create_task(self._close_if_not_connected()),
                       asyncio.create_task(self._close_if_not_alive())]
        self._closed = False
        state.peers.add(self)
        self.pc.on("datachannel", self._on_datachannel)
        self.pc.on("connectionstatechange", self._on_connection_state)

    async def answer(self, offer_sdp: str) -> str:
        """Applies the offer and returns the answer SDP (candidates included, no trickle)."""
        self.transceiver = transceiver = self.pc.addTransceiver(self.track, direction="sendonly")
        transceiver.setCodecPreferences([
            c for c in RTCRtpSender.getCapabilities("audio").codecs
            if c.mimeType.lower() in SUPPORTED_CODECS
        ])
        try:
            await self.pc.setRemoteDescription(RTCSessionDescription(offer_sdp, "offer"))
        except Exception as exc:  # noqa: BLE001 - aiortc raises ValueError, AssertionError, ...
            raise OfferError(_offer_problem(exc)) from None
        if transceiver.mid is None:
            raise OfferError("the offer has no audio m-line: add a recvonly audio transceiver")
        try:
            answer = await self.pc.createAnswer()
            self.track.use_codec(_first_audio_codec(answer.sdp))
            with host_addresses(self.state.ice):
                await self.pc.setLocalDescription(answer)
        except OfferError:
            raise
        except Exception as exc:  # noqa: BLE001 - what the offer asked for cannot be answered
            raise OfferError(_offer_problem(exc)) from None
        return self.pc.localDescription.sdp

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.state.peers.discard(self)
        await self.controller.aclose()
        with contextlib.suppress(asyncio.QueueFull):
            self._inbox.put_nowait(None)
        for task in self._tasks:
            if task is not asyncio.current_task():
                task.cancel()
        self.track.stop()
        await self.pc.close()

    # ------------------------------------------------------------------ control channel
    def _on_datachannel(self, channel: Any) -> None:
        if channel.label != CONTROL_LABEL or self.channel is not None:
            channel.close()
            return
        self.channel = channel
        channel.on("message", self._on_message)
        ready = event("ready", peer_id=self.peer_id, codec=self.track.codec,
                      frame_ms=self.track.frame_ms)
        if channel.readyState == "open":
            channel.send(ready)
        else:
            channel.on("open", lambda: channel.send(ready))

    def _on_message(self, raw: str | bytes) -> None:
        try:
            self._inbox.put_nowait(raw)
        except asyncio.QueueFull:
            logger.warning("peer %s floods its control channel; message dropped", self.peer_id)

    async def _serve_inbox(self) -> None:
        """Handles control messages one by one, in order; a bad one gets an error reply."""
        while (raw := await self._inbox.get()) is not None:
            try:
                message = parse_message(raw)
                if isinstance(message, Playout):
                    self._on_playout(message)
                else:
                    await self.controller.handle(message)
            except ProtocolError as exc:
                await self._send(exc.as_event())
            except Exception as exc:  # keep the peer usable whatever one message did
                logger.exception("control message failed on peer %s", self.peer_id)
                await self._send(error_event("internal", f"{type(exc).__name__}: {exc}"))

    def _on_playout(self, stats: Playout) -> None:
        estimate = self.playout.update(stats)
        turn = self.controller.active
        if turn is None:
            return
        if turn.marks is not None and turn.marks.first_frame_time is not None:
            turn.concealment_events += estimate.new_concealment_events
            self.state.underruns_total += estimate.new_concealment_events
        # The listener's buffer: the browser's jitter buffer plus what still waits in our track.
        buffered_s = estimate.jitter_buffer_s + self.track.queued_s
        self.controller.report_playback(buffered_s, self.state.clock(), "webrtc")

    async def _send(self, text: str) -> None:
        channel = self.channel
        if channel is not None and channel.readyState == "open":
            channel.send(text)

    # ------------------------------------------------------------------ lifecycle
    async def _on_connection_state(self) -> None:
        if self.pc.connectionState == "connected":
            self._connected.set()
        if self.pc.connectionState in ("failed", "closed"):
            await self.close()

    async def _close_if_not_connected(self) -> None:
        """A peer whose ICE/DTLS is not ``connected`` by ``serving.webrtc_connect_timeout_s``
        after its offer is closed: its place under ``max_peers`` and any request are freed."""
        timeout_s = self.state.serving.webrtc_connect_timeout_s
        await asyncio.sleep(timeout_s)
        if self.pc.connectionState != "connected":
            logger.info("peer %s did not connect within %g s; closing", self.peer_id, timeout_s)
            await self.close()

    async def _close_if_not_alive(self) -> None:
        """A connected peer that answers none of our ICE consent checks for
        ``serving.webrtc_liveness_timeout_s`` is closed: its turn, engine request and place
        under ``max_peers`` are freed.

        NOTE: why our own consent probes. aioice declares consent lost only after
        ``CONSENT_FAILURES`` x ``CONSENT_INTERVAL`` (6 x 5 s: RFC 7675's 30 s), module globals
        read by every ``Connection``; changing them would retime every ICE agent in the process
        (clients included) to one value, not this server's setting. Listening for what the peer
        sends on its own is not a safe signal for a *silent* healthy peer: a recvonly browser
        sends audio RTCP receiver reports only every ~5 s (libwebrtc's audio report interval,
        randomised 0.5-1.5x), DataChannel messages only during turns and SCTP heartbeats every
        30 s, so a 10 s bound would close a listener that lost one report. A consent check is
        answered by every ICE agent (it is how ICE itself keeps consent), whether or not it
        sends media, within one RTT; one a second, each retransmitted, means a healthy peer
        must miss about ten in a row to be closed. The probe is built exactly as aioice's own
        consent check (``_consent_probe``), so the peer sees nothing new; aioice's 30 s expiry
        stays as the backstop. It uses aioice internals; ``_ice_connection`` checks they are
        there (and the WebRTC liveness test pins them), else it logs and leaves the 30 s.
        """
        bound_s = self.state.serving.webrtc_liveness_timeout_s
        interval_s = min(CONSENT_PROBE_INTERVAL_S, bound_s / 4)
        await self._connected.wait()
        connection = _ice_connection(self.transceiver)
        if connection is None:
            logger.warning("aioice's Connection lacks what the liveness probe uses; a vanished "
                           "peer is freed only by ICE consent expiry (~30 s)")
            return
        loop = asyncio.get_running_loop()
        last_alive = loop.time()
        probes: set[asyncio.Task[bool]] = set()
        broken: list[BaseException] = []

        def answered(probe: asyncio.Task[bool]) -> None:
            nonlocal last_alive
            probes.discard(probe)
            if probe.cancelled():
                return
            if probe.exception() is not None:  # not a lost check: aioice changed under us
                broken.append(probe.exception())  # type: ignore[arg-type]
            elif probe.result():
                last_alive = loop.time()

        try:
            while True:
                await asyncio.sleep(interval_s)
                if broken:
                    logger.warning("liveness probe of peer %s failed; a vanished peer is freed "
                                   "only by ICE consent expiry (~30 s)", self.peer_id,
                                   exc_info=broken[0])
                    return
                if loop.time() - last_alive > bound_s:
                    logger.info("peer %s answered no consent check for %g s; closing",
                                self.peer_id, bound_s)
                    await self.close()
                    return
                probe = asyncio.create_task(_consent_probe(connection))
                probes.add(probe)
                probe.add_done_callback(answered)
        finally:
            for probe in list(probes):
                probe.cancel()


def _ice_connection(transceiver: Any) -> Any:
    """The aioice ``Connection`` under the transceiver's (bundled) transport, or ``None`` if
    aiortc/aioice no longer have the internals that ``_consent_probe`` uses."""
    connection = getattr(getattr(transceiver.sender.transport, "transport", None),
                         "_connection", None)
    if all(hasattr(connection, name) for name in ("_nominated", "build_request",
                                                  "remote_password")):
        return connection
    return None


async def _consent_probe(connection: Any) -> bool:
    """One RFC 7675 consent check on each nominated pair, as aioice's ``query_consent`` builds
    it; ``True`` if every pair answered."""
    pairs = list(connection._nominated.values())
    if not pairs or connection.remote_password is None:
        return False
    for pair in pairs:
        request = connection.build_request(pair, nominate=False)
        try:
            await pair.protocol.request(
                request, pair.remote_addr,
                integrity_key=connection.remote_password.encode("utf8"),
                retransmissions=CONSENT_PROBE_RETRANSMISSIONS)
        except stun.TransactionError:
            return False
    return True


def _first_audio_codec(sdp: str) -> str:
    for media in SessionDescription.parse(sdp).media:
        if media.kind == "audio" and media.rtp.codecs:
            return media.rtp.codecs[0].mimeType
    raise OfferError("no common audio codec: offer opus, PCMU or PCMA")


def _offer_problem(exc: Exception) -> str:
    text = str(exc) or type(exc).__name__
    if "send parameters" in text:
        return "no common audio codec: offer opus, PCMU or PCMA"
    return f"invalid SDP offer: {text}"


async def _close_all(app: web.Application) -> None:
    peers = list(app[STATE].peers)
    await asyncio.gather(*(peer.close() for peer in peers), return_exceptions=True)
