"""The slot table end to end (CPU, tiny model): a mix of requests (seeds, sampling, CFG,
repetition penalty, two segments, staggered arrivals that reuse slots, EOS, an abort mid-stream,
a failure) runs to its end, every frame in the ring is the one DEPTH sampled, and every freed
slot's rows are back to the defaults.

Owns: the mix and its trace (``drive``), which tests/gpu/test_gpu_slot_state.py replays under
CUDA graphs, and the table's release. Must not need a GPU.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from breezert.config import EngineConfig
from breezert.constants import FRAME_EOS_ID, Stage
from breezert.engine import Engine, RequestOutcome
from breezert.options import SamplingParams, SynthesisOptions
from breezert.outputs import AudioChunk
from breezert.request import RequestStatus, SynthesisRequest
from breezert.sched.plan import StepPlan
from breezert.worker.slot_table import SlotTable
from tests.integration.test_engine import CONFIG, assert_all_released, sequential

pytestmark = pytest.mark.integration

MAX_RUNNING = 3  # fewer slots than requests: later arrivals reuse freed slots
EOS_GAIN = 30.0
"""Scales the lm_head's EOS row: request ``eos`` then samples EOS after one frame."""


def engine_with() -> Engine:
    config = EngineConfig.from_file(CONFIG)
    scheduler = config.scheduler.model_copy(update={"max_running_requests": MAX_RUNNING})
    return deterministic_engine(config.model_copy(update={"scheduler": scheduler}))


def deterministic_engine(config: EngineConfig) -> Engine:
    """An engine on a clock of fixed ticks (two engines fed the same requests make the same
    plans) whose lm_head samples EOS now and then (``EOS_GAIN``)."""
    ticks = itertools.count()
    engine = Engine(config, clock=lambda: 0.002 * next(ticks))
    model = engine.checkpoint.model
    with torch.no_grad():  # random weights never pick EOS: make request "eos" end on its own
        (model.lm_head_fp32 if model.lm_head_fp32 is not None else model.lm_head.weight)[
            FRAME_EOS_ID] *= EOS_GAIN
    return engine


def _request(request_id: str, seed: int, frames: int, *, cfg: bool = False,
             sampling: SamplingParams | None = None, text: str | list[str] | None = None,
             ignore_eos: bool = True) -> SynthesisRequest:
    options = SynthesisOptions(seed=seed, sampling=sampling or SamplingParams(),
                               cfg_scale=2.0 if cfg else 1.0,
                               instructions="calm" if cfg else None)  # CFG needs a negative
    return SynthesisRequest(text=text or f"{request_id} speaks.", options=options,
                            max_frames=frames, ignore_eos=ignore_eos, request_id=request_id)


ARRIVALS: dict[int, list[SynthesisRequest]] = {
    0: [_request("plain", 11, 7), _request("cfg", 12, 9, cfg=True)],
    1: [_request("abort", 16, 40)],
    # a penalty below 1 favours repeats, so the repetition mask changes this request's codes
    2: [_request("greedy", 13, 6, sampling=SamplingParams.greedy(repetition_penalty=0.05))],
    3: [_request("fullsort", 14, 8, sampling=SamplingParams(top_k=0, top_p=0.8,
                                                            repetition_penalty=1.3))],
    5: [_request("twoseg", 15, 5, cfg=True, text=["seg one", "seg two"])],
    6: [_request("eos", 17, 12, ignore_eos=False)],
    9: [_request("late", 18, 4, sampling=SamplingParams(temperature=1.2, depth_top_p=0.7)),
        _request("fail", 19, 20)],
}
ABORT_AFTER_CHUNKS = 2
FAIL_AT_DEPTH = 3
"""The fault hook fails request ``fail`` at its fourth DEPTH step."""


@dataclass
class Trace:
    plans: list[tuple[Stage, tuple]] = field(default_factory=list)
    """Each step's stage and its items' fields (``_summary``)."""
    first_codes: list[dict[str, int]] = field(default_factory=list)
    frames: list[dict[str, list[int]]] = field(default_factory=list)
    """After each DEPTH step: each request's new frame (16 codes), EOS left out."""
    chunks: dict[str, list[AudioChunk]] = field(default_factory=dict)
    outcomes: dict[str, RequestOutcome] = field(default_factory=dict)


def _frame(engine: Engine, slot: int, frame_index: int) -> list[int]:
    """The frame DEPTH just wrote: the slot's last frame, and the ring's entry for it."""
    table = engine.runner.slots
    assert torch.equal(table.ring[slot, frame_index % table.ring_frames], table.last_frame[slot])
    return table.last_frame[slot].tolist()


def _summary(item: object) -> tuple:
    """An item's fields but the prompt (tensors do not compare as one bool); a DECODE or
    DEPTH batch's row as it is."""
    if isinstance(item, tuple):
        return (type(item).__name__, *item)
    return (type(item).__name__,
            *(getattr(item, f.name) for f in dataclasses.fields(item) if f.name != "prompt"))


def drive(engine: Engine) -> Trace:
    trace = Trace()
    execute = engine.runner.execute

    def recording(plan: StepPlan):  # noqa: ANN202 - the runner's StageOutput
        out = execute(plan)
        trace.plans.append((plan.stage, tuple(_summary(item) for item in plan.items)))
        trace.first_codes.append(dict(out.first_codes))
        if plan.stage is Stage.DEPTH:
            trace.frames.append({
                item.request_id: _frame(engine, item.slot, item.output_frame_index)
                for item in plan.items if item.request_id in out.first_codes
                and out.first_codes[item.request_id] != FRAME_EOS_ID})
        return out

    depth_steps = itertools.count()

    def fault(stage: Stage, request_id: str) -> None:
        if stage is Stage.DEPTH and request_id == "fail" and next(depth_steps) == FAIL_AT_DEPTH:
            raise RuntimeError("injected fault")

    engine.runner.execute = recording  # type: ignore[method-assign]
    engine.runner.fault_hook = fault
    try:
        for step in range(2000):
            for request in ARRIVALS.get(step, []):
                engine.add_request(request)
            if len(trace.chunks.get("abort", [])) == ABORT_AFTER_CHUNKS \
                    and "abort" not in trace.outcomes:
                engine.abort("abort")
            if step > max(ARRIVALS) and not engine.has_work():
                return trace
            for out in engine.step():
                if isinstance(out, RequestOutcome):
                    trace.outcomes[out.request_id] = out
                else:
                    trace.chunks.setdefault(out.request_id, []).append(out)
        raise AssertionError("the engine did not go idle")
    finally:
        del engine.runner.execute  # back to the class method
        engine.runner.fault_hook = None


@pytest.fixture(scope="module")
def traces() -> tuple[Engine, Trace]:
    """The mix, run once."""
    engine = engine_with()
    return engine, drive(engine)


def assert_same_trace(want: Trace, got: Trace, audio_atol: float = 0.0) -> None:
    """The same stages step for step, first codes, frames, outcomes and chunk ranges (KV blocks
    may differ); audio within ``audio_atol`` (0: bit for bit)."""
    assert [stage for stage, _ in got.plans] == [stage for stage, _ in want.plans]
    assert got.first_codes == want.first_codes
    assert got.frames == want.frames
    assert {rid: o.status for rid, o in got.outcomes.items()} == \
        {rid: o.status for rid, o in want.outcomes.items()}
    assert got.chunks.keys() == want.chunks.keys()
    for request_id, chunks in want.chunks.items():
        assert [(c.frame_start, c.frame_end) for c in got.chunks[request_id]] == \
            [(c.frame_start, c.frame_end) for c in chunks]
        np.testing.assert_allclose(np.concatenate([c.pcm for c in got.chunks[request_id]]),
                                   np.concatenate([c.pcm for c in chunks]),
                                   atol=audio_atol, rtol=0)


def test_a_second_run_on_the_reused_slots_repeats_the_first(
    traces: tuple[Engine, Trace],
) -> None:
    """Nothing of a freed slot leaks into the next request: the mix again, on the slots the
    first run left, gives the same codes, frames and audio bit for bit."""
    engine, first = traces
    assert_same_trace(first, drive(engine))


def test_the_ring_holds_the_frames_the_codec_turned_into_audio(
    traces: tuple[Engine, Trace],
) -> None:
    """Requests that ran to their end sound as the sequential reference, whose codes the
    ring's frames must then have been (slot reuse, CFG next to plain rows, two segments)."""
    engine, trace = traces
    for wave in ARRIVALS.values():
        for request in wave:
            if request.request_id in ("abort", "fail", "eos"):
                continue
            want = np.concatenate([c.pcm for c in sequential(engine, request)])
            got = np.concatenate([c.pcm for c in trace.chunks[request.request_id]])
            np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_the_mix_reuses_slots_aborts_and_ends_every_request(
    traces: tuple[Engine, Trace],
) -> None:
    assert_mix_ran(traces[1])


def assert_mix_ran(trace: Trace, slots_reused: bool = True) -> None:
    """What the mix must have exercised and how each request ended (``slots_reused``: fewer
    slots than requests, so later arrivals must take freed slots)."""
    assert trace.outcomes["abort"].status is RequestStatus.ABORTED
    assert len(trace.chunks["abort"]) == ABORT_AFTER_CHUNKS
    assert trace.outcomes["fail"].status is RequestStatus.FAILED
    eos = [(items, codes) for (stage, items), codes in zip(trace.plans, trace.first_codes)
           if FRAME_EOS_ID in codes.values()]
    assert len(eos) == 1 and len(eos[0][0]) > 1, "EOS did not end a request in a batch"
    assert len(trace.chunks["eos"]) == 1 and trace.chunks["eos"][0].frame_end == 1
    finished = [rid for rid, o in trace.outcomes.items() if o.status is RequestStatus.FINISHED]
    assert sorted(finished) == sorted(r.request_id for wave in ARRIVALS.values() for r in wave
                                      if r.request_id not in ("abort", "fail"))
    slots: dict[int, set[str]] = {}
    for _, items in trace.plans:
        for _, request_id, slot, *_ in items:
            slots.setdefault(slot, set()).add(request_id)
    if slots_reused:
        assert max(len(ids) for ids in slots.values()) >= 2, "no slot was reused"
    depth = [items for stage, items in trace.plans if stage is Stage.DEPTH]
    assert any({num_branches for *_, num_branches, _ in items} == {1, 2} for items in depth), \
        "no DEPTH step mixed CFG and plain requests"
    assert {c.segment_index for c in trace.chunks["twoseg"]} == {0, 1}


def test_every_freed_slot_is_reset_and_everything_released(
    traces: tuple[Engine, Trace],
) -> None:
    assert_slots_reset(traces[0])


def assert_slots_reset(engine: Engine) -> None:
    """The engine is idle with everything released, every slot's rows at the defaults."""
    assert_all_released(engine)
    table = engine.runner.slots
    slots = table.scratch_slot
    fresh = SlotTable(slots, vocab_size=table.seen.shape[1],
                      hidden_size=table.hidden.shape[-1], hidden_dtype=table.hidden.dtype,
                      ring_frames=table.ring_frames, device=table.device)
    for name in ("sampling", "seeds", "frame_count", "cfg_scale", "has_cfg", "penalty", "no_eos",
                 "seen", "hidden", "last_frame", "ring"):
        got, want = getattr(table, name)[:slots], getattr(fresh, name)[:slots]
        assert torch.equal(got, want), f"{name} of a freed slot was not reset"
    assert not table.next_codec_frame.any()


def test_abort_mid_stream_resets_the_slot_at_once() -> None:
    engine = engine_with()
    engine.add_request(_request("solo", 21, 30))
    while not any(isinstance(o, AudioChunk) for o in engine.step()):
        pass
    table = engine.runner.slots
    assert table.seeds[0].item() == 21 and table.frame_count[0] > 0
    engine.abort("solo")
    assert engine.step() == [RequestOutcome("solo", RequestStatus.ABORTED)]
    assert table.seeds[0].item() == 0 and table.frame_count[0].item() == 0
    assert not table.ring[0].any() and not table.seen[0].any()
    assert_all_released(engine)
