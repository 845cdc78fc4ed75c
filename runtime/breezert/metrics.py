"""Engine metrics: per-stage step times and batch sizes, per-request TTFB, chunk times and RTF.

Owns: recording what the engine reports and producing a plain-dict snapshot (the server exports
it as Prometheus text). Must not: read the clock itself or be read by models.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from breezert.constants import FRAME_S

# Histogram bucket upper bounds for TTFB, seconds (Prometheus ``le`` labels).
TTFB_BUCKETS_S = (0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0)
_WINDOW = 2048  # recent samples kept per series for quantiles


@dataclass
class RequestRecord:
    """Timeline of one request, filled as it runs."""

    request_id: str
    enqueue_time: float
    first_scheduled_time: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    chunk_frames: list[int] = field(default_factory=list)
    finish_time: float | None = None
    status: str = "running"

    @property
    def ttfb_s(self) -> float | None:
        """Enqueue → first chunk out of the engine."""
        return self.chunk_times[0] - self.enqueue_time if self.chunk_times else None

    @property
    def audio_s(self) -> float:
        return sum(self.chunk_frames) * FRAME_S

    @property
    def rtf(self) -> float | None:
        """Wall time / audio time, from enqueue to the last chunk."""
        if not self.chunk_times or self.audio_s == 0:
            return None
        return (self.chunk_times[-1] - self.enqueue_time) / self.audio_s


@dataclass
class _Series:
    count: int = 0
    total: float = 0.0
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=_WINDOW))

    def add(self, value: float) -> None:
        self.count += 1
        self.total += value
        self.recent.append(value)

    def summary(self) -> dict[str, float]:
        if not self.recent:
            return {"count": self.count}
        arr = np.asarray(self.recent)
        return {
            "count": self.count, "mean": self.total / self.count,
            "p50": float(np.percentile(arr, 50)), "p95": float(np.percentile(arr, 95)),
            "p99": float(np.percentile(arr, 99)), "max": float(arr.max()),
        }


class EngineMetrics:
    """Counters, recent-window quantiles and a TTFB histogram."""

    def __init__(self) -> None:
        self.step_s: dict[str, _Series] = {}
        self.batch_rows: dict[str, _Series] = {}
        self.ttfb = _Series()
        self.rtf = _Series()
        self.ttfb_buckets = [0] * (len(TTFB_BUCKETS_S) + 1)
        self.counters: dict[str, int] = {}
        self.requests: dict[str, RequestRecord] = {}
        self.finished: deque[RequestRecord] = deque(maxlen=_WINDOW)

    def incr(self, name: str, value: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + value

    def record_step(self, stage: str, num_rows: int, duration_s: float) -> None:
        self.step_s.setdefault(stage, _Series()).add(duration_s)
        self.batch_rows.setdefault(stage, _Series()).add(float(num_rows))

    def request_added(self, request_id: str, now: float) -> None:
        self.requests[request_id] = RequestRecord(request_id, enqueue_time=now)
        self.incr("requests_added")

    def chunk_emitted(self, request_id: str, num_frames: int, now: float) -> None:
        record = self.requests.get(request_id)
        if record is None:
            return
        if not record.chunk_times:
            ttfb = now - record.enqueue_time
            self.ttfb.add(ttfb)
            index = next((i for i, b in enumerate(TTFB_BUCKETS_S) if ttfb <= b), -1)
            self.ttfb_buckets[index] += 1
        record.chunk_times.append(now)
        record.chunk_frames.append(num_frames)
        self.incr("chunks_emitted")

    def request_finished(self, request_id: str, status: str, now: float) -> RequestRecord | None:
        record = self.requests.pop(request_id, None)
        self.incr(f"requests_{status}")
        if record is None:
            return None
        record.finish_time = now
        record.status = status
        if record.rtf is not None and status == "finished":
            self.rtf.add(record.rtf)
        self.finished.append(record)
        return record

    def snapshot(self) -> dict[str, Any]:
        """A plain dict: counters, per-stage step seconds and rows, TTFB and RTF summaries."""
        return {
            "counters": dict(self.counters),
            "stages": {
                stage: {"step_s": series.summary(), "rows": self.batch_rows[stage].summary()}
                for stage, series in self.step_s.items()
            },
            "ttfb_s": self.ttfb.summary(),
            "ttfb_histogram": {"buckets_s": list(TTFB_BUCKETS_S), "counts": list(self.ttfb_buckets)},
            "rtf": self.rtf.summary(),
            "active_requests": len(self.requests),
        }
