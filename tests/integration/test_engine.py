"""``Engine`` end to end on the tiny random model (CPU): batching, chunks, turns, faults, limits.

Owns the engine-level invariants: batched output equals the request run alone and the sequential
reference (``offline.stream_sequential``), chunks follow each schedule, startup priority, resources
return at finish/abort/failure, admission control and input validation. Must not need a GPU.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch

from breezert.config import EngineConfig
from breezert.constants import FRAME_EOS_ID, Stage
from breezert.engine import Engine, EngineOutput, RequestOutcome
from breezert.layers.attention import decode_meta_on_device
from breezert.errors import EngineOverloaded, InvalidRequest
from breezert.options import SamplingParams
from breezert.metrics import EngineMetrics
from breezert.offline import chunk_sizes, stream_sequential
from breezert.outputs import AudioChunk
from breezert.options import SynthesisOptions
from breezert.request import PlaybackReport, RequestStatus, SynthesisRequest
from breezert.sched.plan import StepPlan

pytestmark = pytest.mark.integration

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny.toml"
SAMPLING = SamplingParams(temperature=0.9, depth_temperature=0.8)  # T > 0: the RNG matters
DEFAULT_SCHEDULE = (1, 2, 4, 8, 16)
ATOL = 1e-5


# ----------------------------------------------------------------------------- helpers


class TickClock:
    """A clock that moves 0.1 ms per reading: the shared engine's time no longer depends on
    the box. With the wall clock, ``starvation_limit_s`` (0.5 s in ``configs/tiny.toml``)
    reorders work whenever steps run slowly (a loaded two-core box: the sixteen staggered
    requests then never shared one DEPTH batch), so batch-shape assertions were the box's."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1e-4
        return self.now


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(EngineConfig.from_file(CONFIG), clock=TickClock())


@pytest.fixture(autouse=True)
def _engine_left_idle(engine: Engine) -> Iterator[None]:
    yield
    engine.runner.fault_hook = None
    assert not engine.has_work(), "a test left requests in the shared engine"


def make(request_id: str, seed: int, frames: int, *, cfg_scale: float = 1.0,
         **kwargs: object) -> SynthesisRequest:
    kwargs.setdefault("text", f"Request {request_id} is speaking now.")
    options = SynthesisOptions(seed=seed, sampling=SAMPLING, cfg_scale=cfg_scale)
    return SynthesisRequest(max_frames=frames, ignore_eos=True, request_id=request_id,
                            options=options, **kwargs)  # type: ignore[arg-type]


def run(engine: Engine, max_steps: int = 10_000) -> list[EngineOutput]:
    outputs: list[EngineOutput] = []
    for _ in range(max_steps):
        if not engine.has_work():
            return outputs
        outputs += engine.step()
    raise AssertionError("engine did not go idle")


def chunks_of(outputs: list[EngineOutput], request_id: str) -> list[AudioChunk]:
    return [o for o in outputs if isinstance(o, AudioChunk) and o.request_id == request_id]


def outcome_of(outputs: list[EngineOutput], request_id: str) -> RequestOutcome:
    (outcome,) = [o for o in outputs if isinstance(o, RequestOutcome)
                  and o.request_id == request_id]
    return outcome


def audio(chunks: list[AudioChunk]) -> np.ndarray:
    return np.concatenate([c.pcm for c in chunks])


def ranges(chunks: list[AudioChunk]) -> list[tuple[int, int]]:
    return [(c.frame_start, c.frame_end) for c in chunks]


def schedule_ranges(schedule: tuple[int, ...], num_frames: int) -> list[tuple[int, int]]:
    """Chunk frame ranges of an uninterrupted stream: the schedule, the last chunk cut short."""
    out, start = [], 0
    for size in chunk_sizes(schedule):
        if start >= num_frames:
            return out
        out.append((start, min(start + size, num_frames)))
        start += size
    raise AssertionError("unreachable")


def sequential(engine: Engine, request: SynthesisRequest) -> list[AudioChunk]:
    return list(stream_sequential(engine.checkpoint, request))


def assert_all_released(engine: Engine) -> None:
    """Blocks, slots and the worker's slot table are all free once the engine is idle."""
    assert engine.step() == [] and not engine.last_step_ran  # an idle step hands out releases
    stats = engine.scheduler.stats()
    assert (stats.num_running, stats.num_waiting) == (0, 0)
    assert stats.num_free_slots == engine.config.scheduler.max_running_requests
    assert engine.block_pool.num_free == engine.block_pool.num_blocks
    assert engine.runner.slots.num_active == 0


@dataclass
class Recorder:
    """Wraps ``runner.execute``: every item run, and every frame DEPTH produced."""

    engine: Engine
    items: list[tuple[int, Stage, str, int]] = field(default_factory=list)
    """(step number, stage, request_id, segment_index) per item; CODEC uses segment -1."""
    frames: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    steps: list[StepPlan] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._execute = self.engine.runner.execute

    def __call__(self, plan: StepPlan):  # noqa: ANN204 - returns the runner's StageOutput
        out = self._execute(plan)
        self.steps.append(plan)
        for item in plan.items:
            self.items.append((len(self.steps), plan.stage, item.request_id,
                               getattr(item, "segment_index", -1)))
            if plan.stage is Stage.DEPTH and item.request_id not in out.failed \
                    and out.first_codes[item.request_id] != FRAME_EOS_ID:  # EOS: no frame
                slots = self.engine.runner.slots
                frame = slots.ring[item.slot, item.output_frame_index % slots.ring_frames]
                self.frames.setdefault(item.request_id, []).append(frame.clone())
        return out


# ----------------------------------------------------------------------------- 16 staggered


def _staggered_requests() -> list[SynthesisRequest]:
    schedules = [None, (2, 3), None, (5,), None, (1, 1, 2)]
    # Early arrivals run longer, so that every request overlaps the last wave.
    return [make(f"r{i:02d}", seed=1000 + i, frames=17 - 3 * (i // 4) - i % 4,
                 chunk_schedule=schedules[i % len(schedules)]) for i in range(16)]


@contextmanager
def recording(engine: Engine) -> Iterator[Recorder]:
    recorder = Recorder(engine)
    engine.runner.execute = recorder  # type: ignore[method-assign]
    try:
        yield recorder
    finally:
        del engine.runner.execute  # back to the class method


@dataclass
class Run:
    chunks: dict[str, list[AudioChunk]]
    outcomes: dict[str, RequestOutcome]
    recorder: Recorder


def _record(engine: Engine, waves: list[list[SynthesisRequest]], gap_steps: int,
            drive: Callable[[list[EngineOutput]], None] | None = None) -> Run:
    """Adds each wave, then steps ``gap_steps`` times (``drive`` may step and act instead)."""
    outputs: list[EngineOutput] = []
    with recording(engine) as recorder:
        for wave in waves:
            for request in wave:
                engine.add_request(request)
            for _ in range(gap_steps):
                outputs += engine.step()
        if drive is not None:
            drive(outputs)
        outputs += run(engine)
    ids = [r.request_id for wave in waves for r in wave]
    return Run({i: chunks_of(outputs, i) for i in ids}, {i: outcome_of(outputs, i) for i in ids},
               recorder)


@pytest.fixture(scope="module")
def batched(engine: Engine) -> Run:
    requests = _staggered_requests()
    return _record(engine, [requests[i : i + 4] for i in range(0, 16, 4)], gap_steps=3)


@pytest.fixture(scope="module")
def alone(engine: Engine, batched: Run) -> dict[str, Run]:
    return {r.request_id: _record(engine, [[r]], gap_steps=0) for r in _staggered_requests()}


def test_sixteen_staggered_requests_all_complete(batched: Run) -> None:
    requests = _staggered_requests()
    assert all(batched.outcomes[r.request_id].status is RequestStatus.FINISHED for r in requests)
    for r in requests:
        chunks = batched.chunks[r.request_id]
        assert chunks[-1].frame_end == r.max_frames and len(audio(chunks)) == r.max_frames * 1920
        assert [c.is_final for c in chunks] == [False] * (len(chunks) - 1) + [True]
    depth_batches = [len(set(p.request_ids)) for p in batched.recorder.steps
                     if p.stage is Stage.DEPTH]
    assert max(depth_batches) == 16  # all 16 really ran in one batch at some point


def test_chunk_boundaries_follow_each_schedule(batched: Run) -> None:
    for r in _staggered_requests():
        expected = schedule_ranges(r.chunk_schedule or DEFAULT_SCHEDULE, r.max_frames or 0)
        assert ranges(batched.chunks[r.request_id]) == expected, r.request_id


def test_codes_are_batch_invariant(batched: Run, alone: dict[str, Run]) -> None:
    for r in _staggered_requests():
        solo = alone[r.request_id].recorder.frames[r.request_id]
        together = batched.recorder.frames[r.request_id]
        assert len(together) == r.max_frames
        assert torch.equal(torch.stack(together), torch.stack(solo)), r.request_id


def test_audio_equals_alone_and_sequential_reference(
    engine: Engine, batched: Run, alone: dict[str, Run]
) -> None:
    for r in _staggered_requests():
        together = batched.chunks[r.request_id]
        solo = alone[r.request_id].chunks[r.request_id]
        reference = sequential(engine, r)
        assert ranges(together) == ranges(solo) == ranges(reference), r.request_id
        np.testing.assert_allclose(audio(together), audio(solo), atol=ATOL, rtol=0)
        np.testing.assert_allclose(audio(together), audio(reference), atol=ATOL, rtol=0)


# ----------------------------------------------------------------------------- startup priority


def test_newcomer_first_chunk_before_any_stream_gets_two_more(engine: Engine) -> None:
    streams = [make(f"s{i:02d}", seed=i, frames=16, chunk_schedule=(1,)) for i in range(15)]
    for request in streams:
        engine.add_request(request)
    outputs: list[EngineOutput] = []
    while any(not chunks_of(outputs, r.request_id) for r in streams):
        outputs += engine.step()
    engine.add_request(make("newcomer", seed=99, frames=4))
    counts = dict.fromkeys((r.request_id for r in streams), 0)
    while not chunks_of(outputs, "newcomer"):
        for out in (new := engine.step()):
            if isinstance(out, AudioChunk) and out.request_id in counts:
                counts[out.request_id] += 1
        outputs += new
    assert max(counts.values()) < 2, counts
    outputs += run(engine)
    assert all(outcome_of(outputs, r.request_id).status is RequestStatus.FINISHED
               for r in streams)


# ----------------------------------------------------------------------------- abort and failure


def test_abort_and_failure_leave_others_correct_and_free_everything(engine: Engine) -> None:
    others = [make(f"ok{i}", seed=40 + i, frames=12) for i in range(3)]
    depth_calls = itertools.count()

    def fault(stage: Stage, request_id: str) -> None:
        if stage is Stage.DEPTH and request_id == "fail" and next(depth_calls) >= 5:
            raise RuntimeError("injected fault")

    engine.runner.fault_hook = fault
    for request in [*others, make("abort", seed=7, frames=60), make("fail", seed=8, frames=60)]:
        engine.add_request(request)
    outputs: list[EngineOutput] = []
    while len(chunks_of(outputs, "abort")) < 3:
        outputs += engine.step()
    engine.abort("abort")
    num_before_abort = len(outputs)
    outputs += run(engine)
    assert not chunks_of(outputs[num_before_abort:], "abort")
    assert outcome_of(outputs, "abort") == RequestOutcome("abort", RequestStatus.ABORTED)
    failed = outcome_of(outputs, "fail")
    assert failed.status is RequestStatus.FAILED and "injected fault" in (failed.error or "")
    assert chunks_of(outputs, "fail") and not chunks_of(outputs, "fail")[-1].is_final
    for r in others:
        assert outcome_of(outputs, r.request_id).status is RequestStatus.FINISHED
        expected = audio(sequential(engine, r))
        np.testing.assert_allclose(audio(chunks_of(outputs, r.request_id)), expected,
                                   atol=ATOL, rtol=0)
    assert_all_released(engine)


def test_idle_engine_releases_worker_slots(engine: Engine) -> None:
    engine.add_request(make("short", seed=1, frames=2))
    run(engine)
    assert engine.runner.slots.num_active == 1  # the release rides on the next plan or idle step
    assert engine.step() == []
    assert engine.runner.slots.num_active == 0


# ----------------------------------------------------------------------------- multi-segment turn


@pytest.fixture(scope="module")
def turns(engine: Engine) -> dict[str, Run]:
    """The same two-segment turn, appended while it runs and given whole up front."""

    def append_after_first_chunk(outputs: list[EngineOutput]) -> None:
        while not chunks_of(outputs, "appended"):
            outputs += engine.step()
        engine.append_text("appended", "seg two")
        engine.close_input("appended")

    appended = make("appended", seed=5, frames=10, text="seg one", input_closed=False)
    whole = make("whole", seed=5, frames=10, text=["seg one", "seg two"])
    return {"appended": _record(engine, [[appended]], 0, append_after_first_chunk),
            "whole": _record(engine, [[whole]], 0)}


def test_appended_turn_equals_one_request_with_both_texts(
    engine: Engine, turns: dict[str, Run]
) -> None:
    appended, whole = turns["appended"].chunks["appended"], turns["whole"].chunks["whole"]
    assert turns["appended"].outcomes["appended"].status is RequestStatus.FINISHED
    assert len(audio(appended)) == 20 * 1920
    np.testing.assert_allclose(audio(appended), audio(whole), atol=ATOL, rtol=0)
    reference = make("whole", seed=5, frames=10, text=["seg one", "seg two"])
    np.testing.assert_allclose(audio(appended), audio(sequential(engine, reference)),
                               atol=ATOL, rtol=0)
    assert {c.segment_index for c in appended} == {0, 1}


def test_next_segment_is_prepared_ahead_without_a_gap(turns: dict[str, Run]) -> None:
    items = turns["appended"].recorder.items
    depth_steps = [step for step, stage, _, seg in items if stage is Stage.DEPTH and seg == 0]
    prep_steps = [step for step, stage, _, seg in items
                  if stage in (Stage.TEXT_ENCODE, Stage.PREFILL) and seg == 1]
    assert len(depth_steps) == 10 and prep_steps
    assert max(prep_steps) < max(depth_steps)  # ready before segment 0's last frame
    chunks = turns["appended"].chunks["appended"]
    # No flush at the boundary: the chunks run straight on, exactly as one 20-frame stream.
    assert ranges(chunks) == schedule_ranges(DEFAULT_SCHEDULE, 20)
    assert ranges(chunks) == ranges(turns["whole"].chunks["whole"])


# ----------------------------------------------------------------------------- admission, input


def test_admission_control_rejects_beyond_the_queue(engine: Engine) -> None:
    data = engine.config.model_dump()
    data["scheduler"].update(max_running_requests=2, max_queued_requests=2)
    small = Engine(EngineConfig.from_dict(data), engine.checkpoint)
    for i in range(4):
        small.add_request(make(f"q{i}", seed=i, frames=3))
    with pytest.raises(EngineOverloaded, match="max_queued_requests=2"):
        small.add_request(make("q4", seed=4, frames=3))
    stats = small.scheduler.stats()
    assert (stats.num_running, stats.num_waiting) == (2, 2)
    assert small.scheduler.get_request("q4") is None
    assert small.metrics.counters["requests_added"] == 4
    outputs = run(small)
    assert all(outcome_of(outputs, f"q{i}").status is RequestStatus.FINISHED for i in range(4))
    assert_all_released(small)
    small.add_request(make("q4", seed=4, frames=3))  # room again
    assert outcome_of(run(small), "q4").status is RequestStatus.FINISHED


@pytest.mark.parametrize(
    ("build", "error", "message"),
    [
        (lambda: SynthesisRequest(text=""), InvalidRequest, r"^text="),
        (lambda: SynthesisRequest(text="Hi", options=SynthesisOptions(cfg_scale=math.nan)), InvalidRequest,
         r"^cfg_scale=nan"),
        (lambda: SynthesisRequest(text="Hi", options=SynthesisOptions(sampling=SamplingParams(temperature=-1))),
         ValueError, r"^temperature=-1 must be >= 0"),
        (lambda: SynthesisRequest(text="Hi", options=SynthesisOptions(speaker="[S12]")), InvalidRequest,
         r"^speaker='\[S12\]' is unknown"),
        (lambda: SynthesisRequest(text="word " * 200), InvalidRequest,
         r"^text: the prompt is \d+ tokens"),
        (lambda: SynthesisRequest(text="Hi", chunk_schedule=(0,)), InvalidRequest,
         r"^chunk_schedule="),
    ],
    ids=["empty-text", "cfg-nan", "negative-temperature", "unknown-speaker", "too-long",
         "chunk-0"],
)
def test_bad_input_is_rejected_and_engine_stays_usable(
    engine: Engine, build: Callable[[], SynthesisRequest], error: type[Exception], message: str
) -> None:
    # The request's own fields fail on construction, what needs the model (speaker, prompt
    # length) in add_request; either way before anything is queued.
    with pytest.raises(error, match=message):
        engine.add_request(build())
    assert not engine.has_work() and engine.scheduler.stats().num_running == 0
    engine.add_request(make("after-bad", seed=3, frames=2))
    assert outcome_of(run(engine), "after-bad").status is RequestStatus.FINISHED


def test_text_for_an_unknown_request_is_rejected(engine: Engine) -> None:
    with pytest.raises(InvalidRequest, match="is not running"):
        engine.append_text("no-such-request", "more")
    with pytest.raises(InvalidRequest, match="is not running"):
        engine.close_input("no-such-request")


# ----------------------------------------------------------------------------- metrics, playback


def test_metrics_snapshot_after_a_run(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine, "metrics", EngineMetrics())
    for i in range(3):
        engine.add_request(make(f"m{i}", seed=i, frames=5, cfg_scale=2.0 if i == 0 else 1.0))
    outputs = run(engine)
    snapshot = engine.metrics.snapshot()
    assert snapshot["ttfb_s"]["count"] == snapshot["counters"]["requests_finished"] == 3
    assert snapshot["rtf"]["count"] == 3 and snapshot["active_requests"] == 0
    assert sum(snapshot["ttfb_histogram"]["counts"]) == 3
    assert snapshot["counters"]["chunks_emitted"] == sum(isinstance(o, AudioChunk)
                                                         for o in outputs)
    assert set(snapshot["stages"]) == {stage.value for stage in Stage}
    for stage in snapshot["stages"].values():
        assert stage["step_s"]["count"] == stage["rows"]["count"] > 0
        assert stage["step_s"]["max"] > 0 and stage["rows"]["max"] >= 1


def test_report_playback_keeps_the_latest_until_the_request_ends(engine: Engine) -> None:
    engine.add_request(make("listen", seed=1, frames=3))
    engine.add_request(make("gone", seed=2, frames=3))
    listen = engine.scheduler.get_request("listen")
    gone = engine.scheduler.get_request("gone")
    assert listen is not None and gone is not None
    engine.report_playback("listen", 0.10, 1.0, "simulated")
    engine.report_playback("listen", 0.25, 2.0, "webrtc")
    engine.report_playback("listen", 0.75, 1.5, "webrtc")  # measured earlier: ignored
    engine.report_playback("gone", 0.5, 2.0, "webrtc")
    engine.report_playback("unknown", 0.5, 2.0, "webrtc")  # ignored: not a live request
    assert listen.playback == PlaybackReport(0.25, 2.0, "webrtc")
    assert gone.playback == PlaybackReport(0.5, 2.0, "webrtc")
    counters = engine.metrics.counters
    assert counters["playback_reports_simulated"] >= 1 and counters["playback_reports_webrtc"] >= 3
    for bad in (-0.01, math.nan):
        with pytest.raises(InvalidRequest, match="buffered_s="):
            engine.report_playback("listen", bad, 3.0, "webrtc")
    with pytest.raises(InvalidRequest, match="source="):
        engine.report_playback("listen", 0.1, 3.0, "")
    engine.abort("gone")
    engine.report_playback("gone", 0.5, 3.0, "webrtc")  # finished: dropped with the request
    assert engine.scheduler.get_request("gone") is None
    run(engine)
    assert engine.scheduler.get_request("listen") is None


def test_chunks_carry_their_segment_index(engine: Engine) -> None:
    request = SynthesisRequest(text=["first part", "second part"], max_frames=6,
                               ignore_eos=True, chunk_schedule=(4,),
                               options=SynthesisOptions(seed=5, sampling=SAMPLING))
    engine.add_request(request)
    chunks: list[AudioChunk] = []
    while engine.has_work():
        chunks.extend(o for o in engine.step() if isinstance(o, AudioChunk))
    # Frames 0-5 are segment 0 and 6-11 segment 1; a chunk is labelled by its last frame.
    assert [(c.frame_start, c.frame_end, c.segment_index) for c in chunks] == [
        (0, 4, 0), (4, 8, 1), (8, 12, 1)
    ]


def test_decode_example_inputs_with_a_real_context(engine: Engine) -> None:
    """The benchmarks' DECODE inputs: rows holding ``cached`` tokens in their own blocks, their
    block tables written into the (idle) engine's slot table."""
    stage = engine.runner.stages[Stage.DECODE]
    slots, kv = engine.runner.slots, engine.runner.kv

    def meta(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return decode_meta_on_device(slots.block_tables[inputs["row_ids"]], inputs["positions"],
                                     inputs["key_slots"], kv.block_size, kv.scratch_row)

    inputs = stage.example_inputs(3, 64, cached=40)
    real = meta(inputs)
    assert real["mask"].reshape(3, -1).sum(dim=1).tolist() == [41, 41, 41]
    assert real["positions"].tolist() == [40, 40, 40]
    assert len(set(real["write_rows"].tolist())) == 3  # each row its own blocks
    idle = meta(stage.example_inputs(2, 64))  # capture inputs: padding rows only
    assert idle["mask"].reshape(2, -1).sum(dim=1).tolist() == [1, 1]
    assert set(idle["write_rows"].tolist()) == {kv.scratch_row}
    with pytest.raises(ValueError, match="blocks"):
        stage.example_inputs(3, 64, cached=kv.num_blocks * 16)


def test_the_real_time_capacity_is_learned_from_the_steps_and_the_host_work_between() -> None:
    """One stream on a clock of 0.1 ms a reading: a step reads it three times (plan, start,
    end), so the engine is busy 0.3 ms a step, of which the step itself is 0.1 ms. The capacity
    starts at 1 s/s, the stream is kept far ahead, so it rises toward what one stream got: audio
    per busy second counting the host work between steps (~120 s/s here), not per step alone
    (which would read three times that)."""
    data = EngineConfig.from_file(CONFIG).model_dump()
    data["scheduler"].update(admission_capacity=1.0, admission_learn_window_s=0.003)
    engine = Engine(EngineConfig.from_dict(data), clock=TickClock())
    engine.add_request(make("learn", seed=1, frames=48))
    steps = frames = 0
    while engine.has_work():
        engine.step()
        steps += engine.last_step_ran
        if engine.last_step_ran and engine.last_plan is not None:
            frames += len(engine.last_plan.items) * (engine.last_plan.stage is Stage.DEPTH)
    capacity = engine.scheduler.capacity
    assert capacity is not None and capacity.num_samples >= 5
    got = frames * 0.08 / (steps * 3e-4)  # what one stream got per busy second
    assert 1.0 < capacity.value <= got * 1.05  # it rose, toward that and not past it
    assert capacity.value > 0.5 * got
