"""``tests/livekit/test_sip.check_real_time`` places a gap the caller heard where it arose, from
the figures measured at each point of the audio's path (synthetic calls: 20 ms packets)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests import realtime
from tests.livekit.telephony import Call, Heard, MediaPacket, RtpPacket, longest_step
from tests.livekit.test_room_python import NotRealTime
from tests.livekit.test_sip import check_real_time

pytestmark = pytest.mark.unit

LOUD, QUIET = np.full(160, 800, np.int16), np.full(160, 4, np.int16)
GAP_AT = 1.0  # the caller's packet after this one comes late (a 120 ms gap)


class Stops:
    longest = 0.0

    def longest_s(self, since: float, until: float) -> float:
        return Stops.longest


@pytest.fixture(autouse=True)
def no_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    Stops.longest = 0.0
    monkeypatch.setattr(realtime, "machine_stops", Stops)


def _times(pause_at: float | None, pause_s: float) -> list[float]:
    """20 ms packets over 2 s from t=0.1, the ones after ``pause_at`` ``pause_s`` late."""
    times = [0.1 + 0.02 * i for i in range(100)]
    return [t + pause_s if pause_at is not None and t > pause_at else t for t in times]


def _call(sent_pause_s: float = 0.0, silent: int = 0, heard_quiet: bool = False) -> Call:
    """A 120 ms gap at the caller after ``GAP_AT``: late packets, or with ``heard_quiet`` quiet
    ones in it; the agent's packets ``sent_pause_s`` late just before, ``silent`` of them
    silence."""
    call = Call("PCMU", answered_at=0.0)
    call.rtp = [RtpPacket(t, 0, i, 160 * i, LOUD) for i, t in enumerate(_times(GAP_AT, 0.1))]
    if heard_quiet:
        call.rtp += [RtpPacket(GAP_AT + 0.02 * k, 0, 0, 0, QUIET) for k in (1, 2, 3)]
    call.agent_sent = [MediaPacket(t - 0.06, i, 960 * i, 140)
                       for i, t in enumerate(_times(GAP_AT - 0.05, sent_pause_s))]
    call.bridge_received = [MediaPacket(p.t + 0.0003, p.seq, p.timestamp,
                                        19 if 45 <= p.seq < 45 + silent else 140)
                            for p in call.agent_sent]
    return call


def _heard(**kwargs: Any) -> Heard:
    figures = dict(codec="PCMU", plugin_rate=24000, first_audio_s=0.1, greet_s=0.01,
                   ttfb_s=0.1, span_s=2.1, gap_s=0.12, expected_s=2.0, agent_played_s=2.0,
                   agent_dry=0, agent_reports=5)
    figures.update(kwargs)
    return Heard(**figures)  # type: ignore[arg-type]


def _side(call: Call, heard: Heard) -> str:
    with pytest.raises(NotRealTime) as miss:
        check_real_time(call, heard)
    return str(miss.value).split("(", 1)[1].split(")", 1)[0]


def test_a_gap_within_the_bound_passes() -> None:
    check_real_time(_call(), _heard(gap_s=0.021, span_s=2.0))


def test_a_stop_of_the_whole_machine_is_named_first() -> None:
    Stops.longest = 0.105
    assert _side(_call(sent_pause_s=0.1), _heard()) == \
        "the whole machine stopped for 105 ms in the gap"


def test_an_agent_whose_packets_left_late_is_late() -> None:
    call = _call(sent_pause_s=0.1)
    assert _side(call, _heard()) == "the agent itself was late"
    assert longest_step(call.agent_sent, 0.0, 3.0)[0] == pytest.approx(0.12)


def test_an_agent_that_sent_silence_on_time_is_late() -> None:
    assert _side(_call(silent=3, heard_quiet=True), _heard()) == "the agent itself was late"


def test_silence_sent_is_not_the_cause_of_a_gap_heard_only_late() -> None:
    assert "lost in LiveKit SIP" in _side(_call(silent=1), _heard())


def test_an_agent_whose_queue_ran_dry_is_late() -> None:
    assert _side(_call(), _heard(agent_dry=2)) == "the agent itself was late"


def test_audio_sent_and_received_in_time_was_lost_in_the_bridge() -> None:
    message = str(pytest.raises(NotRealTime, check_real_time, _call(), _heard()).value)
    assert "lost in LiveKit SIP" in message
    assert "the agent's RTP left it at most 20 ms apart" in message
    assert "0 of its packets silent" in message
