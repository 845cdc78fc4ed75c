"""Agent audio through a real ``rtc.AudioSource`` (the Rust SDK paces it on its own real-time
clock): a tap through ``LocalAudioTrack`` + ``AudioStream`` and the source's queue reaching the
engine, ``AgentSession.say`` through ``AudioSourceOutput`` in real time and interrupted, all
against ``FakeRuntimeClient``, and a ``clear_buffer`` while idle not dropping the next segment.

Owns: what plays in real time through the SDK's source. Integration, not unit: these wait on the
SDK's real clock, which no virtual clock moves (``tests/virtual_clock.py``). Must not: need a
LiveKit server or a model (the rtc FFI runs locally; no room is joined).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
import pytest
from livekit import rtc
from livekit.agents import Agent, AgentSession

from breezert_agent import TTS
from breezert_agent.playout import AudioSourceOutput
from tests.unit.test_agent_tts import FakeRuntimeClient

pytestmark = pytest.mark.integration

SAMPLE_RATE = 24000


async def test_audio_source_tap_captures_frames_and_queue_reaches_the_engine() -> None:
    client = FakeRuntimeClient(chunks_per_segment=3, samples_per_chunk=1200, chunk_delay_s=0.01)
    tts = TTS(client=client, feedback_interval_s=0.02)
    output = AudioSourceOutput(queue_size_ms=200)
    assert tts.attach_audio_output(output)
    track = rtc.LocalAudioTrack.create_audio_track("agent", output.source)
    tap = rtc.AudioStream.from_track(track=track, sample_rate=SAMPLE_RATE, num_channels=1)
    tapped: list[np.ndarray] = []

    async def read_tap() -> None:
        async for event in tap:
            tapped.append(np.frombuffer(event.frame.data, dtype="<i2").copy())

    reader = asyncio.create_task(read_tap())
    session = AgentSession(tts=tts)
    session.output.audio = output
    await session.start(Agent(instructions="offline"))
    await asyncio.wait_for(session.say("First sentence! Second one."), 10.0)
    await asyncio.sleep(0.1)
    await session.aclose()
    await tap.aclose()
    reader.cancel()
    await asyncio.gather(reader, return_exceptions=True)

    samples = np.concatenate(tapped)
    num_voiced = int(np.count_nonzero(np.abs(samples.astype(np.int32)) > 500))
    expected = 2 * 3 * 1200
    assert abs(num_voiced - expected) <= 480  # every synthesized sample came out of the track
    reports = client.turns[0].reports
    assert reports and all(source == "livekit-source" for _, _, source in reports)
    assert max(buffered for buffered, _, _ in reports) > 0.05  # the source's queue, not zero
    await output.aclose()
    await tts.aclose()


# ----------------------------------------------------------------------------- AgentSession.say


async def _session(client: FakeRuntimeClient,
                   finished: list[Any]) -> tuple[TTS, AudioSourceOutput, AgentSession]:
    """An ``AgentSession`` speaking through ``AudioSourceOutput`` with ``client``'s TTS; each
    ``playback_finished`` event goes to ``finished``."""
    tts = TTS(client=client)
    output = AudioSourceOutput()
    output.on("playback_finished", finished.append)
    session = AgentSession(tts=tts)
    session.output.audio = output
    await session.start(Agent(instructions="offline"))
    return tts, output, session


async def test_agent_session_say_plays_in_real_time_through_a_custom_output() -> None:
    client = FakeRuntimeClient(chunks_per_segment=2, samples_per_chunk=2400, chunk_delay_s=0.005)
    started: list[float] = []
    finished: list[Any] = []
    tts, output, session = await _session(client, finished)
    output.on("playback_started", lambda ev: started.append(time.monotonic()))

    async def llm_tokens() -> Any:  # an LLM writing while the TTS speaks
        for token in ("Hello", " there.", " This", " is", " BreezeRT!"):
            yield token
            await asyncio.sleep(0.01)

    start_time = time.monotonic()
    await asyncio.wait_for(session.say(llm_tokens()), 10.0)
    elapsed_s = time.monotonic() - start_time
    audio_s = 2 * client.segment_s()

    assert len(started) == 1 and len(finished) == 1
    assert not finished[0].interrupted
    assert finished[0].playback_position == pytest.approx(audio_s, abs=0.011)
    assert elapsed_s >= audio_s - 0.02  # paced in real time, not faster
    assert len(client.turns) == 1
    assert client.turns[0].segments == ["Hello there.", "This is BreezeRT!"]
    await session.aclose()
    await output.aclose()
    await tts.aclose()


async def test_interrupted_say_aborts_the_turn_and_reports_the_played_position() -> None:
    client = FakeRuntimeClient(chunks_per_segment=40, samples_per_chunk=2400, chunk_delay_s=0.02)
    finished: list[Any] = []
    tts, output, session = await _session(client, finished)
    handle = session.say("A very long answer that the user interrupts!")
    await asyncio.sleep(0.4)
    handle.interrupt()
    await asyncio.wait_for(handle, 5.0)
    for _ in range(100):
        if finished and client.turns[0].is_aborted:
            break
        await asyncio.sleep(0.01)
    assert client.turns[0].is_aborted
    assert finished and finished[0].interrupted
    assert 0.0 < finished[0].playback_position < 1.0
    await session.aclose()
    await output.aclose()
    await tts.aclose()


# ----------------------------------------------------------------------------- RoomIO output


async def test_audio_source_output_ignores_clear_buffer_when_idle() -> None:
    output = AudioSourceOutput()
    finished: list[Any] = []
    output.on("playback_finished", finished.append)
    output.clear_buffer()  # nothing playing: no event, and the next segment is not dropped
    frame = rtc.AudioFrame(data=b"\x01\x00" * 480, sample_rate=SAMPLE_RATE, num_channels=1,
                           samples_per_channel=480)
    await output.capture_frame(frame)
    output.flush()
    await asyncio.wait_for(output.wait_for_playout(), 2.0)
    assert len(finished) == 1 and not finished[0].interrupted
    assert finished[0].playback_position == pytest.approx(0.02)
    await output.aclose()
