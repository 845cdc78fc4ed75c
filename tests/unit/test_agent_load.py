"""``breezert_agent.engine_load`` / ``engine_worker_options`` on stand-in engines (no torch).

Owns: the worker load from the engines ``AsyncEngine.shared`` built (requests, slack) and the
worker's jobs, the way LiveKit Agents calls a ``load_fnc`` (with the server when it takes an
argument), and the options that pair with it. The real dispatcher is ``tests/livekit``'s.
"""

from __future__ import annotations

import functools
import inspect
import sys
import types
from dataclasses import dataclass, field
from typing import Any

import pytest
from livekit.agents import JobExecutorType

from breezert.sched.load import EngineLoad
from breezert_agent import FULL_LOAD, engine_load, engine_worker_options, load_threshold

pytestmark = pytest.mark.unit


@dataclass
class FakeEngine:
    now: EngineLoad

    def load(self) -> EngineLoad:
        return self.now


@dataclass
class FakeServer:
    active_jobs: list[Any] = field(default_factory=list)


@pytest.fixture
def engines(monkeypatch: pytest.MonkeyPatch) -> list[FakeEngine]:
    """Stands in for ``breezert.async_engine`` (whose import would bring torch)."""
    built: list[FakeEngine] = []
    module = types.ModuleType("breezert.async_engine")
    module.AsyncEngine = types.SimpleNamespace(shared_engines=lambda: list(built))  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "breezert.async_engine", module)
    return built


def share(fraction: float) -> float:
    """What ``engine_load`` reports for ``fraction`` of capacity (full = ``FULL_LOAD``)."""
    return FULL_LOAD * fraction


def call_like_livekit(load_fnc: Any, server: Any) -> float:
    """What ``AgentServer._invoke_load_fnc`` (livekit-agents 1.8.9) does."""
    if len(inspect.signature(load_fnc).parameters) == 0:
        return float(load_fnc())
    return float(load_fnc(server))


def test_requests_and_jobs_both_count(engines: list[FakeEngine]) -> None:
    engines.append(FakeEngine(EngineLoad(1, 0, 4, 8)))
    server = FakeServer()
    assert call_like_livekit(engine_load, server) == share(0.25)  # one running request of four
    server.active_jobs = ["a", "b"]
    assert call_like_livekit(engine_load, server) == share(0.5)  # two jobs of four places
    server.active_jobs = ["a", "b", "c", "d", "e"]
    assert call_like_livekit(engine_load, server) == FULL_LOAD  # capped
    assert engine_load(None) == share(0.25)  # no server: the engine alone


def test_a_saturated_or_late_engine_is_full_with_few_jobs(engines: list[FakeEngine]) -> None:
    engines.append(FakeEngine(EngineLoad(4, 2, 4, 8)))
    assert engine_load(FakeServer(["a"])) == FULL_LOAD
    engines[0].now = EngineLoad(1, 0, 4, 8, least_slack_s=-0.01)  # behind real time
    assert engine_load(FakeServer(["a"])) == FULL_LOAD
    engines[0].now = EngineLoad(1, 0, 4, 8, least_slack_s=0.3)
    assert engine_load(FakeServer(["a"])) == share(0.25)


def test_max_jobs_and_the_busiest_of_several_engines(engines: list[FakeEngine]) -> None:
    engines += [FakeEngine(EngineLoad(1, 0, 8, 8)), FakeEngine(EngineLoad(3, 0, 4, 8))]
    assert engine_load(FakeServer()) == share(0.75)
    load_fnc = functools.partial(engine_load, max_jobs=2)
    engines[1].now = EngineLoad(0, 0, 4, 8)
    assert call_like_livekit(load_fnc, FakeServer(["a"])) == share(0.5)
    assert call_like_livekit(engine_load, FakeServer(["a"])) == share(0.25)  # smallest max_running


def test_before_any_engine_only_jobs_against_max_jobs(engines: list[FakeEngine],
                                                      caplog: pytest.LogCaptureFixture) -> None:
    assert engine_load(FakeServer(["a"])) == 0.0
    assert "no in-process engine is built yet" in caplog.text
    assert engine_load(FakeServer(["a"]), max_jobs=4) == share(0.25)


def test_no_engine_module_means_no_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "breezert.async_engine", raising=False)
    assert engine_load(FakeServer(["a"]), max_jobs=2) == share(0.5)
    assert "breezert.async_engine" not in sys.modules  # reading the load imported nothing


def test_worker_options_pair_the_load_with_its_threshold(engines: list[FakeEngine]) -> None:
    options = engine_worker_options("cpu-tiny")
    assert options["load_threshold"] == load_threshold(8) < FULL_LOAD == 0.7
    assert options["job_executor_type"] is JobExecutorType.THREAD
    assert options["num_idle_processes"] == 8  # the profile's max_running_requests
    engines.append(FakeEngine(EngineLoad(0, 0, 8, 32)))
    assert call_like_livekit(options["load_fnc"], FakeServer(["a", "b"])) == share(0.25)
    assert engine_worker_options(max_jobs=3)["num_idle_processes"] == 3


@pytest.mark.parametrize("max_jobs", [1, 2, 3, 4, 7, 8, 16, 32, 64])
def test_livekits_arithmetic_admits_exactly_max_jobs(engines: list[FakeEngine],
                                                     max_jobs: int) -> None:
    """livekit-agents 1.8.9 accepts an offer while ``load + reserved * load / jobs`` (with no
    job yet: ``reserved * threshold / num_idle_processes``) is below ``load_threshold``; the
    server offers jobs only while some available worker reports less than its ``target_load``
    (0.7 by default)."""
    engines.append(FakeEngine(EngineLoad(0, 0, max_jobs, 8)))
    threshold = load_threshold(max_jobs)
    for jobs in range(max_jobs + 1):
        load = engine_load(FakeServer(["job"] * jobs), max_jobs=max_jobs)
        assert (load < FULL_LOAD) == (jobs < max_jobs)  # the server still offers it jobs
        for reserved in range(max_jobs + 2 - jobs):
            estimate = load / jobs if jobs else threshold / max_jobs
            admits = load + reserved * estimate < threshold
            assert admits == (jobs + reserved < max_jobs), (jobs, reserved)
