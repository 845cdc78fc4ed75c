"""DeadlinePredictor: per-stage step-time model, playback deadlines and slack per request.

Owns the stage-time estimate (``StageTimeModel``) and the decision counters; everything it knows
of a request (its chunk log, its listener's latest ``PlaybackReport``) it reads off the
``Request``, which owns it. Never reads the clock (every method takes ``now``), never imports
torch, never reads the engine: the engine feeds step durations in, the chunk policy hands it each
emitted chunk, and the policies in ``sched/policy.py`` ask questions.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass

from breezert.config import SchedulerConfig
from breezert.constants import FRAME_S, Stage
from breezert.request import Request, SegmentPhase

COUNTERS = (
    "predictor_waits", "predictor_early_emits", "predictor_deadline_misses",
    "predictor_lead_yields", "predictor_feedback_used", "predictor_feedback_stale",
    "predictor_feedback_missing", "predictor_first_chunk_covers",
)
"""Decision counters, each reported from 0 (``predictor_feedback_*``: per streaming chunk, where
its deadline's buffer level came from)."""

_BEFORE_TEXT_ENCODED = frozenset({SegmentPhase.QUEUED, SegmentPhase.TEXT_ENCODE})
_BEFORE_PREFILLED = _BEFORE_TEXT_ENCODED | {SegmentPhase.PREFILL}
"""Phases of an active segment that still owe a text encode / a prefill before its frames."""
_DEV_K = 2.0  # predict mean + 2 * mean absolute deviation (roughly a p95 for steady steps)
_LATE_EPS_S = 1e-6  # lateness up to this is float noise, not a miss


def _bucket(rows: int) -> int:
    """Batch-size bucket: the next power of two (1, 2, 4, 8, ...)."""
    return 1 << max(0, rows - 1).bit_length()


@dataclass
class _Ewma:
    mean: float
    dev: float = 0.0

    def add(self, value: float, alpha: float) -> None:
        diff = value - self.mean
        self.mean += alpha * diff
        self.dev = (1.0 - alpha) * self.dev + alpha * abs(diff)


class StageTimeModel:
    """Recent step durations per (stage, batch-size bucket), as an EWMA of the mean and of the
    absolute deviation; a prediction is ``(mean + 2 * deviation) * margin``.

    Args:
        alpha: EWMA weight of a new observation (0 < alpha <= 1).
        margin: Factor applied to every prediction (>= 1 is conservative).
        prior_s: Prediction for a stage never observed, before the margin.
    """

    def __init__(self, alpha: float = 0.2, margin: float = 1.2, prior_s: float = 0.02) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha={alpha} must be in (0, 1]")
        self.alpha, self.margin, self.prior_s = alpha, margin, prior_s
        self._stats: dict[tuple[Stage, int], _Ewma] = {}
        self._last_rows: dict[Stage, int] = {}
        self._memo: dict[tuple[Stage, int | None], float] = {}
        """Predictions since the last observation: the scheduler asks a few hundred times per
        step at 64 streams, and nothing changes them between two steps."""

    def observe(self, stage: Stage, rows: int, duration_s: float) -> None:
        """Records one step of ``stage`` over ``rows`` batch rows that took ``duration_s``."""
        if rows <= 0 or not math.isfinite(duration_s) or duration_s < 0:
            return
        key = (stage, _bucket(rows))
        stats = self._stats.get(key)
        if stats is None:
            self._stats[key] = _Ewma(duration_s)
        else:
            stats.add(duration_s, self.alpha)
        self._last_rows[stage] = rows
        self._memo.clear()

    def predict(self, stage: Stage, rows: int | None = None) -> float:
        """Seconds one ``stage`` step over ``rows`` rows should take (``None``: the size of the
        stage's last observed step). An unseen bucket borrows the nearest known bucket of the
        stage (the larger one on a tie); an unseen stage gets the prior."""
        memo_key = (stage, rows)
        seconds = self._memo.get(memo_key)
        if seconds is None:
            seconds = self._memo[memo_key] = self._predict(stage, rows)
        return seconds

    def _predict(self, stage: Stage, rows: int | None = None) -> float:
        if rows is None:
            rows = self._last_rows.get(stage, 1)
        bucket = _bucket(max(1, rows))
        stats = self._stats.get((stage, bucket))
        if stats is None:
            known = [b for (s, b) in self._stats if s is stage]
            if not known:
                return self.prior_s * self.margin
            nearest = min(known, key=lambda b: (abs(b.bit_length() - bucket.bit_length()), -b))
            stats = self._stats[(stage, nearest)]
        return (stats.mean + _DEV_K * stats.dev) * self.margin


class DeadlinePredictor:
    """Deadlines, predicted work and slack per request; time is always an argument.

    The deadline of a request's next chunk: for a request without audio yet, its enqueue time
    plus ``ttfb_target_s``; for a streaming request, the moment its listener's buffer runs dry,
    ``now + buffered``. ``buffered`` comes from the freshest report if it is at most
    ``feedback_stale_s`` old (the report's level, plus audio emitted after it was measured, minus
    time elapsed since), otherwise from the estimate ``first_chunk_time + audio emitted - now``
    (playback starts at the first chunk and runs in real time); both are floored at 0.

    Args:
        time_model: Step durations per stage.
        ttfb_target_s: Startup deadline after enqueue.
        min_slack_s: A stream whose slack is below this is urgent.
        max_lead_s: A stream with more audio buffered than this is far ahead.
        feedback_stale_s: Reports older than this are ignored.
        overdue_startup_urgent: Startup work below ``min_slack_s`` is urgent too (see
            ``SchedulerConfig.predictor_overdue_startup_urgent``).
        on_count: Receives each decision counter increment (the engine's ``metrics.incr``).
    """

    def __init__(
        self,
        time_model: StageTimeModel | None = None,
        *,
        ttfb_target_s: float = 0.2,
        min_slack_s: float = 0.05,
        max_lead_s: float = 2.0,
        feedback_stale_s: float = 0.5,
        overdue_startup_urgent: bool = False,
        on_count: Callable[[str, int], None] | None = None,
    ) -> None:
        self.time_model = time_model or StageTimeModel()
        self.overdue_startup_urgent = overdue_startup_urgent
        self.ttfb_target_s = ttfb_target_s
        self.min_slack_s = min_slack_s
        self.max_lead_s = max_lead_s
        self.feedback_stale_s = feedback_stale_s
        self.counters: dict[str, int] = {}
        self._on_count = on_count
        for name in COUNTERS:
            self.count(name, 0)
        self._pass_now: float | None = None
        self._pass_dry: dict[int, float] = {}
        self._pass_work: dict[tuple[int, int], float] = {}
        """Inside a scheduling pass (``begin_pass``): each request's dry time and predicted work
        per chunk size, computed once (the policies ask for them 3-5 times per request and
        step); keyed by ``id(request)``, emptied when the pass ends."""

    @classmethod
    def from_config(cls, config: SchedulerConfig,
                    on_count: Callable[[str, int], None] | None = None) -> DeadlinePredictor:
        model = StageTimeModel(config.predictor_ewma_alpha, config.predictor_time_margin,
                               config.predictor_prior_step_s)
        return cls(model, ttfb_target_s=config.predictor_ttfb_target_s,
                   min_slack_s=config.predictor_min_slack_s,
                   max_lead_s=config.predictor_max_lead_s,
                   feedback_stale_s=config.predictor_feedback_stale_s,
                   overdue_startup_urgent=config.predictor_overdue_startup_urgent,
                   on_count=on_count)

    # ------------------------------------------------------------------ scheduling passes
    def begin_pass(self, now: float) -> None:
        """Starts one scheduling pass at ``now``: until ``end_pass``, answers for ``now`` are
        computed once per request. The caller changes no request, report or step time inside
        the pass (the scheduler's ranking and pick); answers for another ``now`` are not kept."""
        self._pass_now = now
        self._pass_dry.clear()
        self._pass_work.clear()

    def end_pass(self) -> None:
        self._pass_now = None
        self._pass_dry.clear()
        self._pass_work.clear()

    # ------------------------------------------------------------------ inputs
    def observe_step(self, stage: Stage, rows: int, duration_s: float) -> None:
        """One executed step (feeds the stage-time model)."""
        self.time_model.observe(stage, rows, duration_s)

    def on_chunk(self, request: Request, num_frames: int, now: float) -> None:
        """A chunk of ``num_frames`` leaves the engine at ``now`` (called before the request
        records it): counts a deadline miss (a streaming chunk after its listener's buffer ran
        dry), an early emit, and which buffer source its deadline used."""
        first = request.first_chunk_time
        if first is not None:
            dry_time, source = self._dry_time(request, first,
                                              request.num_decoded_frames * FRAME_S, now)
            self.count(f"predictor_feedback_{source}")
            if now > dry_time + _LATE_EPS_S:
                self.count("predictor_deadline_misses")
        target = request.early_emit_target
        if target is not None and num_frames < target:
            self.count("predictor_early_emits")

    def count(self, name: str, value: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + value
        if self._on_count is not None:
            self._on_count(name, value)

    # ------------------------------------------------------------------ queries
    def buffered_s(self, request: Request, now: float) -> float:
        """Audio ahead of the listener's playhead at ``now`` (0 before the first chunk)."""
        if not request.chunk_emit_times:
            return 0.0
        return max(0.0, self._pass_dry_time(request, now) - now)

    def feedback_source(self, request: Request, now: float) -> str:
        """``used`` (a fresh report), ``stale`` (too old) or ``missing`` (none yet)."""
        report = request.playback
        if report is None:
            return "missing"
        return "used" if now - report.measured_at <= self.feedback_stale_s else "stale"

    def deadline(self, request: Request, now: float) -> float:
        """When the request's next chunk is due."""
        if not request.is_streaming:
            return request.enqueue_time + self.ttfb_target_s
        return now + self.buffered_s(request, now)

    def frame_time_s(self) -> float:
        """One more frame for a request: a DECODE step plus a DEPTH step at the current batch."""
        return self.time_model.predict(Stage.DECODE) + self.time_model.predict(Stage.DEPTH)

    def work_s(self, request: Request, num_frames: int) -> float:
        """Predicted time until the request's next chunk of ``num_frames`` is out: its active
        segment's remaining text encode / prefill, the missing frames, one codec step."""
        if self._pass_now is None:
            return self._work_s(request, num_frames)
        key = (id(request), num_frames)
        seconds = self._pass_work.get(key)
        if seconds is None:
            seconds = self._pass_work[key] = self._work_s(request, num_frames)
        return seconds

    def _work_s(self, request: Request, num_frames: int) -> float:
        model = self.time_model
        missing = num_frames - request.num_pending_frames
        seconds = model.predict(Stage.CODEC)
        if missing <= 0:
            return seconds
        active = request.active_segment
        if active is None:
            return seconds
        phase = active.phase
        if phase in _BEFORE_TEXT_ENCODED:
            seconds += model.predict(Stage.TEXT_ENCODE)
        if phase in _BEFORE_PREFILLED:
            seconds += model.predict(Stage.PREFILL)
        return seconds + missing * self.frame_time_s()

    def slack(self, request: Request, now: float, delay_s: float = 0.0) -> float:
        """Deadline - now - predicted work for the next chunk (after an extra ``delay_s``).

        The chunk is the schedule's target while that still leaves ``min_slack_s``; otherwise
        (streaming) the pending frames plus one more, where ``DeadlineChunkPolicy`` cuts it. Below
        0 even that chunk will be late.
        """
        available = self.deadline(request, now) - now - delay_s
        full = available - self.work_s(request, request.current_chunk_target)
        if full >= self.min_slack_s or not request.is_streaming:
            return full
        return available - self.work_s(request, request.num_pending_frames + 1)

    # ------------------------------------------------------------------ internals
    def _pass_dry_time(self, request: Request, now: float) -> float:
        """When a streaming request's listener runs dry, computed once per pass at its ``now``."""
        kept = now == self._pass_now
        dry = self._pass_dry.get(id(request)) if kept else None
        if dry is None:
            dry, _ = self._dry_time(request, request.chunk_emit_times[0],
                                    request.num_decoded_frames * FRAME_S, now)
            if kept:
                self._pass_dry[id(request)] = dry
        return dry

    def _dry_time(self, request: Request, first_time: float, audio_s: float,
                  now: float) -> tuple[float, str]:
        """When the listener's buffer runs dry, and where that came from (see the class doc)."""
        report = request.playback
        source = self.feedback_source(request, now)
        if report is not None and source == "used":
            since = _audio_since(request, report.measured_at)
            return report.measured_at + report.buffered_s + since, source
        return first_time + audio_s, source


def _audio_since(request: Request, time: float) -> float:
    """Audio the request emitted after ``time``, per its chunk log."""
    index = bisect_right(request.chunk_emit_times, time)
    ends = request.chunk_frame_ends
    before = ends[index - 1] if index > 0 else 0
    return ((ends[-1] if ends else 0) - before) * FRAME_S
