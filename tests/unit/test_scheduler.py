"""Scheduler tests on a virtual clock, driven by a fake worker that fabricates StepResults."""

from __future__ import annotations

import itertools
import subprocess
import sys
from dataclasses import dataclass, field

import numpy as np
import pytest

from breezert.config import SchedulerConfig
from breezert.constants import FRAME_EOS_ID, Stage
from breezert.errors import EngineOverloaded, InvalidRequest
from breezert.options import SynthesisOptions
from breezert.request import Request, RequestStatus, Segment
from breezert.sched.block_pool import BlockPool
from breezert.sched.plan import (
    CodecRow,
    DepthRow,
    PrefillItem,
    StepPlan,
    StepResult,
    TextEncodeItem,
)
from breezert.sched.policy import ScheduleChunkPolicy
from breezert.sched.streams import StreamTable
from breezert.sched.scheduler import (
    ChunkEmitted,
    RequestFinished,
    Scheduler,
    SchedulerEvent,
    SegmentEnded,
)

pytestmark = pytest.mark.unit

FOREVER = 10**9  # frames before EOS: effectively never


# ----------------------------------------------------------------------------- helpers


def make_config(**overrides: object) -> SchedulerConfig:
    values: dict[str, object] = dict(
        max_running_requests=32, max_queued_requests=32, max_model_len=1024,
        default_max_frames=500, starvation_limit_s=10.0,
    )
    values.update(overrides)
    return SchedulerConfig(**values)  # type: ignore[arg-type]


def make_request(request_id: str, prompt_lens: tuple[int, ...] = (12,), num_segments: int = 1,
                 *, cfg_scale: float = 1.0, **kwargs: object) -> Request:
    segments = [Segment(prompt_lens, prompt=f"{request_id}/{i}") for i in range(num_segments)]
    return Request(request_id, segments=segments, num_branches=len(prompt_lens),
                   options=SynthesisOptions(cfg_scale=cfg_scale), **kwargs)  # type: ignore[arg-type]


@dataclass
class FakeWorker:
    """DEPTH returns code 7, or EOS once a segment has ``eos_after[(request_id, segment)]``
    frames (default ``eos_after_default``). ``fail_at[request_id] = (stage, n)`` fails the
    request on its n-th item of that stage."""

    eos_after: dict[tuple[str, int], int] = field(default_factory=dict)
    eos_after_default: int = 5
    fail_at: dict[str, tuple[Stage, int]] = field(default_factory=dict)
    seen: dict[tuple[str, Stage], int] = field(default_factory=dict)

    def run(self, plan: StepPlan) -> StepResult:
        codes: dict[str, int] = {}
        failed: dict[str, str] = {}
        for item in plan.items:
            key = (item.request_id, plan.stage)
            self.seen[key] = self.seen.get(key, 0) + 1
            if self.fail_at.get(item.request_id) == (plan.stage, self.seen[key]):
                failed[item.request_id] = "injected failure"
            if plan.stage is Stage.DEPTH:
                limit = self.eos_after.get((item.request_id, item.segment_index),
                                           self.eos_after_default)
                codes[item.request_id] = FRAME_EOS_ID if item.frame_index >= limit else 7
        return StepResult(plan.step_id, codes, failed)


class Harness:
    """Scheduler + fake worker + virtual clock (``dt`` seconds per step)."""

    def __init__(self, config: SchedulerConfig | None = None, num_blocks: int = 512,
                 block_size: int = 16, dt: float = 0.01) -> None:
        self.config = config or make_config()
        self.pool = BlockPool(num_blocks, block_size)
        self.sched = Scheduler(self.config, self.pool)
        self.worker = FakeWorker()
        self.now = 0.0
        self.dt = dt
        self.plans: list[StepPlan] = []
        self.events: list[SchedulerEvent] = []

    def add(self, request: Request, eos_after: int | None = None) -> Request:
        if eos_after is not None:
            for i in range(len(request.segments) + 8):
                self.worker.eos_after[(request.request_id, i)] = eos_after
        self.sched.add_request(request, self.now)
        return request

    def step(self) -> StepPlan | None:
        plan = self.sched.schedule(self.now)
        if plan is None:
            return None
        self.events += self.sched.commit(plan, self.worker.run(plan), self.now)
        self.plans.append(plan)
        self.now += self.dt
        return plan

    def run(self, max_steps: int = 5000) -> None:
        for _ in range(max_steps):
            if self.step() is None:
                return
        raise AssertionError("scheduler did not go idle")

    def chunks(self, request_id: str) -> list[ChunkEmitted]:
        return [e for e in self.events
                if isinstance(e, ChunkEmitted) and e.request_id == request_id]

    def finished(self, request_id: str) -> RequestFinished:
        (event,) = [e for e in self.events
                    if isinstance(e, RequestFinished) and e.request_id == request_id]
        return event

    def items_of(self, request_id: str, stage: Stage | None = None) -> list[object]:
        return [item for plan in self.plans for item in plan.items
                if item.request_id == request_id and (stage is None or plan.stage is stage)]

    def assert_all_free(self) -> None:
        stats = self.sched.stats()
        assert self.pool.num_free == self.pool.num_blocks
        assert stats.num_free_slots == self.config.max_running_requests
        assert stats.num_running == stats.num_waiting == 0


# ----------------------------------------------------------------------------- stage choice


def test_single_request_runs_stages_in_order() -> None:
    h = Harness()
    h.add(make_request("a"), eos_after=3)
    h.run()
    stages = [plan.stage.value for plan in h.plans]
    assert stages == ["text_encode", "prefill", "depth", "codec", "decode", "depth", "decode",
                      "depth", "codec", "decode", "depth"]
    assert [c.num_frames for c in h.chunks("a")] == [1, 2]
    assert h.finished("a").status is RequestStatus.FINISHED
    request_plan = h.plans[0]
    assert [d.request_id for d in request_plan.new_requests] == ["a"]
    assert h.plans[-1].finished_request_ids == ()  # released with the next plan
    h.assert_all_free()


def test_items_carry_positions_and_block_tables() -> None:
    h = Harness(block_size=4)
    h.add(make_request("a", prompt_lens=(10, 6), cfg_scale=2.0), eos_after=3)
    h.run()
    te = h.items_of("a", Stage.TEXT_ENCODE)
    assert te == [TextEncodeItem("a", 0, 0, 16, "a/0")]
    prefill = h.items_of("a", Stage.PREFILL)
    assert [(p.branch, p.start_pos, p.num_tokens, p.is_last_chunk) for p in prefill] == [
        (0, 0, 10, True), (1, 0, 6, True)]
    # ceil((10 + 500) / 4) and ceil((6 + 500) / 4) blocks, allocated once for the segment.
    assert [len(p.block_ids) for p in prefill] == [128, 127]
    decodes = h.items_of("a", Stage.DECODE)
    assert [[position for position, _ in d.branches] for d in decodes] == [
        [10, 6], [11, 7], [12, 8]]
    assert decodes[0].branches[0][1] is prefill[0].block_ids
    depth = h.items_of("a", Stage.DEPTH)
    assert [(d.frame_index, d.output_frame_index, d.num_branches) for d in depth] == [
        (0, 0, 2), (1, 1, 2), (2, 2, 2), (3, 3, 2)]
    assert sum(plan.num_rows for plan in h.plans if plan.stage is Stage.DECODE) == 6


def test_startup_work_runs_before_active_streams() -> None:
    h = Harness()
    h.add(make_request("old"), eos_after=FOREVER)
    for _ in range(12):
        h.step()
    assert h.chunks("old")
    h.add(make_request("new"), eos_after=FOREVER)
    newcomer = [h.step() for _ in range(4)]
    assert [p.stage for p in newcomer] == [Stage.TEXT_ENCODE, Stage.PREFILL, Stage.DEPTH,
                                           Stage.CODEC]
    assert all(p is not None and {i.request_id for i in p.items} >= {"new"} for p in newcomer)
    assert len(h.chunks("new")) == 1


def test_higher_priority_starts_first() -> None:
    h = Harness(make_config(max_text_encode_requests=1))
    h.add(make_request("low", priority=0), eos_after=1)
    h.add(make_request("high", priority=5), eos_after=1)
    h.step()
    assert h.plans[0].items[0].request_id == "high"


def test_lookahead_prefill_is_not_starved_by_decode() -> None:
    h = Harness()
    h.add(make_request("a", num_segments=2), eos_after=40)
    h.run()
    seg1_prefill = min(i for i, p in enumerate(h.plans)
                       if any(isinstance(x, PrefillItem) and x.segment_index == 1
                              for x in p.items))
    seg0_end = min(i for i, p in enumerate(h.plans)
                   if p.stage is Stage.DEPTH and any(
                       x.segment_index == 0 and x.frame_index == 40 for x in p.items))
    assert seg1_prefill < 15 < seg0_end


# ----------------------------------------------------------------------------- batch limits


def test_text_encode_limits_requests_and_tokens() -> None:
    h = Harness(make_config(max_text_encode_requests=2, max_text_encode_tokens=25))
    for i in range(3):
        h.add(make_request(f"r{i}", prompt_lens=(12,)), eos_after=1)
    h.add(make_request("big", prompt_lens=(40,)), eos_after=1)
    te_batches = []
    while (plan := h.step()) is not None:
        if plan.stage is Stage.TEXT_ENCODE:
            te_batches.append([item.request_id for item in plan.items])
    # 12 + 12 fit 25 tokens; the 40-token segment runs alone although it exceeds the budget.
    assert te_batches == [["r0", "r1"], ["r2"], ["big"]]


def test_prefill_is_chunked_over_several_steps() -> None:
    h = Harness(make_config(max_prefill_tokens=16))
    h.add(make_request("a", prompt_lens=(40,)), eos_after=2)
    h.run()
    prefill = h.items_of("a", Stage.PREFILL)
    assert [(p.start_pos, p.num_tokens, p.is_last_chunk) for p in prefill] == [
        (0, 16, False), (16, 16, False), (32, 8, True)]
    assert [p.stage for p in h.plans[:5]] == [Stage.TEXT_ENCODE] + [Stage.PREFILL] * 3 + [
        Stage.DEPTH]


def test_prefill_budget_is_shared_and_cfg_branches_split() -> None:
    h = Harness(make_config(max_prefill_tokens=20, max_prefill_requests=2))
    h.add(make_request("cfg", prompt_lens=(12, 9), cfg_scale=3.0), eos_after=1)
    h.add(make_request("b", prompt_lens=(5,)), eos_after=1)
    h.add(make_request("c", prompt_lens=(5,)), eos_after=1)
    h.step()  # TEXT_ENCODE of all three
    plan = h.step()
    assert plan is not None and plan.stage is Stage.PREFILL
    assert [(p.request_id, p.branch, p.start_pos, p.num_tokens) for p in plan.items] == [
        ("cfg", 0, 0, 12), ("cfg", 1, 0, 8), ]
    plan = h.step()
    assert plan is not None
    assert [(p.request_id, p.branch, p.start_pos, p.num_tokens) for p in plan.items] == [
        ("cfg", 1, 8, 1), ("b", 0, 0, 5)]


def test_decode_and_depth_rows_count_cfg_branches() -> None:
    cfg = make_config(max_decode_rows=5, max_depth_rows=5, max_depth_requests=8)
    h = Harness(cfg)
    h.add(make_request("c1", prompt_lens=(8, 4), cfg_scale=2.0), eos_after=FOREVER)
    h.add(make_request("c2", prompt_lens=(8, 4), cfg_scale=2.0), eos_after=FOREVER)
    h.add(make_request("c3", prompt_lens=(8, 4), cfg_scale=2.0), eos_after=FOREVER)
    h.add(make_request("s1", prompt_lens=(8,)), eos_after=FOREVER)
    for _ in range(60):
        h.step()
    for plan in h.plans:
        if plan.stage in (Stage.DECODE, Stage.DEPTH):
            assert plan.num_rows <= 5
    # Two CFG requests (4 rows) leave room for the 1-row request behind a third CFG one.
    batches = [([i.request_id for i in p.items], p.num_rows)
               for p in h.plans if p.stage is Stage.DEPTH]
    assert (["c1", "c2", "s1"], 5) in batches and (["c3"], 2) in batches


def test_decode_and_codec_request_limits() -> None:
    h = Harness(make_config(max_decode_requests=3, max_codec_requests=2))
    for i in range(5):
        h.add(make_request(f"r{i}"), eos_after=FOREVER)
    for _ in range(80):
        h.step()
    assert max(len(p.items) for p in h.plans if p.stage is Stage.DECODE) == 3
    assert max(len(p.items) for p in h.plans if p.stage is Stage.CODEC) == 2


def test_codec_step_frame_budget_bounds_each_step() -> None:
    h = Harness(make_config(max_codec_step_frames=20))
    for i in range(4):
        h.add(make_request(f"r{i}", chunk_schedule=(16,)), eos_after=FOREVER)
    for _ in range(200):
        h.step()
    sizes = [sum(item.num_frames for item in p.items) for p in h.plans if p.stage is Stage.CODEC]
    assert sizes and max(sizes) <= 20  # one 16-frame chunk per step, never two
    assert all(len(h.chunks(f"r{i}")) >= 2 for i in range(4))  # every stream still advances
    # The first item always fits, whatever the budget.
    h = Harness(make_config(max_codec_step_frames=8))
    h.add(make_request("big", chunk_schedule=(16,)), eos_after=FOREVER)
    for _ in range(150):
        h.step()
    assert [c.num_frames for c in h.chunks("big")][:2] == [16, 16]


def _first_chunk_codec_steps(startup_cap: int) -> list[StepPlan]:
    """CODEC steps led by a newcomer's 1-frame first chunk while 6 streams make 16-frame chunks
    (a newcomer every 3 steps, so some first chunks meet ready long chunks)."""
    h = Harness(make_config(max_startup_codec_step_frames=startup_cap))
    for i in range(6):
        h.add(make_request(f"s{i}", chunk_schedule=(16,)), eos_after=FOREVER)
    for step in range(400):
        if 100 <= step < 300 and step % 3 == 0:
            h.add(make_request(f"n{step}"), eos_after=20)
        h.step()
    return [p for p in h.plans if p.stage is Stage.CODEC and next(iter(p.items)).is_first_chunk
            and next(iter(p.items)).request_id.startswith("n")]


def test_a_first_chunk_leads_a_short_codec_step() -> None:
    uncapped = _first_chunk_codec_steps(startup_cap=256)
    assert max(sum(i.num_frames for i in p.items) for p in uncapped) > 16  # the case exists
    capped = _first_chunk_codec_steps(startup_cap=16)
    assert len(capped) == len(uncapped) > 10
    assert max(sum(i.num_frames for i in p.items) for p in capped) <= 16


# ----------------------------------------------------------------------------- chunks


def test_chunks_follow_the_schedule_and_flush_at_the_end() -> None:
    h = Harness()
    h.add(make_request("a"), eos_after=50)
    h.add(make_request("b", chunk_schedule=(3, 5)), eos_after=14)
    h.run()
    a = h.chunks("a")
    assert [c.num_frames for c in a] == [1, 2, 4, 8, 16, 16, 3]
    assert [c.start_frame for c in a] == [0, 1, 3, 7, 15, 31, 47]
    assert [c.is_final for c in a] == [False] * 6 + [True]
    assert [c.num_frames for c in h.chunks("b")] == [3, 5, 5, 1]
    codec = h.items_of("a", Stage.CODEC)
    assert [c.is_first_chunk for c in codec] == [True] + [False] * 6
    request_a = h.finished("a")
    assert request_a.status is RequestStatus.FINISHED
    h.assert_all_free()


def expected_chunks(schedule: tuple[int, ...], num_frames: int) -> list[int]:
    sizes: list[int] = []
    while sum(sizes) < num_frames:
        target = schedule[min(len(sizes), len(schedule) - 1)]
        sizes.append(min(target, num_frames - sum(sizes)))
    return sizes


def test_staggered_requests_all_complete_on_their_own_schedules() -> None:
    h = Harness(make_config(max_running_requests=16, max_decode_requests=16))
    schedules = [(1, 2, 4, 8, 16), (2, 4), (3,), (1, 1, 8)]
    lengths = {}
    for i in range(16):
        lengths[f"r{i}"] = 10 + 7 * i
        h.add(make_request(f"r{i}", prompt_lens=(8 + i, 5 + i) if i % 3 == 0 else (8 + i,),
                           cfg_scale=2.0 if i % 3 == 0 else 1.0,
                           chunk_schedule=schedules[i % 4]), eos_after=lengths[f"r{i}"])
        for _ in range(3):
            h.step()
    h.run()
    for i in range(16):
        chunks = h.chunks(f"r{i}")
        assert [c.num_frames for c in chunks] == expected_chunks(schedules[i % 4],
                                                                 lengths[f"r{i}"])
        assert [c.start_frame for c in chunks] == [sum(c.num_frames for c in chunks[:k])
                                                   for k in range(len(chunks))]
        assert h.finished(f"r{i}").status is RequestStatus.FINISHED
    h.assert_all_free()


def test_max_frames_ends_a_segment() -> None:
    h = Harness()
    request = h.add(make_request("a", max_frames=6, ignore_eos=True), eos_after=FOREVER)
    h.run()
    (ended,) = [e for e in h.events if isinstance(e, SegmentEnded)]
    assert (ended.num_frames, ended.reason) == (6, "max_frames")
    assert sum(c.num_frames for c in h.chunks("a")) == 6
    assert [c.num_frames for c in h.chunks("a")] == [1, 2, 3]
    assert request.finish_time is not None and len(request.chunk_emit_times) == 3


def test_eos_on_first_frame_finishes_without_audio() -> None:
    h = Harness()
    h.add(make_request("a"), eos_after=0)
    h.run()
    assert h.chunks("a") == []
    assert h.finished("a").status is RequestStatus.FINISHED
    h.assert_all_free()


def test_chunk_policy_hook_overrides_the_schedule() -> None:
    class OneFrame(ScheduleChunkPolicy):
        def chunk_frames(self, table: StreamTable, rows: np.ndarray, now: float) -> np.ndarray:
            return np.ones(len(rows), np.int64)

    h = Harness()
    h.sched.chunk_policy = OneFrame()
    h.add(make_request("a"), eos_after=6)
    h.run()
    assert [c.num_frames for c in h.chunks("a")] == [1] * 6


# ----------------------------------------------------------------------------- segments


def test_next_segment_prepares_ahead_and_follows_without_gap() -> None:
    h = Harness()
    request = h.add(make_request("a", num_segments=3), eos_after=20)
    seg2 = request.segments[2]
    while request.segments[0].num_frames < 3:
        h.step()
    # Lookahead is one segment: segment 1 holds blocks, segment 2 does not yet.
    assert request.segments[1].block_ids and not seg2.block_ids
    h.run()
    for seg_index in (0, 1):
        end_step = next(i for i, p in enumerate(h.plans) if p.stage is Stage.DEPTH
                        for x in p.items if x.segment_index == seg_index and x.frame_index == 20)
        prepared = [i for i, p in enumerate(h.plans) for x in p.items
                    if isinstance(x, (TextEncodeItem, PrefillItem))
                    and x.segment_index == seg_index + 1]
        assert max(prepared) < end_step  # text encode + prefill ran while generating
        after = h.plans[end_step + 1]
        assert after.stage is Stage.DEPTH
        assert list(after.items) == [DepthRow("a", 0, seg_index + 1, 0, 1, 20 * (seg_index + 1))]
    chunks = h.chunks("a")
    assert [c.num_frames for c in chunks] == [1, 2, 4, 8, 16, 16, 13]  # no flush at boundaries
    assert sum(c.num_frames for c in chunks) == 60
    h.assert_all_free()


def test_open_input_flushes_at_a_gap_then_continues() -> None:
    h = Harness()
    request = h.add(make_request("a", input_closed=False), eos_after=5)
    h.run()
    assert [c.num_frames for c in h.chunks("a")] == [1, 2, 2]  # flush: no next segment yet
    assert not h.chunks("a")[-1].is_final
    assert request.status is RequestStatus.RUNNING and h.pool.num_free == h.pool.num_blocks
    h.sched.append_segment("a", Segment((7,), prompt="a/1"), h.now)
    h.run()
    assert [c.num_frames for c in h.chunks("a")] == [1, 2, 2, 5]
    assert h.chunks("a")[-1].start_frame == 5
    assert h.sched.close_input("a", h.now) == [RequestFinished(
        "a", RequestStatus.FINISHED, None, h.now, request.enqueue_time, request.last_chunk_time,
        num_emitted_frames=10)]
    assert h.sched.schedule(h.now) is None
    assert h.sched.schedule(h.now) is None
    h.assert_all_free()


def test_close_input_before_last_segment_ends_gives_final_flush() -> None:
    h = Harness()
    h.add(make_request("a", input_closed=False), eos_after=5)
    h.step()
    h.sched.close_input("a", h.now)
    h.run()
    assert h.chunks("a")[-1].is_final
    assert h.finished("a").status is RequestStatus.FINISHED


def test_open_request_without_text_waits_and_blocks_nobody() -> None:
    h = Harness(make_config(max_running_requests=1))
    empty = Request("empty", input_closed=False)
    h.add(empty)
    h.add(make_request("b"), eos_after=1)
    assert h.sched.num_running == 1 and empty.status is RequestStatus.WAITING
    h.run()
    assert h.sched.close_input("empty", h.now)[0].status is RequestStatus.FINISHED
    h.assert_all_free()


# ----------------------------------------------------------------------------- abort / failure


def test_abort_mid_stream_frees_blocks_and_slot() -> None:
    h = Harness()
    h.add(make_request("a", num_segments=2, prompt_lens=(10, 8), cfg_scale=2.0), eos_after=30)
    h.add(make_request("b"), eos_after=30)
    for _ in range(25):
        h.step()
    assert h.chunks("a")
    (event,) = h.sched.abort("a", h.now)
    assert event.status is RequestStatus.ABORTED
    assert h.sched.abort("a", h.now) == []  # idempotent
    plan = h.step()
    assert plan is not None and plan.finished_request_ids == ("a",)
    h.run()
    assert h.finished("b").status is RequestStatus.FINISHED
    h.assert_all_free()


def test_abort_waiting_request() -> None:
    h = Harness(make_config(max_running_requests=1))
    h.add(make_request("a"), eos_after=2)
    waiting = h.add(make_request("b"), eos_after=2)
    assert h.sched.num_waiting == 1
    h.sched.abort("b", h.now)
    assert waiting.status is RequestStatus.ABORTED and h.sched.num_waiting == 0
    h.run()
    h.assert_all_free()


def test_abort_before_first_plan_never_reaches_worker() -> None:
    h = Harness()
    h.add(make_request("a"))
    h.sched.abort("a", h.now)
    h.add(make_request("b"), eos_after=1)
    plan = h.step()
    assert plan is not None
    assert [d.request_id for d in plan.new_requests] == ["b"]
    assert plan.finished_request_ids == ()


def test_failure_in_step_result_fails_only_that_request() -> None:
    h = Harness()
    h.add(make_request("a", num_segments=2), eos_after=20)
    h.add(make_request("b"), eos_after=20)
    h.worker.fail_at["a"] = (Stage.DEPTH, 6)
    h.run()
    failed = h.finished("a")
    assert failed.status is RequestStatus.FAILED and failed.error == "injected failure"
    assert h.finished("b").status is RequestStatus.FINISHED
    assert sum(c.num_frames for c in h.chunks("b")) == 20
    assert any("a" in p.finished_request_ids for p in h.plans)
    assert h.sched.stats().num_finished == {"finished": 1, "aborted": 0, "failed": 1}
    h.assert_all_free()


def test_invalid_first_code_fails_the_request() -> None:
    h = Harness()
    h.add(make_request("a"))
    for _ in range(2):
        h.step()
    plan = h.sched.schedule(h.now)
    assert plan is not None and plan.stage is Stage.DEPTH
    events = h.sched.commit(plan, StepResult(plan.step_id, {"a": 2050}), h.now)
    assert isinstance(events[0], RequestFinished) and events[0].status is RequestStatus.FAILED
    h.assert_all_free()


# ----------------------------------------------------------------------------- admission


def test_admission_control_rejects_the_overflow() -> None:
    h = Harness(make_config(max_running_requests=2, max_queued_requests=3))
    for i in range(5):
        h.add(make_request(f"r{i}"), eos_after=2)
    assert (h.sched.num_running, h.sched.num_waiting) == (2, 3)
    with pytest.raises(EngineOverloaded):
        h.add(make_request("r5"))
    assert h.sched.num_waiting == 3 and h.sched.get_request("r5") is None
    h.run()
    assert all(h.finished(f"r{i}").status is RequestStatus.FINISHED for i in range(5))
    h.assert_all_free()


def test_zero_queue_still_admits_when_a_slot_is_free() -> None:
    h = Harness(make_config(max_running_requests=1, max_queued_requests=0))
    h.add(make_request("a"))
    with pytest.raises(EngineOverloaded):
        h.add(make_request("b"))


def test_a_request_queued_past_max_queue_wait_is_refused_and_freed() -> None:
    h = Harness(make_config(max_running_requests=1, max_queue_wait_s=2.0))
    h.add(make_request("holder", input_closed=False))
    h.add(make_request("late"))
    assert h.sched.expire_waiting(h.now + 1.9) == []  # wait unknown: it waits, up to the limit
    (event,) = h.sched.expire_waiting(h.now + 2.5)
    assert isinstance(event, RequestFinished) and event.request_id == "late"
    assert event.status is RequestStatus.FAILED and event.overloaded
    assert event.retry_after_s is None  # the holder's end is unknown (its input is open)
    assert "max_queue_wait_s=2" in (event.error or "")
    assert h.sched.get_request("late") is None and h.sched.num_waiting == 0
    h.sched.abort("holder", h.now)
    h.assert_all_free()


def test_a_request_refused_after_its_wait_carries_the_wait_still_predicted() -> None:
    """The holder's frames left predict when its slot frees: a request that queued within
    ``max_queue_wait_s`` and then waited past it is refused with that wait as it stands."""
    h = Harness(make_config(max_running_requests=1, max_queue_wait_s=2.0))
    holder = h.add(make_request("holder", max_frames=40, ignore_eos=True), eos_after=FOREVER)
    while holder.num_frames < 36:
        assert h.step() is not None
    late = h.add(make_request("late"))
    assert late.status is RequestStatus.WAITING
    at = h.now + 2.5
    predicted = h.sched.predicted_queue_wait(0, at)
    assert predicted is not None and predicted > 0
    (event,) = h.sched.expire_waiting(at)
    assert event.request_id == "late" and event.overloaded
    assert event.retry_after_s == pytest.approx(predicted)
    assert "waited 2.5 s for a slot" in (event.error or "")
    h.sched.abort("holder", h.now)
    h.assert_all_free()


def test_abort_during_a_step_in_flight_frees_the_slot_at_its_commit() -> None:
    """The worker may still write the aborted request's slot state and KV blocks while the
    plan runs: a newcomer must not get them before the plan is committed."""
    h = Harness(make_config(max_running_requests=1))
    h.add(make_request("a"), eos_after=FOREVER)
    while (plan := h.step()) is not None and not h.items_of("a", Stage.CODEC):
        pass
    plan = h.sched.schedule(h.now)
    assert plan is not None and "a" in plan.request_ids
    free_blocks = h.pool.num_free
    h.sched.abort("a", h.now)
    assert h.sched.stats().num_free_slots == 0 and h.pool.num_free == free_blocks
    newcomer = h.add(make_request("b"))
    assert newcomer.status is RequestStatus.WAITING  # the slot is still the plan's
    h.sched.commit(plan, h.worker.run(plan), h.now)
    assert h.sched.stats().num_free_slots == 1
    assert h.sched.schedule(h.now) is not None and newcomer.status is RequestStatus.RUNNING
    h.sched.abort("b", h.now)
    h.sched.take_released()


def test_admission_waits_for_blocks() -> None:
    # ceil((12 + 500) / 16) = 32 blocks per request; the pool holds 40.
    h = Harness(num_blocks=40)
    first = h.add(make_request("a"), eos_after=3)
    second = h.add(make_request("b"), eos_after=3)
    assert first.status is RequestStatus.RUNNING and second.status is RequestStatus.WAITING
    h.run()
    assert second.first_scheduled_time is not None
    assert second.first_scheduled_time > h.finished("a").time - 1e-9
    h.assert_all_free()


def test_a_running_request_gets_freed_blocks_for_its_next_segment_before_a_waiting_one() -> None:
    # 32 blocks a segment, 40 in the pool: "a"'s second segment waits for its first one's
    # blocks, and runs before "b" (waiting since it came) gets any.
    h = Harness(num_blocks=40)
    first = h.add(make_request("a", num_segments=2), eos_after=3)
    assert h.sched._short_of_blocks == {"a"}  # running, a segment without blocks
    second = h.add(make_request("b"), eos_after=3)
    assert second.status is RequestStatus.WAITING
    h.run()
    assert all(seg.num_frames == 3 for seg in first.segments)
    steps = [{(item.request_id, getattr(item, "segment_index", None)) for item in plan.items}
             for plan in h.plans]
    a_second = next(i for i, ids in enumerate(steps) if ("a", 1) in ids)
    b_first = next(i for i, ids in enumerate(steps) if ("b", 0) in ids)
    assert a_second < b_first
    assert h.sched._short_of_blocks == set()
    h.assert_all_free()


def test_segment_that_can_never_fit_is_rejected() -> None:
    h = Harness(make_config(max_model_len=64, default_max_frames=20), num_blocks=7)
    with pytest.raises(InvalidRequest, match="max_model_len"):
        h.add(make_request("long", prompt_lens=(63,)))
    with pytest.raises(InvalidRequest, match="KV blocks"):
        h.add(make_request("wide", prompt_lens=(60, 60), cfg_scale=2.0))
    h.add(make_request("ok", input_closed=False))
    with pytest.raises(InvalidRequest, match="CFG branch"):
        h.sched.append_segment("ok", Segment((4, 4)), h.now)
    h.sched.close_input("ok", h.now)
    with pytest.raises(InvalidRequest, match="closed"):
        h.sched.append_segment("ok", Segment((4,)), h.now)
    with pytest.raises(InvalidRequest, match="already known"):
        h.add(make_request("ok"))


def test_plan_protocol_is_enforced() -> None:
    h = Harness()
    h.add(make_request("a"))
    plan = h.sched.schedule(h.now)
    assert plan is not None
    with pytest.raises(RuntimeError):
        h.sched.schedule(h.now)
    with pytest.raises(ValueError):
        h.sched.commit(plan, StepResult(plan.step_id + 1), h.now)
    h.sched.commit(plan, StepResult(plan.step_id), h.now)


# ----------------------------------------------------------------------------- fairness


def test_active_stream_progresses_while_new_requests_keep_arriving() -> None:
    limit = 0.1
    h = Harness(make_config(max_running_requests=64, max_queued_requests=1000,
                            starvation_limit_s=limit), num_blocks=20000, dt=0.01)
    h.add(make_request("stream"), eos_after=FOREVER)
    while not h.chunks("stream"):
        h.step()
    for i in range(300):
        h.add(make_request(f"n{i}"), eos_after=2)
        h.step()
    assert h.sched.stats().num_finished["finished"] > 50  # newcomers kept finishing too
    served = [i for i, p in enumerate(h.plans) if "stream" in p.request_ids]
    gaps = [b - a for a, b in itertools.pairwise(served)]
    assert max(gaps) * h.dt <= limit + 2 * h.dt
    assert len(h.chunks("stream")) >= 5


def test_newcomer_gets_first_chunk_before_any_stream_gets_two_more() -> None:
    h = Harness(make_config(starvation_limit_s=1.0), num_blocks=4096)
    for i in range(15):
        h.add(make_request(f"s{i}"), eos_after=FOREVER)
    while min(len(h.chunks(f"s{i}")) for i in range(15)) < 3:
        h.step()
    before = {f"s{i}": len(h.chunks(f"s{i}")) for i in range(15)}
    h.add(make_request("new", prompt_lens=(30,)), eos_after=FOREVER)
    while not h.chunks("new"):
        h.step()
    gained = {rid: len(h.chunks(rid)) - n for rid, n in before.items()}
    assert max(gained.values()) < 2
    codec_items = [x for x in h.items_of("new") if isinstance(x, CodecRow)]
    assert codec_items[0].num_frames == 1


def test_codec_and_decode_items_do_not_skip_requests_forever() -> None:
    h = Harness(make_config(max_codec_requests=1, max_decode_requests=2, max_depth_requests=2))
    for i in range(4):
        h.add(make_request(f"r{i}"), eos_after=12)
    h.run()
    for i in range(4):
        assert h.finished(f"r{i}").status is RequestStatus.FINISHED
        assert sum(c.num_frames for c in h.chunks(f"r{i}")) == 12
    assert all(len(p.items) <= 2 for p in h.plans if p.stage is Stage.DECODE)


def test_scheduler_modules_do_not_import_torch() -> None:
    code = (
        "import sys\n"
        "import breezert.sched.scheduler, breezert.config, breezert.request\n"
        "import breezert.sched.plan, breezert.sched.block_pool, breezert.errors\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
