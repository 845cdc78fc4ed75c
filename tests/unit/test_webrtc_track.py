"""``EngineAudioTrack`` on a virtual clock: pacing, framing, barge-in, codecs, frame encoders.

Owns: the track's timing contract (one frame per tick from the injected clock, a chunk's first
frame on the next tick, silence when idle, ``clear`` silent on the next tick) and the encoders'
one-packet-per-frame contract. Must not: sleep on the wall clock or open sockets.
"""

from __future__ import annotations

import asyncio
import fractions

import av
import numpy as np
import pytest
from aiortc.codecs import get_decoder
from aiortc.jitterbuffer import JitterFrame
from aiortc.mediastreams import MediaStreamError
from aiortc.rtcrtpparameters import RTCRtpCodecParameters

from breezert.server.webrtc_track import EngineAudioTrack, FrameEncoder

pytestmark = pytest.mark.unit

CHUNK = 1920  # one engine frame: 80 ms at 24 kHz


class VirtualClock:
    """Time only moves when the code under test sleeps."""

    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, delay: float) -> None:
        self.sleeps.append(delay)
        self.now += max(delay, 0.0)
        await asyncio.sleep(0)


def _tone(n: int, level: float = 0.5) -> np.ndarray:
    return (level * np.sin(np.arange(n) * 0.05)).astype(np.float32)


def _track(clock: VirtualClock, **kwargs: object) -> EngineAudioTrack:
    return EngineAudioTrack(clock=clock, sleep=clock.sleep, **kwargs)  # type: ignore[arg-type]


def _silent(frame: av.AudioFrame) -> bool:
    return not np.any(frame.to_ndarray())


async def test_paces_one_frame_per_tick_and_sends_silence_when_idle() -> None:
    clock = VirtualClock()
    track = _track(clock, frame_ms=20)
    frames = [await track.recv() for _ in range(5)]
    assert clock.now == pytest.approx(100.0 + 4 * 0.020)
    assert [f.pts for f in frames] == [i * 960 for i in range(5)]
    assert all(f.samples == 960 and f.sample_rate == 48000 and _silent(f) for f in frames)


async def test_late_ticks_are_not_slept_and_a_long_stall_rebases() -> None:
    clock = VirtualClock()
    track = _track(clock, frame_ms=10, max_lag_s=0.2)
    await track.recv()
    clock.now += 0.05  # a 50 ms hiccup: the missed ticks go out back to back
    for _ in range(5):
        await track.recv()
    assert clock.sleeps == []
    clock.now += 1.0  # a stall past max_lag_s: pacing restarts from now
    before = len(clock.sleeps)
    await track.recv()
    await track.recv()
    assert clock.sleeps[before:] == [pytest.approx(0.010)]
    assert track.num_frames_sent == 8  # the RTP clock stays contiguous


async def test_pushed_chunk_plays_on_the_next_tick() -> None:
    clock = VirtualClock()
    track = _track(clock, frame_ms=20)
    await track.recv()
    turn = track.begin_turn("t1")
    track.push("t1", _tone(CHUNK))
    frame = await track.recv()
    assert not _silent(frame)
    assert turn.first_frame.is_set() and turn.first_frame_time == pytest.approx(100.02)


async def test_turn_audio_is_contiguous_and_drains_completely() -> None:
    clock = VirtualClock()
    track = _track(clock, frame_ms=20)
    turn = track.begin_turn("t1")
    for _ in range(3):
        track.push("t1", _tone(CHUNK))
    track.end_turn("t1")
    out = []
    while not turn.drained.is_set():
        out.append((await track.recv()).to_ndarray()[0])
    audio = np.concatenate(out)
    expected = 3 * CHUNK * 2
    assert len(audio) == -(-expected // 960) * 960  # the last frame is padded, nothing lost
    assert np.count_nonzero(np.abs(audio) > 1000) > 0.9 * expected * 0.5
    assert turn.num_starved_frames == 0 and track.is_idle and track.queued_s == 0


async def test_partial_frame_waits_for_the_rest_of_its_turn() -> None:
    clock = VirtualClock()
    track = _track(clock, frame_ms=20)
    track.begin_turn("t1")
    track.push("t1", _tone(300))  # under one 48 kHz frame after resampling
    assert not track.next_frame(clock.now).any()  # starved: the partial frame is not split
    track.push("t1", _tone(CHUNK))
    assert np.abs(track.next_frame(clock.now)).max() > 0.1


async def test_starvation_inside_a_turn_is_counted() -> None:
    clock = VirtualClock()
    track = _track(clock, frame_ms=20)
    turn = track.begin_turn("t1")
    track.next_frame(clock.now)  # before the first audio: waiting, not starving
    track.push("t1", _tone(CHUNK))
    while track.queued_s * 48000 >= 960:
        track.next_frame(clock.now)
    track.next_frame(clock.now)
    assert turn.num_starved_frames == 1 and track.num_starved_frames == 1


async def test_clear_silences_the_next_tick_and_releases_waiters() -> None:
    clock = VirtualClock()
    track = _track(clock, frame_ms=10)
    turn = track.begin_turn("t1")
    for _ in range(10):
        track.push("t1", _tone(CHUNK))
    assert not _silent(await track.recv())
    dropped = track.clear()
    assert dropped > 0.7 and track.queued_s == 0
    assert turn.drained.is_set() and turn.is_cancelled
    assert _silent(await track.recv())
    assert track.push("t1", _tone(CHUNK)) is False  # late chunks of a cleared turn are dropped
    assert track.is_idle


async def test_queued_s_reports_audio_waiting_in_the_track() -> None:
    clock = VirtualClock()
    track = _track(clock, frame_ms=20)
    track.begin_turn("t1")
    track.push("t1", _tone(4 * CHUNK))
    track.end_turn("t1")
    assert track.queued_s == pytest.approx(0.32, abs=1e-3)
    await track.recv()
    assert track.queued_s == pytest.approx(0.30, abs=1e-3)


async def test_stopped_track_raises() -> None:
    track = _track(VirtualClock())
    track.stop()
    with pytest.raises(MediaStreamError):
        await track.recv()


@pytest.mark.parametrize("mime,rate", [("audio/PCMU", 8000), ("audio/PCMA", 8000),
                                       ("audio/opus", 48000)])
@pytest.mark.parametrize("frame_ms", [10, 20])
async def test_bound_codec_sends_one_packet_per_frame(mime: str, rate: int, frame_ms: int) -> None:
    clock = VirtualClock()
    track = _track(clock, frame_ms=frame_ms)
    track.use_codec(mime)
    assert track.sample_rate == rate and track.frame_samples == rate * frame_ms // 1000
    track.begin_turn("t1")
    track.push("t1", _tone(4 * CHUNK))
    track.end_turn("t1")
    packets = [await track.recv() for _ in range(20)]
    assert all(isinstance(p, av.Packet) for p in packets)
    assert [p.pts for p in packets] == [i * track.frame_samples for i in range(20)]
    assert all(p.time_base == fractions.Fraction(1, rate) for p in packets)


def _decode_all(mime: str, clock_rate: int, packets: list[av.Packet]) -> list[av.AudioFrame]:
    channels = 2 if mime == "audio/opus" else 1
    decoder = get_decoder(RTCRtpCodecParameters(mimeType=mime, clockRate=clock_rate,
                                                channels=channels, payloadType=96))
    frames: list[av.AudioFrame] = []
    for packet in packets:
        frames += decoder.decode(JitterFrame(bytes(packet), int(packet.pts)))
    return frames


@pytest.mark.parametrize("frame_ms", [10, 20])
def test_opus_frames_decode_completely(frame_ms: int) -> None:
    """10 ms frames need libopus's frame size changed too; every sample must come back."""
    encoder = FrameEncoder("audio/opus", frame_ms)
    n = encoder.frame_samples
    packets = [encoder.encode(_tone(n), i * n) for i in range(50)]
    frames = _decode_all("audio/opus", 48000, packets)
    assert len(frames) == 50 and all(f.samples == n for f in frames)
    assert sum(f.samples for f in frames) == 50 * n


def test_pcmu_round_trip_keeps_the_waveform() -> None:
    encoder = FrameEncoder("audio/PCMU", 20)
    tone = _tone(160 * 10)
    packets = [encoder.encode(tone[i * 160:(i + 1) * 160], i * 160) for i in range(10)]
    decoded = np.concatenate([f.to_ndarray()[0] for f in _decode_all("audio/PCMU", 8000, packets)])
    assert len(decoded) == len(tone)
    assert np.abs(decoded / 32768.0 - tone).max() < 0.02


def test_unsupported_codec_and_frame_size_are_rejected() -> None:
    with pytest.raises(ValueError, match="G722"):
        FrameEncoder("audio/G722", 20)
    with pytest.raises(ValueError, match="frame_ms=30"):
        EngineAudioTrack(frame_ms=30)
