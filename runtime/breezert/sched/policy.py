"""Scheduling policies: the ``StagePolicy``/``ChunkPolicy`` hooks, the default policy
(startup priority with a starvation guard, the chunk schedule) and the deadline-aware pair over a
``DeadlinePredictor``.

Owns the decisions (which stage runs, in which order requests join its batch, how many frames a
chunk has; with the predictor: urgency by slack, far-ahead streams yielding, wait-to-batch for
CODEC, early emit of a partial chunk) and their counters. Must not read the clock, touch the
engine or import torch; the ``Scheduler`` calls these hooks with ``now``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

from breezert.config import SchedulerConfig
from breezert.constants import FRAME_S, Stage
from breezert.request import Request
from breezert.sched.deadline import DeadlinePredictor


class ChunkPolicy(Protocol):
    """Decides how many frames the request's next chunk has (the predictor's hook)."""

    def chunk_frames(self, request: Request, now: float) -> int:
        """Frames of the next chunk; clamped to 1..max_codec_frames by the scheduler."""
        ...

    def on_chunk(self, request: Request, num_frames: int, now: float) -> None:
        """The request's next chunk, ``num_frames`` long, leaves at ``now`` (not yet recorded)."""
        ...


class ScheduleChunkPolicy:
    """Default: follow the request's chunk schedule (1, 2, 4, 8, 16, 16, ...)."""

    def chunk_frames(self, request: Request, now: float) -> int:
        return request.current_chunk_target

    def on_chunk(self, request: Request, num_frames: int, now: float) -> None:
        pass


ReadyPair = tuple[tuple[float, ...], Request, Stage]
"""(priority key, request, stage) of one ready pair."""


class StagePolicy(Protocol):
    """Ranks ready (request, stage) pairs (the smallest key is served first), then picks the
    stage of the step and its candidates in batch order."""

    def priority_key(self, request: Request, stage: Stage, now: float) -> tuple[float, ...]:
        ...

    def priority_keys(self, request: Request, stages: Sequence[Stage],
                      now: float) -> list[tuple[float, ...]]:
        """``priority_key`` of each of the request's ready stages (asked once per request and
        step, so that what the stages share is computed once)."""
        ...

    def pick(self, ready: Sequence[ReadyPair], now: float) -> tuple[Stage, list[Request]]:
        """``ready`` is sorted by key; returns the stage to run and its candidates (the batch is
        filled from them in order, within the stage's limits)."""
        ...

    def begin_pass(self, now: float) -> None:
        """The scheduler starts ranking and picking at ``now`` (it changes no request until
        ``end_pass``): what the policy derives per request may be kept until then."""
        ...

    def end_pass(self) -> None:
        ...


def first_stage(ready: Sequence[ReadyPair]) -> tuple[Stage, list[Request]]:
    """The stage of the first ready pair, and every request ready for it, in order."""
    stage = ready[0][2]
    return stage, [request for _, request, s in ready if s is stage]


# Lower = closer to audio output.
OUTPUT_ORDER = {Stage.CODEC: 0, Stage.DEPTH: 1, Stage.DECODE: 2, Stage.PREFILL: 3,
                 Stage.TEXT_ENCODE: 4}


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

    def priority_key(self, request: Request, stage: Stage, now: float) -> tuple[float, ...]:
        closeness = OUTPUT_ORDER[stage]
        last = request.last_chunk_time
        if last is None:
            return (1, -request.priority, request.enqueue_time, closeness)
        if now - last > self.starvation_limit_s:
            return (0, last, closeness)
        return (2, request.stage_ready_step[stage], closeness)

    def priority_keys(self, request: Request, stages: Sequence[Stage],
                      now: float) -> list[tuple[float, ...]]:
        return [self.priority_key(request, stage, now) for stage in stages]

    def pick(self, ready: Sequence[ReadyPair], now: float) -> tuple[Stage, list[Request]]:
        return first_stage(ready)

    def begin_pass(self, now: float) -> None:
        pass

    def end_pass(self) -> None:
        pass


_GENERATE = (Stage.DECODE, Stage.DEPTH)
_PREP = (Stage.TEXT_ENCODE, Stage.PREFILL)


class DeadlineStagePolicy:
    """Ranks ready work in four classes (smallest key first):

    0. urgent streams: slack below ``min_slack_s``, least slack first (a startup step still goes
       first when the least slack absorbs its predicted time); with ``overdue_startup_urgent``,
       startup work below ``min_slack_s`` too, ranked with them by slack;
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
    """

    def __init__(self, predictor: DeadlinePredictor) -> None:
        self.predictor = predictor

    def begin_pass(self, now: float) -> None:
        self.predictor.begin_pass(now)

    def end_pass(self) -> None:
        self.predictor.end_pass()

    def priority_key(self, request: Request, stage: Stage, now: float) -> tuple[float, ...]:
        return self.priority_keys(request, (stage,), now)[0]

    def priority_keys(self, request: Request, stages: Sequence[Stage],
                      now: float) -> list[tuple[float, ...]]:
        """The request's slack and buffer level are the same for each of its stages: each is
        computed once, and only if a stage's key needs it (the host time of a step at 64
        streams was mostly these predictions)."""
        p = self.predictor
        if not request.is_streaming:
            if p.overdue_startup_urgent and (slack := p.slack(request, now)) < p.min_slack_s:
                # its first chunk is due: compete on slack
                return [(0, slack, OUTPUT_ORDER[stage]) for stage in stages]
            deadline = p.deadline(request, now)
            return [(1, -request.priority, deadline, OUTPUT_ORDER[stage]) for stage in stages]
        at_gap = request.is_at_gap
        slack: float | None = None
        buffered: float | None = None
        keys: list[tuple[float, ...]] = []
        for stage in stages:
            closeness = OUTPUT_ORDER[stage]
            waited = request.stage_ready_step.get(stage, 0)
            if stage in _PREP and not at_gap:
                keys.append((2, waited, 0.0, closeness))
                continue
            if slack is None:
                slack = p.slack(request, now)
            if slack < p.min_slack_s:
                keys.append((0, slack, closeness))
                continue
            if buffered is None:
                buffered = p.buffered_s(request, now)
            keys.append((3 if buffered > p.max_lead_s else 2, waited, slack, closeness))
        return keys

    def pick(self, ready: Sequence[ReadyPair], now: float) -> tuple[Stage, list[Request]]:
        stage, candidates = first_stage(self._startup_within_slack(ready))
        if stage is Stage.CODEC and self._should_wait(ready, candidates, now):
            stage, candidates = Stage.DEPTH, [r for _, r, s in ready if s is Stage.DEPTH]
            self.predictor.count("predictor_waits")
        if stage in _GENERATE:
            candidates = self._yield_far_ahead(candidates, now)
        return stage, candidates

    def _startup_within_slack(self, ready: Sequence[ReadyPair]) -> Sequence[ReadyPair]:
        """Urgent streams first, unless the first startup step fits in the least urgent slack:
        then that step runs first (an urgent stream loses only what its slack can absorb)."""
        if not ready or ready[0][0][0] != 0:
            return ready
        startup = next((pair for pair in ready if pair[0][0] == 1), None)
        if startup is None:
            return ready
        stage = startup[2]
        rows = sum(r.num_branches for _, r, s in ready if s is stage)
        if ready[0][0][1] - self.predictor.time_model.predict(stage, rows) < 0:
            return ready
        return [startup, *(pair for pair in ready if pair is not startup)]

    def _should_wait(self, ready: Sequence[ReadyPair], codec: list[Request], now: float) -> bool:
        """Whether to run DEPTH first so that streams one frame short of their chunk join the
        CODEC batch: only for streaming requests (a first chunk never waits: TTFB), only if one
        batched CODEC step is predicted cheaper than two, and only if every waiting stream keeps
        ``min_slack_s`` after the DEPTH step."""
        if any(not r.is_streaming for r in codec):
            return False
        ready_ids = {r.request_id for r in codec}
        depth = [r for _, r, s in ready if s is Stage.DEPTH]
        joiners = [r for r in depth if r.request_id not in ready_ids
                   and r.num_pending_frames + 1 >= r.current_chunk_target]
        if not joiners:
            return False
        model = self.predictor.time_model
        n, m = len(codec), len(joiners)
        saving = (model.predict(Stage.CODEC, n) + model.predict(Stage.CODEC, m)
                  - model.predict(Stage.CODEC, n + m))
        if saving <= 0:
            return False
        delay = model.predict(Stage.DEPTH, sum(r.num_branches for r in depth))
        p = self.predictor
        return all(p.deadline(r, now) - now - delay - model.predict(Stage.CODEC, n + m)
                   >= p.min_slack_s for r in codec)

    def _yield_far_ahead(self, candidates: list[Request], now: float) -> list[Request]:
        """Drops streams more than ``max_lead_s`` ahead from a batch that carries startup work
        (their frames are not needed yet; the startup step runs on fewer rows)."""
        if all(r.is_streaming for r in candidates):
            return candidates
        p = self.predictor
        kept = [r for r in candidates
                if not r.is_streaming or p.buffered_s(r, now) <= p.max_lead_s]
        if len(kept) < len(candidates):
            p.count("predictor_lead_yields")
        return kept


class DeadlineChunkPolicy:
    """Follows the chunk schedule, except that a streaming request whose next chunk cannot be
    out before its deadline emits the frames it already has (a smaller chunk, counted as an
    early emit when it goes out), and, with ``first_chunk_cover``, a first chunk holds enough
    audio to last while the next frame is made and decoded (``_first_chunk``; counted as a
    first-chunk cover).

    NOTE(predictor): the cut comes as late as it can: while one more frame still fits before the
    deadline, generation goes on, so the partial chunk is as large as possible (each chunk costs
    a CODEC step).
    """

    def __init__(self, predictor: DeadlinePredictor, *, first_chunk_cover: bool = False) -> None:
        self.predictor = predictor
        self.first_chunk_cover = first_chunk_cover

    def chunk_frames(self, request: Request, now: float) -> int:
        target = request.current_chunk_target
        pending = request.num_pending_frames
        p = self.predictor
        request.early_emit_target = None
        if not request.is_streaming:
            return self._first_chunk(request, target) if self.first_chunk_cover else target
        if not 0 < pending < target or request.is_at_gap:
            return target
        deadline = p.deadline(request, now)
        if (now + p.work_s(request, target) <= deadline
                or now + p.work_s(request, pending + 1) <= deadline):
            return target
        request.early_emit_target = target
        return pending

    def on_chunk(self, request: Request, num_frames: int, now: float) -> None:
        schedule = request.chunk_schedule
        if not request.is_streaming and schedule and num_frames > schedule[0]:
            self.predictor.count("predictor_first_chunk_covers")
        self.predictor.on_chunk(request, num_frames, now)
        request.early_emit_target = None

    def _first_chunk(self, request: Request, target: int) -> int:
        """The fewest frames, from ``target`` up to the schedule's largest entry, whose audio
        lasts while the engine makes one more frame and decodes it with ``min_slack_s`` to
        spare (the next chunk can be cut to that frame, so it is what must fit)."""
        p = self.predictor
        cover_s = p.frame_time_s() + p.time_model.predict(Stage.CODEC) + p.min_slack_s
        largest = max(request.chunk_schedule or (target,))
        return max(target, min(largest, math.ceil(cover_s / FRAME_S - 1e-9)))


def make_policies(
    config: SchedulerConfig, predictor: DeadlinePredictor | None
) -> tuple[StagePolicy | None, ChunkPolicy | None]:
    """The scheduler's policies: the deadline pair with a predictor, the defaults without."""
    if predictor is None or not config.use_predictor:
        return None, None
    return DeadlineStagePolicy(predictor), DeadlineChunkPolicy(
        predictor, first_chunk_cover=config.predictor_first_chunk_cover)
