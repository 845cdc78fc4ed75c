"""The synchronous engine: ``step()`` = schedule → execute → commit.

Owns: turning ``SynthesisRequest``s into scheduler ``Request``s (tokenizing on the host), the
engine lock that makes ``add_request``/``abort``/``append_text`` safe from other threads, and
assembling ``AudioChunk``s and request outcomes from a step. Must not: run asyncio, make policy
decisions (the scheduler does) or run the model's stages (the worker does). The tensors it does
touch are outside ``step``: the CPU prompt tensors that tokenizing builds (``make_prompt``), and
``encode_reference``, which runs the codec encoder (torch) on the caller's thread.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from breezert.config import EngineConfig
from breezert.errors import InvalidRequest
from breezert.loader import Checkpoint
from breezert.metrics import EngineMetrics
from breezert.models.generate import cfg_branches
from breezert.outputs import AudioChunk, StageOutput
from breezert.prompting import make_prompt
from breezert.request import Reference, Request, RequestStatus, Segment, SynthesisRequest
from breezert.sched.block_pool import BlockPool
from breezert.sched.deadline import DeadlinePredictor
from breezert.sched.plan import StepPlan, StepResult
from breezert.sched.policy import make_policies
from breezert.sched.scheduler import (
    ChunkEmitted,
    RequestFinished,
    Scheduler,
    SchedulerEvent,
    SegmentEnded,
)
from breezert.worker.model_runner import ModelRunner

logger = logging.getLogger("breezert.engine")


@dataclass(frozen=True)
class RequestOutcome:
    """A request reached a terminal status (the last output it gets)."""

    request_id: str
    status: RequestStatus
    error: str | None = None


EngineOutput = AudioChunk | RequestOutcome


@dataclass(frozen=True)
class PlaybackReport:
    """The listener's playback buffer for one request, as last reported."""

    buffered_s: float
    """Audio queued ahead of the listener's playhead, seconds."""
    measured_at: float
    """``time.monotonic()`` when it was measured."""
    source: str
    """Where it came from: ``simulated``, ``webrtc``, ``livekit-source``, ``livekit-client``."""


class Engine:
    """Multi-stage TTS engine over one model. Thread-safe entry points; ``step`` on one thread."""

    def __init__(
        self,
        config: EngineConfig,
        checkpoint: Checkpoint | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        from breezert.config import apply_env_overrides
        from breezert.runtime_setup import build_runner, load_engine_checkpoint

        config = apply_env_overrides(config)
        self.config = config
        self.checkpoint = checkpoint or load_engine_checkpoint(config.model)
        self.clock = clock
        self.runner: ModelRunner = build_runner(config, self.checkpoint)
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
                                   chunk_policy=chunk_policy)
        self.playback: dict[str, PlaybackReport] = {}
        self._lock = threading.RLock()
        self._pending: list[EngineOutput] = []  # outcomes produced outside step()
        self._segment_ends: dict[str, list[int]] = {}  # request -> cumulative segment ends
        self.last_step_ran = False
        self.last_plan: StepPlan | None = None
        """The last plan run (dumped when the engine loop dies)."""
        """Whether the last ``step`` ran a plan (False: nothing was runnable)."""
        self._max_seq_len = min(config.scheduler.max_model_len, self.checkpoint.config.max_seq_len)

    # ----------------------------------------------------------------- requests
    def add_request(self, request: SynthesisRequest) -> str:
        """Queues ``request``; raises ``InvalidRequest`` or ``EngineOverloaded`` at once."""
        if request.seed is None:  # a known seed makes every request reproducible
            from dataclasses import replace

            request = replace(request, seed=secrets.randbits(63))
        segments = [self._segment(request, text) for text in request.segments]
        num_branches = segments[0].num_branches if segments else self._num_branches(request)
        logical = Request.from_synthesis(request, segments, payload=request,
                                         num_branches=num_branches)
        with self._lock:
            now = self.clock()
            self.scheduler.add_request(logical, now)
            self.metrics.request_added(logical.request_id, now)
        return logical.request_id

    def encode_reference(self, samples: Any, sample_rate: int, ref_text: str) -> Reference:
        """Reference audio -> ``Reference(ref_text, ref_codes)`` for voice clone / direction.

        Runs the checkpoint's codec encoder (fp32) under ``torch.inference_mode`` on its own
        device. Touches no scheduler state, so any thread may call it while ``step`` runs.

        Args:
            samples: ``[num_samples]`` or ``[num_samples, num_channels]``; float, int16 or int32.
            sample_rate: Hz (resampled to 24 kHz).
            ref_text: the reference audio's transcript.

        Raises:
            InvalidRequest: naming ``reference_text``, ``samples`` / ``sample_rate`` (bad audio)
                or ``reference_audio`` (the model has no encoder).
        """
        import torch

        from breezert.reference_audio import encode_reference

        if not isinstance(ref_text, str) or not ref_text.strip():
            raise InvalidRequest("reference_text: must be non-empty text (the reference's "
                                 "transcript)")
        encoder = self.checkpoint.codec_encoder
        if encoder is None:
            raise InvalidRequest("reference_audio: this model has no reference-audio encoder "
                                 "(its checkpoint lacks the audio-tokenizer encoder weights)")
        with torch.inference_mode():
            codes = encode_reference(encoder, samples, sample_rate)
        return Reference(ref_text=ref_text, ref_codes=codes)

    def append_text(self, request_id: str, text: str) -> None:
        """Adds a text segment to a running turn (its input must still be open)."""
        with self._lock:
            request = self._live_request(request_id)
            synth = request.payload
        segment = self._segment(synth, text)
        with self._lock:
            self.scheduler.append_segment(request_id, segment, self.clock())

    def close_input(self, request_id: str) -> None:
        """No more segments: the turn ends after the last one."""
        with self._lock:
            self._live_request(request_id)
            self._pending.extend(self._outcomes(self.scheduler.close_input(request_id, self.clock())))

    def abort(self, request_id: str) -> None:
        """Stops a request at once and frees its slot, blocks and codec state."""
        with self._lock:
            self._pending.extend(self._outcomes(self.scheduler.abort(request_id, self.clock())))
            self.playback.pop(request_id, None)

    def report_playback(
        self, request_id: str, buffered_s: float, measured_at: float, source: str
    ) -> None:
        """Stores the listener's real playback-buffer level for ``request_id``."""
        if not buffered_s >= 0.0:
            raise InvalidRequest(f"buffered_s={buffered_s!r} must be a number >= 0")
        with self._lock:
            if self.scheduler.get_request(request_id) is not None:
                self.playback[request_id] = PlaybackReport(buffered_s, measured_at, source)
                if self.predictor is not None:
                    self.predictor.update_feedback(request_id, buffered_s, measured_at, source)

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
            plan = self.scheduler.schedule(self.clock())
        self.last_step_ran = plan is not None
        self.last_plan = plan or self.last_plan
        if plan is None:
            self._release_idle()
            return self._drain_pending()
        start = self.clock()
        out = self.runner.execute(plan)
        end = self.clock()
        with self._lock:
            result = StepResult(plan.step_id, out.first_codes, out.failed)
            events = self.scheduler.commit(plan, result, end)
            self._record_step(plan, end - start)
            return self._drain_pending() + self._outputs(plan, out, events, end)

    # ------------------------------------------------------------------ helpers
    def _record_step(self, plan: StepPlan, duration_s: float) -> None:
        self.metrics.record_step(plan.stage.value, plan.num_rows, duration_s)
        if self.predictor is not None:
            self.predictor.observe_step(plan.stage, plan.num_rows, duration_s)

    def _outputs(
        self, plan: StepPlan, out: StageOutput, events: list[SchedulerEvent], now: float
    ) -> list[EngineOutput]:
        chunks = {(c.request_id, c.start_frame): c for c in out.chunks}
        self._track_segments(events)
        outputs: list[EngineOutput] = []
        for event in events:
            if isinstance(event, ChunkEmitted):
                decoded = chunks.pop((event.request_id, event.start_frame))
                segment = self._segment_of(event.request_id, event.start_frame + event.num_frames)
                outputs.append(AudioChunk(
                    request_id=event.request_id, pcm=decoded.pcm,
                    sample_rate=self.checkpoint.config.codec.sample_rate,
                    frame_start=event.start_frame,
                    frame_end=event.start_frame + event.num_frames,
                    segment_index=segment, created_time=now, is_final=event.is_final,
                ))
                self.metrics.chunk_emitted(event.request_id, event.num_frames, now)
                if self.predictor is not None:
                    self.predictor.on_chunk(event.request_id, event.num_frames, now)
        outputs.extend(self._outcomes(events))
        return outputs

    def _outcomes(self, events: list[SchedulerEvent]) -> list[EngineOutput]:
        outcomes: list[EngineOutput] = []
        for event in events:
            if isinstance(event, RequestFinished):
                self.metrics.request_finished(event.request_id, event.status.value, event.time)
                self.playback.pop(event.request_id, None)
                if self.predictor is not None:
                    self.predictor.forget(event.request_id)
                self._segment_ends.pop(event.request_id, None)
                outcomes.append(RequestOutcome(event.request_id, event.status, event.error))
        return outcomes

    def _release_idle(self) -> None:
        """Hands pending slot releases to the worker when no plan carries them (idle engine)."""
        with self._lock:
            released = self.scheduler.take_released()
        for request_id in released:
            self.runner.batch.release_request(request_id)

    def _drain_pending(self) -> list[EngineOutput]:
        with self._lock:
            pending, self._pending = self._pending, []
        return pending

    def _segment(self, request: SynthesisRequest, text: str) -> Segment:
        prompt = make_prompt(
            self.checkpoint.tokenizer, text, speaker=request.speaker,
            instructions=request.instructions, reference=request.reference,
            max_seq_len=self._max_seq_len,
        )
        branches = cfg_branches(prompt, float(request.cfg_scale))
        return Segment(
            prompt_lens=tuple(p.num_tokens for p in branches), prompt=branches,
            num_text_tokens=sum(len(s) for p in branches for s in p.text_segments()),
        )

    def _num_branches(self, request: SynthesisRequest) -> int:
        """CFG branches of a turn that has no text yet (its template decides them)."""
        probe = make_prompt(
            self.checkpoint.tokenizer, "probe", speaker=request.speaker,
            instructions=request.instructions, reference=request.reference,
            max_seq_len=self._max_seq_len,
        )
        return len(cfg_branches(probe, float(request.cfg_scale)))

    def _segment_of(self, request_id: str, frame_end: int) -> int:
        """Index of the segment holding frame ``frame_end - 1`` of the request's audio."""
        ends = self._segment_ends.get(request_id, [])
        return next((i for i, end in enumerate(ends) if frame_end <= end), len(ends))

    def _track_segments(self, events: list[SchedulerEvent]) -> None:
        """Records where each ended segment's frames stop in the request's audio stream."""
        for event in events:
            if isinstance(event, SegmentEnded):
                ends = self._segment_ends.setdefault(event.request_id, [])
                ends.append((ends[-1] if ends else 0) + event.num_frames)

    def _live_request(self, request_id: str) -> Request:
        request = self.scheduler.get_request(request_id)
        if request is None or request.status.is_finished:
            raise InvalidRequest(f"request_id={request_id!r} is not running")
        return request
