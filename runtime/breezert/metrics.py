"""Engine metrics: per-stage step times and batch sizes, TTFB and RTF over requests, counters.

Owns: aggregates of what the engine reports (step times) and of the scheduler's events (chunks
out, requests done), and a plain-dict snapshot (the server exports it as Prometheus text). Holds
nothing per request: a request's timeline is its ``Request``'s. Must not: read the clock itself
or be read by models.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from breezert.constants import FRAME_S
from breezert.sched.scheduler import ChunkEmitted, RequestFinished, SchedulerEvent

STEP_LOG = 1 << 16
"""Steps a benchmark's log keeps (minutes of steps at 64 streams); older ones fall out."""


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One step the worker ran: its stage, the requests it carried, when it ran (engine
    clock, seconds)."""

    stage: str
    request_ids: frozenset[str]
    start: float
    end: float


# Histogram bucket upper bounds for TTFB, seconds (Prometheus ``le`` labels).
TTFB_BUCKETS_S = (0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0)
_WINDOW = 2048  # recent samples kept per series for quantiles


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

    def __init__(self, step_log: int = 0) -> None:
        """``step_log``: keep the latest that many steps in ``steps`` (0: none; a serving
        engine keeps none, since each entry holds the ids of the requests it carried)."""
        self.step_s: defaultdict[str, _Series] = defaultdict(_Series)
        self.batch_rows: defaultdict[str, _Series] = defaultdict(_Series)
        self.ttfb = _Series()
        self.rtf = _Series()
        self.ttfb_buckets = [0] * (len(TTFB_BUCKETS_S) + 1)
        self.counters: dict[str, int] = {}
        self.steps: deque[StepRecord] = deque(maxlen=step_log)
        """The latest steps in order (``breezert_bench.first_packet`` reads them; not exported)."""
        self.num_finished = 0
        """Requests that reached a terminal status (``active_requests`` = added - this)."""

    def incr(self, name: str, value: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + value

    def record_step(self, stage: str, num_rows: int, duration_s: float,
                    request_ids: Iterable[str] = (), start: float | None = None) -> None:
        """A step's time and rows; with ``start`` (engine clock) it also enters the step log."""
        self.step_s[stage].add(duration_s)
        self.batch_rows[stage].add(float(num_rows))
        if start is not None and self.steps.maxlen:
            self.steps.append(StepRecord(stage, frozenset(request_ids), start,
                                         start + duration_s))

    def request_added(self) -> None:
        self.incr("requests_added")

    def on_events(self, events: Iterable[SchedulerEvent]) -> None:
        """Records what one commit of the scheduler reported (chunks out, requests done)."""
        num_chunks = 0
        for event in events:
            if isinstance(event, ChunkEmitted):
                num_chunks += 1
                if event.chunk_index == 0:
                    self._first_chunk(event)
            elif isinstance(event, RequestFinished):
                self._request_finished(event)
        if num_chunks:
            self.incr("chunks_emitted", num_chunks)

    def _first_chunk(self, event: ChunkEmitted) -> None:
        ttfb = event.time - event.enqueue_time
        self.ttfb.add(ttfb)
        index = next((i for i, b in enumerate(TTFB_BUCKETS_S) if ttfb <= b), -1)
        self.ttfb_buckets[index] += 1

    def _request_finished(self, event: RequestFinished) -> None:
        # a request refused after waiting past max_queue_wait_s counts with the refusals at
        # arrival (``requests_refused_<reason>``, Engine.add_request), not with the failures
        self.incr("requests_refused_waited" if event.overloaded
                  else f"requests_{event.status.value}")
        self.num_finished += 1
        audio_s = event.num_emitted_frames * FRAME_S
        if event.status.value == "finished" and event.last_chunk_time is not None and audio_s:
            self.rtf.add((event.last_chunk_time - event.enqueue_time) / audio_s)

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
            "active_requests": self.counters.get("requests_added", 0) - self.num_finished,
        }
