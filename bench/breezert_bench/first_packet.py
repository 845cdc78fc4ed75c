"""Where each request's first packet spends its time: its own steps by stage, other requests'
steps it waited behind, and the host time in between.

Owns: ``first_packet_paths`` over the engine's step log (``EngineMetrics.steps``) and the
requests' submit and first-chunk times, and its summary; ``opening_steps``, the step timeline of
a closed loop's opening burst. For request r submitted at ``s``,
whose first chunk left the engine at ``c`` (the end of the CODEC step that made it):

- ``own_<stage>``: time in steps of that stage that carried r, between s and c;
- ``others``: time in steps between s and c that did not carry r (it waited behind them);
- ``host``: the rest of ``c - s`` (scheduling, committing, input preparation outside steps,
  and the engine loop between steps); the parts sum to the TTFB by construction.

A step that began before s counts from s (a request submitted mid-step waits for its end).
Step times are the host's wall time around the worker's ``execute``: a step that returns
before its GPU work ends (TEXT_ENCODE, PREFILL, DECODE read nothing back) leaves that work to
the next step that waits for the GPU, so a request's DEPTH step holds its own text encode and
prefill, and its wait behind another request's step can hold GPU work of its own (or theirs).
A log that lost its oldest steps (``EngineMetrics(step_log=N)``) makes the summary say
``log_truncated``: the lost time would count as host time.
Must not: run anything or read the clock; it reads what a run recorded.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from breezert.metrics import StepRecord


@dataclass(frozen=True, slots=True)
class FirstPacket:
    """One request: when it was submitted and when its first chunk left the engine."""

    request_id: str
    submit_time: float
    first_chunk_time: float


def first_packet_path(steps: Sequence[StepRecord], request: FirstPacket) -> dict[str, float]:
    """Seconds of ``request``'s TTFB by part (``own_<stage>``, ``others``, ``host``)."""
    s, c = request.submit_time, request.first_chunk_time
    parts: dict[str, float] = {}
    busy = 0.0
    for step in steps:
        if step.end <= s or step.start >= c:
            continue
        length = min(step.end, c) - max(step.start, s)
        key = f"own_{step.stage}" if request.request_id in step.request_ids else "others"
        parts[key] = parts.get(key, 0.0) + length
        busy += length
    parts["host"] = (c - s) - busy
    return parts


def first_packet_paths(steps: Iterable[StepRecord], requests: Iterable[FirstPacket],
                       log_full: bool = False) -> dict[str, Any]:
    """Per part: p50 / p95 / mean milliseconds over ``requests`` (a part a request lacks counts
    as 0 for it), and how many requests; empty without requests or steps. ``log_full``: the
    log is at its size limit, so steps may have fallen out of it."""
    log = sorted(steps, key=lambda step: step.start)
    requests = list(requests)
    paths = [first_packet_path(log, r) for r in requests]
    if not paths or not log:
        return {}
    names = sorted({name for path in paths for name in path})
    summary: dict[str, Any] = {"num_requests": len(paths)}
    if log_full and log[0].start > min(r.submit_time for r in requests):
        summary["log_truncated"] = True
    for name in names:
        values = np.array([path.get(name, 0.0) for path in paths]) * 1000
        summary[f"{name}_ms"] = {"p50": float(np.percentile(values, 50)),
                                 "p95": float(np.percentile(values, 95)),
                                 "mean": float(values.mean())}
    return summary


def opening_steps(steps: Iterable[StepRecord], requests: Iterable[FirstPacket],
                  burst: int) -> dict[str, Any]:
    """The timeline of a run's opening burst: the first ``burst`` requests by submit time, the
    steps that ran from the first submit to the last of their first chunks (stage, how many of
    the burst's requests and how many requests in all they carried, start and length in ms
    from the first submit), and when each burst request's first chunk left. Empty without
    requests or steps."""
    firsts = sorted(requests, key=lambda r: r.submit_time)[:burst]
    log = sorted(steps, key=lambda step: step.start)
    if not firsts or not log:
        return {}
    t0, end = firsts[0].submit_time, max(r.first_chunk_time for r in firsts)
    ids = {r.request_id for r in firsts}

    def ms(t: float) -> float:
        return round((t - t0) * 1000, 3)

    return {
        "num_requests": len(firsts),
        "submit_ms": [ms(r.submit_time) for r in firsts],
        "first_chunk_ms": sorted(ms(r.first_chunk_time) for r in firsts),
        "steps": [{"stage": s.stage, "burst_requests": len(s.request_ids & ids),
                   "requests": len(s.request_ids), "start_ms": ms(s.start),
                   "ms": round((s.end - s.start) * 1000, 3)}
                  for s in log if s.end > t0 and s.start < end],
    }
