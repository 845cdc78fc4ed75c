"""Real room, browser participant: headless Chromium with livekit-client plays the agent's track
and runs ``examples/playout_reporter.js``; its reports cross the server to the plugin and the
engine's Predictor uses them.

Owns: the ``breezert.playout`` data topic end to end (livekit-client -> SFU -> agent), the
``livekit-client`` source counted in the engine, the agreement between the jitter-buffer delay
the agent received and the browser's own ``getStats()``, and the turn as the browser heard it
(first audio, no gap, its length; at most one packet of speech concealed during it).
"""

from __future__ import annotations

import statistics
from dataclasses import replace
from typing import Any

import pytest

from tests.livekit.browser import join_browser
from tests.livekit.test_room_python import (
    LONG,
    NotRealTime,
    assert_played_in_real_time,
    delta,
    idle,
    speak,
)
from tests.latency import LatencyMiss
from tests.realtime import retry_if_starved

pytestmark = pytest.mark.livekit

AGREE_S = 0.020  # both are Δ jitterBufferDelay / Δ emitted over ~100 ms windows of the same
#                  counters at different phases; on loopback the buffer is steady, so their
#                  medians differ by less than one 20 ms Opus packet


def assert_browser_real_time(heard: Any, playout: dict[str, int], expected_s: float) -> None:
    """The turn in real time at the browser: ``assert_played_in_real_time`` (at most one packet
    of speech concealed by the jitter buffer, the length judged within its time-stretch) on the
    speech without the quiet runs the page's level meter adds after the jitter buffer.

    That meter sits in an ``AudioContext`` that headless Chromium renders on its fake output
    device's clock: its FIFO from the track under-runs now and then and inserts quiet runs of
    5-50 ms while the jitter buffer conceals nothing (measured on this VM: 0 concealed samples in
    turns heard 6.06-6.15 s long, the excess all in such runs; and once 3246 samples removed,
    none inserted, in a turn whose span less quiet runs was 6.022 s of 6.000, so that
    acceleration was not in the speech). So no quiet run may pass ``MAX_GAP_S`` and the speech
    without them must be the turn's length."""
    speech = replace(heard, span_s=heard.span_s - heard.quiet_s)
    try:
        assert_played_in_real_time(speech, playout, expected_s)
    except NotRealTime as miss:
        raise NotRealTime(f"{miss}; the page's quiet runs {heard.quiet_s:.3f} s taken out of "
                          f"its span {heard.span_s:.3f} s") from None


async def test_browser_hears_the_turn_and_its_reports_reach_the_predictor(
        room_factory: Any, agent_worker: Any, livekit_server: Any, web_root: str) -> None:
    room = await room_factory()
    async with join_browser(web_root, livekit_server, room.name) as browser:
        before = agent_worker.metrics()

        async def attempt() -> None:
            # 6 s: reports flow while the engine request runs, and its first ~0.4 s has none
            # from the browser yet (two reporter samples with audio in them make the first)
            start = await browser.playout_counters()
            sent, tts_metrics = await speak(room, agent_worker, LONG)
            heard = await browser.heard(since=sent)
            assert heard is not None, "the browser never heard the turn"
            playout = await browser.playout_counters(since=start)
            print(f"browser: first audio {(heard.first - sent) * 1000:.0f} ms after the trigger "
                  f"(agent TTFB {tts_metrics['ttfb'] * 1000:.0f} ms), heard {heard.span_s:.3f} s "
                  f"of {tts_metrics['audio_duration']:.3f} s, longest gap "
                  f"{heard.gap_s * 1000:.0f} ms, quiet runs {heard.quiet_s * 1000:.0f} ms; "
                  f"jitter buffer samples {playout}")
            assert_browser_real_time(heard, playout, tts_metrics["audio_duration"])

        await retry_if_starved(attempt, (LatencyMiss,), "browser turn in real time")
        after = await idle(agent_worker)
        state = await browser.state()
    assert not state["errors"], state["errors"]
    reports = [e for e in agent_worker.events(room.name) if e["type"] == "report"]
    client = [e for e in reports if e["source"] == "livekit-client"]
    used = delta(after, before, "predictor_feedback_used")
    counted = delta(after, before, "playback_reports_livekit-client")
    received = [d for e in client for k, d in e["listeners"].items() if k.startswith("browser/")]
    series = state["stats"]
    browser_delay = [(b["delay"] - a["delay"]) / (b["emitted"] - a["emitted"])
                     for a, b in zip(series, series[1:]) if b["emitted"] > a["emitted"]]
    print(f"browser: {counted} livekit-client reports counted by the engine, predictor used "
          f"{used} reports; listener delay at the agent median "
          f"{statistics.median(received) * 1000:.0f} ms, getStats median "
          f"{statistics.median(browser_delay) * 1000:.0f} ms")
    assert counted >= 5 and used >= 5
    assert client, "no report used the browser's jitter buffer"
    # compared in whole microseconds: 0.05 - 0.03 is 0.020000000000000004 in floats (a fresh
    # clone failed on exactly 20 ms apart, 4 Dec)
    gap_us = round(abs(statistics.median(received) - statistics.median(browser_delay)) * 1e6)
    assert gap_us <= round(AGREE_S * 1e6), gap_us
