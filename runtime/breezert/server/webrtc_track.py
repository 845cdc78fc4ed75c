"""aiortc audio track fed by engine chunks: 10/20 ms framing and real-time pacing, no LiveKit.

Owns: resampling each turn's chunks to the negotiated codec's rate (``soxr``), pacing frames off
an injectable monotonic clock (silence when idle), barge-in (``clear``), per-turn playout marks
(first frame sent, turn drained) and encoding each frame with an encoder sized to the frame.
Must not: talk to the engine or the turn protocol, read the wall clock directly, or import
LiveKit or other server modules; ``webrtc_api.py`` feeds it.
"""

from __future__ import annotations

import asyncio
import fractions
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import av
import numpy as np
import soxr
from aiortc import MediaStreamTrack
from aiortc.mediastreams import MediaStreamError
from av.audio.codeccontext import AudioCodecContext

from breezert.audio import (
    DEFAULT_RESAMPLE_QUALITY,
    ENGINE_SAMPLE_RATE,
    FRAME_MS_CHOICES,
    G711_SAMPLE_RATE,
    OPUS_SAMPLE_RATE,
    float_to_int16,
    new_resampler,
    resample_chunk,
    samples_per_frame,
)

if TYPE_CHECKING:
    Packet = av.Packet[Any]  # an encoded RTP payload with its pts (the sender packs it as is)
else:
    Packet = av.Packet
Clock = Callable[[], float]
Sleep = Callable[[float], Awaitable[object]]

# codec mime type (lower case) -> (ffmpeg encoder, sample rate)
_CODECS = {
    "audio/opus": ("libopus", OPUS_SAMPLE_RATE),
    "audio/pcmu": ("pcm_mulaw", G711_SAMPLE_RATE),
    "audio/pcma": ("pcm_alaw", G711_SAMPLE_RATE),
}
SUPPORTED_CODECS = tuple(_CODECS)


class FrameEncoder:
    """Encodes one mono frame of exactly ``frame_ms`` into exactly one RTP payload.

    NOTE(webrtc): aiortc's own ``OpusEncoder`` re-chunks its input to 960 samples (20 ms), so
    10 ms frames would leave as 20 ms packets: half the packets, 10 ms more latency. Here libopus
    gets ``frame_duration=frame_ms`` and the track hands the sender pre-encoded ``av.Packet``s,
    which aiortc's ``RTCRtpSender`` passes through (``Encoder.pack``) without re-encoding.
    """

    def __init__(self, mime_type: str, frame_ms: int) -> None:
        key = mime_type.lower()
        if key not in _CODECS:
            raise ValueError(f"codec {mime_type!r} is not supported; use one of {SUPPORTED_CODECS}")
        if frame_ms not in FRAME_MS_CHOICES:
            raise ValueError(f"frame_ms={frame_ms} must be one of {FRAME_MS_CHOICES}")
        name, self.sample_rate = _CODECS[key]
        self.mime_type = mime_type
        self.frame_samples = samples_per_frame(self.sample_rate, frame_ms)
        self.time_base = fractions.Fraction(1, self.sample_rate)
        self.codec = cast(AudioCodecContext, av.CodecContext.create(name, "w"))
        self.codec.format = "s16"
        self.codec.layout = "mono"
        self.codec.sample_rate = self.sample_rate
        self.codec.time_base = self.time_base
        if name == "libopus":
            self.codec.bit_rate = 64000
            self.codec.options = {"application": "voip", "frame_duration": str(frame_ms)}

    def encode(self, pcm: np.ndarray, pts: int) -> Packet:
        """``pcm``: float32 ``[frame_samples]``; ``pts`` in samples (the RTP timestamp offset)."""
        assert len(pcm) == self.frame_samples, (len(pcm), self.frame_samples)
        frame = av.AudioFrame.from_ndarray(float_to_int16(pcm)[None, :], format="s16",
                                           layout="mono")
        frame.sample_rate = self.sample_rate
        frame.pts = pts
        frame.time_base = self.time_base
        packets = self.codec.encode(frame)
        if len(packets) != 1:
            raise RuntimeError(
                f"{self.mime_type} encoder returned {len(packets)} packets for one "
                f"{self.frame_samples}-sample frame; expected exactly one"
            )
        packet: Packet = av.Packet(bytes(packets[0]))
        packet.pts = pts  # our own contiguous sample clock, not the encoder's (it starts < 0)
        packet.time_base = self.time_base
        return packet


@dataclass(eq=False)
class TurnPlayout:
    """Playout marks of one turn, set by the track as its frames go out."""

    turn_id: str
    resampler: soxr.ResampleStream | None = field(repr=False, default=None)
    num_queued: int = 0
    """Samples of this turn still in the track's queue (output rate)."""
    is_input_ended: bool = False
    is_cancelled: bool = False
    first_frame_time: float | None = None
    """Clock time of the tick that sent the turn's first sample."""
    num_starved_frames: int = 0
    """Ticks sent as silence after the turn started playing while its audio had not arrived."""
    first_frame: asyncio.Event = field(default_factory=asyncio.Event, repr=False)
    drained: asyncio.Event = field(default_factory=asyncio.Event, repr=False)
    """Set when every sample of the ended turn has been sent, or the turn was cleared."""


@dataclass(eq=False)
class _Piece:
    turn: TurnPlayout
    pcm: np.ndarray  # float32 at the output rate
    offset: int = 0


class EngineAudioTrack(MediaStreamTrack):
    """An aiortc audio track that plays engine chunks in real time.

    Feed it per turn: ``begin_turn`` → ``push`` (each chunk's PCM as it arrives) → ``end_turn``;
    ``clear`` drops everything queued (barge-in). ``recv`` sends one frame per tick; a pushed
    chunk's first frame goes out on the next tick. Bind the negotiated codec with ``use_codec``
    before the sender starts: ``recv`` then returns encoded ``av.Packet``s; unbound, it returns
    mono s16 ``AudioFrame``s at ``sample_rate``.

    Args:
        frame_ms: 10 or 20.
        clock: Monotonic time source (seconds); inject a virtual clock in tests.
        sleep: Awaitable sleep matching ``clock``.
        resample_quality: ``soxr`` quality preset (see ``breezert.audio``).
        max_lag_s: After a stall longer than this, pacing restarts from now instead of sending
            the missed ticks back to back (the RTP timestamps stay contiguous either way).
    """

    kind = "audio"

    def __init__(
        self,
        *,
        frame_ms: int = 20,
        sample_rate: int = OPUS_SAMPLE_RATE,
        clock: Clock = time.monotonic,
        sleep: Sleep = asyncio.sleep,
        resample_quality: str = DEFAULT_RESAMPLE_QUALITY,
        max_lag_s: float = 0.2,
    ) -> None:
        super().__init__()
        if frame_ms not in FRAME_MS_CHOICES:
            raise ValueError(f"frame_ms={frame_ms} must be one of {FRAME_MS_CHOICES}")
        self.frame_ms = frame_ms
        self.frame_s = frame_ms / 1000
        self._clock, self._sleep = clock, sleep
        self._quality = resample_quality
        self._max_lag_s = max_lag_s
        self._encoder: FrameEncoder | None = None
        self.sample_rate = sample_rate
        self._frame_samples = samples_per_frame(sample_rate, frame_ms)
        self._pieces: deque[_Piece] = deque()
        self._turns: dict[str, TurnPlayout] = {}
        self._num_queued = 0
        self._start_time: float | None = None
        self.num_frames_sent = 0
        self.num_starved_frames = 0

    # ------------------------------------------------------------------ setup
    def use_codec(self, mime_type: str) -> None:
        """Encode frames for ``mime_type`` (``audio/opus``, ``audio/PCMU``, ``audio/PCMA``)."""
        if self._turns or self.num_frames_sent:
            raise RuntimeError("use_codec must be called before the track plays anything")
        self._encoder = FrameEncoder(mime_type, self.frame_ms)
        self.sample_rate = self._encoder.sample_rate
        self._frame_samples = self._encoder.frame_samples

    @property
    def codec(self) -> str | None:
        return self._encoder.mime_type if self._encoder else None

    @property
    def frame_samples(self) -> int:
        return self._frame_samples

    # ------------------------------------------------------------------ feeding
    def begin_turn(self, turn_id: str, sample_rate: int = ENGINE_SAMPLE_RATE) -> TurnPlayout:
        """Opens a turn whose chunks arrive at ``sample_rate``."""
        if turn_id in self._turns:
            raise ValueError(f"turn_id={turn_id!r} is already playing")
        turn = TurnPlayout(turn_id, new_resampler(sample_rate, self.sample_rate, self._quality))
        self._turns[turn_id] = turn
        return turn

    def push(self, turn_id: str, pcm: np.ndarray) -> bool:
        """Queues one chunk of the turn (float32 at the turn's rate); False if the turn is gone
        (cleared or ended), in which case the audio is dropped."""
        turn = self._turns.get(turn_id)
        if turn is None or turn.is_input_ended:
            return False
        self._enqueue(turn, resample_chunk(turn.resampler, pcm))
        return True

    def end_turn(self, turn_id: str) -> None:
        """No more chunks: flushes the resampler; ``drained`` is set once all of it is sent."""
        turn = self._turns.get(turn_id)
        if turn is None or turn.is_input_ended:
            return
        if turn.resampler is not None:
            tail = resample_chunk(turn.resampler, np.zeros(0, np.float32), last=True)
            self._enqueue(turn, tail)
        turn.is_input_ended = True
        self._maybe_drained(turn)

    def clear(self) -> float:
        """Barge-in: drops every queued sample and open turn; returns the seconds dropped.
        The next tick is silence."""
        dropped_s = self.queued_s
        self._pieces.clear()
        self._num_queued = 0
        for turn in self._turns.values():
            turn.is_cancelled = True
            turn.num_queued = 0
            turn.first_frame.set()
            turn.drained.set()
        self._turns.clear()
        return dropped_s

    @property
    def queued_s(self) -> float:
        """Audio waiting in this track's queue (not yet handed to the sender), seconds."""
        return self._num_queued / self.sample_rate

    @property
    def is_idle(self) -> bool:
        """No open turn and nothing queued."""
        return not self._turns and not self._pieces

    # ------------------------------------------------------------------ sending
    async def recv(self) -> Packet | av.AudioFrame:
        """Waits for the next tick and returns its frame (audio, or silence when idle)."""
        if self.readyState != "live":
            raise MediaStreamError
        now = self._clock()
        if self._start_time is None:
            self._start_time = now
        else:
            due = self._start_time + self.num_frames_sent * self.frame_s
            if due > now:
                await self._sleep(due - now)
                now = self._clock()
            elif now - due > self._max_lag_s:
                self._start_time = now - self.num_frames_sent * self.frame_s
        if self.readyState != "live":
            raise MediaStreamError
        pcm = self.next_frame(now)
        pts = self.num_frames_sent * self._frame_samples
        self.num_frames_sent += 1
        if self._encoder is not None:
            return self._encoder.encode(pcm, pts)
        frame = av.AudioFrame.from_ndarray(float_to_int16(pcm)[None, :], format="s16",
                                           layout="mono")
        frame.sample_rate, frame.pts = self.sample_rate, pts
        frame.time_base = fractions.Fraction(1, self.sample_rate)
        return frame

    def next_frame(self, now: float) -> np.ndarray:
        """The frame for the tick at ``now``: queued audio, or silence (float32 ``[samples]``).

        A partial frame waits for the rest of its turn unless the turn's input has ended (then
        it is padded with silence), so audio inside a turn is never split by padding.
        """
        out = np.zeros(self._frame_samples, dtype=np.float32)
        tail_ended = bool(self._pieces) and self._pieces[-1].turn.is_input_ended
        if self._num_queued < self._frame_samples and not tail_ended:
            self._count_starved()
            return out
        filled = 0
        while filled < len(out) and self._pieces:
            piece = self._pieces[0]
            n = min(len(out) - filled, len(piece.pcm) - piece.offset)
            out[filled:filled + n] = piece.pcm[piece.offset:piece.offset + n]
            piece.offset += n
            filled += n
            self._num_queued -= n
            turn = piece.turn
            turn.num_queued -= n
            if turn.first_frame_time is None:
                turn.first_frame_time = now
                turn.first_frame.set()
            if piece.offset == len(piece.pcm):
                self._pieces.popleft()
                self._maybe_drained(turn)
        return out

    # ------------------------------------------------------------------ helpers
    def _enqueue(self, turn: TurnPlayout, pcm: np.ndarray) -> None:
        if len(pcm) == 0:
            return
        self._pieces.append(_Piece(turn, pcm))
        self._num_queued += len(pcm)
        turn.num_queued += len(pcm)

    def _maybe_drained(self, turn: TurnPlayout) -> None:
        if turn.is_input_ended and turn.num_queued == 0:
            turn.drained.set()
            self._turns.pop(turn.turn_id, None)

    def _count_starved(self) -> None:
        starved = [t for t in self._turns.values()
                   if t.first_frame_time is not None and not t.is_input_ended]
        for turn in starved:
            turn.num_starved_frames += 1
        if starved:
            self.num_starved_frames += 1
