"""``bench/sched_sim.py``: the real engine's scheduling on a stage-time model (no GPU).

Checks the step-time model between and past its points, a refused caller coming back, and a
small closed-loop run end to end: every request streams all its frames, the clock holds the
model's step times plus host time, and a simulator switch puts the old host path back beside
today's.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from breezert.constants import Stage
from breezert.sched.plan import CodecBatch, CodecRow, StepPlan

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


def _sim():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("sched_sim", REPO / "bench" / "sched_sim.py")
    assert spec is not None and spec.loader is not None
    sys.path.insert(0, str(REPO / "bench"))  # its own import of cuda_bench
    try:
        module = importlib.util.module_from_spec(spec)
        sys.modules["sched_sim"] = module  # its dataclasses look their module up
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(REPO / "bench"))
    return module


def _plan(stage: Stage, rows: int) -> StepPlan:
    from breezert.sched.plan import DepthBatch

    zeros = np.zeros(rows, np.int64)
    items = DepthBatch(tuple(f"r{i}" for i in range(rows)), np.arange(rows), zeros, zeros,
                       np.ones(rows, np.int64), zeros)
    return StepPlan(1, stage, items)


def test_step_model_interpolates_between_its_points_and_extends_past_them() -> None:
    sim = _sim()
    assert sim.step_ms(_plan(Stage.DEPTH, 1)) == pytest.approx(9.6)
    assert sim.step_ms(_plan(Stage.DEPTH, 29)) == pytest.approx(10.0 + 2.4 * 15 / 30)
    assert sim.step_ms(_plan(Stage.DEPTH, 84)) == pytest.approx(13.5 + 1.1 * 20 / 20)
    codec = StepPlan(2, Stage.CODEC, CodecBatch.of([CodecRow("a", 0, 0, 4, False, False),
                                                    CodecRow("b", 1, 8, 16, False, False)]))
    base, per_frame, per_chunk = sim.CODEC_MS
    assert sim.step_ms(codec) == pytest.approx(base + per_frame * 19 + per_chunk)


def test_a_closed_loop_streams_every_request_whole(tmp_path: Path) -> None:
    texts = tmp_path / "texts.tsv"
    texts.write_text("id\ttext\n" + "".join(
        f"{i}\t{'A sentence of some length for the simulator. ' * (1 + i % 3)}\n"
        for i in range(10)))
    out = tmp_path / "sim.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO / "runtime"), str(REPO / "bench"), str(REPO)])}
    subprocess.run(
        [sys.executable, str(REPO / "bench" / "sched_sim.py"), "--concurrency", "4",
         "--num-requests", "12", "--warmup", "2", "--texts", str(texts), "--out", str(out),
         "--variant", "today=", "--variant", "no-memo=sim.predict_memo=false"],
        check=True, env=env, timeout=240, capture_output=True)
    doc = json.loads(out.read_text())
    assert [run["variant"] for run in doc["runs"]] == ["today", "no-memo"]
    for run in doc["runs"]:
        assert run["ok"] == run["requests"] == 12
        assert run["ttfb_ms"]["count"] == 12 and run["ttfb_ms"]["p50"] > 9.6 + 1.9
        assert run["steps"]["depth"]["count"] >= max(1, 12 * 3)  # >= 3 s of speech each
        assert 0 < run["model_busy"] < 1 and 0 < run["host_share"] < 1
        assert run["model_busy"] + run["host_share"] <= 1.0 + 1e-6


def test_a_refused_caller_says_its_request_again_after_the_wait() -> None:
    """Two running requests at most and no queue, four callers: two are refused at the start
    (a record each), come back after the refusal's wait and are served; every item once."""
    from breezert_bench.runner import REFUSED_MIN_WAIT_S
    from breezert_bench.workload import make_workload

    sim = _sim()
    clock = sim.SimClock((0.3, 0.0))
    engine, _ = sim.build_engine({"scheduler": {
        "max_running_requests": 2, "max_queued_requests": 0, "admission_capacity": None,
        "admission_max_cycle_s": None, "admission_max_starting": None}}, clock)
    items = make_workload(["A short sentence for the simulator to say."], 4, seed=0)
    results = sim.run_point(engine, clock, items, 4, "t")
    refused = [r for r in results if r.error == "EngineOverloaded"]
    served = [r for r in results if r.is_ok]
    assert len(refused) >= 2 and sorted(r.index for r in served) == [0, 1, 2, 3]
    retried = [r for r in served if r.request_id.count("-") == 2]  # t-INDEX-ATTEMPT
    assert {r.index for r in retried} == {r.index for r in refused}
    for r in retried:  # said again no sooner than the refusal's wait
        first = min(x.submit_time for x in refused if x.index == r.index)
        assert r.submit_time - first >= REFUSED_MIN_WAIT_S


def test_an_unknown_simulator_switch_is_refused() -> None:
    with pytest.raises(SystemExit, match="sim.nonsense"):
        _sim().parse_variant("x=sim.nonsense=true")


def test_what_if_switches_change_the_stage_time_model() -> None:
    sim = _sim()
    name, overrides = sim.parse_variant(
        "fast=sim.text_encode_ms=[[1, 2.0], [16, 3.5]];sim.depth_scale=0.5;"
        "sim.codec_ms=[3.0, 0.1, 0.2];sim.codec_scale=2")
    times = sim.StageTimes().with_switches(overrides["sim"])
    assert name == "fast"
    assert times.step_ms(_plan(Stage.TEXT_ENCODE, 6)) == pytest.approx(2.0 + 1.5 * 5 / 15)
    assert times.step_ms(_plan(Stage.DEPTH, 1)) == pytest.approx(9.6 / 2)
    assert times.step_ms(_plan(Stage.PREFILL, 16)) == pytest.approx(4.0)  # untouched
    codec = StepPlan(2, Stage.CODEC, CodecBatch.of([CodecRow("a", 0, 0, 4, False, False),
                                                    CodecRow("b", 1, 8, 16, False, False)]))
    assert times.step_ms(codec) == pytest.approx(2 * (3.0 + 0.1 * 19 + 0.2))
    assert sim.StageTimes().step_ms(codec) == sim.step_ms(codec)  # the fitted model unchanged
    with pytest.raises(SystemExit, match="rows increasing"):
        sim.StageTimes().with_switches({"prefill_ms": [[16, 4.0], [1, 0.6]]})


def test_the_capacity_profile_runs_on_the_h100_step_model() -> None:
    sim = _sim()
    engine, worker = sim.build_engine({}, sim.SimClock(None), "capacity", "h100-capacity")
    assert engine.config.scheduler.max_running_requests == 256
    # the profile as served: the frame cycle bounds admission (6 Dec's H100 A/B)
    assert engine.config.scheduler.admission_max_cycle_s == 0.03
    assert engine.config.scheduler.predictor_first_chunk_cover
    times = worker.times
    # the 64- and 128-row buckets' steps: one row past a bucket costs the next bucket
    assert times.step_ms(_plan(Stage.DEPTH, 64)) == pytest.approx(13.0)
    assert times.step_ms(_plan(Stage.DEPTH, 65)) == pytest.approx(17.0)
    assert times.step_ms(_plan(Stage.DEPTH, 129)) == pytest.approx(23.0)
    assert times.codec == sim.H100_CAPACITY_CODEC_MS
    latency, _ = sim.build_engine({}, sim.SimClock(None))
    assert latency.config.scheduler.max_running_requests == 64  # the default profile
