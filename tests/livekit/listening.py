"""What a listener heard of the agent: the Python participant's frames and a turn's summary.

Owns: ``Recording`` (every frame of the agent's track at the ``livekit.rtc`` participant, in
playout order), ``Heard`` (one turn: first audio, length and longest gap) and the speech
threshold both listeners use. The browser's ``Heard`` comes from ``browser.edges_heard``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ENERGY_RMS = 200.0  # int16 RMS above which a 10 ms frame counts as speech (tiny-model noise is
#                     thousands; the Opus-decoded silence between turns is < 10)


@dataclass(frozen=True)
class Heard:
    """One turn as a listener heard it: the energetic frames from the first to the last."""

    first: float
    """``time.monotonic()`` at which the first energetic frame reached this process."""
    span_s: float
    """Playout time from the first energetic frame to the end of the last (frames x 10 ms)."""
    gap_s: float
    """Longest run of quiet frames inside it, in playout time (what the listener heard as a gap)."""
    arrival_gap_s: float
    """Longest wait between energetic frames by arrival time here: ``gap_s`` plus this process's
    own delivery jitter (the frames come from the SDK's 10 ms playout clock)."""
    quiet_s: float = 0.0
    """All quiet runs inside it, in playout time (the tiny model's noise has none of its own:
    each one is something a stage after the agent inserted)."""
    quiet_runs: tuple[tuple[float, float], ...] = ()
    """Each quiet run inside it as (start, length) in playout seconds from its first energetic
    frame (where in the turn a hole fell: right after the first chunk, or later)."""


@dataclass
class Recording:
    """Every frame of the agent's track as it reached this participant, in playout order.

    ``rtc.AudioStream`` hands over what the SDK's playout clock pulls out of WebRTC's jitter
    buffer every 10 ms (silence included, none dropped: the queue is unbounded), so the frame
    sequence is what a listener's speaker would play; arrival times add this process's jitter.
    """

    times: list[float] = field(default_factory=list)  # time.monotonic() at arrival
    rms: list[float] = field(default_factory=list)
    durations: list[float] = field(default_factory=list)  # seconds of audio in each frame

    def energetic(self, since: float = 0.0, until: float = float("inf")) -> list[float]:
        return [t for t, e in zip(self.times, self.rms) if e > ENERGY_RMS and since <= t <= until]

    def heard(self, since: float, until: float = float("inf")) -> Heard | None:
        """The speech that arrived in [since, until], or ``None`` if none did."""
        loud = [i for i, (t, e) in enumerate(zip(self.times, self.rms))
                if e > ENERGY_RMS and since <= t <= until]
        if not loud:
            return None
        first, last = loud[0], loud[-1]
        quiet = [sum(self.durations[a + 1:b]) for a, b in zip(loud, loud[1:])]
        runs = tuple((round(sum(self.durations[first:a + 1]), 3), round(q, 3))
                     for a, q in zip(loud, quiet) if q > 0)
        arrival = max((self.times[b] - self.times[a] for a, b in zip(loud, loud[1:])),
                      default=0.0)
        return Heard(first=self.times[first], span_s=sum(self.durations[first:last + 1]),
                     gap_s=max(quiet, default=0.0), arrival_gap_s=arrival, quiet_s=sum(quiet),
                     quiet_runs=runs)
