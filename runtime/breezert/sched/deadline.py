"""DeadlinePredictor: per-stage step-time model, playback deadlines and slack per request.

Owns the stage-time estimate (``StageTimeModel``) and the decision counters. It answers for many
requests at once, over rows of the scheduler's ``StreamTable`` (numpy columns per slot: the
chunk log summary, the listener's latest ``PlaybackReport``); a question about one ``Request``
is the same computation over a one-row table. Never reads the clock (every method takes
``now``), never imports torch, never reads the engine: the engine feeds step durations in, the
chunk policy hands it each step's emitted chunks, and the policies in ``sched/policy.py`` ask
questions.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from breezert.config import SchedulerConfig
from breezert.constants import FRAME_S, Stage
from breezert.request import Request
from breezert.sched.streams import DECODE, NO_PHASE, PREFILL, QUEUED, TEXT_ENCODE, StreamTable

COUNTERS = (
    "predictor_waits", "predictor_early_emits", "predictor_deadline_misses",
    "predictor_lead_yields", "predictor_feedback_used", "predictor_feedback_stale",
    "predictor_feedback_missing", "predictor_first_chunk_covers",
)
"""Decision counters, each reported from 0 (``predictor_feedback_*``: per streaming chunk, where
its deadline's buffer level came from)."""

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


RECENT_STEPS = 8
"""A prediction without a row count is for the largest of the stage's last this many steps
(``StageTimeModel``'s default ``recent_steps``)."""


class StageTimeModel:
    """Recent step durations per (stage, batch-size bucket), as an EWMA of the mean and of the
    absolute deviation; a prediction is ``(mean + 2 * deviation) * margin``.

    NOTE(predictor): a question without a row count (a streaming request's next frame or chunk)
    is answered at the largest batch among the stage's last ``recent_steps`` steps, not at the
    last one. Under load, newcomers' one-row startup steps (a lone first frame ~9.6 ms, a lone
    first chunk ~3.3 ms in the H200's step times) alternate with the streams' batches (~14 ms
    DEPTH, 10-25 ms CODEC at 70 streams): priced at the last step, a stream's next chunk was
    predicted up to ~20 ms cheaper than the batch it rides, so startup work took the slack it
    did not have and the 2nd-5th chunks of newcomers came 0.2-9 ms late (bench/sched_sim.py,
    5 Dec). The same rule prices TEXT_ENCODE and PREFILL (asked without rows) at their recent
    largest batch: more cautious for a newcomer arriving after a burst, never cheaper.

    Args:
        alpha: EWMA weight of a new observation (0 < alpha <= 1).
        margin: Factor applied to every prediction (>= 1 is conservative).
        prior_s: Prediction for a stage never observed, before the margin.
        recent_steps: A prediction without a row count is for the largest of the stage's last
            this many steps (1: the last step's size, as before 5 Dec).
    """

    def __init__(self, alpha: float = 0.2, margin: float = 1.2, prior_s: float = 0.02,
                 recent_steps: int = RECENT_STEPS) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha={alpha} must be in (0, 1]")
        if recent_steps < 1:
            raise ValueError(f"recent_steps={recent_steps} must be >= 1")
        self.alpha, self.margin, self.prior_s = alpha, margin, prior_s
        self.recent_steps = recent_steps
        self._stats: dict[tuple[Stage, int], _Ewma] = {}
        self._recent_rows: dict[Stage, deque[int]] = {}
        self.num_observed = 0
        """Steps observed (a prediction changes only when this does)."""
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
        self._recent_rows.setdefault(stage, deque(maxlen=self.recent_steps)).append(rows)
        self._memo.clear()
        self.num_observed += 1

    def predict(self, stage: Stage, rows: int | None = None) -> float:
        """Seconds one ``stage`` step over ``rows`` rows should take (``None``: the largest size
        among the stage's last ``recent_steps`` observed steps, class NOTE). An unseen bucket
        borrows the nearest known bucket of the stage (the larger one on a tie); an unseen stage
        gets the prior."""
        memo_key = (stage, rows)
        seconds = self._memo.get(memo_key)
        if seconds is None:
            seconds = self._memo[memo_key] = self._predict(stage, rows)
        return seconds

    def _predict(self, stage: Stage, rows: int | None = None) -> float:
        if rows is None:
            rows = max(self._recent_rows.get(stage, (1,)))
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

    The plural methods answer for rows ``rows`` of a ``StreamTable`` (arrays in row order); the
    singular ones for one ``Request``, through a one-row table (the same arithmetic).

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
        self._work_memo: tuple[object, tuple[float, np.ndarray, float]] = (
            None, (0.0, np.zeros(0), 0.0))
        """``_work_terms``' answer and the (time model, steps observed) it holds for."""
        for name in COUNTERS:
            self.count(name, 0)

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

    # ------------------------------------------------------------------ inputs
    def observe_step(self, stage: Stage, rows: int, duration_s: float) -> None:
        """One executed step (feeds the stage-time model)."""
        self.time_model.observe(stage, rows, duration_s)

    def on_chunks(self, table: StreamTable, rows: np.ndarray, num_frames: np.ndarray,
                  now: float) -> None:
        """Chunks of ``num_frames`` leave the engine at ``now`` for ``rows`` (before the table
        and the requests record them): counts deadline misses (a streaming chunk after its
        listener's buffer ran dry), early emits, and which buffer source each streaming chunk's
        deadline used."""
        streaming = table.num_chunks[rows] > 0
        if streaming.any():
            used = self._feedback_used(table, rows, now)
            self._count_sum("predictor_feedback_used", streaming & used)
            self._count_sum("predictor_feedback_stale",
                            streaming & ~used & table.has_report[rows])
            self._count_sum("predictor_feedback_missing", streaming & ~table.has_report[rows])
            late = now > self.dry_times(table, rows, now, used) + _LATE_EPS_S
            self._count_sum("predictor_deadline_misses", streaming & late)
        target = table.early_target[rows]
        self._count_sum("predictor_early_emits", (target >= 0) & (num_frames < target))

    def count(self, name: str, value: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + value
        if self._on_count is not None:
            self._on_count(name, value)

    def _count_sum(self, name: str, mask: np.ndarray) -> None:
        if value := int(np.count_nonzero(mask)):
            self.count(name, value)

    # ------------------------------------------------------------------ queries over rows
    def dry_times(self, table: StreamTable, rows: np.ndarray, now: float,
                  used: np.ndarray | None = None) -> np.ndarray:
        """When each streaming row's listener runs dry (see the class doc; NaN before a
        chunk; ``used``: the rows' ``_feedback_used``, if the caller has it)."""
        estimate = table.first_chunk_time[rows] + table.decoded[rows] * FRAME_S
        reported = (table.report_at[rows] + table.report_buffered[rows]
                    + table.frames_since[rows] * FRAME_S)
        if used is None:
            used = self._feedback_used(table, rows, now)
        return np.where(used, reported, estimate)

    def buffered(self, table: StreamTable, rows: np.ndarray, now: float) -> np.ndarray:
        """Audio ahead of each row's listener at ``now`` (0 before the first chunk)."""
        dry = self.dry_times(table, rows, now)
        return np.where(table.num_chunks[rows] > 0, np.maximum(0.0, dry - now), 0.0)

    def deadlines(self, table: StreamTable, rows: np.ndarray, now: float,
                  buffered: np.ndarray | None = None) -> np.ndarray:
        """When each row's next chunk is due (``buffered``: the rows' ``buffered``, if the
        caller has it)."""
        if buffered is None:
            buffered = self.buffered(table, rows, now)
        return np.where(table.num_chunks[rows] > 0, now + buffered,
                        table.enqueue_time[rows] + self.ttfb_target_s)

    def frame_time_s(self) -> float:
        """One more frame for a request: a DECODE step plus a DEPTH step at the streams' recent
        batch (``StageTimeModel`` NOTE)."""
        return self.time_model.predict(Stage.DECODE) + self.time_model.predict(Stage.DEPTH)

    def work(self, table: StreamTable, rows: np.ndarray, num_frames: np.ndarray) -> np.ndarray:
        """Predicted time until each row's next chunk of ``num_frames`` is out: its active
        segment's remaining text encode / prefill, the missing frames, one codec step."""
        codec, ahead, frame_s = self._work_terms()
        phase = table.phase[rows] + 1
        missing = num_frames - table.pending[rows]
        return np.where(missing > 0, ahead[phase] + missing * frame_s[phase], codec)

    def _work_terms(self) -> tuple[float, np.ndarray, np.ndarray]:
        """``work``'s predictions, kept until the time model observes a step: the codec step;
        by phase (NO_PHASE first), the codec step and the stages still ahead of it (summed in
        the order ``work_row`` sums them), and a frame's time (``frame_time_s``; 0.0 for
        NO_PHASE, whose work is the codec step alone whatever is missing)."""
        model = self.time_model
        key = (model, model.num_observed)
        if self._work_memo[0] != key:
            codec = model.predict(Stage.CODEC)
            encode, prefill = model.predict(Stage.TEXT_ENCODE), model.predict(Stage.PREFILL)
            phases = range(NO_PHASE, DECODE + 1)
            ahead = np.array([codec + (encode if QUEUED <= phase <= TEXT_ENCODE else 0.0)
                              + (prefill if QUEUED <= phase <= PREFILL else 0.0)
                              for phase in phases])
            frame_s = np.array([0.0 if phase == NO_PHASE else self.frame_time_s()
                                for phase in phases])
            self._work_memo = (key, (codec, ahead, frame_s))
        return self._work_memo[1]

    def slacks(self, table: StreamTable, rows: np.ndarray, now: float, delay_s: float = 0.0,
               buffered: np.ndarray | None = None) -> np.ndarray:
        """Deadline - now - predicted work for each row's next chunk (after ``delay_s``;
        ``buffered`` as in ``deadlines``).

        The chunk is the schedule's target while that still leaves ``min_slack_s``; otherwise
        (streaming) the pending frames plus one more, the smallest chunk ``DeadlineChunkPolicy``
        can cut while in time. Below 0 even that chunk will be late (a stream that dry gets a
        cover chunk, ``DeadlineChunkPolicy._dry_frames``, which can be larger: the slack ranks
        it, it does not size it). (``work`` twice, sharing its per-phase terms: one frame
        missing is always more than none.)
        """
        available = self.deadlines(table, rows, now, buffered) - now
        if delay_s:
            available -= delay_s
        codec, ahead, frame_s = self._work_terms()
        phase = table.phase[rows] + 1
        base, per_frame = ahead[phase], frame_s[phase]
        missing = table.chunk_target[rows] - table.pending[rows]
        full = available - np.where(missing > 0, base + missing * per_frame, codec)
        keep = (full >= self.min_slack_s) | (table.num_chunks[rows] == 0)
        if keep.all():
            return full
        return np.where(keep, full, available - (base + per_frame))

    def step_buffered(self, table: StreamTable, now: float) -> np.ndarray:
        """``buffered`` of every row of ``table`` at ``now``, over whole columns (no gather; a
        free row's entry is stale and never read): once per ``now`` while the table's
        ``step_memo`` is on (the scheduler's ``schedule``, whose readiness, ranking and pick
        all ask), afresh otherwise."""
        return self._step_column(table, "buffered", now, lambda: self.buffered(
            table, slice(None), now))  # type: ignore[arg-type]

    def step_slacks(self, table: StreamTable, now: float) -> np.ndarray:
        """``slacks`` of every row of ``table`` at ``now``, as ``step_buffered``."""
        return self._step_column(table, "slack", now, lambda: self.slacks(
            table, slice(None), now, buffered=self.step_buffered(table, now)))  # type: ignore

    @staticmethod
    def _step_column(table: StreamTable, name: str, now: float,
                     compute: Callable[[], np.ndarray]) -> np.ndarray:
        memo = table.step_memo
        if memo is None:
            return compute()
        column = memo.get((name, now))
        if column is None:
            column = memo[(name, now)] = compute()
        return column

    def _feedback_used(self, table: StreamTable, rows: np.ndarray, now: float) -> np.ndarray:
        return table.has_report[rows] & (now - table.report_at[rows] <= self.feedback_stale_s)

    # ------------------------------------------------------------------ one row, no numpy
    def buffered_and_slack(self, table: StreamTable, row: int, now: float) -> tuple[float, float]:
        """``buffered`` and ``slacks`` of one row in plain floats, the same operations in the
        same order (a policy ranking a few pairs: tests/unit/test_sched_vectorized.py holds
        them equal to the array versions)."""
        streaming = table.num_chunks[row] > 0
        buffered = 0.0
        if streaming:
            buffered = max(0.0, self.dry_time_row(table, row, now) - now)
            available = now + buffered - now
        else:
            available = float(table.enqueue_time[row] + self.ttfb_target_s) - now
        full = available - self.work_row(table, row, int(table.chunk_target[row]))
        if full >= self.min_slack_s or not streaming:
            return buffered, full
        return buffered, available - self.work_row(table, row, int(table.pending[row]) + 1)

    def dry_time_row(self, table: StreamTable, row: int, now: float) -> float:
        """``dry_times`` of one streaming row."""
        if table.has_report[row] and now - table.report_at[row] <= self.feedback_stale_s:
            return float(table.report_at[row] + table.report_buffered[row]
                         + table.frames_since[row] * FRAME_S)
        return float(table.first_chunk_time[row] + table.decoded[row] * FRAME_S)

    def work_row(self, table: StreamTable, row: int, num_frames: int) -> float:
        """``work`` of one row."""
        model = self.time_model
        codec = model.predict(Stage.CODEC)
        missing = num_frames - int(table.pending[row])
        phase = int(table.phase[row])
        active = phase >= QUEUED
        if not (missing > 0 and active):
            return codec
        return (codec + (model.predict(Stage.TEXT_ENCODE) if phase <= TEXT_ENCODE else 0.0)
                + (model.predict(Stage.PREFILL) if phase <= PREFILL else 0.0)
                + missing * self.frame_time_s())

    # ------------------------------------------------------------------ one request
    def buffered_s(self, request: Request, now: float) -> float:
        return float(self.buffered(*_one(request), now)[0])

    def deadline(self, request: Request, now: float) -> float:
        return float(self.deadlines(*_one(request), now)[0])

    def work_s(self, request: Request, num_frames: int) -> float:
        table, rows = _one(request)
        return float(self.work(table, rows, np.array([num_frames]))[0])

    def slack(self, request: Request, now: float, delay_s: float = 0.0) -> float:
        return float(self.slacks(*_one(request), now, delay_s)[0])

    def feedback_source(self, request: Request, now: float) -> str:
        """``used`` (a fresh report), ``stale`` (too old) or ``missing`` (none yet)."""
        if request.playback is None:
            return "missing"
        return "used" if self._feedback_used(*_one(request), now)[0] else "stale"


def _one(request: Request) -> tuple[StreamTable, np.ndarray]:
    return StreamTable.of([request]), np.zeros(1, np.int64)
