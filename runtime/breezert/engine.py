"""The synchronous engine: ``step()`` = schedule → execute → commit.

Owns: turning prepared ``SynthesisRequest``s into scheduler ``Request``s, the engine lock that
makes ``add_request``/``abort``/``append_segments`` safe from other threads, and assembling
``AudioChunk``s and request outcomes from a step. Must not: run asyncio, make policy decisions
(the scheduler does), run the model's stages (the worker does) or tokenize under its lock: the
text front end (``frontend.TextFrontEnd``, ``self.frontend``) builds the prompts, on the
caller's thread, before a request or a segment reaches the scheduler.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from breezert.config import EngineConfig
from breezert.engine_client import EngineCapacity
from breezert.errors import EngineOverloaded, InvalidRequest
from breezert.frontend import PreparedRequest, PreparedText, TextFrontEnd
from breezert.loader import Checkpoint
from breezert.metrics import EngineMetrics, StepRecord
from breezert.outputs import AudioChunk, StageOutput
from breezert.request import (
    PlaybackReport,
    Request,
    RequestStatus,
    SynthesisRequest,
)
from breezert.sched.block_pool import BlockPool
from breezert.sched.deadline import DeadlinePredictor
from breezert.sched.load import EngineLoad
from breezert.sched.plan import StepPlan, StepResult
from breezert.sched.policy import make_policies
from breezert.sched.scheduler import ChunkEmitted, RequestFinished, Scheduler, SchedulerEvent
from breezert.text import Split
from breezert.worker.model_runner import ModelRunner
from breezert.worker.warmup import Progress

logger = logging.getLogger("breezert.engine")


@dataclass(frozen=True)
class RequestOutcome:
    """A request reached a terminal status (the last output it gets)."""

    request_id: str
    status: RequestStatus
    error: str | None = None
    overloaded: bool = False
    """Refused while waiting for a slot (``max_queue_wait_s``): retry later or elsewhere."""
    retry_after_s: float | None = None
    """With ``overloaded``: when a retry may find room (its predicted wait left), if known."""


EngineOutput = AudioChunk | RequestOutcome


class Engine:
    """Multi-stage TTS engine over one model. Thread-safe entry points; ``step`` on one thread."""

    def __init__(
        self,
        config: EngineConfig,
        checkpoint: Checkpoint | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        progress: Progress | None = None,
    ) -> None:
        from breezert.config import apply_env_overrides
        from breezert.runtime_setup import build_runner, load_engine_checkpoint

        config = apply_env_overrides(config)
        self.config = config
        self.checkpoint = checkpoint or load_engine_checkpoint(config.model, progress)
        self.clock = clock
        self.runner: ModelRunner = build_runner(config, self.checkpoint, progress)
        layout = self.runner.layout
        self.block_pool = BlockPool(layout.num_blocks, layout.block_size)
        self.metrics = EngineMetrics()
        self.predictor: DeadlinePredictor | None = None
        """Deadline predictor (``scheduler.use_predictor``); fed reports, step times, chunks."""
        if config.scheduler.use_predictor:
            # late-bound: a caller may swap in fresh metrics (the bench does, per run)
            self.predictor = DeadlinePredictor.from_config(
                config.scheduler, lambda name, value: self.metrics.incr(name, value))
        stage_policy, chunk_policy = make_policies(config.scheduler, self.predictor)
        self.scheduler = Scheduler(config.scheduler, self.block_pool, stage_policy=stage_policy,
                                   chunk_policy=chunk_policy, buffers=self.predictor)
        self._lock = threading.RLock()
        self._pending: list[EngineOutput] = []  # outcomes produced outside step()
        self.last_step_ran = False
        """Whether the last ``step`` ran a plan (False: nothing was runnable)."""
        self.last_plan: StepPlan | None = None
        """The last plan run (dumped when the engine loop dies)."""
        self._busy_since: float | None = None
        """When the last step ended, while the engine has had work ever since (``None`` after a
        step with nothing to run): the next step's cost to the real-time capacity counts from
        there, host work between the steps included."""
        self.frontend = TextFrontEnd(
            self.checkpoint.tokenizer,
            min(config.scheduler.max_model_len, self.checkpoint.config.max_seq_len),
            self.checkpoint.codec_encoder)
        """Tokenizer, templates, splitting and reference audio: the prompts, built once."""

    # ----------------------------------------------------------------- requests
    def add_request(self, request: SynthesisRequest | PreparedRequest) -> str:
        """Queues ``request`` (prepared here, on the calling thread, unless it already was by
        ``frontend.prepare``); raises ``InvalidRequest`` or ``EngineOverloaded`` at once."""
        prepared = (request if isinstance(request, PreparedRequest)
                    else self.frontend.prepare(request))
        synth = prepared.request
        if synth.options.seed is None:  # a known seed makes every request reproducible
            synth = replace(synth, options=replace(synth.options, seed=secrets.randbits(63)))
        sampling = synth.options.resolve_sampling(self.checkpoint.generation.sampling)
        logical = Request.from_synthesis(synth, prepared.text.segments, sampling=sampling,
                                         num_branches=prepared.num_branches)
        with self._lock:
            try:
                self.scheduler.add_request(logical, self.clock())
            except EngineOverloaded as exc:  # counted by reason: capacity, slot_wait, ...
                self.metrics.incr(f"requests_refused_{exc.reason or 'overloaded'}")
                raise
            self.metrics.request_added()
        return logical.request_id

    def prepare_append(self, request_id: str, text: str, split: Split) -> PreparedText:
        """``text`` as segments of the running turn ``request_id`` (its voice, instructions
        and reference), for ``append_segments``; builds the prompts outside the engine lock."""
        with self._lock:
            request = self._live_request(request_id)
        return self.frontend.prepare_text([text], request.options, request.reference, split)

    def append_segments(self, request_id: str, prepared: PreparedText) -> None:
        """Adds prepared segments to a running turn (its input must still be open)."""
        with self._lock:
            for segment in prepared.segments:
                self.scheduler.append_segment(request_id, segment, self.clock())

    def append_text(self, request_id: str, text: str) -> None:
        """Adds ``text`` to a running turn as one segment (its input must still be open)."""
        self.append_segments(request_id, self.prepare_append(request_id, text, Split.NONE))

    def close_input(self, request_id: str) -> None:
        """No more segments: the turn ends after the last one."""
        with self._lock:
            self._live_request(request_id)
            self._pending.extend(self._outcomes(self.scheduler.close_input(request_id, self.clock())))

    def abort(self, request_id: str) -> None:
        """Stops a request at once and frees its slot, blocks and codec state."""
        with self._lock:
            self._pending.extend(self._outcomes(self.scheduler.abort(request_id, self.clock())))

    def report_playback(
        self, request_id: str, buffered_s: float, measured_at: float, source: str
    ) -> None:
        """Hands the listener's real playback-buffer level to ``request_id`` (ignored once it
        has finished); the predictor reads it from there.

        Raises:
            InvalidRequest: ``buffered_s`` is not a number >= 0, or ``source`` is empty.
        """
        report = PlaybackReport(buffered_s, measured_at, source)
        with self._lock:
            if self.scheduler.report_playback(request_id, report):
                self.metrics.incr(f"playback_reports_{source}")

    def capacity(self) -> EngineCapacity:
        """Slots, KV blocks and codec slots in use: lengths and counters, read without the
        engine lock (safe from any thread)."""
        stats = self.scheduler.stats()
        return EngineCapacity(
            running=stats.num_running, queued=stats.num_waiting,
            max_running=self.config.scheduler.max_running_requests,
            free_slots=stats.num_free_slots, kv_blocks_free=stats.num_free_blocks,
            kv_blocks_total=stats.num_blocks, codec_slots_used=self.runner.slots.num_active)

    def load(self) -> EngineLoad:
        """Running and queued requests against the limits, and the Predictor's least slack
        (``breezert.sched.load.EngineLoad``); safe from any thread."""
        with self._lock:
            return self.scheduler.load(self.predictor, self.clock())

    def step_log(self) -> list[StepRecord]:
        """A copy of the metrics' step log (``EngineMetrics(step_log=N)``; empty without one);
        safe from any thread."""
        with self._lock:
            return list(self.metrics.steps)

    def drain(self) -> list[EngineOutput]:
        """Outcomes produced outside ``step`` (``abort``, ``close_input``) that no step returned
        yet; for a caller that stops stepping (``AsyncEngine.aclose``)."""
        return self._drain_pending()

    def has_work(self) -> bool:
        with self._lock:
            return bool(self._pending) or self.scheduler.has_work()

    # --------------------------------------------------------------------- step
    def step(self) -> list[EngineOutput]:
        """One scheduler step: plan → run on the worker → commit; returns what it produced."""
        with self._lock:
            now = self.clock()
            self._pending.extend(self._outcomes(self.scheduler.expire_waiting(now)))
            plan = self.scheduler.schedule(now)
        self.last_step_ran = plan is not None
        self.last_plan = plan or self.last_plan
        if plan is None:
            self._busy_since = None
            self.release_finished()
            return self._drain_pending()
        start = self.clock()
        out = self.runner.execute(plan)
        end = self.clock()
        with self._lock:
            result = StepResult(plan.step_id, out.first_codes, out.failed)
            events = self.scheduler.commit(plan, result, end)
            self._record_step(plan, start, end)
            return self._drain_pending() + self._outputs(plan, out, events, end)

    # ------------------------------------------------------------------ helpers
    def _record_step(self, plan: StepPlan, start: float, end: float) -> None:
        rows = plan.num_rows
        ids = plan.request_ids if self.metrics.steps.maxlen else ()  # the step log's only
        self.metrics.record_step(plan.stage.value, rows, end - start, ids, start)
        busy_since = start if self._busy_since is None else min(start, self._busy_since)
        self.scheduler.observe_step(plan, end - busy_since)
        self._busy_since = end
        if self.predictor is not None:
            self.predictor.observe_step(plan.stage, rows, end - start)

    def _outputs(
        self, plan: StepPlan, out: StageOutput, events: list[SchedulerEvent], now: float
    ) -> list[EngineOutput]:
        chunks = {(c.request_id, c.start_frame): c for c in out.chunks}
        outputs: list[EngineOutput] = []
        sample_rate = self.checkpoint.config.codec.sample_rate
        for event in events:
            if isinstance(event, ChunkEmitted):
                decoded = chunks.pop((event.request_id, event.start_frame))
                outputs.append(AudioChunk(
                    request_id=event.request_id, pcm=decoded.pcm, sample_rate=sample_rate,
                    frame_start=event.start_frame,
                    frame_end=event.start_frame + event.num_frames,
                    segment_index=event.segment_index, created_time=now,
                    is_final=event.is_final,
                ))
        outputs.extend(self._outcomes(events))
        return outputs

    def _outcomes(self, events: list[SchedulerEvent]) -> list[EngineOutput]:
        """Feeds the events to the metrics; returns the outcomes of finished requests."""
        self.metrics.on_events(events)
        return [RequestOutcome(e.request_id, e.status, e.error, e.overloaded, e.retry_after_s)
                for e in events if isinstance(e, RequestFinished)]

    def release_finished(self) -> None:
        """Hands pending slot releases to the worker now, not with the next plan (an idle step
        does it itself); ``step``'s thread only."""
        with self._lock:
            released = self.scheduler.take_released()
        for request_id in released:
            self.runner.release(request_id)

    def _drain_pending(self) -> list[EngineOutput]:
        with self._lock:
            pending, self._pending = self._pending, []
        return pending

    def _live_request(self, request_id: str) -> Request:
        request = self.scheduler.get_request(request_id)
        if request is None or request.status.is_finished:
            raise InvalidRequest(f"request_id={request_id!r} is not running")
        return request
