"""The suite's own rules: what may skip, that nothing xfails, and the one real-time retry.

Owns: a scan of every ``.py`` under ``tests/`` for imperative ``pytest.xfail(``, ``xfail``
markers and skips (``pytest.skip(``, ``skipif(``, ``importorskip(``, ``mark.skip(``) outside
``ALLOWED``, the small list of places that skip with the reason written next to each; and
``tests.realtime.retry_if_starved``'s policy and its report (terminal summary, JUnit property),
on a fake CPU meter and a loop that does not sleep.
"""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests import conftest as suite
from tests import realtime

pytestmark = pytest.mark.unit

TESTS = Path(__file__).resolve().parents[1]
THIS = Path(__file__).resolve()
XFAIL = re.compile(r"\bpytest\.xfail\s*\(|\bmark\.xfail\b")
SKIP = re.compile(r"\bpytest\.skip\s*\(|\bskipif\s*\(|\bimportorskip\s*\(|\bmark\.skip\s*\(")
ALLOWED: dict[str, tuple[int, str]] = {
    "conftest.py": (1, "gpu tests without CUDA (torch.cuda.is_available() is False)"),
    "components.py": (2, "a component make test installs, absent outside CI; under CI=true the "
                         "test fails with the install log instead"),
    "golden/_paths.py": (1, "the golden fixtures outside the repository (../shared), absent "
                            "outside CI; under CI=true the test fails"),
    "unit/test_ports.py": (1, "a kernel without IPv6 sockets (absent hardware support)"),
    "unit/test_tokenizer_prompting.py": (1, "the real Breeze tokenizer, which is not shipped"),
    "unit/test_asr_gate_parts.py": (1, "../shared/bench/texts_en.tsv, outside the repository: "
                                        "the committed copy is checked where it exists"),
}
"""Relative path under tests/ -> (how many skip sites, why each may skip)."""


def _code(path: Path) -> str:
    """``path`` without its comments (a comment may name what it must not call)."""
    return "\n".join(line.split("#", 1)[0] for line in path.read_text().splitlines())


def _sites(pattern: re.Pattern[str]) -> dict[str, int]:
    found: dict[str, int] = {}
    for path in sorted(TESTS.rglob("*.py")):
        if path.resolve() == THIS:
            continue
        count = len(pattern.findall(_code(path)))
        if count:
            found[path.relative_to(TESTS).as_posix()] = count
    return found


def test_no_test_xfails() -> None:
    assert _sites(XFAIL) == {}, "an xfail cannot fail: assert, or fail with the figures"


def test_skips_only_where_the_allow_list_says_why() -> None:
    found = _sites(SKIP)
    extra = {path: n for path, n in found.items() if ALLOWED.get(path, (0, ""))[0] < n}
    assert not extra, (f"skips outside the allow-list (CUDA, absent hardware, what cannot exist): "
                       f"{extra}; a component make test installs goes through "
                       "tests/components.missing / needs")
    stale = {path for path, (n, _) in ALLOWED.items() if found.get(path, 0) != n}
    assert not stale, f"the allow-list names skips that are gone: {stale}"


def test_the_scan_sees_each_form() -> None:
    for line in ("pytest.xfail('x')", "@pytest.mark.xfail(strict=True)"):
        assert XFAIL.search(line), line
    for line in ("pytest.skip('x')", "pytest.mark.skipif(True, reason='r')",
                 "pytest.importorskip('torch')", "pytest.mark.skip(reason='r')"):
        assert SKIP.search(line), line
    assert not SKIP.search("Skips only when the server cannot be built")


# ----------------------------------------------------------------------- one retry


class FakeMeter:
    """``CpuMeter`` reading the next figure of ``loads`` at each ``foreign_cores``."""

    loads: list[float] = []

    def foreign_cores(self) -> float:
        return FakeMeter.loads.pop(0)


class Miss(AssertionError):
    pass


STOPS: list[float] = []
"""``MachineStops.longest_s``'s next figures (seconds), one per reading; 0.0 when empty."""


class FakeStops:
    def longest_s(self, since: float, until: float) -> float:
        return STOPS.pop(0) if STOPS else 0.0


@pytest.fixture
def item(monkeypatch: pytest.MonkeyPatch) -> Any:
    async def quiet(timeout_s: float = 0.0, window_s: float = 0.0) -> float:
        return 0.0

    monkeypatch.setattr(realtime, "CpuMeter", FakeMeter)
    monkeypatch.setattr(realtime, "wait_for_quiet", quiet)
    monkeypatch.setattr(realtime, "machine_stops", FakeStops)
    return SimpleNamespace(user_properties=[])  # a test item: set as current in the test


def _attempts(*outcomes: str | None) -> tuple[list[int], Any]:
    """An attempt that raises ``Miss(outcome)`` or returns its call count, in order."""
    calls: list[int] = []

    async def attempt() -> int:
        calls.append(1)
        outcome = outcomes[len(calls) - 1]
        if outcome is not None:
            raise Miss(outcome)
        return len(calls)

    return calls, attempt


async def test_a_miss_on_a_quiet_box_fails_at_once(item: Any) -> None:
    realtime.current_item = item  # the hook made the real item current; use the fake
    FakeMeter.loads = [0.10]
    calls, attempt = _attempts("a 90 ms gap")
    with pytest.raises(Miss, match=r"a 90 ms gap \(0.10 cores .* not starved, no retry\)"):
        await realtime.retry_if_starved(attempt, (Miss,))
    assert len(calls) == 1 and item.user_properties == []


async def test_a_starved_miss_is_retried_once_and_recorded(item: Any) -> None:
    realtime.current_item = item  # the hook made the real item current; use the fake
    FakeMeter.loads = [0.80]
    calls, attempt = _attempts("a 90 ms gap", None)
    assert await realtime.retry_if_starved(attempt, (Miss,), "turn") == 2
    assert len(calls) == 2
    reason = ("turn: a 90 ms gap with 0.80 cores of foreign load and the machine stopped for "
              "at most 0 ms (starved)")
    assert item.user_properties == [(realtime.RETRY_PROPERTY, reason)]


async def test_a_miss_in_a_stop_of_the_machine_is_retried_once(item: Any) -> None:
    """A stop that ``CpuMeter`` cannot see (0.00 cores) but ``MachineStops`` can."""
    realtime.current_item = item  # the hook made the real item current; use the fake
    FakeMeter.loads, STOPS[:] = [0.00], [0.050]
    calls, attempt = _attempts("a 67 ms gap", None)
    assert await realtime.retry_if_starved(attempt, (Miss,), "call") == 2
    assert item.user_properties == [(realtime.RETRY_PROPERTY, (
        "call: a 67 ms gap with 0.00 cores of foreign load and the machine stopped for at most "
        "50 ms (starved)"))]


async def test_a_stop_shorter_than_the_limit_is_no_reason_to_retry(item: Any) -> None:
    realtime.current_item = item  # the hook made the real item current; use the fake
    FakeMeter.loads, STOPS[:] = [0.00], [0.031]
    calls, attempt = _attempts("a 90 ms gap")
    with pytest.raises(Miss, match=r"stopped for at most 31 ms during the attempt: the machine "
                                   r"was not starved, no retry"):
        await realtime.retry_if_starved(attempt, (Miss,))
    assert len(calls) == 1 and item.user_properties == []


async def test_a_second_miss_fails_even_when_starved(item: Any) -> None:
    realtime.current_item = item  # the hook made the real item current; use the fake
    FakeMeter.loads = [0.80, 0.90]
    calls, attempt = _attempts("first", "second")
    with pytest.raises(Miss, match="second .* on the one retry; the first attempt: .*first"):
        await realtime.retry_if_starved(attempt, (Miss,))
    assert len(calls) == 2


async def test_other_failures_are_never_retried(item: Any) -> None:
    realtime.current_item = item  # the hook made the real item current; use the fake
    FakeMeter.loads = [0.80]

    async def attempt() -> None:
        raise ValueError("not a real-time miss")

    with pytest.raises(ValueError):
        await realtime.retry_if_starved(attempt, (Miss,))
    assert item.user_properties == []


def test_the_terminal_summary_lists_each_retry_with_its_reason() -> None:
    lines: list[str] = []
    report = SimpleNamespace(when="call", nodeid="tests/livekit/test_x.py::test_y",
                             user_properties=[(realtime.RETRY_PROPERTY, "a 90 ms gap (starved)"),
                                              ("other", "x")])
    reporter = SimpleNamespace(stats={"passed": [report]},
                               section=lambda title: lines.append(f"== {title}"),
                               line=lines.append)
    suite.pytest_terminal_summary(reporter)  # type: ignore[arg-type]
    assert lines == ["== real-time retries (the machine was starved)",
                     "tests/livekit/test_x.py::test_y: a 90 ms gap (starved)",
                     "1 real-time check(s) retried once"]


def test_the_foreign_load_meter_reads_this_box() -> None:
    """Over the shortest window the suite reads it in (``wait_for_quiet``'s 0.5 s): over ~20 ms
    its 10 ms ticks read 2.1 cores of 2 in a fresh clone's run (4 Dec)."""
    meter = realtime.CpuMeter()
    end = realtime.time.monotonic() + 0.5
    while realtime.time.monotonic() < end:
        sum(i * i for i in range(20_000))  # our own work is not foreign
    assert 0.0 <= meter.foreign_cores() <= (realtime.os.cpu_count() or 1)


# ----------------------------------------------------------------------- virtual clock

REAL_SLEEP = re.compile(r"\basyncio\.sleep\s*\((?!\s*0\s*\))")  # any wait but a bare yield


def test_unit_tests_that_wait_on_time_run_on_the_virtual_clock() -> None:
    """No unit test sleeps in real time: ``time.sleep`` is not used, and a module that awaits
    ``asyncio.sleep(t)`` runs on ``virtual_clock`` (its pytestmark)."""
    blocking, real = [], []
    for path in sorted((TESTS / "unit").glob("*.py")):
        code = _code(path)
        if re.search(r"\btime\.sleep\s*\(", code):
            blocking.append(path.name)
        if REAL_SLEEP.search(code) and 'usefixtures("virtual_clock")' not in code:
            real.append(path.name)
    assert not blocking and not real, (blocking, real)


async def test_the_virtual_clock_skips_idle_waits_and_moves_every_clock(
        virtual_clock: Any) -> None:
    import asyncio
    import time

    real = virtual_clock._perf
    start_real, start_mono, start_perf = real(), time.monotonic(), time.perf_counter()
    order: list[str] = []

    async def after(delay: float, name: str) -> None:
        await asyncio.sleep(delay)
        order.append(name)

    await asyncio.gather(after(0.5, "late"), after(0.2, "early"), after(30.0, "latest"))
    assert order == ["early", "late", "latest"]
    assert time.monotonic() - start_mono >= 30.0 and time.perf_counter() - start_perf >= 30.0
    assert asyncio.get_running_loop().time() == pytest.approx(time.monotonic(), abs=0.05)
    assert real() - start_real < 5.0, "a virtual wait took real time"
    with pytest.raises(TimeoutError):  # timeouts fire on virtual time too
        await asyncio.wait_for(asyncio.Event().wait(), 60.0)


# ----------------------------------------------------------------------- latency bounds


def test_every_latency_check_has_a_measured_bound_of_the_stated_rule() -> None:
    """Each ``latency.check("name", ...)`` in tests/ names a bound in tests/latency_bounds.json,
    and each bound is its measured p95 times the file's margin, or a perceptual cap below that
    with its reason (no hand-typed seconds)."""
    import math

    from tests import latency

    doc = latency.bounds()
    names = set()
    for path in TESTS.rglob("*.py"):
        if path.resolve() == THIS:
            continue
        names |= set(re.findall(r"latency\.check\(\s*\"(\w+)\"", _code(path)))
        for listener, figure in re.findall(
                r"latency\.check\(\s*f\"room_\{(\w+)\}_(first_audio|over_ttfb)\"", _code(path)):
            assert listener == "name"  # test_room_latency's listeners
            names |= {f"room_python_{figure}", f"room_browser_{figure}"}
    assert names and names <= set(doc["bounds"]), names - set(doc["bounds"])
    assert {"machine", "runs", "margin", "rule"} <= set(doc)
    for name, entry in doc["bounds"].items():
        want = min(math.ceil(entry["p95_ms"] * doc["margin"]), entry.get("cap_ms", math.inf))
        assert entry["bound_ms"] == want, name
        assert "cap_ms" not in entry or entry["cap_reason"], name
        assert entry["n"] >= 3 and entry["p50_ms"] <= entry["p95_ms"] <= entry["max_ms"], name


# ----------------------------------------------------------------------- missing components


def test_a_missing_component_fails_under_ci_with_the_logs_last_lines(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests import components

    log = tmp_path / "build.log"
    log.write_text("".join(f"line {i}\n" for i in range(100)) + "go: module not found\n")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match=r"(?s)CI=true.*livekit-server could not be "
                       r"built \(make livekit-server installs it\).*line 99\ngo: module not found"):
        components.missing("livekit-server could not be built", "livekit-server", log)
    assert "line 75" not in components.log_tail(log) and "line 76" in components.log_tail(log)
    monkeypatch.setenv("CI", "")
    with pytest.raises(pytest.skip.Exception, match="go: module not found"):
        components.missing("livekit-server could not be built", "livekit-server", log)
    assert "make never tried" in components.log_tail(tmp_path / "absent.log")


def test_needs_skips_outside_ci_and_runs_under_ci_where_make_provides_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from tests import components

    def skips(mark: pytest.MarkDecorator) -> bool:
        return bool(mark.mark.args[0])

    absent = "breezert_no_such_module_xyz"
    monkeypatch.setenv("CI", "")
    assert skips(components.needs(absent)) and not skips(components.needs("json"))
    assert "make install installs it" in components.needs(absent).mark.kwargs["reason"]
    monkeypatch.setenv("CI", "true")
    assert not skips(components.needs(absent))  # runs, and fails on the missing module
    assert skips(components.needs(absent, provided=False))  # make provides none here


def test_the_in_process_product_runs_at_the_agents_priority_and_gets_its_own_back() -> None:
    import os
    import threading

    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    with realtime.agent_priority_here():
        inside = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before
    try:  # the right to raise priority (CAP_SYS_NICE: root, as make test runs in CI)
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), before - 1)
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), before)
    except OSError:
        assert inside == before
    else:
        assert inside == realtime.AGENT_NICE
