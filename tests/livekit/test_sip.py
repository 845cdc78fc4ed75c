"""A real phone call: baresip dials LiveKit SIP over G.711, the agent greets, the caller hears it.

Owns: a call through LiveKit SIP into a room with the agent dispatched (inbound trunk and
dispatch rule made with ``livekit-api``); the greeting as the caller receives it (first audio
after the answer, no gap during speech, the whole duration, 8 kHz G.711 of the negotiated
payload type, baresip's own decoded recording), for PCMU and PCMA; and a hang-up mid-turn
ending the engine request, the agent's session and the room. Times are the kernel's stamps at
the caller's sockets and at the server's media port (the agent's RTP leaving it, LiveKit SIP's
arriving) and the worker's ``time.monotonic()`` (one machine). A gap at the caller is placed
where it arose (``check_real_time``). Measured on this shared two-core VM (4 Dec, the machine's
stops probed): in 65 calls beside up to 1.6 cores of other work, both gaps of 40 ms or more lay
in stops of the whole machine (the agent, the server and LiveKit SIP's clock froze together);
in 90 calls beside 1.4-1.6 cores (a second run of the suite's real-time processes among them),
the agent's own sender paused 56-311 ms in 16 of the 21 such gaps and one lay in a 53 ms stop.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator

import numpy as np
import pytest
from livekit import api

from tests import latency, realtime
from tests.latency import LatencyMiss
from tests.realtime import retry_if_starved

from .conftest import API_KEY, API_SECRET
from .telephony import (
    CALLER_ENERGY_RMS,
    G711_RATE,
    PAYLOAD_TYPES,
    Call,
    Caller,
    Heard,
    Telephony,
    create_dispatch,
    greeted_call,
    longest_step,
    run_telephony,
    wait_greeting,
)
from .test_room_python import NotRealTime

pytestmark = pytest.mark.livekit

SENTENCE = "Hello from the agent."  # one segment: MAX_FRAMES (25) frames = 2.0 s of tiny noise
# The hang-up test's greeting: six sentences of 25 frames, 12.0 s. The engine runs ahead of the
# caller (step time 0.28-0.42 of the audio in the room tests here), and a three-sentence greeting
# (6.0 s) once had finished generating when the caller had heard a second of it: nothing to abort.
LONG = ("First sentence here. Second sentence here. Third sentence here. "
        "Fourth sentence here. Fifth sentence here. Sixth sentence here.")
SHORT_NUMBER, LONG_NUMBER = "+15550100", "+15550101"
NUMBERS = {24000: SHORT_NUMBER, 8000: "+15550108"}  # the greeting, by the plugin's rate
MAX_GAP_S = 0.060
DURATION_TOLERANCE_S = 0.100  # 20 ms packets each end, the bridge's mixer and the jitter
HANG_UP_AFTER_S = 1.0
SILENT_OPUS_BYTES = 40  # an SRTP Opus payload this small is silence: 17-19 bytes where the
#                         agent's source ran dry; 90-209 in 5,955 packets of greeting over 60
#                         calls (4 Dec), 70-71 in its quiet first 100 ms
BRIDGE_BUFFER_S = 0.100  # LiveKit SIP's mixer input: 5 packets of 20 ms at most (media-sdk's
#                          DefaultInputBufferFrames), so a packet it plays left the agent <= 100 ms
#                          (plus transit, ~0.3 ms here) before


@pytest.fixture(scope="module")
def telephony() -> Iterator[Telephony]:
    with run_telephony(SENTENCE) as telephony:
        server = telephony.server
        for rate, number in NUMBERS.items():
            asyncio.run(create_dispatch(server, number, SENTENCE, sample_rate=rate))
        asyncio.run(create_dispatch(server, LONG_NUMBER, LONG))
        yield telephony


def check_signalling(call: Call) -> None:
    """The call was answered with the offered codec, and what came is 8 kHz G.711 of it."""
    assert call.answered_at is not None, "no 200 OK to the INVITE reached the caller"
    payload_type = PAYLOAD_TYPES[call.codec]
    media = re.search(r"^m=audio \d+ RTP/AVP ([\d ]+)\r?$", call.answer_sdp, re.M)
    assert media, f"no audio in the answer: {call.answer_sdp!r}"
    assert media.group(1).split()[0] == str(payload_type), f"answered {media.group(0)}"
    audio = [p for p in call.rtp if p.payload_type in (0, 8)]
    assert audio, "no G.711 RTP reached the caller"
    assert {p.payload_type for p in audio} == {payload_type}
    assert {p.samples.size for p in audio} == {160}, "not 20 ms packets of 8 kHz G.711"
    steps = np.diff([p.timestamp for p in sorted(audio, key=lambda p: p.seq)]) % (1 << 32)
    assert int(np.median(steps)) == 160, "RTP clock is not 8 kHz"


def check_recording(call: Call, heard: Heard) -> None:
    """baresip's own decode of the call (its sndfile dump): 8 kHz mono, and the greeting in it
    spans what arrived on its socket."""
    assert call.recording is not None, "baresip wrote no recording"
    pcm, rate = call.recording
    assert rate == G711_RATE and pcm.ndim == 1
    frames = pcm[: pcm.size // 160 * 160].reshape(-1, 160).astype(np.float32)
    loud = np.flatnonzero(np.sqrt(np.mean(frames * frames, axis=1)) > CALLER_ENERGY_RMS)
    assert loud.size, "the recording is silent"
    recorded = (loud[-1] - loud[0] + 1) * 0.020
    print(f"{call.codec}: baresip recorded {pcm.size / rate:.2f} s, the greeting spans "
          f"{recorded:.3f} s of it")
    assert abs(recorded - heard.span_s) <= 0.060


def check_media_path(call: Call) -> None:
    """The agent's RTP was seen leaving it and reaching LiveKit SIP (``MediaWatch``): without
    them a gap at the caller could not be placed."""
    assert call.agent_sent, "no RTP from the agent to the server's media port was seen"
    assert call.bridge_received, "no RTP from the server to LiveKit SIP was seen"


def check_real_time(call: Call, heard: Heard) -> None:
    """No gap over ``MAX_GAP_S`` and the whole duration at the caller; else raises
    ``NotRealTime`` saying where the time was lost, from what was measured at each point the
    audio passed: whether the whole machine stopped during the gap (``realtime.MachineStops``: no
    process ran, the agent, the server and LiveKit SIP alike; a stop of ``MACHINE_STOP_LIMIT_S``
    or more earns ``retry_if_starved``'s one retry), the agent's own playout (its source queue,
    reported while the turn is made), its RTP as it left the agent and as LiveKit SIP received it
    (kernel stamps at the server's media port), and the caller's packets around the gap (arrival,
    sequence, RMS). A late agent fails like a late bridge: the caller hears the same hole."""
    if (heard.gap_s <= MAX_GAP_S
            and abs(heard.span_s - heard.expected_s) <= DURATION_TOLERANCE_S):
        return
    answered = call.answered_at or 0.0
    since = heard.first_audio_s + answered
    start, end = call.gap_window(since, float("inf"))
    stopped = realtime.machine_stops().longest_s(start, end)
    # the audio heard at the gap's end left the agent up to the bridge's mixer buffer earlier
    # (LiveKit SIP buffers 3-5 packets of 20 ms before its 20 ms ticks); and a machine that
    # stopped resumes everyone at once: the agent's next packet may leave just after the
    # caller's (0.1 ms after it, in a 50 ms stop)
    window = (start - BRIDGE_BUFFER_S, end + 0.020)
    sent, sent_at = longest_step(call.agent_sent, *window)
    received, received_at = longest_step(call.bridge_received, *window)
    # silence the agent sent counts where the caller heard quiet packets in the gap, not only
    # late ones (a lone 19-byte packet once came mid-speech with none heard quiet)
    quiet = [p for p in call.rtp if start < p.t < end and p.samples.size]
    silent = [p for p in call.bridge_received
              if window[0] <= p.t <= window[1] and p.size <= SILENT_OPUS_BYTES] if quiet else []
    if stopped >= realtime.MACHINE_STOP_LIMIT_S:
        side = f"the whole machine stopped for {stopped * 1000:.0f} ms in the gap"
    elif not heard.agent_real_time(DURATION_TOLERANCE_S) or sent > MAX_GAP_S or silent:
        side = "the agent itself was late"
    elif received > MAX_GAP_S:
        side = "the agent sent in real time, the server forwarded late"
    else:  # its mixer waits for 60 ms of audio again whenever its input ran dry at a tick
        side = ("the agent sent in real time and LiveKit SIP received it so: lost in LiveKit "
                "SIP")
    path = (f"the caller's longest gap ended {(end - answered) * 1000:.0f} ms after the "
            f"answer; from {BRIDGE_BUFFER_S * 1000:.0f} ms before it began to its end the "
            f"agent's RTP left it at most {sent * 1000:.0f} ms apart (the step ending at "
            f"{(sent_at - answered) * 1000:.0f} ms), LiveKit SIP received it at most "
            f"{received * 1000:.0f} ms apart (at {(received_at - answered) * 1000:.0f} ms) and "
            f"{len(silent)} of its packets silent, and the machine's longest stop in the gap "
            f"was {stopped * 1000:.0f} ms")
    raise NotRealTime(f"not real-time at the caller ({side}): {heard.line()}; {path}; "
                      f"{call.describe_gap(since, float('inf'))}")


async def checked_call(telephony: Telephony, codec: str, plugin_rate: int) -> tuple[Call, Heard]:
    """The short greeting with the plugin at ``plugin_rate``, and every check of it; a miss of
    real time (``NotRealTime``) or of first audio's bound raises ``latency.LatencyMiss``. Real
    time is judged before baresip's recording is compared with its socket: a gap at the caller
    also parts those two (by 79 ms in a 170 ms gap, at 1.97 cores of foreign load), and the gap
    is what must be placed, and retried only on a starved machine."""
    call, heard = await greeted_call(telephony, codec, NUMBERS[plugin_rate], plugin_rate)
    print(heard.line())
    check_signalling(call)
    check_media_path(call)
    check_real_time(call, heard)
    latency.check("sip_first_audio", heard.first_audio_s)  # answer -> first sound at the caller
    check_recording(call, heard)
    return call, heard


@pytest.mark.parametrize(("codec", "plugin_rate"),
                         [("PCMU", 24000), ("PCMA", 24000), ("PCMU", 8000)])
async def test_a_call_hears_the_agents_greeting_whole(telephony: Telephony, codec: str,
                                                      plugin_rate: int) -> None:
    """The plugin at the runtime's 24 kHz (the bridge resamples), and at 8 kHz
    (``TTS(sample_rate=8000)``, the RoomIO track at 8 kHz too)."""
    await retry_if_starved(lambda: checked_call(telephony, codec, plugin_rate), (LatencyMiss,),
                           f"{codec} call in real time")


async def test_hanging_up_mid_turn_aborts_the_request_and_frees_the_call(
        telephony: Telephony) -> None:
    worker = telephony.worker
    before = worker.metrics()
    async with Caller("PCMU") as caller:
        dialled = time.monotonic()
        await caller.dial(telephony.sip.uri(LONG_NUMBER))
        await caller.wait_event("CALL_ESTABLISHED")
        greet = await wait_greeting(worker, dialled)
        room = greet["room"]
        for _ in range(600):  # HANG_UP_AFTER_S into the speech
            heard = caller.snapshot().energetic()
            if heard and heard[-1].t - heard[0].t >= HANG_UP_AFTER_S:
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError("the caller never heard a second of the greeting")
        running = worker.metrics()
        assert running["engine"]["active_requests"] == 1, "the turn was no longer generating"
        hung_up = await caller.hangup()
        await caller.wait_event("CALL_CLOSED", timeout_s=10)
    closed = await worker.wait_event(room, "session_closed", timeout_s=10)
    done = await worker.wait_event(room, "done", id=f"greet-{greet['identity']}")
    after = await worker.wait_metrics(lambda m: m["engine"]["active_requests"] == 0, 5.0)
    aborted = (after["engine"]["counters"].get("requests_aborted", 0)
               - before["engine"]["counters"].get("requests_aborted", 0))
    print(f"hang-up -> the agent's session closed {(closed['t'] - hung_up) * 1000:.0f} ms, "
          f"the turn done (interrupted={done['interrupted']}), requests aborted {aborted}")
    assert done["interrupted"] is True
    assert aborted == 1
    # the room empties and goes: nothing of the call is left on the server
    async with api.LiveKitAPI(telephony.server.http_url, API_KEY, API_SECRET) as lkapi:
        for _ in range(100):
            rooms = await lkapi.room.list_rooms(api.ListRoomsRequest(names=[room]))
            if not rooms.rooms:
                break
            await asyncio.sleep(0.1)
        assert not rooms.rooms, f"room {room} is still open: {rooms.rooms}"
    await worker.wait_event(room, "shutdown", timeout_s=10)
