"""How loaded an engine is: ``EngineLoad``, one figure for a dispatcher or a load balancer.

Owns: the load snapshot (running and queued requests against the scheduler's limits, the
Predictor's least slack over the requests that still owe audio, and the running streams'
real-time demand against what admission lets in), the single ``fraction`` every
consumer compares (LiveKit's ``load_fnc``, ``/readyz``, the remote client's replica choice) and
its JSON form. Must not: read a clock, take a lock or touch torch; the scheduler measures under
the engine's lock (``Engine.load``) over its ``StreamTable``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from breezert.sched.admission import fits
from breezert.sched.deadline import DeadlinePredictor
from breezert.sched.streams import NO_PHASE, StreamTable


@dataclass(frozen=True)
class EngineLoad:
    """One engine's load at one moment.

    ``fraction`` is 1.0 (full) when every running slot is taken (a new request would queue),
    the Predictor sees a request that owes audio with negative slack (even its smallest next
    chunk will be late: the engine is behind real time) or one more stream would not fit the
    real-time capacity (``sched/admission.py``); otherwise the larger of the share of running
    slots in use and the share of the admitted real-time capacity in use.
    """

    running: int
    queued: int
    max_running: int
    max_queued: int
    least_slack_s: float | None = None
    """The Predictor's least slack (seconds) over running requests that owe audio; ``None``
    without a Predictor or with no such request."""
    realtime_demand: float | None = None
    """Seconds of audio per second the running streams need (``None``: admission by real-time
    capacity is off)."""
    realtime_limit: float | None = None
    """Seconds of audio per second admission lets them need: ``admission_headroom`` of the
    learned capacity (``None``: off)."""

    @property
    def is_behind(self) -> bool:
        return self.least_slack_s is not None and self.least_slack_s < 0.0

    @property
    def fraction(self) -> float:
        """0 (idle) .. 1 (full): requests against running slots or real-time demand against its
        limit, 1 when behind or when one more stream would not fit."""
        if self.is_behind or self.max_running <= 0:
            return 1.0
        share = (self.running + self.queued) / self.max_running
        demand, limit = self.realtime_demand, self.realtime_limit
        if demand is not None and limit is not None:
            if not fits(demand, 1, limit):
                return 1.0
            share = max(share, demand / limit)
        return min(1.0, share)

    @property
    def is_full(self) -> bool:
        return self.fraction >= 1.0

    def as_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "fraction": round(self.fraction, 4), "running": self.running, "queued": self.queued,
            "max_running": self.max_running, "max_queued": self.max_queued,
        }
        if self.least_slack_s is not None:
            body["least_slack_s"] = round(self.least_slack_s, 4)
        if self.realtime_demand is not None and self.realtime_limit is not None:
            body["realtime_demand"] = round(self.realtime_demand, 4)
            body["realtime_limit"] = round(self.realtime_limit, 4)
        return body

    @classmethod
    def from_json(cls, body: Any) -> EngineLoad | None:
        """The load in an ``as_json`` body (``/readyz``'s ``load``); ``None`` when it is not
        one (an older server, a proxy's page)."""
        if not isinstance(body, Mapping):
            return None
        try:
            slack, demand, limit = (body.get(key) for key in (
                "least_slack_s", "realtime_demand", "realtime_limit"))
            return cls(int(body["running"]), int(body["queued"]), int(body["max_running"]),
                       int(body["max_queued"]), None if slack is None else float(slack),
                       None if demand is None else float(demand),
                       None if limit is None else float(limit))
        except (KeyError, TypeError, ValueError):
            return None


def least_slack(table: StreamTable, predictor: DeadlinePredictor, now: float) -> float | None:
    """The predictor's least slack over the running requests that owe audio: a segment to
    generate or frames to decode (an open turn whose text has all been spoken owes nothing
    until its next text: its slack means nothing); ``None`` when none does."""
    live = np.flatnonzero(table.live)
    owes = live[(table.phase[live] != NO_PHASE) | (table.pending[live] > 0)]
    return float(predictor.slacks(table, owes, now).min()) if len(owes) else None
