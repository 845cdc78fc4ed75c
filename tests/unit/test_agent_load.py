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
from breezert_agent import LOAD_THRESHOLD, engine_load, engine_worker_options

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


def call_like_livekit(load_fnc: Any, server: Any) -> float:
    """What ``AgentServer._invoke_load_fnc`` (livekit-agents 1.8.9) does."""
    if len(inspect.signature(load_fnc).parameters) == 0:
        return float(load_fnc())
    return float(load_fnc(server))


def test_requests_and_jobs_both_count(engines: list[FakeEngine]) -> None:
    engines.append(FakeEngine(EngineLoad(1, 0, 4, 8)))
    server = FakeServer()
    assert call_like_livekit(engine_load, server) == 0.25  # one running request of four
    server.active_jobs = ["a", "b"]
    assert call_like_livekit(engine_load, server) == 0.5  # two jobs of four places
    server.active_jobs = ["a", "b", "c", "d", "e"]
    assert call_like_livekit(engine_load, server) == 1.0  # capped
    assert engine_load(None) == 0.25  # no server: the engine alone


def test_a_saturated_or_late_engine_is_full_with_few_jobs(engines: list[FakeEngine]) -> None:
    engines.append(FakeEngine(EngineLoad(4, 2, 4, 8)))
    assert engine_load(FakeServer(["a"])) == 1.0
    engines[0].now = EngineLoad(1, 0, 4, 8, least_slack_s=-0.01)  # behind real time
    assert engine_load(FakeServer(["a"])) == 1.0
    engines[0].now = EngineLoad(1, 0, 4, 8, least_slack_s=0.3)
    assert engine_load(FakeServer(["a"])) == 0.25


def test_max_jobs_and_the_busiest_of_several_engines(engines: list[FakeEngine]) -> None:
    engines += [FakeEngine(EngineLoad(1, 0, 8, 8)), FakeEngine(EngineLoad(3, 0, 4, 8))]
    assert engine_load(FakeServer()) == 0.75
    load_fnc = functools.partial(engine_load, max_jobs=2)
    engines[1].now = EngineLoad(0, 0, 4, 8)
    assert call_like_livekit(load_fnc, FakeServer(["a"])) == 0.5
    assert call_like_livekit(engine_load, FakeServer(["a"])) == 0.25  # smallest max_running


def test_before_any_engine_only_jobs_against_max_jobs(engines: list[FakeEngine],
                                                      caplog: pytest.LogCaptureFixture) -> None:
    assert engine_load(FakeServer(["a"])) == 0.0
    assert "no in-process engine is built yet" in caplog.text
    assert engine_load(FakeServer(["a"]), max_jobs=4) == 0.25


def test_no_engine_module_means_no_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "breezert.async_engine", raising=False)
    assert engine_load(FakeServer(["a"]), max_jobs=2) == 0.5
    assert "breezert.async_engine" not in sys.modules  # reading the load imported nothing


def test_worker_options_pair_the_load_with_its_threshold(engines: list[FakeEngine]) -> None:
    options = engine_worker_options("cpu-tiny")
    assert options["load_threshold"] == LOAD_THRESHOLD == 1.0
    assert options["job_executor_type"] is JobExecutorType.THREAD
    assert options["num_idle_processes"] == 8  # the profile's max_running_requests
    engines.append(FakeEngine(EngineLoad(0, 0, 8, 32)))
    assert call_like_livekit(options["load_fnc"], FakeServer(["a", "b"])) == 0.25
    assert engine_worker_options(max_jobs=3)["num_idle_processes"] == 3
