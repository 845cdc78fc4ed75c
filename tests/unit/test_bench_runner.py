"""The benchmark runner against a fake engine: load shapes, listener feedback, timeouts, errors,
and variant definitions.

Owns: the runner's contract with ``AsyncEngine`` (submit / stream / report_playback) on a fake
with scripted chunk timing. Must not: build a model (the integration test does).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import numpy as np
import pytest

from breezert_bench import runner
from breezert_bench.options import BenchOptions, LoadPoint
from breezert_bench.variants import (
    BUILTIN_VARIANTS, parse_variant_spec, resolve_variants, variant_config,
)
from breezert_bench.workload import make_workload
from breezert.engine_client import Submitted
from breezert.errors import EngineOverloaded, RequestFailed
from breezert.outputs import AudioChunk
from breezert.profiles import EMBEDDED_PROFILE, profile_path
from breezert.request import SynthesisRequest

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("virtual_clock")]


class FakeAsyncEngine:
    """Emits ``frames`` chunks ``gap_s`` apart; records feedback, concurrency and aborts."""

    def __init__(self, frames: tuple[int, ...] = (1, 2, 4), gap_s: float = 0.02,
                 fail: str | None = None, max_in_flight: int = 1000,
                 retry_after_s: float | None = None) -> None:
        self.frames, self.gap_s, self.fail, self.limit = frames, gap_s, fail, max_in_flight
        self.retry_after_s = retry_after_s
        self.in_flight = self.max_seen = 0
        self.reports: list[tuple[str, float, float, str]] = []
        self.submitted: list[tuple[float, SynthesisRequest]] = []
        self.closed: list[str] = []

    async def submit(self, request: SynthesisRequest) -> Submitted:
        if self.in_flight >= self.limit:
            raise EngineOverloaded("queue full", retry_after_s=self.retry_after_s)
        self.in_flight += 1
        self.max_seen = max(self.max_seen, self.in_flight)
        self.submitted.append((time.monotonic(), request))
        return Submitted(str(request.request_id), (0,), 0, False)

    async def stream(self, request_id: str) -> AsyncIterator[AudioChunk]:
        start = 0
        try:
            for n in self.frames:
                await asyncio.sleep(self.gap_s)
                if self.fail == "error":
                    raise RequestFailed(request_id, "boom")
                yield AudioChunk(request_id, np.zeros(1920 * n, np.float32), 24000, start,
                                 start + n, 0, time.monotonic(), start + n == sum(self.frames))
                start += n
        finally:
            self.in_flight -= 1
            self.closed.append(request_id)

    def report_playback(self, request_id: str, buffered_s: float, measured_at: float,
                        source: str) -> None:
        self.reports.append((request_id, buffered_s, measured_at, source))


def _options(**kwargs) -> BenchOptions:
    kwargs.setdefault("feedback_period_s", 0.01)
    kwargs.setdefault("request_timeout_s", 5.0)
    return BenchOptions(config_path=profile_path(EMBEDDED_PROFILE), **kwargs)


def _item(index: int = 0):
    return make_workload(["Hello there, listener."], index + 1, seed=0)[index]


def test_one_request_streams_into_the_listener_and_reports_playback() -> None:
    engine = FakeAsyncEngine(frames=(1, 2, 4, 8), gap_s=0.03)
    result = asyncio.run(runner._one_request(engine, _item(), _options(), "t"))
    assert result.status == "ok" and result.num_frames == 15
    assert len(result.chunk_times) == 4
    assert result.ttfb_s == pytest.approx(0.03, abs=0.02)
    # chunks 30 ms apart carry 80+ ms each: the listener never runs dry
    assert not result.timeline.has_underrun
    assert result.num_feedback_reports == len(engine.reports) >= 3
    assert {r[0] for r in engine.reports} == {result.request_id}
    assert {r[3] for r in engine.reports} == {"simulated"}
    assert all(r[1] >= 0 for r in engine.reports)
    request = engine.submitted[0][1]
    assert request.ignore_eos and request.max_frames == _item().num_frames


def test_feedback_can_be_switched_off() -> None:
    engine = FakeAsyncEngine(gap_s=0.03)
    result = asyncio.run(runner._one_request(engine, _item(), _options(feedback=False), "t"))
    assert result.status == "ok" and engine.reports == [] and result.num_feedback_reports == 0


def test_slow_chunks_show_as_an_underrun() -> None:
    # 1 frame (80 ms) then 2 frames 150 ms later: 70 ms late
    engine = FakeAsyncEngine(frames=(1, 2), gap_s=0.15)
    result = asyncio.run(runner._one_request(engine, _item(), _options(), "t"))
    assert result.timeline.has_underrun
    assert result.timeline.extra_buffer_s >= 0.07 - 1e-3  # sleeps end late, never early
    assert result.timeline.extra_buffer_s == pytest.approx(result.timeline.lateness_s[1])


def test_timeout_and_errors_are_counted_not_raised() -> None:
    slow = FakeAsyncEngine(frames=(1, 1, 1), gap_s=0.2)
    result = asyncio.run(runner._one_request(slow, _item(), _options(request_timeout_s=0.05), "t"))
    assert (result.status, result.error) == ("timeout", "timeout")
    assert slow.closed == [result.request_id]  # the stream was closed (the engine aborts it)
    failing = FakeAsyncEngine(fail="error")
    result = asyncio.run(runner._one_request(failing, _item(), _options(), "t"))
    assert (result.status, result.error) == ("error", "RequestFailed")
    full = FakeAsyncEngine(max_in_flight=0)
    result = asyncio.run(runner._one_request(full, _item(), _options(), "t"))
    assert (result.status, result.error) == ("refused", "EngineOverloaded")
    assert result.retry_after_s == 1.0  # a refusal that names no wait is retried after 1 s


def test_a_refused_closed_loop_client_waits_its_retry_after_and_says_it_again() -> None:
    # one request at a time fits; each takes 50 ms; a refusal says "retry in 0.3 s". Caller B is
    # refused at once and must not take the next items while it waits, so A serves items 0, 2
    # and 3 (150 ms); at 0.3 s B says item 1 again and is served: one refusal in all (without
    # the wait B would be refused at every item it grabs, without the retry item 1 is lost).
    engine = FakeAsyncEngine(frames=(1,), gap_s=0.05, max_in_flight=1, retry_after_s=0.3)
    items = make_workload(["a b c d e f"], 4, seed=0)
    start = time.monotonic()
    results = asyncio.run(runner._closed_loop(engine, items, 2, _options(), "t", None))
    assert [(r.index, r.status) for r in results] == [
        (0, "ok"), (1, "refused"), (1, "ok"), (2, "ok"), (3, "ok")]
    assert [r.request_id for r in results if r.index == 1] == ["t-1", "t-1-1"]
    assert len(engine.submitted) == 4
    assert time.monotonic() - start >= 0.35  # B's wait, then its item
    summary = runner.summarize_requests(results)
    assert summary["num_refused"] == 1 and summary["num_ok"] == 4


def test_a_refused_caller_stops_retrying_when_the_budget_ends() -> None:
    engine = FakeAsyncEngine(frames=(1,), max_in_flight=0, retry_after_s=0.3)
    items = make_workload(["a b c d e f"], 3, seed=0)
    start = time.monotonic()
    results = asyncio.run(runner._closed_loop(engine, items, 1, _options(), "t", start + 1.0))
    # refused at 0, 0.3, 0.6 and 0.9 s, then the budget ends during the last wait
    assert [(r.index, r.status) for r in results] == [(0, "refused")] * 4
    assert time.monotonic() - start == pytest.approx(1.0, abs=0.01)


def test_closed_loop_keeps_n_in_flight_until_all_complete() -> None:
    engine = FakeAsyncEngine(frames=(1,), gap_s=0.01)
    items = make_workload(["a b c d e f"], 12, seed=0)
    results = asyncio.run(runner._closed_loop(engine, items, 4, _options(), "t", None))
    assert [r.index for r in results] == list(range(12))
    assert all(r.is_ok for r in results)
    assert engine.max_seen == 4


def test_open_loop_submits_at_poisson_offsets() -> None:
    engine = FakeAsyncEngine(frames=(1,), gap_s=0.01)
    items = make_workload(["a b c d e f"], 6, seed=0)
    results = asyncio.run(runner._open_loop(engine, items, 50.0, _options(), "t", None))
    assert len(results) == 6 and all(r.is_ok for r in results)
    times = [t for t, _ in engine.submitted]
    expected = runner.poisson_offsets(50.0, 6, 0)
    for got, want in zip(times, expected):  # sleeps end late, never early
        assert want - 1e-3 <= got - times[0] <= want + 0.25


def test_variant_overrides() -> None:
    assert BUILTIN_VARIANTS["fixed16-eager"].overrides["scheduler"]["default_chunk_schedule"] \
        == [16]
    graphs = BUILTIN_VARIANTS["progressive-graphs"].overrides["graph"]
    assert graphs == {"enable_cuda_graphs": True, "compile_depth": True, "fused_depth": True}
    compiled = BUILTIN_VARIANTS["progressive-compiled"].overrides["graph"]
    assert compiled == {"enable_cuda_graphs": False, "compile_depth": True, "fused_depth": True}
    inductor = BUILTIN_VARIANTS["progressive-graphs-inductor"].overrides["graph"]
    assert inductor["compile_depth"] and not inductor["fused_depth"]
    assert BUILTIN_VARIANTS["naive"].is_naive


def test_variant_config_applies_overrides_and_rejects_graphs_on_cpu() -> None:
    from breezert.config import EngineConfig

    base = EngineConfig.from_file(profile_path(EMBEDDED_PROFILE))
    fixed = variant_config(base, BUILTIN_VARIANTS["fixed16-eager"])
    assert fixed.scheduler.default_chunk_schedule == (16,)
    assert fixed.scheduler.max_running_requests == base.scheduler.max_running_requests
    with pytest.raises(ValueError, match="enable_cuda_graphs"):
        variant_config(base, BUILTIN_VARIANTS["progressive-graphs"])


def test_custom_variant_spec() -> None:
    variant = parse_variant_spec(
        "small-queue=fixed16-eager;scheduler.max_running_requests=4;"
        "scheduler.default_chunk_schedule=[2, 4]"
    )
    assert variant.name == "small-queue"
    assert variant.overrides["scheduler"] == {"default_chunk_schedule": [2, 4],
                                              "max_running_requests": 4, "use_predictor": False}
    assert variant.overrides["graph"]["compile_depth"] is False
    assert [v.name for v in resolve_variants(["naive", "small-queue"], [
        "small-queue=scheduler.max_running_requests=4"])] == ["naive", "small-queue"]
    assert [v.name for v in resolve_variants([], [])] == ["config"]
    with pytest.raises(ValueError, match="unknown nope"):
        resolve_variants(["nope"])
    with pytest.raises(ValueError, match="unknown base variant"):
        parse_variant_spec("x=nope;scheduler.a=1")
    with pytest.raises(ValueError, match="section.key=value"):
        parse_variant_spec("x=scheduler=1")


def test_load_points_default_to_the_concurrency_sweep() -> None:
    assert [p.label for p in _options().load_points()] == [
        "c=1", "c=4", "c=8", "c=16", "c=32", "c=64"]
    assert [p.label for p in _options(rates=(2.5,)).load_points()] == ["r=2.5/s"]
    both = _options(concurrency=(16,), rates=(4.0,)).load_points()
    assert both == [LoadPoint("closed", 16), LoadPoint("open", 4.0)]


def test_gc_pauses_records_each_collection_by_generation_and_unhooks() -> None:
    import gc

    with runner.GcPauses() as pauses:
        gc.collect(2)
        gc.collect(0)
    summary = pauses.summary()
    assert summary["gen2"]["count"] >= 1 and summary["gen0"]["count"] >= 1
    assert summary["gen2"]["max_ms"] >= 0 and summary["gen2"]["total_ms"] >= summary["gen2"]["max_ms"]
    assert pauses._callback not in gc.callbacks
    assert runner._gc_note(summary).startswith(f", {summary['gen2']['count']} full GC passes")
    assert runner._gc_note({"gen2": {"count": 0, "max_ms": 0.0}}) == ""


def test_ttfb_after_the_opening_burst_leaves_the_bursts_requests_out() -> None:
    """A closed loop's first ``burst`` submissions (all at once) can decide a few hundred
    requests' p95 alone: the steady state's TTFB is read without them (by submit time, not by
    index), and refused or unanswered requests count in neither."""
    from breezert_bench.listener import RequestResult

    def result(index: int, submit: float, ttfb: float | None, status: str = "ok") -> object:
        r = RequestResult(index, f"r{index}", 10, submit_time=submit, status=status)
        if ttfb is not None:
            r.add_chunk(submit + ttfb, 0.08, 1, submit + ttfb)
        return r

    burst = [result(i, 0.0, 0.080) for i in range(4)]
    later = [result(4, 1.0, 0.020), result(5, 2.0, 0.030), result(6, 3.0, None, "refused")]
    got = runner.ttfb_after_burst([later[1], *burst, later[0], later[2]], burst=4)
    assert got["count"] == 2 and got["max"] == pytest.approx(0.030)
    assert got["p50"] == pytest.approx(0.025)
