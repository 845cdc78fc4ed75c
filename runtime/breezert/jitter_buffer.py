"""WebRTC receiver counters -> the listener's jitter buffer over the last report interval.

Owns: the delta arithmetic over cumulative ``RTCInboundRtpStreamStats`` counters
(``jitterBufferDelay`` is a sum over emitted samples, so the current delay is Δdelay / Δemitted),
shared by the server's WebRTC peers (``server/playout.py``) and the LiveKit plugin's data-topic
reporter (``breezert_agent/playout.py``). Must not: read the clock, keep state or import
anything beyond the standard library (the plugin imports it without the server stack).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class JitterInterval:
    """What changed between two reports of one receiver."""

    delay_s: float | None
    """Mean time a sample emitted in the interval spent in the jitter buffer (None: no sample
    was emitted)."""
    target_delay_s: float | None
    """The buffer's mean target delay over the interval, when both reports carry it."""
    new_concealed_samples: int
    """Samples the receiver had to invent in the interval (> 0: the listener heard a gap)."""
    new_concealment_events: int


@dataclass(frozen=True)
class JitterCounters:
    """One cumulative report: ``jitterBufferDelay`` (s), ``jitterBufferEmittedCount``, and the
    optional ``jitterBufferTargetDelay`` (s), ``concealedSamples``, ``concealmentEvents``."""

    delay_s: float
    emitted: float
    target_delay_s: float | None = None
    concealed_samples: float | None = None
    concealment_events: float | None = None

    def restarted_since(self, previous: JitterCounters) -> bool:
        """The receiver reset its counters (a new track): deltas would be meaningless."""
        return self.emitted < previous.emitted

    def lifetime(self) -> JitterInterval:
        """Averages over the receiver's whole life (a first report has nothing to diff)."""
        if self.emitted <= 0:
            return JitterInterval(None, None, 0, 0)
        target = None if self.target_delay_s is None else self.target_delay_s / self.emitted
        return JitterInterval(self.delay_s / self.emitted, target, 0, 0)

    def since(self, previous: JitterCounters) -> JitterInterval:
        emitted = self.emitted - previous.emitted
        delay = target = None
        if emitted > 0:
            delay = max((self.delay_s - previous.delay_s) / emitted, 0.0)
            if self.target_delay_s is not None and previous.target_delay_s is not None:
                target = max((self.target_delay_s - previous.target_delay_s) / emitted, 0.0)
        return JitterInterval(
            delay, target,
            int(_growth(self.concealed_samples, previous.concealed_samples)),
            int(_growth(self.concealment_events, previous.concealment_events)),
        )


def _growth(new: float | None, old: float | None) -> float:
    if new is None or old is None:
        return 0.0
    return max(new - old, 0.0)
