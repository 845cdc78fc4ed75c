"""The first-packet breakdown (``breezert_bench.first_packet``) on a hand-made step log, and on
random step logs against a point-sampling oracle (what the engine was doing at each instant)."""

from __future__ import annotations

import numpy as np
import pytest

from breezert.metrics import EngineMetrics, StepRecord
from breezert_bench.first_packet import (
    FirstPacket,
    first_packet_path,
    first_packet_paths,
    opening_steps,
)

pytestmark = pytest.mark.unit


def _step(stage: str, ids: set[str], start: float, end: float) -> StepRecord:
    return StepRecord(stage, frozenset(ids), start, end)


LOG = [
    _step("depth", {"b"}, 0.0, 0.010),  # in flight when "a" arrives at 0.004
    _step("text_encode", {"a"}, 0.011, 0.013),
    _step("prefill", {"a", "b"}, 0.0135, 0.014),
    _step("codec", {"b"}, 0.015, 0.018),  # "a" waits behind it
    _step("depth", {"a", "b"}, 0.018, 0.026),
    _step("codec", {"a"}, 0.027, 0.029),
    _step("decode", {"a"}, 0.030, 0.032),  # after the first packet: not on its path
]


def test_parts_are_own_steps_by_stage_others_and_host() -> None:
    parts = first_packet_path(LOG, FirstPacket("a", 0.004, 0.029))
    assert parts == pytest.approx({
        "others": 0.006 + 0.003,  # the rest of b's DEPTH step from 0.004, b's CODEC
        "own_text_encode": 0.002, "own_prefill": 0.0005, "own_depth": 0.008,
        "own_codec": 0.002, "host": 0.025 - 0.0215,
    })


def _sampled(log: list[StepRecord], request: FirstPacket, dt: float) -> dict[str, float]:
    """The oracle: at each instant of a ``dt`` grid over the request's wait, what the step log
    says the engine was doing (its own step of a stage, another request's, none), times ``dt``."""
    parts: dict[str, float] = {}
    for t in np.arange(request.submit_time, request.first_chunk_time, dt) + dt / 2:
        step = next((s for s in log if s.start <= t < s.end), None)
        key = ("host" if step is None else f"own_{step.stage}"
               if request.request_id in step.request_ids else "others")
        parts[key] = parts.get(key, 0.0) + dt
    return parts


def test_parts_match_what_the_step_log_says_at_each_instant() -> None:
    rng = np.random.default_rng(3)
    stages = ("text_encode", "prefill", "depth", "codec")
    dt = 1e-5
    for _ in range(40):
        log, t = [], 0.0
        for _ in range(int(rng.integers(1, 12))):  # one engine thread: steps never overlap
            t += float(rng.choice([0.0, rng.uniform(0.0, 0.004)]))  # host time between steps
            length = float(rng.uniform(0.0005, 0.008))
            ids = {"a", "b"} if rng.random() < 0.4 else {str(rng.choice(["a", "b"]))}
            log.append(_step(str(rng.choice(stages)), ids, round(t, 5), round(t + length, 5)))
            t += length
        submit = round(float(rng.uniform(0.0, t / 2)), 5)
        request = FirstPacket("a", submit, round(float(rng.uniform(submit + dt, t + 0.003)), 5))
        want = _sampled(log, request, dt)
        got = first_packet_path(log, request)
        assert set(got) - {"host"} <= set(want)
        for key in set(got) | set(want):
            assert got.get(key, 0.0) == pytest.approx(want.get(key, 0.0), abs=3 * dt), key


def test_summary_over_requests_in_milliseconds_with_missing_parts_as_zero() -> None:
    summary = first_packet_paths(LOG, [FirstPacket("a", 0.004, 0.029),
                                       FirstPacket("b", 0.0, 0.018)])
    assert summary["num_requests"] == 2
    assert summary["own_text_encode_ms"]["mean"] == pytest.approx(1.0)  # b: 0, a: 2 ms
    assert summary["own_codec_ms"]["p50"] == pytest.approx(2.5)  # b 3 ms, a 2 ms
    means = sum(v["mean"] for k, v in summary.items() if k.endswith("_ms"))
    assert means == pytest.approx(1000 * ((0.029 - 0.004) + 0.018) / 2)
    assert first_packet_paths([], [FirstPacket("a", 0.0, 1.0)]) == {}
    assert "log_truncated" not in summary
    # a full log whose oldest step began after a request's submit lost steps of its path
    late = first_packet_paths(LOG[1:], [FirstPacket("a", 0.004, 0.029)], log_full=True)
    assert late["log_truncated"] is True
    assert "log_truncated" not in first_packet_paths(LOG, [FirstPacket("a", 0.004, 0.029)],
                                                     log_full=True)


def test_the_engine_metrics_log_steps_with_their_requests_only_when_asked() -> None:
    metrics = EngineMetrics(step_log=2)
    metrics.record_step("depth", 2, 0.005, ("a", "b", "a"), start=1.0)
    metrics.record_step("codec", 1, 0.002)  # no start: timed, not logged
    assert list(metrics.steps) == [_step("depth", {"a", "b"}, 1.0, 1.005)]
    for start in (2.0, 3.0):  # the log keeps the latest ``step_log`` steps
        metrics.record_step("decode", 1, 0.001, ("c",), start=start)
    assert [step.start for step in metrics.steps] == [2.0, 3.0]
    serving = EngineMetrics()  # a serving engine's metrics keep no log
    serving.record_step("depth", 2, 0.005, ("a", "b"), start=1.0)
    assert not serving.steps and serving.snapshot()["stages"]["depth"]["step_s"]["count"] == 1
    assert metrics.snapshot()["stages"]["codec"]["step_s"]["count"] == 1
    assert "steps" not in metrics.snapshot()  # the log is not exported


def test_the_opening_burst_timeline_lists_the_steps_until_its_last_first_chunk() -> None:
    requests = [FirstPacket("b", 0.0, 0.018), FirstPacket("a", 0.004, 0.029),
                FirstPacket("c", 0.5, 0.6)]  # c came later: not in a burst of 2
    burst = opening_steps(LOG, requests, 2)
    assert burst["num_requests"] == 2
    assert burst["submit_ms"] == [0.0, 4.0]
    assert burst["first_chunk_ms"] == [18.0, 29.0]
    stages = [(s["stage"], s["burst_requests"], s["requests"]) for s in burst["steps"]]
    assert stages == [("depth", 1, 1), ("text_encode", 1, 1), ("prefill", 2, 2),
                      ("codec", 1, 1), ("depth", 2, 2), ("codec", 1, 1)]  # not the decode at 30
    assert burst["steps"][1]["start_ms"] == pytest.approx(11.0)
    assert burst["steps"][1]["ms"] == pytest.approx(2.0)
    assert opening_steps([], requests, 2) == {}
