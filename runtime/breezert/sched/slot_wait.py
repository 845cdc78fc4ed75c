"""Predicted wait for a running slot, from the running requests' remaining audio.

Owns: the estimate an over-capacity request is refused with (``EngineOverloaded.retry_after_s``,
the HTTP ``Retry-After``) and that ``scheduler.max_queue_wait_s`` is compared against. Must not:
read a clock, touch torch or change a request; the scheduler hands in its running requests and
``now``.

The estimate (simple on purpose, so a caller can check it):

- a running request's remaining frames: for each segment not ended, its expected length minus the
  frames it has. The expected length is ``max_frames`` under ``ignore_eos``, otherwise
  ``min(max_frames, frames_per_token * num_text_tokens)`` with ``frames_per_token`` learned from
  the segments that ended by EOS (``FramesPerToken``); before one has, unknown;
- the time per frame: the running requests' seconds since they were first scheduled over the
  frames they generated (all of them), one figure for every request since they step together;
- its end: now plus remaining frames times the time per frame; unknown for a request whose
  input is still open and that has nothing left to generate (it waits for more text) and for
  one whose segments' lengths are unknown;
- the waiting request at ``position`` (0 = next) gets the slot of the ``position + 1``-th running
  request to end; past the number of running requests (all with a known end) the cycle repeats,
  each slot taking the running requests' mean length (elapsed plus remaining) once more.

It counts slots only: a request that finds a slot but not the KV blocks for its first segment
waits longer (``configs/h200-capacity.toml``'s pool holds 256 typical requests at once).
"""

from __future__ import annotations

from collections.abc import Sequence

from breezert.request import Request

_RATIO_ALPHA = 0.2
"""EWMA weight of one ended segment's frames per text token."""


class FramesPerToken:
    """Frames of speech per text token, an EWMA over the segments that ended by EOS."""

    def __init__(self) -> None:
        self.value: float | None = None

    def observe(self, num_frames: int, num_text_tokens: int | None) -> None:
        if not num_text_tokens or num_frames <= 0:
            return
        ratio = num_frames / num_text_tokens
        self.value = ratio if self.value is None else (
            self.value + _RATIO_ALPHA * (ratio - self.value))


def remaining_frames(request: Request, frames_per_token: float | None) -> int | None:
    """Frames ``request`` is expected still to generate (see the module doc); ``None`` when its
    end is unknown."""
    remaining = 0
    for seg in request.segments:
        if seg.is_ended:
            continue
        expected = seg.max_frames
        if not request.ignore_eos:
            if frames_per_token is None or seg.num_text_tokens is None:
                return None
            expected = min(expected, round(frames_per_token * seg.num_text_tokens))
        remaining += max(expected - seg.num_frames, 1)  # a segment not ended owes a frame
    if remaining == 0 and not request.input_closed:
        return None
    return remaining


def frame_time_s(running: Sequence[Request], now: float) -> float | None:
    """Seconds per frame of one running request: their time running over their frames; ``None``
    before any frame."""
    elapsed = frames = 0.0
    for request in running:
        if request.first_scheduled_time is not None and request.num_frames > 0:
            elapsed += now - request.first_scheduled_time
            frames += request.num_frames
    return elapsed / frames if frames > 0 else None


def predicted_slot_wait(running: Sequence[Request], position: int, now: float,
                        frames_per_token: float | None) -> float | None:
    """Seconds until the waiting request at ``position`` (0 = next) gets a slot (module doc);
    ``None`` when unknown (no frame generated yet, or requests with no known end hold the
    slots it needs)."""
    per_frame = frame_time_s(running, now)
    if per_frame is None or not running:
        return None
    remaining = [remaining_frames(r, frames_per_token) for r in running]
    ends = sorted(n * per_frame for n in remaining if n is not None)
    if position < len(ends):
        return ends[position]
    if len(ends) < len(running):
        return None
    cycles, index = divmod(position, len(running))
    mean_length = sum((now - r.first_scheduled_time if r.first_scheduled_time is not None else 0.0)
                      + n * per_frame for r, n in zip(running, remaining) if n is not None
                      ) / len(running)
    return ends[index] + cycles * mean_length
