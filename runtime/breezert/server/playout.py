"""Browser playout stats -> the listener's current playback buffer and concealment growth.

Owns: the delta arithmetic over cumulative ``RTCInboundRtpStreamStats`` (``jitterBufferDelay``
is a sum over emitted samples, so the current delay is delta-delay / delta-emitted). Must not:
read the clock, keep more than the previous sample, or talk to the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

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
        self._last: Playout | None = None
        self._jitter_buffer_s = 0.0
        self._target_s: float | None = None

    def update(self, stats: Playout) -> PlayoutEstimate:
        last, self._last = self._last, stats
        if last is None or stats.jitter_buffer_emitted_count < last.jitter_buffer_emitted_count:
            # First report, or the receiver restarted its counters: use the lifetime average.
            return self._first(stats)
        emitted = stats.jitter_buffer_emitted_count - last.jitter_buffer_emitted_count
        if emitted > 0:
            delay = stats.jitter_buffer_delay - last.jitter_buffer_delay
            self._jitter_buffer_s = max(delay / emitted, 0.0)
            target = _delta(stats.jitter_buffer_target_delay, last.jitter_buffer_target_delay)
            if target is not None:
                self._target_s = max(target / emitted, 0.0)
        return PlayoutEstimate(
            self._jitter_buffer_s, self._target_s,
            int(_delta(stats.concealment_events, last.concealment_events) or 0),
            int(_delta(stats.concealed_samples, last.concealed_samples) or 0),
        )

    def _first(self, stats: Playout) -> PlayoutEstimate:
        emitted = stats.jitter_buffer_emitted_count
        if emitted > 0:
            self._jitter_buffer_s = stats.jitter_buffer_delay / emitted
            if stats.jitter_buffer_target_delay is not None:
                self._target_s = stats.jitter_buffer_target_delay / emitted
        return PlayoutEstimate(self._jitter_buffer_s, self._target_s, 0, 0)


def _delta(new: float | None, old: float | None) -> float | None:
    if new is None or old is None:
        return None
    return max(new - old, 0.0)
