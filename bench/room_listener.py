"""The room benchmark's listener: one caller's playout clock, its playout reports, one room.

Owns: ``PlayoutClock`` (what a caller hears of the agent's track: first audio, every gap),
``playout_message`` (the ``breezert.playout`` report of ``examples/playout_reporter.js``, built
from ``livekit.rtc``'s inbound-rtp stats), the listener's token and agent dispatch (the browser
listener's too, ``bench/room_browser.py``) and ``ListenerRoom`` (a ``livekit.rtc`` participant
that joins one room, dispatches the bench agent into it, triggers turns and records them).
Must not: touch the engine or the agent's process (it sees the agent only through the room:
its audio track and the ``bench.*`` data messages of ``bench/room_agent.py``).

The playout model. ``rtc.AudioStream`` hands over what the SDK pulls out of WebRTC's jitter
buffer (NetEq) every 10 ms, silence and concealment included. The listener's "speaker" plays
those frames on its own real-time clock: it starts ``prebuffer_s`` after the turn's first
energetic frame arrived (a device buffer of two 10 ms periods by default) and then plays frame
after frame. A gap heard is either

* ``quiet``: a run of quiet frames between energetic ones (the jitter buffer ran dry and
  NetEq filled the hole with silence or fading concealment; the tiny and random models'
  audio has no quiet frames of its own), or
* ``late``: a frame that reached this process after its due time on the speaker's clock (the
  speaker ran dry; it resumes when the frame arrives, later by that much).

Quiet or late stretches after the last energetic frame are the end of the turn, not gaps.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

ENERGY_RMS = 200.0
"""int16 RMS above which a frame counts as speech (as ``tests/livekit/listening.py``)."""
SOUND_RMS = 1.0
"""int16 RMS above which a frame is not the digital silence the agent's source sends between
turns (decoded Opus silence reads 0): the turn's first frame of any sound, which dates the
transport apart from how far into the audio its first energetic frame lies."""
DEFAULT_PREBUFFER_S = 0.02
"""The speaker's own buffer before it starts a turn: two 10 ms device periods."""
REPORT_INTERVAL_S = 0.1
"""How often the listener reads its receiver's stats and (variant ``listener``) reports them,
as ``examples/playout_reporter.js`` does."""
PLAYOUT_TOPIC = "breezert.playout"  # breezert_agent.models.PLAYOUT_TOPIC (no plugin import here)
# the inbound-rtp counters the reporter sends, as (message name, rtc stats field)
_COUNTERS = (("jitterBufferDelay", "jitter_buffer_delay"),
             ("jitterBufferEmittedCount", "jitter_buffer_emitted_count"),
             ("jitterBufferTargetDelay", "jitter_buffer_target_delay"),
             ("jitterBufferMinimumDelay", "jitter_buffer_minimum_delay"),
             ("concealedSamples", "concealed_samples"),
             ("concealmentEvents", "concealment_events"),
             ("totalSamplesReceived", "total_samples_received"))


@dataclass(frozen=True)
class Gap:
    """One gap heard: where in the turn (playout seconds from its first audio), how long."""

    at_s: float
    length_s: float
    kind: str
    """``quiet`` (a hole in the stream) or ``late`` (a frame after its due time)."""


@dataclass(frozen=True)
class TurnHeard:
    """One turn as the listener's speaker played it."""

    first_arrival: float
    """``time.monotonic()`` at which the turn's first energetic frame reached this process."""
    first_heard: float
    """When the speaker started playing it (``first_arrival + prebuffer_s``)."""
    first_sound_arrival: float
    """When the turn's first frame above ``SOUND_RMS`` reached this process (at or before
    ``first_arrival``; the audio's quiet lead-in lies between them)."""
    span_s: float
    """Speaker time from the first energetic frame's start to the last one's end, gaps included."""
    audio_s: float
    """Audio played from the first to the last energetic frame (frames x their length)."""
    gaps: tuple[Gap, ...]
    min_rms: float
    """The quietest energetic-run frame (shows whether ``ENERGY_RMS`` suits the model's audio)."""

    @property
    def gap_s(self) -> float:
        return sum(g.length_s for g in self.gaps)

    @property
    def longest_gap_s(self) -> float:
        return max((g.length_s for g in self.gaps), default=0.0)


class PlayoutClock:
    """A speaker fed with the frames of one track, one turn at a time (see the module doc).

    ``arm()`` before a turn's audio can arrive; ``push()`` every frame in arrival order (arrival
    time, duration, RMS); ``finish()`` once the turn is over returns what was heard (``None``:
    no energetic frame arrived)."""

    def __init__(self, *, prebuffer_s: float = DEFAULT_PREBUFFER_S,
                 energy_rms: float = ENERGY_RMS, sound_rms: float = SOUND_RMS) -> None:
        if prebuffer_s < 0:
            raise ValueError(f"prebuffer_s={prebuffer_s!r} must be >= 0")
        self.prebuffer_s, self.energy_rms, self.sound_rms = prebuffer_s, energy_rms, sound_rms
        self._armed = False
        self._reset()

    def _reset(self) -> None:
        self._first_sound: float | None = None
        self._first_arrival: float | None = None
        self._start = 0.0  # speaker time of the first energetic frame's start
        self._due = 0.0  # when the next frame is due on the speaker
        self._played_s = 0.0  # audio played since the first energetic frame
        self._last_energetic_end = 0.0  # speaker time at which the last energetic frame ended
        self._audio_at_last = 0.0  # audio played up to the end of the last energetic frame
        self._gaps: list[Gap] = []
        self._pending: list[Gap] = []  # quiet or late since the last energetic frame
        self._quiet_run: float | None = None  # position of the quiet run in progress
        self._quiet_len = 0.0
        self._min_rms = float("inf")

    @property
    def is_armed(self) -> bool:
        return self._armed

    @property
    def has_audio(self) -> bool:
        return self._first_arrival is not None

    def arm(self) -> None:
        """The next energetic frame starts a turn."""
        self._reset()
        self._armed = True

    def push(self, arrival: float, duration_s: float, rms: float) -> None:
        if not self._armed:
            return
        energetic = rms > self.energy_rms
        if self._first_sound is None and (energetic or rms > self.sound_rms):
            self._first_sound = arrival
        if self._first_arrival is None:
            if not energetic:
                return  # silence before the turn's audio
            self._first_arrival = arrival
            self._start = self._due = arrival + self.prebuffer_s
        position = self._played_s
        if arrival > self._due:  # the speaker ran dry: it waits for this frame
            self._pending.append(Gap(round(position, 4), round(arrival - self._due, 4), "late"))
            self._due = arrival
        self._due += duration_s
        self._played_s += duration_s
        if energetic:
            self._min_rms = min(self._min_rms, rms)
            if self._quiet_run is not None:
                self._pending.append(Gap(round(self._quiet_run, 4), round(self._quiet_len, 4),
                                         "quiet"))
                self._quiet_run, self._quiet_len = None, 0.0
            self._gaps.extend(sorted(self._pending, key=lambda g: g.at_s))
            self._pending.clear()
            self._last_energetic_end = self._due
            self._audio_at_last = self._played_s
        else:
            if self._quiet_run is None:
                self._quiet_run = position
            self._quiet_len += duration_s

    def finish(self) -> TurnHeard | None:
        """The turn heard (what followed its last energetic frame is dropped); disarms."""
        self._armed = False
        if self._first_arrival is None:
            return None
        return TurnHeard(
            first_arrival=self._first_arrival, first_heard=self._start,
            first_sound_arrival=self._first_sound,
            span_s=round(self._last_energetic_end - self._start, 4),
            audio_s=round(self._audio_at_last, 4), gaps=tuple(self._gaps),
            min_rms=round(self._min_rms, 1))


def frame_rms(data: memoryview | bytes) -> float:
    """RMS of one int16 frame."""
    import numpy as np

    samples = np.frombuffer(data, dtype=np.int16).astype(np.float32)
    return float(np.sqrt(np.mean(samples * samples))) if samples.size else 0.0


# ----------------------------------------------------------------------------- reports


def inbound_audio(stats: Any) -> Any | None:
    """The inbound-rtp audio stats of a ``room.get_rtc_stats()`` answer (the subscriber's
    list, or the publisher's: with livekit-server's single peer connection the inbound
    stream is reported there), or ``None``."""
    for entry in [*stats.subscriber_stats, *stats.publisher_stats]:
        if entry.WhichOneof("stats") == "inbound_rtp" and entry.inbound_rtp.stream.kind == "audio":
            return entry.inbound_rtp
    return None


def playout_message(inbound: Any, track_sid: str, timestamp_ms: float) -> dict[str, Any]:
    """The ``breezert.playout`` message of ``examples/playout_reporter.js`` for one receiver:
    its cumulative jitter-buffer counters under the ``RTCInboundRtpStreamStats`` names."""
    received = inbound.inbound
    message: dict[str, Any] = {"type": "playout", "v": 1, "trackSid": track_sid,
                               "timestampMs": timestamp_ms}
    for name, attribute in _COUNTERS:
        message[name] = float(getattr(received, attribute))
    return message


@dataclass
class ReceiverLog:
    """The receiver's cumulative counters at each stats read: (monotonic time, delay sum s,
    emitted samples, concealed samples); what the itemisation reads back per turn."""

    reads: list[tuple[float, float, float, float]] = field(default_factory=list)

    def add(self, now: float, message: dict[str, Any]) -> None:
        self.reads.append((now, message["jitterBufferDelay"],
                           message["jitterBufferEmittedCount"], message["concealedSamples"]))

    def delay_after(self, t: float) -> float | None:
        """The jitter buffer's mean delay over the first stats interval that ends after ``t``
        and emitted audio (an estimate of what the turn's first audio waited there)."""
        for (_, d0, e0, _), (t1, d1, e1, _) in zip(self.reads, self.reads[1:]):
            if t1 > t and e1 > e0:
                return max((d1 - d0) / (e1 - e0), 0.0)
        return None

    def concealed_between(self, t0: float, t1: float, rate: int) -> float:
        """Seconds concealed over the stats intervals that lie within [t0, t1]."""
        total = 0.0
        for (ta, _, _, ca), (tb, _, _, cb) in zip(self.reads, self.reads[1:]):
            if ta >= t0 and tb <= t1:
                total += max(cb - ca, 0.0)
        return total / rate


class LoopLag:
    """How late this process's event loop wakes a ``period_s`` timer, sampled while ``run()``
    runs: every frame and message is stamped when the loop gets to it, so a late loop (many
    rooms in one process) delays the stamps, not what a caller would hear."""

    def __init__(self, period_s: float = 0.005, keep: int = 40_000) -> None:
        self.period_s = period_s
        self.samples: deque[tuple[float, float]] = deque(maxlen=keep)

    async def run(self) -> None:
        while True:
            due = time.monotonic() + self.period_s
            await asyncio.sleep(self.period_s)
            now = time.monotonic()
            self.samples.append((now, now - due))

    def max_between(self, t0: float, t1: float) -> float | None:
        """The latest wake-up sampled in [t0, t1] (``None``: none sampled there)."""
        return max((lag for t, lag in self.samples if t0 <= t <= t1), default=None)


# ----------------------------------------------------------------------------- one room


def listener_token(api_key: str, api_secret: str, room: str) -> str:
    """The listener's join token for ``room`` (identity ``listener``; it publishes data)."""
    from livekit import api

    grants = api.VideoGrants(room_join=True, room=room, can_publish=True, can_subscribe=True,
                             can_publish_data=True)
    return (api.AccessToken(api_key, api_secret).with_identity("listener")
            .with_grants(grants).to_jwt())


async def dispatch_agent(api_url: str, api_key: str, api_secret: str, agent_name: str,
                         room: str, variant: str) -> None:
    """Dispatches the bench agent ``agent_name`` into ``room`` with ``variant`` in its
    metadata (the agent reads it there, ``bench/room_agent.py``)."""
    from livekit import api

    async with api.LiveKitAPI(api_url, api_key, api_secret) as lkapi:
        await lkapi.agent_dispatch.create_dispatch(api.CreateAgentDispatchRequest(
            agent_name=agent_name, room=room, metadata=json.dumps({"variant": variant})))


SUBSCRIBE_NUDGE_S = 20.0  # a ready agent's track not subscribed by then is asked for again


class RoomJoinError(RuntimeError):
    """A room whose agent or track did not come: the run goes on without it."""


class ListenerRoom:
    """One caller: joins ``room`` as ``listener``, dispatches the bench agent with ``variant``
    in its metadata, plays the agent's track on a ``PlayoutClock``, reads its receiver's stats
    every 100 ms (and, for ``report=True``, publishes them on ``breezert.playout`` to the
    agent), and runs turns with ``turn()``."""

    def __init__(self, *, url: str, api_url: str, api_key: str, api_secret: str, room: str,
                 agent_name: str, variant: str, report: bool,
                 prebuffer_s: float = DEFAULT_PREBUFFER_S, energy_rms: float = ENERGY_RMS,
                 tail_s: float = 0.3, loop_lag: LoopLag | None = None) -> None:
        from livekit import rtc

        self.url, self.api_url, self.api_key, self.api_secret = url, api_url, api_key, api_secret
        self.name, self.agent_name, self.variant, self.report = room, agent_name, variant, report
        self.tail_s, self.loop_lag = tail_s, loop_lag
        self.clock = PlayoutClock(prebuffer_s=prebuffer_s, energy_rms=energy_rms)
        self.receiver = ReceiverLog()
        self.room = rtc.Room()
        self.sample_rate = 48000
        self.reports_sent = 0
        self.frames = 0
        self._track: Any = None
        self._agent_identity: str | None = None
        self._subscribed = asyncio.Event()
        self._ready: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._turn_events: dict[str, asyncio.Queue[dict[str, Any]]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._n = 0

    async def join(self, timeout_s: float = 120.0) -> dict[str, Any]:
        """Connects, dispatches the agent and waits until it is ready and its track is
        subscribed; returns the agent's ``bench.ready`` message with ``join_s`` (how long that
        took) added."""
        from livekit import rtc

        started = time.monotonic()
        self.room.on("track_subscribed", self._on_track)
        self.room.on("data_received", self._on_data)
        await self.room.connect(self.url, listener_token(self.api_key, self.api_secret, self.name),
                                rtc.RoomOptions(auto_subscribe=True))
        await dispatch_agent(self.api_url, self.api_key, self.api_secret, self.agent_name,
                             self.name, self.variant)
        ready = await asyncio.wait_for(self._ready, timeout_s)
        nudged = await self._await_track(timeout_s)
        self._tasks.append(asyncio.create_task(self._stats_loop()))
        return {**ready, "join_s": round(time.monotonic() - started, 3),
                "subscribe_nudged": nudged}

    async def _await_track(self, timeout_s: float) -> bool:
        """Waits for the agent's audio track; returns whether it took a nudge. On the H200 (6
        Dec, 128 rooms, 8 agent workers) a few rooms' agents were ready and their tracks never
        came to the auto-subscribing listener in 240 s; after ``SUBSCRIBE_NUDGE_S`` each audio
        publication in the room is asked for again (``set_subscribed``). Raises ``RoomJoinError``
        naming what the room had when the track still did not come."""
        try:
            await asyncio.wait_for(self._subscribed.wait(), min(SUBSCRIBE_NUDGE_S, timeout_s))
            return False
        except asyncio.TimeoutError:
            pass
        for publication in self._audio_publications():
            publication.set_subscribed(True)
        try:
            await asyncio.wait_for(self._subscribed.wait(),
                                   max(timeout_s - SUBSCRIBE_NUDGE_S, 1.0))
        except asyncio.TimeoutError:
            seen = [(p.sid, p.subscribed) for p in self._audio_publications()]
            raise RoomJoinError(f"{self.name}: the agent was ready, its audio track not "
                                f"subscribed in {timeout_s} s (audio publications, subscribed: "
                                f"{seen}; participants: {list(self.room.remote_participants)})"
                                ) from None
        return True

    def _audio_publications(self) -> list[Any]:
        from livekit import rtc

        return [publication for participant in self.room.remote_participants.values()
                for publication in participant.track_publications.values()
                if publication.kind == rtc.TrackKind.KIND_AUDIO]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.room.disconnect()

    def _on_track(self, track: Any, publication: Any, participant: Any) -> None:
        from livekit import rtc

        if track.kind == rtc.TrackKind.KIND_AUDIO and self._track is None:
            self._track, self._agent_identity = publication, participant.identity
            self._tasks.append(asyncio.create_task(self._play(track)))
            self._subscribed.set()

    async def _play(self, track: Any) -> None:
        from livekit import rtc

        stream = rtc.AudioStream(track, sample_rate=self.sample_rate, num_channels=1)
        async for event in stream:
            self.frames += 1
            self.clock.push(time.monotonic(), event.frame.duration, frame_rms(event.frame.data))

    def _on_data(self, packet: Any) -> None:
        if not packet.topic.startswith("bench."):
            return
        body = json.loads(packet.data)
        if packet.topic == "bench.ready" and not self._ready.done():
            self._ready.set_result(body)
        elif packet.topic == "bench.turn" and body.get("id") in self._turn_events:
            self._turn_events[body["id"]].put_nowait(body)

    async def _stats_loop(self) -> None:
        while True:
            started = time.monotonic()
            try:
                inbound = inbound_audio(await self.room.get_rtc_stats())
                if inbound is not None and self._track is not None:
                    message = playout_message(inbound, self._track.sid, time.time() * 1000)
                    self.receiver.add(time.monotonic(), message)
                    if self.report and self._agent_identity is not None:
                        await self.room.local_participant.publish_data(
                            json.dumps(message), reliable=False, topic=PLAYOUT_TOPIC,
                            destination_identities=[self._agent_identity])
                        self.reports_sent += 1
            except Exception:  # a closing room; the next read tells
                pass
            await asyncio.sleep(max(REPORT_INTERVAL_S - (time.monotonic() - started), 0.0))

    async def turn(self, text: str, max_frames: int, seed: int,
                   timeout_s: float = 120.0) -> dict[str, Any]:
        """One turn: asks the agent to say ``text``, plays it, returns its record."""
        self._n += 1
        turn_id = f"t{self._n}"
        events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._turn_events[turn_id] = events
        self.clock.arm()
        sent = time.monotonic()
        await self.room.local_participant.publish_data(
            json.dumps({"id": turn_id, "text": text, "max_frames": max_frames, "seed": seed}),
            reliable=True, topic="bench.say")
        record: dict[str, Any] = {"room": self.name, "id": turn_id, "variant": self.variant,
                                  "chars": len(text), "max_frames": max_frames, "sent": sent}
        try:
            done = await asyncio.wait_for(events.get(), timeout_s)
        except asyncio.TimeoutError:
            record["error"] = f"no bench.turn from the agent in {timeout_s} s"
            self.clock.finish()
            return record
        finally:
            del self._turn_events[turn_id]
        await asyncio.sleep(self.tail_s)  # the end of the turn is still on its way here
        heard = self.clock.finish()
        record["agent"] = done
        if heard is None:
            record["error"] = "no audio heard"
            return record
        record["heard"] = {**asdict(heard), "gaps": [asdict(g) for g in heard.gaps]}
        if self.loop_lag is not None:  # the trigger to the first energetic frame's stamp
            record["loop_lag_max_s"] = self.loop_lag.max_between(sent, heard.first_arrival)
        record["jitter_buffer_s"] = self.receiver.delay_after(heard.first_arrival)
        record["concealed_s"] = self.receiver.concealed_between(
            heard.first_arrival, heard.first_arrival + heard.span_s, self.sample_rate)
        return record
