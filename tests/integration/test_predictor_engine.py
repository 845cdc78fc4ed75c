"""``Engine`` with ``scheduler.use_predictor`` on the tiny CPU model, on a fake clock.

Owns the engine-level checks of issue 5: the stream whose reported buffer drains is served
first, a stream near underrun gets an early partial chunk, a simulated listener's reports reach
the predictor, and chunking changes while the audio (vs ``offline.stream_sequential``) does not.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from breezert_bench.listener import PlaybackTimeline
from breezert.config import EngineConfig
from breezert.constants import Stage
from breezert.engine import Engine, EngineOutput
from breezert.options import SamplingParams
from breezert.offline import stream_sequential
from breezert.outputs import AudioChunk
from breezert.options import SynthesisOptions
from breezert.request import SynthesisRequest
from breezert.sched.plan import StepPlan

pytestmark = pytest.mark.integration

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny.toml"
SAMPLING = SamplingParams(temperature=0.9, depth_temperature=0.8)
SCHEDULE = (1, 2, 4, 8, 16)
TICK_S = 0.002  # the fake clock advances this much per reading: every step "takes" 2 ms
ATOL = 1e-5


class FakeClock:
    """Monotonic seconds that advance ``tick_s`` at every reading."""

    def __init__(self, tick_s: float) -> None:
        self.now, self.tick_s = 100.0, tick_s

    def __call__(self) -> float:
        self.now += self.tick_s
        return self.now


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def engine() -> Engine:
    """One DECODE/DEPTH/CODEC request per step, so that the order of service is visible."""
    config = EngineConfig.from_file(CONFIG)
    scheduler = config.scheduler.model_copy(update={
        "use_predictor": True, "max_decode_requests": 1, "max_depth_requests": 1,
        "max_codec_requests": 1,
    })
    return Engine(config.model_copy(update={"scheduler": scheduler}), clock=FakeClock(TICK_S))


@pytest.fixture(autouse=True)
def _engine_left_idle(engine: Engine) -> Iterator[None]:
    yield
    assert not engine.has_work(), "a test left requests in the shared engine"


def make(request_id: str, seed: int, frames: int) -> SynthesisRequest:
    return SynthesisRequest(text=f"Request {request_id} is speaking now.",
                            options=SynthesisOptions(seed=seed, sampling=SAMPLING),
                            max_frames=frames, ignore_eos=True, request_id=request_id,
                            chunk_schedule=SCHEDULE)


class Driver:
    """Steps the engine, keeping every output and every plan."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.outputs: list[EngineOutput] = []
        self.plans: list[StepPlan] = []
        self._execute = engine.runner.execute

    def __enter__(self) -> Driver:
        def execute(plan: StepPlan):  # noqa: ANN202 - the runner's StageOutput
            self.plans.append(plan)
            return self._execute(plan)

        self.engine.runner.execute = execute  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        del self.engine.runner.execute

    def step(self) -> list[EngineOutput]:
        out = self.engine.step()
        self.outputs += out
        return out

    def until(self, done, max_steps: int = 5000) -> None:  # noqa: ANN001
        for _ in range(max_steps):
            if done():
                return
            self.step()
        raise AssertionError("condition never met")

    def finish(self) -> None:
        self.until(lambda: not self.engine.has_work())

    def chunks(self, request_id: str) -> list[AudioChunk]:
        return [o for o in self.outputs
                if isinstance(o, AudioChunk) and o.request_id == request_id]


def assert_audio_equals_reference(engine: Engine, driver: Driver,
                                  requests: list[SynthesisRequest]) -> None:
    for request in requests:
        chunks = driver.chunks(request.request_id or "")
        reference = list(stream_sequential(engine.checkpoint, request))
        assert [c.frame_start for c in chunks[1:]] == [c.frame_end for c in chunks[:-1]]
        assert chunks[-1].frame_end == request.max_frames and chunks[-1].is_final
        got = np.concatenate([c.pcm for c in chunks])
        want = np.concatenate([c.pcm for c in reference])
        np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)


def _served_after_report(engine: Engine, draining: str, full: str,
                         seeds: tuple[int, int]) -> tuple[Driver, list[str]]:
    """Starts both streams, reports ``draining`` almost dry and ``full`` with 3 s, then returns
    which request got each of the next 12 DEPTH steps."""
    requests = [make(draining, seeds[0], 40), make(full, seeds[1], 40)]
    with Driver(engine) as driver:
        for request in requests:
            engine.add_request(request)
        driver.until(lambda: all(len(driver.chunks(r.request_id or "")) >= 3
                                 for r in requests))
        now = engine.clock()
        engine.report_playback(draining, 0.01, now, "simulated")
        engine.report_playback(full, 3.0, now, "simulated")
        start = len(driver.plans)
        driver.until(lambda: sum(p.stage is Stage.DEPTH for p in driver.plans[start:]) >= 12)
        served = [p.request_ids[0] for p in driver.plans[start:] if p.stage is Stage.DEPTH]
        after = lambda: [o.request_id for o in driver.outputs  # noqa: E731
                         if isinstance(o, AudioChunk) and o.created_time > now]
        driver.until(lambda: bool(after()))
        assert after()[0] == draining
        driver.finish()
    assert_audio_equals_reference(engine, driver, requests)
    return driver, served


def test_the_stream_whose_buffer_drains_is_served_first(engine: Engine) -> None:
    _, served = _served_after_report(engine, "drain-a", "full-b", (11, 12))
    assert served == ["drain-a"] * 12
    _, served = _served_after_report(engine, "drain-b", "full-a", (13, 14))  # roles swapped
    assert served == ["drain-b"] * 12


def test_stream_near_underrun_gets_an_early_partial_chunk(engine: Engine) -> None:
    before = engine.metrics.counters.get("predictor_early_emits", 0)
    request = make("near-underrun", 21, 60)
    with Driver(engine) as driver:
        engine.add_request(request)
        driver.until(lambda: len(driver.chunks("near-underrun")) >= 4)  # next target: 16
        for _ in range(4):  # some frames of the 16-frame chunk, then the listener runs low:
            driver.step()  # it holds what decoding the frames there takes, not one more frame
        p = engine.predictor
        assert p is not None
        low_s = p.time_model.predict(Stage.CODEC) + p.frame_time_s() / 2 + TICK_S
        engine.report_playback("near-underrun", low_s, engine.clock(), "simulated")
        driver.until(lambda: len(driver.chunks("near-underrun")) >= 5)
        fifth = driver.chunks("near-underrun")[4]
        driver.finish()
    assert 0 < fifth.frame_end - fifth.frame_start < SCHEDULE[4]
    assert not fifth.is_final
    assert engine.metrics.counters["predictor_early_emits"] > before
    assert_audio_equals_reference(engine, driver, [request])


def test_simulated_listener_feedback_reaches_the_predictor(engine: Engine) -> None:
    """Six staggered streams with a listener reporting every 5 steps (as the bench does every
    100 ms): every request completes, its audio equals the reference, reports are used."""
    counters = engine.metrics.counters
    used_before = counters.get("predictor_feedback_used", 0)
    requests = [make(f"listen-{i}", 30 + i, 24 + 3 * i) for i in range(6)]
    timelines = {r.request_id or "": PlaybackTimeline() for r in requests}
    with Driver(engine) as driver:
        for index, request in enumerate(requests):
            engine.add_request(request)
            for _ in range(3 * index):
                driver.step()
        for step in range(10_000):
            if not engine.has_work():
                break
            for out in driver.step():
                if isinstance(out, AudioChunk) and out.request_id in timelines:
                    timelines[out.request_id].on_chunk(out.created_time, out.duration_s)
            if step % 5 == 0:
                now = engine.clock()
                for request_id, timeline in timelines.items():
                    if timeline.start_time is not None and engine.scheduler.get_request(
                            request_id) is not None:
                        engine.report_playback(request_id, timeline.buffered_s(now), now,
                                               "simulated")
    assert_audio_equals_reference(engine, driver, requests)
    assert counters["predictor_feedback_used"] > used_before
    snapshot = engine.metrics.snapshot()["counters"]
    for name in ("predictor_waits", "predictor_early_emits", "predictor_deadline_misses",
                 "predictor_feedback_used", "predictor_feedback_stale"):
        assert name in snapshot
    assert not engine.has_work()  # every request ended; the predictor holds nothing per request
