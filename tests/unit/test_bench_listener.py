"""The benchmark's simulated listener, TTFB/RTF math, percentiles and run summaries.

Owns: playback math on hand-built chunk timelines (no engine, no clock). Must not: run a model.
"""

from __future__ import annotations

import numpy as np
import pytest

from breezert_bench.listener import (
    PlaybackTimeline, RequestResult, percentile, replay, summarize, summarize_requests, ttfb_s,
)

pytestmark = pytest.mark.unit

FRAME_S = 0.08


def _chunks(start: float, frames: list[int], arrivals: list[float]) -> list[tuple[float, float]]:
    return [(start + a, n * FRAME_S) for n, a in zip(frames, arrivals)]


def test_no_underrun_when_every_chunk_arrives_early() -> None:
    # progressive 1,2,4,8 frames: scheduled starts at +0, +0.08, +0.24, +0.56
    timeline = replay(_chunks(10.0, [1, 2, 4, 8], [0.0, 0.05, 0.20, 0.50]))
    assert not timeline.has_underrun
    assert timeline.num_late_chunks == 0
    assert timeline.extra_buffer_s == 0.0
    assert timeline.received_s == pytest.approx(15 * FRAME_S)


def test_chunk_exactly_on_time_is_not_an_underrun() -> None:
    timeline = replay(_chunks(3.0, [1, 2, 4], [0.0, 0.08, 0.24]))
    assert not timeline.has_underrun
    assert timeline.extra_buffer_s == 0.0


def test_one_late_chunk_gives_an_underrun_and_the_exact_extra_buffer() -> None:
    # chunk 2 is scheduled at +0.24 (after 1 + 2 frames) and arrives at +0.30: 60 ms late
    timeline = replay(_chunks(10.0, [1, 2, 4, 8], [0.0, 0.05, 0.30, 0.50]))
    assert timeline.has_underrun
    assert timeline.num_late_chunks == 1
    assert timeline.extra_buffer_s == pytest.approx(0.06, abs=1e-12)
    assert timeline.lateness_s[2] == pytest.approx(0.06, abs=1e-12)


def test_extra_buffer_is_the_largest_lateness() -> None:
    # late by 0.02 (chunk 1) and 0.10 (chunk 3: scheduled at +0.56, arrives at +0.66)
    timeline = replay(_chunks(0.0, [1, 2, 4, 8], [0.0, 0.10, 0.20, 0.66]))
    assert timeline.num_late_chunks == 2
    assert timeline.extra_buffer_s == pytest.approx(0.10, abs=1e-12)
    # with that much extra start-up buffer no chunk would be late
    shifted = [lateness - timeline.extra_buffer_s for lateness in timeline.lateness_s]
    assert max(shifted) <= 1e-12


def test_longest_stall_is_the_largest_rise_of_the_lateness() -> None:
    # late by 0.02 (chunk 1), on time again relative to it (chunk 2: 0.01), then 0.10 (chunk 3):
    # a listener that resumes at each chunk stalls 0.02 s, then 0.08 s
    timeline = replay(_chunks(0.0, [1, 2, 4, 8], [0.0, 0.10, 0.25, 0.66]))
    assert timeline.longest_stall_s == pytest.approx(0.08, abs=1e-12)
    assert replay(_chunks(0.0, [1, 2], [0.0, 0.05])).longest_stall_s == 0.0


def test_buffered_level_follows_the_playhead() -> None:
    timeline = PlaybackTimeline()
    assert timeline.buffered_s(5.0) == 0.0  # not playing yet
    timeline.on_chunk(5.0, 0.08)
    timeline.on_chunk(5.01, 0.16)
    assert timeline.buffered_s(5.0) == pytest.approx(0.24)
    assert timeline.buffered_s(5.1) == pytest.approx(0.14)
    assert timeline.buffered_s(6.0) == 0.0  # ran dry: never negative


def test_ttfb_and_rtf_of_a_request() -> None:
    assert ttfb_s(100.0, 100.025) == pytest.approx(0.025)
    result = RequestResult(0, "r0", num_frames_target=15, submit_time=100.0)
    assert result.ttfb_s is None and result.rtf is None and not result.is_ok
    for created, frames in ((100.025, 1), (100.05, 2), (100.1, 4), (100.3, 8)):
        result.add_chunk(created, frames * FRAME_S, frames, receive_time=created + 0.001)
    assert result.ttfb_s == pytest.approx(0.025)
    assert result.audio_s == pytest.approx(1.2)
    assert result.rtf == pytest.approx(0.3 / 1.2)
    assert result.num_frames == 15 and result.is_ok
    assert result.compact()["num_chunks"] == 4


@pytest.mark.parametrize("q", [0, 1, 50, 90, 95, 99, 100])
def test_percentile_matches_numpy_linear(q: float) -> None:
    values = np.random.default_rng(0).exponential(size=37).tolist()
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentile_edge_cases() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0], 50) == 1.5
    with pytest.raises(ValueError, match="q=101"):
        percentile([1.0], 101)
    assert summarize([]) == {"count": 0, "mean": None, "p50": None, "p95": None, "p99": None,
                             "max": None}


def test_summary_counts_errors_and_measures_only_ok_requests() -> None:
    on_time = RequestResult(0, "a", 3, submit_time=0.0)
    on_time.add_chunk(0.1, 0.08, 1, 0.1)
    on_time.add_chunk(0.15, 0.16, 2, 0.15)
    late = RequestResult(1, "b", 3, submit_time=0.0)
    late.add_chunk(0.2, 0.08, 1, 0.2)
    late.add_chunk(0.33, 0.16, 2, 0.33)  # scheduled at 0.28: 50 ms late
    failed = RequestResult(2, "c", 3, submit_time=0.0, status="error", error="RequestFailed")
    timed_out = RequestResult(3, "d", 3, submit_time=0.0, status="timeout", error="timeout")
    run = summarize_requests([on_time, late, failed, timed_out])
    assert (run["num_requests"], run["num_ok"], run["num_errors"]) == (4, 2, 2)
    assert run["num_timeouts"] == 1
    assert run["errors"] == {"RequestFailed": 1, "timeout": 1}
    assert run["underrun_requests"] == 1
    assert run["max_extra_buffer_s"] == pytest.approx(0.05)
    assert run["ttfb_s"]["p50"] == pytest.approx(0.15)
    assert run["audio_s_total"] == pytest.approx(0.48)
    assert run["wall_s"] == pytest.approx(0.33)
    assert run["audio_s_per_s"] == pytest.approx(0.48 / 0.33)
