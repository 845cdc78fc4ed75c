"""breezert.jitter_buffer: receiver counters -> the listener's buffer over a report interval."""

from __future__ import annotations

import pytest

from breezert.jitter_buffer import JitterCounters, JitterInterval

pytestmark = pytest.mark.unit


def test_interval_is_the_delta_mean_over_samples_emitted_in_it() -> None:
    old = JitterCounters(delay_s=10.0, emitted=100_000, target_delay_s=8.0, concealed_samples=5,
                         concealment_events=1)
    new = JitterCounters(delay_s=10.0 + 0.06 * 4800, emitted=104_800, target_delay_s=8.0 + 0.05 * 4800,
                         concealed_samples=485, concealment_events=2)
    interval = new.since(old)
    assert interval.delay_s == pytest.approx(0.06)
    assert interval.target_delay_s == pytest.approx(0.05)
    assert (interval.new_concealed_samples, interval.new_concealment_events) == (480, 1)


def test_no_audio_missing_fields_and_restarts() -> None:
    old = JitterCounters(delay_s=1.0, emitted=48_000)
    same = JitterCounters(delay_s=1.0, emitted=48_000, target_delay_s=2.0, concealed_samples=9)
    assert same.since(old) == JitterInterval(None, None, 0, 0)  # nothing emitted, no old target
    restarted = JitterCounters(delay_s=0.5, emitted=9_600, target_delay_s=0.4)
    assert restarted.restarted_since(old) and not old.restarted_since(old)
    assert restarted.lifetime() == JitterInterval(pytest.approx(0.5 / 9_600),
                                                  pytest.approx(0.4 / 9_600), 0, 0)
    assert JitterCounters(0.0, 0).lifetime() == JitterInterval(None, None, 0, 0)
    shrunk = JitterCounters(delay_s=0.9, emitted=52_800)  # a counter going back is clamped at 0
    assert shrunk.since(old).delay_s == 0.0
