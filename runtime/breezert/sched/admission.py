"""Admission by real-time capacity: whether the engine can feed one more stream as fast as its
listener plays it.

Owns: the engine's real-time capacity (``RealtimeCapacity``: seconds of audio it makes per second
of its steps at the load it runs, learned from its own step timings), its frame cycle
(``FrameCycle``: busy time from one DEPTH step to the next) and the streams that cycle can feed
within a bound (``cycle_stream_limit``), what each running stream still needs
(``stream_demand``) and when a newcomer fits (``capacity_wait``). Must not: read a
clock, touch torch or change a request; the scheduler hands in its rows' figures and decides
(``Scheduler.add_request``: admit, queue for a short predicted wait, or refuse with it).

The model (fluid and simple on purpose, so that a caller can check it by hand):

- a stream that still has audio to generate needs it at ``remaining / (remaining + buffered)``
  seconds of audio per second (``remaining`` the audio it is expected still to make,
  ``buffered`` what its listener has ahead of it): 1 while its listener has nothing buffered (a
  newcomer), less the further ahead it is, 1 when its remaining audio is unknown, and a stream
  with nothing left to generate needs nothing;
- ``n`` newcomers fit while ``demand + n <= headroom * capacity``, and always when no running
  stream needs anything (an idle engine serves whatever its capacity estimate says);
- otherwise the wait is the time until enough running streams have finished generating (in
  order of their predicted ends) that they fit; unknown when a stream whose end is unknown
  stands in the way;
- the capacity: over a window of ``window_s`` busy seconds (the engine's steps and the host work
  between them while it has work: ``Engine`` hands each step's share in), ``produced`` (audio made
  per busy second) against ``fed`` (the streams owed audio, on average over the window). More
  streams make more audio a second (bigger batches) but each gets a smaller share, so the
  capacity (the load at which every stream gets exactly 1 s/s) is at least ``produced`` when
  ``produced >= fed`` (every stream was kept ahead) and at most ``produced`` when ``produced <
  fed`` (they fell behind). The estimate moves a fraction ``alpha`` of the way toward a window's
  rate only when that bound says it is wrong: a slow step is a small part of a window, and a
  light load (which keeps ahead) never lowers it, so one stall cannot make it refuse everything;
  and once load drops after a slow spell, the streams it keeps ahead raise it again.
"""

from __future__ import annotations

import math

import numpy as np

from breezert.constants import FRAME_S

_IDLE = 1e-9
"""Demand at or below this is none: nothing running needs audio."""


class RealtimeCapacity:
    """Seconds of audio per second the engine can make at full load, learned from its steps
    (module doc).

    Args:
        initial_s: The estimate to start from (a profile's measured figure).
        window_s: Busy seconds of steps per sample; ``None``: ``initial_s`` stays fixed.
        alpha: Fraction of the way a sample that contradicts the estimate moves it.
    """

    def __init__(self, initial_s: float, window_s: float | None = 1.0, alpha: float = 0.25) -> None:
        if not (math.isfinite(initial_s) and initial_s > 0):
            raise ValueError(f"initial_s={initial_s} must be a finite number > 0")
        if window_s is not None and not window_s > 0:
            raise ValueError(f"window_s={window_s} must be > 0")
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha={alpha} must be in (0, 1]")
        self.value = float(initial_s)
        self.window_s, self.alpha = window_s, alpha
        self.num_samples = 0
        """Windows that closed with audio made (each is one sample, moving the estimate or not)."""
        self._busy_s = self._audio_s = self._stream_s = 0.0

    def observe_step(self, duration_s: float, frames: int, streams: int) -> None:
        """One step that took ``duration_s`` of busy time (with the host work since the step
        before), made ``frames`` frames of audio (a DEPTH step's items; 0 for other stages)
        while ``streams`` running streams were owed audio. O(1)."""
        if self.window_s is None or not (math.isfinite(duration_s) and duration_s >= 0):
            return
        self._busy_s += duration_s
        self._audio_s += frames * FRAME_S
        self._stream_s += streams * duration_s
        if self._busy_s < self.window_s:
            return
        busy, audio, stream_s = self._busy_s, self._audio_s, self._stream_s
        self._busy_s = self._audio_s = self._stream_s = 0.0
        if audio <= 0.0 or stream_s <= 0.0:
            return  # nothing generated: the window says nothing about the rate
        self.num_samples += 1
        produced, fed = audio / busy, stream_s / busy
        behind_and_lower = produced < fed and produced < self.value
        ahead_and_higher = produced >= fed and produced > self.value
        if behind_and_lower or ahead_and_higher:
            self.value += self.alpha * (produced - self.value)


class FrameCycle:
    """The engine's frame cycle: the busy time from one DEPTH step to the next (every stage's
    steps and the host work between them), a moving average. A stream owed audio gets at most
    one frame a cycle, so a newcomer's progressive start (chunks of 1, 2, 4 frames, each made
    while the chunk before it plays) keeps ahead of its listener only while two cycles fit in
    one frame's 80 ms: a bound on the cycle, which seconds of audio per second do not see (a
    long cycle over many streams can make as much audio as a short one over few).

    Args:
        alpha: Fraction of the way one cycle moves the average (the first sets it).
    """

    def __init__(self, alpha: float = 0.25) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha={alpha} must be in (0, 1]")
        self.alpha = alpha
        self.value: float | None = None
        """Seconds a cycle, on average; ``None`` before the first DEPTH step."""
        self._busy_s = 0.0

    def observe_step(self, duration_s: float, depth: bool) -> None:
        """One step of ``duration_s`` busy seconds (with the host work since the step before);
        ``depth``: a DEPTH step, which closes a cycle. O(1)."""
        if not (math.isfinite(duration_s) and duration_s >= 0):
            return
        self._busy_s += duration_s
        if not depth:
            return
        cycle, self._busy_s = self._busy_s, 0.0
        self.value = cycle if self.value is None else self.value + self.alpha * (cycle -
                                                                                  self.value)


def cycle_stream_limit(cycle_s: float | None, streams: int, max_cycle_s: float) -> float:
    """How many streams owed audio the engine can feed within ``max_cycle_s`` a frame cycle:
    ``streams * max_cycle_s / cycle_s``, extrapolated from the ``streams`` that make today's
    cycle (a cycle grows with its rows no faster than in proportion: a step's fixed costs do
    not grow); unbounded (``inf``) before a cycle was measured, with no stream owed audio, or
    while the cycle is within half of the bound (there the fixed costs dominate and the
    proportion would hold back an arrival burst at low load)."""
    if cycle_s is None or streams <= 0 or cycle_s <= 0.5 * max_cycle_s:
        return math.inf
    return streams * max_cycle_s / cycle_s


def stream_demand(remaining_s: np.ndarray, buffered_s: np.ndarray) -> np.ndarray:
    """Seconds of audio per second each stream needs: ``remaining / (remaining + buffered)``;
    1 where ``remaining_s`` is NaN (unknown), 0 where it is 0 (module doc)."""
    total = remaining_s + buffered_s
    share = np.divide(remaining_s, total, out=np.zeros_like(total), where=total > 0)
    return np.where(np.isnan(remaining_s), 1.0, share)


def fits(demand: float, need: float, limit: float) -> bool:
    """Whether ``need`` more streams at 1 s/s fit beside ``demand`` within ``limit`` (always when
    nothing runs)."""
    return demand <= _IDLE or demand + need <= limit


def capacity_wait(demand: np.ndarray, ends_s: np.ndarray, need: float,
                  limit: float) -> float | None:
    """Seconds until ``need`` more streams fit: 0 now, else the predicted end (``ends_s``,
    seconds from now; NaN: unknown) of the running stream whose end makes room; ``None`` when
    that stream's end is unknown (module doc)."""
    total = float(demand.sum())
    if fits(total, need, limit):
        return 0.0
    order = np.argsort(ends_s, kind="stable")  # NaN (unknown) last
    left = total - np.cumsum(demand[order])
    room = np.flatnonzero((left <= _IDLE) | (left + need <= limit))
    end = float(ends_s[order[room[0]]])  # the last stream's end always makes room
    return None if math.isnan(end) else end
