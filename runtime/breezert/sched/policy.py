"""Scheduling policies: the ``StagePolicy``/``ChunkPolicy`` hooks, the default policy
(startup priority with a starvation guard, the chunk schedule) and the deadline-aware pair over a
``DeadlinePredictor``.

Owns the decisions (which stage runs, in which order requests join its batch, how many frames a
chunk has; with the predictor: urgency by slack, far-ahead streams yielding, wait-to-batch for
CODEC, early emit of a partial chunk) and their counters. Each is made for every running
request at once, as array operations over the scheduler's ``StreamTable`` (no Python per
request). Must not read the clock, touch the engine, change a request or import torch; the
``Scheduler`` calls these hooks with ``now``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from breezert.config import SchedulerConfig
from breezert.constants import FRAME_S, Stage
from breezert.sched.deadline import DeadlinePredictor
from breezert.sched.streams import DECODE, DEPTH, FEW_ROWS, STAGE_CODE, STAGES, StreamTable


class ChunkPolicy(Protocol):
    """Decides how many frames each request's next chunk has (the predictor's hook)."""

    def chunk_frames(self, table: StreamTable, rows: np.ndarray, now: float) -> np.ndarray:
        """Frames of the next chunk of each row (rows with pending frames); clamped to
        1..max_codec_frames by the scheduler."""
        ...

    def on_chunks(self, table: StreamTable, rows: np.ndarray, num_frames: np.ndarray,
                  now: float) -> None:
        """The rows' next chunks, ``num_frames`` long, leave at ``now`` (not yet recorded)."""
        ...


class ScheduleChunkPolicy:
    """Default: follow the request's chunk schedule (1, 2, 4, 8, 16, 16, ...)."""

    def chunk_frames(self, table: StreamTable, rows: np.ndarray, now: float) -> np.ndarray:
        return table.chunk_target[rows]

    def on_chunks(self, table: StreamTable, rows: np.ndarray, num_frames: np.ndarray,
                  now: float) -> None:
        pass


@dataclass(frozen=True)
class Ranked:
    """Ready (slot, stage) pairs in serving order (the smallest key first), with the first two
    fields of each pair's key: its class and the class's first criterion (see the policies)."""

    slots: np.ndarray
    stages: np.ndarray
    """``STAGE_CODE`` of each pair."""
    cls: np.ndarray
    k1: np.ndarray

    def __len__(self) -> int:
        return len(self.slots)

    def take(self, index: np.ndarray) -> Ranked:
        return Ranked(self.slots[index], self.stages[index], self.cls[index], self.k1[index])

    def ready_for(self, stage: int) -> np.ndarray:
        """Slots ready for ``stage``, in serving order."""
        return self.slots[self.stages == stage]


class StagePolicy(Protocol):
    """Ranks ready (slot, stage) pairs, then picks the stage of the step and its candidates in
    batch order. Asked only when two or more pairs are ready: the scheduler runs a lone ready
    pair as it is (what every policy here would pick, with no counter to bump), so the steps of
    one stream cost no ranking."""

    def rank(self, table: StreamTable, slots: np.ndarray, stages: np.ndarray,
             now: float) -> Ranked:
        """The pairs ``(slots[i], stages[i])`` in serving order: by key, ties in admission
        order."""
        ...

    def pick(self, table: StreamTable, ranked: Ranked, now: float) -> tuple[Stage, np.ndarray]:
        """The stage to run and its candidate slots (the batch is filled from them in order,
        within the stage's limits)."""
        ...


def sort_pairs(table: StreamTable, slots: np.ndarray, stages: np.ndarray,
               key: tuple[np.ndarray, ...]) -> Ranked:
    """The pairs sorted by ``key`` (columns, the first most significant), then by admission
    order. A request's pairs never tie: each key ends in its stage's output order."""
    order = np.lexsort((table.seq[slots], *reversed(key)))
    return Ranked(slots[order], stages[order], key[0][order], key[1][order])


def sort_keyed(keyed: list[tuple]) -> Ranked:
    """``sort_pairs`` for pairs keyed one by one: ``(*key (4 floats), seq, slot, stage)``
    tuples, sorted by key, then admission order."""
    keyed.sort()
    return Ranked(np.array([k[5] for k in keyed], np.int64),
                  np.array([k[6] for k in keyed], np.int64),
                  np.array([k[0] for k in keyed], np.float64),
                  np.array([k[1] for k in keyed], np.float64))


def first_stage(ranked: Ranked) -> tuple[int, np.ndarray]:
    """The stage of the first ready pair, and every slot ready for it, in order."""
    stage = int(ranked.stages[0])
    return stage, ranked.ready_for(stage)


# Lower = closer to audio output.
OUTPUT_ORDER = {Stage.CODEC: 0, Stage.DEPTH: 1, Stage.DECODE: 2, Stage.PREFILL: 3,
                Stage.TEXT_ENCODE: 4}
_CLOSENESS = np.array([OUTPUT_ORDER[stage] for stage in STAGES], np.float64)
_CODEC = STAGE_CODE[Stage.CODEC]
_DEPTH = STAGE_CODE[Stage.DEPTH]
_GENERATE = (STAGE_CODE[Stage.DECODE], _DEPTH)
_PREP_MAX = STAGE_CODE[Stage.PREFILL]  # TEXT_ENCODE and PREFILL codes are 0 and 1
_FEW_PAIRS = 8
"""Up to this many ready pairs, the stage policies rank them pair by pair."""


class DefaultStagePolicy:
    """Three classes, in order:

    1. starving streams: emitted a chunk, but none for more than ``starvation_limit_s``
       (oldest last chunk first);
    2. startup work: no chunk yet (higher priority, then earlier arrival);
    3. active streams: longest-waiting ready stage first (in steps), ties go to the stage
       closer to output (CODEC > DEPTH > DECODE > PREFILL > TEXT_ENCODE).

    NOTE(scheduler): in class 3 the wait comes before the output order. With output order first,
    the DEPTH/DECODE ping-pong of any stream would starve the next segment's lookahead PREFILL
    forever (a gap at every segment boundary). Waiting in steps rather than seconds keeps the
    order independent of step durations; lockstep streams still batch together.
    """

    def __init__(self, starvation_limit_s: float) -> None:
        self.starvation_limit_s = starvation_limit_s

    def rank(self, table: StreamTable, slots: np.ndarray, stages: np.ndarray,
             now: float) -> Ranked:
        if len(slots) <= _FEW_PAIRS:
            return self._rank_pairs(table, slots, stages, now)
        return self._rank_arrays(table, slots, stages, now)

    def _rank_pairs(self, table: StreamTable, slots: np.ndarray, stages: np.ndarray,
                    now: float) -> Ranked:
        """``rank`` pair by pair, for a few pairs: the same keys and order as
        ``_rank_arrays``, whose ~30 numpy calls cost several times this at the one or two
        streams of a first packet (tests/unit/test_sched_vectorized.py holds the two equal)."""
        keyed = []
        limit = self.starvation_limit_s
        for slot, stage in zip(slots.tolist(), stages.tolist(), strict=True):
            closeness = float(_CLOSENESS[stage])
            if table.num_chunks[slot] == 0:  # startup
                key = (1.0, -float(table.priority[slot]), float(table.enqueue_time[slot]),
                       closeness)
            elif now - (last := float(table.last_chunk_time[slot])) > limit:  # starving
                key = (0.0, last, closeness, 0.0)
            else:
                key = (2.0, float(table.ready_since[stage, slot]), closeness, 0.0)
            keyed.append((*key, int(table.seq[slot]), slot, stage))
        return sort_keyed(keyed)

    def _rank_arrays(self, table: StreamTable, slots: np.ndarray, stages: np.ndarray,
                     now: float) -> Ranked:
        """``rank`` as array operations over the pairs."""
        closeness = _CLOSENESS[stages]
        last = table.last_chunk_time[slots]
        startup = table.num_chunks[slots] == 0
        starving = ~startup & (now - last > self.starvation_limit_s)
        waited = table.ready_since[stages, slots].astype(np.float64)
        key = (np.where(startup, 1.0, np.where(starving, 0.0, 2.0)),
               np.where(startup, -table.priority[slots].astype(np.float64),
                        np.where(starving, last, waited)),
               np.where(startup, table.enqueue_time[slots], closeness),
               np.where(startup, closeness, 0.0))
        return sort_pairs(table, slots, stages, key)

    def pick(self, table: StreamTable, ranked: Ranked, now: float) -> tuple[Stage, np.ndarray]:
        stage, candidates = first_stage(ranked)
        return STAGES[stage], candidates


class DeadlineStagePolicy:
    """Ranks ready work in four classes (smallest key first):

    0. urgent streams: slack below ``min_slack_s``, least slack first (a startup step still goes
       first when the least slack absorbs its predicted time); with ``overdue_startup_urgent``,
       startup work below ``min_slack_s`` too, ranked with them by slack; whatever that switch,
       starving startup work: more than ``starvation_limit_s`` past its first-chunk deadline
       (that late, its slack is below a dry stream's: it goes first);
    1. startup work (no chunk yet): higher priority, then earlier deadline (enqueue + TTFB target);
    2. other streams: longest-waiting ready stage first (in steps), then least slack;
    3. streams more than ``max_lead_s`` ahead of their listener: as class 2, after everything.

    ``pick`` then makes two batch decisions: wait-to-batch (run the DEPTH step that lets more
    streams join a CODEC batch first, if batching saves time and no waiting stream's slack
    drops below ``min_slack_s``), and far-ahead streams yield DECODE/DEPTH batches that carry
    startup work.

    NOTE(predictor): a lookahead segment's TEXT_ENCODE/PREFILL stays in class 2 whatever the
    stream's slack (its deadline is the segment boundary, not the next chunk); ranking it by the
    stream's slack would let the stream's own DECODE/DEPTH starve it, as in ``DefaultStagePolicy``.

    ``starvation_limit_s``: ``make_policies`` passes the config's; the default, infinity, lets
    startup work wait behind urgent streams for good (no bound).
    """

    def __init__(self, predictor: DeadlinePredictor,
                 starvation_limit_s: float = math.inf) -> None:
        self.predictor = predictor
        self.starvation_limit_s = starvation_limit_s

    def rank(self, table: StreamTable, slots: np.ndarray, stages: np.ndarray,
             now: float) -> Ranked:
        if len(slots) <= _FEW_PAIRS:
            ranked = self._rank_pairs(table, slots, stages, now)
            if ranked is not None:
                return ranked
        return self._rank_arrays(table, slots, stages, now)

    def _rank_pairs(self, table: StreamTable, slots: np.ndarray, stages: np.ndarray,
                    now: float) -> Ranked | None:
        """``rank`` pair by pair (``DeadlinePredictor.buffered_and_slack``), for a few pairs:
        the same keys and order as ``_rank_arrays`` (tests/unit/test_sched_vectorized.py holds
        them equal); ``None`` when a key is NaN (the arrays' sort places it, not this one)."""
        p = self.predictor
        keyed = []
        for slot, stage in zip(slots.tolist(), stages.tolist(), strict=True):
            closeness = float(_CLOSENESS[stage])
            streaming = bool(table.num_chunks[slot] > 0)
            buffered, slack = p.buffered_and_slack(table, slot, now)
            lookahead = (streaming and stage <= _PREP_MAX
                         and int(table.phase[slot]) in (DEPTH, DECODE))
            urgent = not lookahead and slack < p.min_slack_s
            if not p.overdue_startup_urgent:
                urgent = urgent and streaming
            if not streaming and now - float(table.enqueue_time[slot] + p.ttfb_target_s) \
                    > self.starvation_limit_s:  # starving startup
                urgent = True
            if urgent:
                key = (0.0, slack, closeness, 0.0)
            elif not streaming:  # startup
                key = (1.0, -float(table.priority[slot]),
                       float(table.enqueue_time[slot] + p.ttfb_target_s), closeness)
            else:
                key = (3.0 if buffered > p.max_lead_s and not lookahead else 2.0,
                       float(table.ready_since[stage, slot]), 0.0 if lookahead else slack,
                       closeness)
            if any(math.isnan(k) for k in key):
                return None
            keyed.append((*key, int(table.seq[slot]), slot, stage))
        return sort_keyed(keyed)

    def _rank_arrays(self, table: StreamTable, slots: np.ndarray, stages: np.ndarray,
                     now: float) -> Ranked:
        """``rank`` as array operations over the pairs."""
        p = self.predictor
        closeness = _CLOSENESS[stages]
        streaming = table.num_chunks[slots] > 0
        buffered = p.step_buffered(table, now)[slots]
        slack = p.step_slacks(table, now)[slots]
        phase = table.phase[slots]
        generating = phase >= DEPTH  # DEPTH or DECODE, the last phase codes
        lookahead = streaming & (stages <= _PREP_MAX) & generating
        urgent = ~lookahead & (slack < p.min_slack_s)
        if not p.overdue_startup_urgent:
            urgent &= streaming
        deadline = table.enqueue_time[slots] + p.ttfb_target_s
        urgent |= ~streaming & (now - deadline > self.starvation_limit_s)  # starving startups
        startup = ~streaming & ~urgent
        ahead = buffered > p.max_lead_s
        waited = table.ready_since[stages, slots].astype(np.float64)
        # the four classes; a lookahead pair is class 2 with 0.0 for its slack
        key = (np.where(urgent, 0.0, np.where(startup, 1.0,
                                              np.where(ahead & ~lookahead, 3.0, 2.0))),
               np.where(urgent, slack, np.where(startup, -table.priority[slots]
                                                .astype(np.float64), waited)),
               np.where(urgent, closeness, np.where(startup, deadline,
                                                    np.where(lookahead, 0.0, slack))),
               np.where(urgent, 0.0, closeness))
        return sort_pairs(table, slots, stages, key)

    def pick(self, table: StreamTable, ranked: Ranked, now: float) -> tuple[Stage, np.ndarray]:
        stage, candidates = first_stage(self._startup_within_slack(table, ranked))
        if stage == _CODEC and self._should_wait(table, ranked, candidates, now):
            stage, candidates = _DEPTH, ranked.ready_for(_DEPTH)
            self.predictor.count("predictor_waits")
        if stage in _GENERATE:
            candidates = self._yield_far_ahead(table, candidates, now)
        return STAGES[stage], candidates

    def _startup_within_slack(self, table: StreamTable, ranked: Ranked) -> Ranked:
        """Urgent streams first, unless the first startup step fits in the least urgent slack:
        then that step runs first (an urgent stream loses only what its slack can absorb)."""
        if not len(ranked) or ranked.cls[0] != 0:
            return ranked
        startups = np.flatnonzero(ranked.cls == 1)
        if not startups.size:
            return ranked
        first = int(startups[0])
        stage = int(ranked.stages[first])
        rows = int(table.num_branches[ranked.ready_for(stage)].sum())
        if ranked.k1[0] - self.predictor.time_model.predict(STAGES[stage], rows) < 0:
            return ranked
        order = np.arange(len(ranked))
        return ranked.take(np.concatenate(([first], np.delete(order, first))))

    def _should_wait(self, table: StreamTable, ranked: Ranked, codec: np.ndarray,
                     now: float) -> bool:
        """Whether to run DEPTH first so that streams one frame short of their chunk join the
        CODEC batch: only for streaming requests (a first chunk never waits: TTFB), only if one
        batched CODEC step is predicted cheaper than two, and only if every waiting stream keeps
        ``min_slack_s`` after the DEPTH step."""
        if (table.num_chunks[codec] == 0).any():
            return False
        depth = ranked.ready_for(_DEPTH)
        in_codec = np.zeros(len(table.live), bool)
        in_codec[codec] = True
        joins = ~in_codec[depth] & (table.pending[depth] + 1 >= table.chunk_target[depth])
        m = int(np.count_nonzero(joins))
        if not m:
            return False
        model = self.predictor.time_model
        n = len(codec)
        saving = (model.predict(Stage.CODEC, n) + model.predict(Stage.CODEC, m)
                  - model.predict(Stage.CODEC, n + m))
        if saving <= 0:
            return False
        delay = model.predict(Stage.DEPTH, int(table.num_branches[depth].sum()))
        p = self.predictor
        left = (p.deadlines(table, codec, now, p.step_buffered(table, now)[codec]) - now - delay
                - model.predict(Stage.CODEC, n + m))
        return bool((left >= p.min_slack_s).all())

    def _yield_far_ahead(self, table: StreamTable, candidates: np.ndarray,
                         now: float) -> np.ndarray:
        """Drops streams more than ``max_lead_s`` ahead from a batch that carries startup work
        (their frames are not needed yet; the startup step runs on fewer rows)."""
        streaming = table.num_chunks[candidates] > 0
        if streaming.all():
            return candidates
        p = self.predictor
        kept = ~streaming | (p.step_buffered(table, now)[candidates] <= p.max_lead_s)
        if not kept.all():
            p.count("predictor_lead_yields")
        return candidates[kept]


class DeadlineChunkPolicy:
    """Follows the chunk schedule, except that a streaming request whose next chunk cannot be
    out before its deadline emits the frames it already has if they still reach the listener
    before it runs dry (a smaller chunk, counted as an early emit when it goes out); a stream
    that is dry, or will be before even those frames are out, gets a chunk that covers making
    the next one (``_cover_frames``, at most the schedule's entry); and, with
    ``first_chunk_cover``, a first chunk holds that much audio too (``_first_chunk``; counted
    as a first-chunk cover).

    NOTE(predictor): the cut comes as late as it can: while one more frame still fits before the
    deadline, generation goes on, so the partial chunk is as large as possible (each chunk costs
    a CODEC step). Where the cut cannot avert the gap it would only shorten it, at a CODEC step
    for every stream: past capacity, cutting dry streams too made almost every chunk one frame
    and the CODEC steps most of the wall (behind -> one-frame chunks -> further behind). The
    cover chunk's size grows with the step times, so a stream that recovers can be cut in time
    again (bench/README.md, "CPU, 5 Dec: the early emit only where it averts a gap").
    """

    def __init__(self, predictor: DeadlinePredictor, *, first_chunk_cover: bool = False) -> None:
        self.predictor = predictor
        self.first_chunk_cover = first_chunk_cover

    def chunk_frames(self, table: StreamTable, rows: np.ndarray, now: float) -> np.ndarray:
        if len(rows) <= FEW_ROWS and not self.first_chunk_cover:
            return self._chunk_frames_rows(table, rows, now)
        return self._chunk_frames_arrays(table, rows, now)

    def _chunk_frames_arrays(self, table: StreamTable, rows: np.ndarray,
                             now: float) -> np.ndarray:
        """``chunk_frames`` as array operations over the rows."""
        target = table.chunk_target[rows]
        pending = table.pending[rows]
        streaming = table.num_chunks[rows] > 0
        table.early_target[rows] = -1
        frames = target
        if self.first_chunk_cover:
            frames = np.where(streaming, target, self._first_chunk(table, rows, target))
        phase = table.phase[rows]
        may_cut = (streaming & (pending > 0) & (pending < target)
                   & (phase >= DEPTH))  # DEPTH or DECODE
        if not may_cut.any():
            return frames
        p = self.predictor
        cut_rows = rows[may_cut]
        # streaming rows: due when their listener runs dry (``DeadlinePredictor.deadlines``)
        deadline = now + p.step_buffered(table, now)[cut_rows]
        # one more frame fits (the whole chunk, pending < target, is never less work)
        fits = now + p.work(table, cut_rows, pending[may_cut] + 1) <= deadline
        # the frames it has reach the listener before it runs dry: out after one CODEC step
        # (``work`` of the pending frames, nothing missing)
        in_time = now + p.time_model.predict(Stage.CODEC) <= deadline
        cut, dry = np.zeros_like(may_cut), np.zeros_like(may_cut)
        cut[may_cut] = ~fits & in_time
        dry[may_cut] = ~in_time
        table.early_target[rows[cut]] = target[cut]
        frames = np.where(cut, pending, frames)
        if not dry.any():
            return frames
        return np.where(dry, self._dry_frames(target, pending), frames)

    def _chunk_frames_rows(self, table: StreamTable, rows: np.ndarray, now: float) -> np.ndarray:
        """``chunk_frames`` row by row in plain floats (without ``first_chunk_cover``), the
        same operations in the same order: a dozen array calls cost several times this at the
        one or two streams of a first packet, at every step."""
        p = self.predictor
        frames = []
        for row in rows.tolist():
            target = int(table.chunk_target[row])
            table.early_target[row] = -1
            if self._may_cut_row(table, row):
                pending = int(table.pending[row])
                deadline = now + max(0.0, p.dry_time_row(table, row, now) - now)
                if not now + p.time_model.predict(Stage.CODEC) <= deadline:  # dry
                    target = int(self._dry_frames(target, pending))
                elif not now + p.work_row(table, row, pending + 1) <= deadline:
                    table.early_target[row] = target
                    target = pending
            frames.append(target)
        return np.array(frames, np.int64)

    @staticmethod
    def _may_cut_row(table: StreamTable, row: int) -> bool:
        """``may_cut`` of ``chunk_frames`` for one row, in plain Python (a few rows' check
        costs a dozen array calls otherwise, at every step of a first packet after DEPTH)."""
        pending = table.pending[row]
        return bool(table.num_chunks[row] > 0 and 0 < pending < table.chunk_target[row]
                    and table.phase[row] in (DEPTH, DECODE))

    def on_chunks(self, table: StreamTable, rows: np.ndarray, num_frames: np.ndarray,
                  now: float) -> None:
        self.predictor._count_sum("predictor_first_chunk_covers",
                                  (table.num_chunks[rows] == 0)
                                  & (num_frames > table.first_target[rows]))
        self.predictor.on_chunks(table, rows, num_frames, now)
        table.early_target[rows] = -1

    def _cover_frames(self) -> int:
        """The fewest frames whose audio lasts while the engine makes one more frame and
        decodes it with ``min_slack_s`` to spare (the next chunk can be cut to that frame, so
        it is what must fit)."""
        p = self.predictor
        cover_s = p.frame_time_s() + p.time_model.predict(Stage.CODEC) + p.min_slack_s
        return math.ceil(cover_s / FRAME_S - 1e-9)

    def _first_chunk(self, table: StreamTable, rows: np.ndarray,
                     target: np.ndarray) -> np.ndarray:
        """``_cover_frames``, from ``target`` up to the schedule's largest entry."""
        return np.maximum(target, np.minimum(table.largest_target[rows], self._cover_frames()))

    def _dry_frames(self, target: np.ndarray | int, pending: np.ndarray | int) -> np.ndarray:
        """A dry stream's chunk (its frames cannot reach the listener in time): what it has if
        that covers making the next chunk, else ``_cover_frames``, at most ``target``. Not an
        early emit: the gap is there anyway (``predictor_deadline_misses`` counts the chunk)."""
        return np.minimum(target, np.maximum(pending, self._cover_frames()))


def make_policies(
    config: SchedulerConfig, predictor: DeadlinePredictor | None
) -> tuple[StagePolicy | None, ChunkPolicy | None]:
    """The scheduler's policies: the deadline pair with a predictor, the defaults without."""
    if predictor is None or not config.use_predictor:
        return None, None
    return DeadlineStagePolicy(predictor, config.starvation_limit_s), DeadlineChunkPolicy(
        predictor, first_chunk_cover=config.predictor_first_chunk_cover)
