"""Browser playout stats -> the listener's current playback buffer and concealment growth.

Owns: one WebRTC peer's tracker over its client's ``playout`` messages (the arithmetic is
``breezert.jitter_buffer``'s). Must not: read the clock, keep more than the previous sample, or
talk to the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

from breezert.jitter_buffer import JitterCounters
from breezert.server.protocol import Playout


@dataclass(frozen=True)
class PlayoutEstimate:
    jitter_buffer_s: float
    """Current jitter-buffer delay: how long audio waits in the browser before it plays."""
    target_s: float | None
    """The jitter buffer's current target delay, when reported."""
    new_concealment_events: int
    """Concealment events since the previous report (each one is an audible gap)."""
    new_concealed_samples: int


class PlayoutTracker:
    """Turns successive cumulative reports of one receiver into current values."""

    def __init__(self) -> None:
        self._last: JitterCounters | None = None
        self._jitter_buffer_s = 0.0
        self._target_s: float | None = None

    def update(self, stats: Playout) -> PlayoutEstimate:
        counters = JitterCounters(
            stats.jitter_buffer_delay, stats.jitter_buffer_emitted_count,
            stats.jitter_buffer_target_delay, stats.concealed_samples, stats.concealment_events,
        )
        last, self._last = self._last, counters
        if last is None or counters.restarted_since(last):
            # First report, or the receiver restarted its counters: use the lifetime average.
            interval = counters.lifetime()
        else:
            interval = counters.since(last)
        if interval.delay_s is not None:
            self._jitter_buffer_s = interval.delay_s
            if interval.target_delay_s is not None:
                self._target_s = interval.target_delay_s
        return PlayoutEstimate(self._jitter_buffer_s, self._target_s,
                               interval.new_concealment_events, interval.new_concealed_samples)
