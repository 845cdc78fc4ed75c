"""Playback feedback for LiveKit agents: how much audio sits ahead of the listener's playhead.

Owns: reading the agent's ``rtc.AudioSource`` queue, parsing the listener-side reporter's stats
(``examples/playout_reporter.js`` on the ``breezert.playout`` data topic), choosing which turn
they belong to, and ``AudioSourceOutput`` (an agent audio output into an ``rtc.AudioSource``
without a room). Must not: talk to the runtime except through ``Turn.report_playback``.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from livekit import rtc
from livekit.agents.voice import io

from breezert.jitter_buffer import JitterCounters

from .client import Turn
from .log import logger
from .models import (
    LISTENER_SETTLE_S,
    LISTENER_STATS_MAX_AGE_S,
    NUM_CHANNELS,
    PLAYOUT_TOPIC,
    SAMPLE_RATE,
)


@dataclass(frozen=True)
class ListenerStats:
    """One listener's jitter buffer over the reporter's last interval (~100 ms)."""

    key: str
    """``participant identity/track sid``."""
    delay_s: float
    """Mean time a sample spent in the jitter buffer (Δ jitterBufferDelay / Δ emitted count)."""
    target_delay_s: float | None
    num_concealed_samples: int
    """Samples the browser had to invent in the interval (an underrun when > 0)."""
    received_time: float


def _room_output_backlog(node: object) -> float:
    # NOTE(breezert): livekit-agents 1.8.9 RoomIO keeps frames it accepted but has not yet handed
    # to its AudioSource (whose own queue is only 200 ms) in a channel; count those too. Private
    # attributes of a pinned version: 0 if they ever move.
    pushed = getattr(node, "_pushed_duration", None)
    in_source = getattr(node, "_source_pushed_duration", None)
    if isinstance(pushed, (int, float)) and isinstance(in_source, (int, float)):
        return max(float(pushed) - float(in_source), 0.0)
    return 0.0


def _source_of(node: object) -> tuple[rtc.AudioSource, Callable[[], float]] | None:
    """The ``rtc.AudioSource`` an output node plays into, and its backlog before the source."""
    if isinstance(node, AudioSourceOutput):
        return node.source, lambda: node.pending_s
    source = getattr(node, "_audio_source", None)  # RoomIO's participant output
    if isinstance(source, rtc.AudioSource):
        return source, lambda: _room_output_backlog(node)
    return None


class PlayoutFeedback:
    """Estimates how much audio is queued ahead of the listener's playhead, for the current turn.

    Two sources, each blind to part of the path:

    * **sender** (``attach_audio_source`` / ``attach_audio_output``): our ``rtc.AudioSource``
      ``queued_duration`` (plus what RoomIO holds before it). Exact and live, and it drains in
      real time even without a room, but it ends where the audio leaves this process: it cannot
      see packets in flight or the listener's jitter buffer (40-300+ ms in a browser).
    * **listener** (``listen_room`` + ``examples/playout_reporter.js``): the browser's jitter
      buffer from ``getStats()`` deltas, published every 100 ms on ``breezert.playout``. It sees
      the last hop, but is up to ~100 ms plus one data-channel trip old, and needs the client to
      run the reporter.

    Reported: sender + the smallest fresh listener buffer (``livekit-client``), else the sender
    alone (``livekit-source``). Neither sees audio in flight on the network (about RTT/2).

    With an output attached (``attach_audio_output``) nothing is reported unless it is playing,
    i.e. between its public ``playback_started`` and ``playback_finished`` events: RoomIO holds
    every frame until a participant subscribes, and its empty queue then is not a listener that
    ran dry (the engine would hurry); unreported, the engine keeps its own estimate.

    The same output says when a turn's audio may start (``wait_for_listener``): once RoomIO
    has a subscriber, and ``listener_settle_s`` after a subscription that came while the turn
    was being made, so that its first frames do not reach a receive path still being set up
    (not for a room of SIP callers only: ``_settle_s``).
    """

    def __init__(self, *, max_age_s: float = LISTENER_STATS_MAX_AGE_S,
                 listener_settle_s: float = LISTENER_SETTLE_S) -> None:
        self._max_age_s = max_age_s
        self._listener_settle_s = listener_settle_s
        self._subscribed: asyncio.Future[None] | None = None
        self._subscribed_at: float | None = None  # -inf: subscribed before it was attached
        self._sender: Callable[[], float] | None = None
        self._last_raw: dict[str, JitterCounters] = {}
        self.listeners: dict[str, ListenerStats] = {}
        self._turns: list[Turn] = []  # turns whose audio is playing, newest last
        self._rooms: list[rtc.Room] = []
        self._output: io.AudioOutput | None = None
        self.is_playing = True
        """False while an attached output is not playing (see the class doc)."""
        self.num_packets = 0
        self.num_bad_packets = 0
        self.num_concealed_samples = 0

    # ------------------------------------------------------------------ sources
    def attach_audio_source(
        self, source: rtc.AudioSource, *, pending_s: Callable[[], float] | None = None
    ) -> None:
        """Reads ``source.queued_duration`` (plus ``pending_s()``, audio held before it)."""

        def probe() -> float:
            return source.queued_duration + (pending_s() if pending_s is not None else 0.0)

        self._sender = probe

    def attach_audio_output(self, output: io.AudioOutput | None) -> bool:
        """Finds the ``rtc.AudioSource`` behind an agent output chain (RoomIO's) and reports only
        while ``output`` plays; True if found."""
        node: object | None = output
        while node is not None:
            found = _source_of(node)
            if found is not None and output is not None:
                self.attach_audio_source(found[0], pending_s=found[1])
                self._watch(output)
                self._watch_subscription(getattr(node, "subscribed", None))
                return True
            node = getattr(node, "next_in_chain", None)
        return False

    def _watch(self, output: io.AudioOutput) -> None:
        self._unwatch()
        self._output, self.is_playing = output, False
        output.on("playback_started", self._on_playback_started)
        output.on("playback_finished", self._on_playback_finished)

    def _unwatch(self) -> None:
        if self._output is not None:
            self._output.off("playback_started", self._on_playback_started)
            self._output.off("playback_finished", self._on_playback_finished)
        self._output, self.is_playing = None, True

    def _watch_subscription(self, subscribed: object) -> None:
        """RoomIO's public ``subscribed`` future (resolved when a participant subscribed to its
        track); an output without one never holds a turn."""
        self._subscribed = subscribed if isinstance(subscribed, asyncio.Future) else None
        self._subscribed_at = None
        if self._subscribed is None:
            return
        if self._subscribed.done():
            self._subscribed_at = -math.inf
        else:
            self._subscribed.add_done_callback(self._on_subscribed)

    def _on_subscribed(self, _future: asyncio.Future[None]) -> None:
        self._subscribed_at = time.monotonic()

    async def wait_for_listener(self) -> None:
        """Returns when a turn's first audio may go to the attached output: at once without
        RoomIO, or once it has a subscriber and ``listener_settle_s`` has passed since the
        subscription (``models.LISTENER_SETTLE_S`` says why). Audio made meanwhile waits in
        the turn, whole: the listener hears the turn from its start."""
        subscribed = self._subscribed
        if subscribed is None:
            return
        if not subscribed.done():
            await asyncio.shield(subscribed)
        if self._subscribed_at is None:  # its done callback has not run yet: just now
            self._subscribed_at = time.monotonic()
        remaining = self._subscribed_at + self._settle_s() - time.monotonic()
        if remaining > 0:
            await asyncio.sleep(remaining)

    def _settle_s(self) -> float:
        """``listener_settle_s``, or none when every participant of the rooms it listens to
        (``listen_room``) is a SIP caller. LiveKit SIP's receive path took a greeting said at
        its subscription whole: 6 of 6 calls heard 2.0 s of 2.0 s with first audio 148-204 ms
        after the answer, against 396-454 ms held 300 ms (4-5 Dec, ``test_sip``'s greeting on
        two cores); the hold is for the ``livekit.rtc`` receive path that ``models.
        LISTENER_SETTLE_S`` measured. Unknown participants (no ``listen_room``) are held."""
        callers = [p for room in self._rooms for p in room.remote_participants.values()]
        if callers and all(p.kind == rtc.ParticipantKind.PARTICIPANT_KIND_SIP for p in callers):
            return 0.0
        return self._listener_settle_s

    def _on_playback_started(self, _event: object) -> None:
        self.is_playing = True

    def _on_playback_finished(self, _event: object) -> None:
        self.is_playing = False

    def listen_room(self, room: rtc.Room) -> None:
        """Listens for the listener-side reporter's stats on ``breezert.playout``."""
        room.on("data_received", self.on_data_packet)
        self._rooms.append(room)

    def detach(self) -> None:
        for room in self._rooms:
            room.off("data_received", self.on_data_packet)
        self._rooms.clear()
        self._unwatch()
        self._sender = None
        self._subscribed, self._subscribed_at = None, None

    # ------------------------------------------------------------------ turns
    @property
    def current_turn(self) -> Turn | None:
        return self._turns[-1] if self._turns else None

    def begin(self, turn: Turn) -> None:
        self._turns.append(turn)

    def end(self, turn: Turn) -> None:
        if turn in self._turns:
            self._turns.remove(turn)

    def estimate(self, now: float) -> tuple[float, str] | None:
        """(buffered_s, source) or ``None`` when nothing is attached or fresh, or the attached
        output is not playing."""
        if not self.is_playing:
            return None
        sender = self._sender() if self._sender is not None else None
        fresh = [s.delay_s for s in self.listeners.values()
                 if now - s.received_time <= self._max_age_s]
        if fresh:
            return (sender or 0.0) + min(fresh), "livekit-client"
        if sender is not None:
            return sender, "livekit-source"
        return None

    def report(self, turn: Turn, now: float) -> None:
        estimate = self.estimate(now)
        if estimate is not None:
            turn.report_playback(estimate[0], now, estimate[1])

    # ------------------------------------------------------------------ listener reporter
    def on_data_packet(self, packet: rtc.DataPacket) -> None:
        """``room.on("data_received")`` handler: parse, update, report for the current turn."""
        if packet.topic != PLAYOUT_TOPIC:
            return
        self.num_packets += 1
        now = time.monotonic()
        stats = self._parse(packet, now)
        if stats is None:
            return
        if stats.num_concealed_samples > 0 and self.current_turn is not None:
            self.num_concealed_samples += stats.num_concealed_samples
            logger.debug("listener concealed %d samples", stats.num_concealed_samples,
                         extra={"listener": stats.key})
        if (turn := self.current_turn) is not None:
            self.report(turn, now)

    def _parse(self, packet: rtc.DataPacket, now: float) -> ListenerStats | None:
        try:
            raw = json.loads(packet.data)
            if not isinstance(raw, dict) or raw.get("type", "playout") != "playout":
                raise ValueError("not a playout sample")
            delay = float(raw["jitterBufferDelay"])
            emitted = float(raw["jitterBufferEmittedCount"])
            target = raw.get("jitterBufferTargetDelay")
            target = float(target) if target is not None else None
            concealed = float(raw.get("concealedSamples") or 0)
        except (ValueError, KeyError, TypeError):
            self.num_bad_packets += 1
            return None
        identity = packet.participant.identity if packet.participant is not None else "?"
        key = f"{identity}/{raw.get('trackSid', '')}"
        counters = JitterCounters(delay, emitted, target, concealed)
        previous = self._last_raw.get(key)
        self._last_raw[key] = counters
        if previous is None or counters.restarted_since(previous):
            return None  # nothing to diff yet
        interval = counters.since(previous)
        if interval.delay_s is None:  # no audio emitted since the last sample
            return None
        stats = ListenerStats(
            key=key, delay_s=interval.delay_s, target_delay_s=interval.target_delay_s,
            num_concealed_samples=interval.new_concealed_samples, received_time=now,
        )
        self.listeners[key] = stats
        return stats


class _Flush:
    """Marks the end of a playback segment in ``AudioSourceOutput``'s queue."""


class AudioSourceOutput(io.AudioOutput):
    """The agent's audio output into an ``rtc.AudioSource``, paced in real time, room or not.

    Frames are accepted at any speed and handed to the source, whose bounded queue
    (``queue_size_ms``) makes the hand-over wait: playback runs at wall-clock speed even with
    no room, so ``source.queued_duration`` is a real sender-side buffer. Publish ``source`` with
    ``rtc.LocalAudioTrack.create_audio_track`` to send it anywhere, or read it back with
    ``rtc.AudioStream``. ``on_frame`` sees each frame as it is handed over (e.g. to write a WAV).
    """

    def __init__(
        self,
        *,
        sample_rate: int = SAMPLE_RATE,
        num_channels: int = NUM_CHANNELS,
        queue_size_ms: int = 200,
        on_frame: Callable[[rtc.AudioFrame], None] | None = None,
        label: str = "AudioSourceOutput",
    ) -> None:
        super().__init__(label=label, capabilities=io.AudioOutputCapabilities(pause=False),
                         sample_rate=sample_rate)
        self.source = rtc.AudioSource(sample_rate, num_channels, queue_size_ms=queue_size_ms)
        self._on_frame = on_frame
        self._queue: asyncio.Queue[rtc.AudioFrame | _Flush] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self._interrupted = asyncio.Event()
        self._queued_s = 0.0  # accepted, not yet handed to the source
        self._handed_s = 0.0  # handed to the source in this segment
        self._is_segment_open = False
        self._interrupted_at: float | None = None

    @property
    def pending_s(self) -> float:
        """Audio accepted but not yet in the source's queue (seconds)."""
        return self._queued_s

    async def capture_frame(self, frame: rtc.AudioFrame) -> None:
        await super().capture_frame(frame)
        if self._task is None:
            self._task = asyncio.create_task(self._forward(), name="AudioSourceOutput.forward")
        self._is_segment_open = True
        self._queued_s += frame.duration
        self._queue.put_nowait(frame)

    def flush(self) -> None:
        super().flush()
        if self._is_segment_open:
            self._is_segment_open = False
            self._queue.put_nowait(_Flush())

    def clear_buffer(self) -> None:
        if self._pending_playback_count == 0:
            return  # nothing playing: nothing to interrupt
        if self._interrupted_at is None:
            self._interrupted_at = max(self._handed_s - self.source.queued_duration, 0.0)
        self._interrupted.set()
        self.source.clear_queue()

    async def _forward(self) -> None:
        is_started = False
        while True:
            item = await self._queue.get()
            if isinstance(item, _Flush):
                await self._finish_segment()
                is_started = False
                continue
            self._queued_s = max(self._queued_s - item.duration, 0.0)
            if self._interrupted.is_set():
                continue  # the rest of an interrupted segment is dropped
            if not is_started:
                is_started = True
                self.on_playback_started(created_at=time.time())
            await self.source.capture_frame(item)
            self._handed_s += item.duration
            if self._on_frame is not None:
                self._on_frame(item)

    async def _finish_segment(self) -> None:
        if not self._interrupted.is_set():
            playout = asyncio.ensure_future(self.source.wait_for_playout())
            interrupted = asyncio.ensure_future(self._interrupted.wait())
            await asyncio.wait([playout, interrupted], return_when=asyncio.FIRST_COMPLETED)
            for waiter in (playout, interrupted):
                waiter.cancel()
        position, is_interrupted = self._handed_s, self._interrupted.is_set()
        if is_interrupted and self._interrupted_at is not None:
            position = self._interrupted_at
        self._handed_s, self._interrupted_at = 0.0, None
        self._interrupted.clear()
        self.on_playback_finished(playback_position=position, interrupted=is_interrupted)

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        await self.source.aclose()
