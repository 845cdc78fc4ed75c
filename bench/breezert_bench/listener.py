"""The simulated listener and per-run statistics, as pure functions of chunk timelines.

Owns: a listener that starts playing at its first chunk's arrival and plays in real time (its
underruns, the extra start-up buffer that would have avoided them, its buffer level for
``report_playback``), TTFB/RTF per request, percentiles and the run summary. Must not: read the
clock or touch the engine; callers pass every time point (``time.monotonic()`` values).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

LATE_EPS_S = 1e-9
"""Lateness up to this is float noise, not an underrun."""


def percentile(values: Iterable[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) with linear interpolation (numpy's default); ``None`` for
    no values."""
    data = sorted(values)
    if not data:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"q={q!r} must be in 0..100")
    pos = (len(data) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def summarize(values: Iterable[float]) -> dict[str, float | int | None]:
    """``count``, ``mean``, ``p50``, ``p95``, ``p99``, ``max`` (``None`` when empty)."""
    data = sorted(values)
    mean = sum(data) / len(data) if data else None
    return {
        "count": len(data), "mean": mean, "p50": percentile(data, 50),
        "p95": percentile(data, 95), "p99": percentile(data, 99),
        "max": data[-1] if data else None,
    }


def ttfb_s(submit_time: float, first_chunk_time: float) -> float:
    """Enqueue → first chunk out of the engine."""
    return first_chunk_time - submit_time


@dataclass
class PlaybackTimeline:
    """A listener that starts playing when the first chunk arrives and then plays in real time.

    Chunk ``k`` is scheduled to start at ``start_time + (audio of chunks 0..k-1)``; arriving after
    that is an underrun by its lateness. A start-up buffer of ``extra_buffer_s`` (the largest
    lateness) would have avoided every underrun.

    NOTE(bench): the schedule is fixed at the start (no stall-and-resume), so the buffer level
    ``buffered_s`` and the lateness of every chunk are measured against the same clock.
    """

    start_time: float | None = None
    """Arrival of the first chunk (playback starts then)."""
    received_s: float = 0.0
    """Audio received so far, seconds."""
    max_lateness_s: float = 0.0
    num_late_chunks: int = 0
    lateness_s: list[float] = field(default_factory=list)
    """Per chunk: arrival minus scheduled start (<= 0: on time)."""

    def on_chunk(self, arrival_time: float, duration_s: float) -> float:
        """Records a chunk; returns its lateness (0 for the first chunk)."""
        if self.start_time is None:
            self.start_time = arrival_time
        lateness = arrival_time - (self.start_time + self.received_s)
        self.lateness_s.append(lateness)
        if lateness > LATE_EPS_S:
            self.num_late_chunks += 1
        self.max_lateness_s = max(self.max_lateness_s, lateness)
        self.received_s += duration_s
        return lateness

    def buffered_s(self, now: float) -> float:
        """Audio queued ahead of the playhead at ``now`` (0 before playback starts or when dry)."""
        if self.start_time is None:
            return 0.0
        return max(0.0, self.start_time + self.received_s - now)

    @property
    def has_underrun(self) -> bool:
        return self.num_late_chunks > 0

    @property
    def extra_buffer_s(self) -> float:
        """Smallest extra start-up buffer with no underrun (0 when none happened)."""
        return self.max_lateness_s if self.has_underrun else 0.0

    @property
    def longest_stall_s(self) -> float:
        """The longest silence of a listener that pauses when dry and resumes at the next
        chunk (its stalls add up to ``extra_buffer_s``): the largest rise of the running
        maximum of the lateness."""
        longest = reached = 0.0
        for lateness in self.lateness_s:
            if lateness > reached + LATE_EPS_S:
                longest = max(longest, lateness - reached)
            reached = max(reached, lateness)
        return longest


def replay(chunks: Sequence[tuple[float, float]]) -> PlaybackTimeline:
    """A ``PlaybackTimeline`` fed ``(arrival_time, duration_s)`` pairs in order."""
    timeline = PlaybackTimeline()
    for arrival_time, duration_s in chunks:
        timeline.on_chunk(arrival_time, duration_s)
    return timeline


@dataclass
class RequestResult:
    """What one benchmark request saw."""

    index: int
    request_id: str
    num_frames_target: int
    submit_time: float
    chunk_times: list[float] = field(default_factory=list)
    """``AudioChunk.created_time`` of each chunk (when it left the engine)."""
    chunk_durations_s: list[float] = field(default_factory=list)
    receive_times: list[float] = field(default_factory=list)
    """When the caller's event loop got each chunk."""
    num_frames: int = 0
    status: str = "ok"
    """``ok``, ``error``, ``timeout`` or ``refused`` (``EngineOverloaded``: past capacity)."""
    error: str | None = None
    """Error class name (never the text)."""
    retry_after_s: float | None = None
    """A refused request's Retry-After (what a closed-loop client waits before its next one)."""
    num_feedback_reports: int = 0
    timeline: PlaybackTimeline = field(default_factory=PlaybackTimeline)
    server_ttfb_s: float | None = None
    """Against a running server: its own say -> first audio time (``first_audio.server_ms``),
    beside ``ttfb_s`` measured at this client."""

    def add_chunk(self, created_time: float, duration_s: float, num_frames: int,
                  receive_time: float) -> None:
        self.chunk_times.append(created_time)
        self.chunk_durations_s.append(duration_s)
        self.receive_times.append(receive_time)
        self.num_frames += num_frames
        self.timeline.on_chunk(created_time, duration_s)

    @property
    def is_ok(self) -> bool:
        return self.status == "ok" and bool(self.chunk_times)

    @property
    def audio_s(self) -> float:
        return sum(self.chunk_durations_s)

    @property
    def ttfb_s(self) -> float | None:
        return ttfb_s(self.submit_time, self.chunk_times[0]) if self.chunk_times else None

    @property
    def rtf(self) -> float | None:
        """Wall time from submit to the last chunk / audio seconds."""
        if not self.chunk_times or self.audio_s <= 0:
            return None
        return (self.chunk_times[-1] - self.submit_time) / self.audio_s

    def compact(self) -> dict[str, Any]:
        """The per-request record kept in the JSON."""
        return {
            "index": self.index, "status": self.status, "error": self.error,
            "ttfb_s": _round(self.ttfb_s), "rtf": _round(self.rtf),
            "audio_s": _round(self.audio_s), "num_frames": self.num_frames,
            "num_frames_target": self.num_frames_target, "num_chunks": len(self.chunk_times),
            "extra_buffer_s": _round(self.timeline.extra_buffer_s),
            "underrun": self.timeline.has_underrun,
        }


def _round(value: float | None, digits: int = 5) -> float | None:
    return None if value is None else round(value, digits)


def summarize_records(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The per-run numbers that follow from the per-request records alone (``compact()``
    dicts): counts, TTFB, RTF, underruns, audio. Shards of one run merge through this."""
    ok = [r for r in records if r["status"] == "ok" and r["num_chunks"]]
    errors: dict[str, int] = {}
    for r in records:
        if not (r["status"] == "ok" and r["num_chunks"]):
            key = r["error"] or r["status"]
            errors[key] = errors.get(key, 0) + 1
    extra = [r["extra_buffer_s"] for r in ok]
    return {
        "num_requests": len(records),
        "num_ok": len(ok),
        "num_errors": len(records) - len(ok),
        "num_timeouts": sum(r["status"] == "timeout" for r in records),
        "num_refused": sum(r["status"] == "refused" for r in records),
        "errors": errors,
        "num_short": sum(r["num_frames"] < r["num_frames_target"] for r in ok),
        "ttfb_s": summarize(r["ttfb_s"] for r in ok if r["ttfb_s"] is not None),
        "rtf": summarize(r["rtf"] for r in ok if r["rtf"] is not None),
        "underrun_requests": sum(r.get("underrun", r["extra_buffer_s"] > 0) for r in ok),
        "extra_buffer_s": summarize(extra),
        "max_extra_buffer_s": max(extra, default=0.0),
        "audio_s_total": sum(r["audio_s"] for r in ok),
        "chunks_per_request": summarize(r["num_chunks"] for r in ok),
    }


def summarize_requests(results: Sequence[RequestResult]) -> dict[str, Any]:
    """The per-run numbers of the benchmark table from its requests' results: those of
    ``summarize_records`` (from the JSON records, so times rounded to 10 µs, as a merge of shards
    sees them) plus wall time, throughput, delivery lag and feedback reports."""
    summary = summarize_records([r.compact() for r in results])
    ok = [r for r in results if r.is_ok]
    if results and ok:
        wall_s = max(r.chunk_times[-1] for r in ok) - min(r.submit_time for r in results)
    else:
        wall_s = 0.0
    lags = [rt - ct for r in ok for ct, rt in zip(r.chunk_times, r.receive_times)]
    audio_s = summary["audio_s_total"]
    summary.update({
        "wall_s": wall_s,
        "audio_s_per_s": audio_s / wall_s if wall_s > 0 else None,
        "requests_per_s": len(ok) / wall_s if wall_s > 0 else None,
        "delivery_lag_s": summarize(lags),
        "feedback_reports": sum(r.num_feedback_reports for r in results),
    })
    server = [r.server_ttfb_s for r in ok if r.server_ttfb_s is not None]
    if server:
        summary["server_ttfb_s"] = summarize(server)
    return summary
