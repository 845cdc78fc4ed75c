"""Suite-wide rules: every test module declares exactly one kind marker; gpu tests need CUDA;
every real-time retry is reported.

Owns marker enforcement (collection fails when a module lacks its ``pytestmark`` or has two kinds),
the CUDA skip (a usage error instead under ``BREEZERT_REQUIRE_CUDA=1``, ``make test-gpu``), and
the report of ``tests/realtime.py``'s retries: the running test is made known
to it, and the terminal summary lists every retry with its reason (they are in the JUnit XML as
``realtime_retry`` properties). Must not import torch at module level: CPU-only runs stay
torch-free here.
"""

from __future__ import annotations

import functools
import os

import pytest

from tests import realtime
from tests.virtual_clock import virtual_clock  # noqa: F401  (the fixture, for every tier)

KIND_MARKERS = ("unit", "golden", "integration", "gpu", "livekit")


def _module_kinds(module: object) -> list[str]:
    marks = getattr(module, "pytestmark", [])
    if not isinstance(marks, (list, tuple)):
        marks = [marks]
    return [mark.name for mark in marks if getattr(mark, "name", None) in KIND_MARKERS]


@functools.lru_cache(maxsize=1)
def _cuda_available() -> bool:
    try:
        import torch
    except Exception:  # any import failure means: no usable CUDA
        return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    bad: dict[str, list[str]] = {}
    for item in items:
        module = item.getparent(pytest.Module)
        if module is None:
            continue
        kinds = _module_kinds(module.obj)
        if len(kinds) != 1:
            bad[module.nodeid] = kinds
    if bad:
        lines = [f"  {nodeid}: found {kinds or 'none'}" for nodeid, kinds in sorted(bad.items())]
        raise pytest.UsageError(
            "each test module needs exactly one of pytestmark = pytest.mark.{"
            + ",".join(KIND_MARKERS) + "}:\n" + "\n".join(lines)
        )
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if gpu_items and not _cuda_available() and os.environ.get("BREEZERT_REQUIRE_CUDA") == "1":
        raise pytest.UsageError(f"BREEZERT_REQUIRE_CUDA=1 (make test-gpu) and no CUDA here: "
                                f"{len(gpu_items)} gpu tests would only skip")
    if gpu_items and not _cuda_available():
        skip = pytest.mark.skip(reason="needs CUDA (torch.cuda.is_available() is False)")
        for item in gpu_items:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():  # type: ignore[no-untyped-def]
    """Tiny CPU models gain nothing from intra-op threads, and those stall whenever the other
    core is busy (CI has two): run the suite on one. Imported lazily, like the CUDA check."""
    try:
        import torch
    except Exception:  # torch-free runs (scheduler-only) need nothing here
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):  # type: ignore[no-untyped-def]
    """Makes the running test known to ``tests.realtime`` (its retries go on this item)."""
    realtime.current_item = item
    try:
        return (yield)
    finally:
        realtime.current_item = None


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Every real-time retry of the run with its reason (from the reports, so that runs under
    pytest-xdist list them too), and their count."""
    retries = [(report.nodeid, value)
               for reports in terminalreporter.stats.values() for report in reports
               if getattr(report, "when", None) == "call"
               for name, value in getattr(report, "user_properties", ())
               if name == realtime.RETRY_PROPERTY]
    if not retries:
        return
    terminalreporter.section("real-time retries (the machine was starved)")
    for nodeid, reason in retries:
        terminalreporter.line(f"{nodeid}: {reason}")
    terminalreporter.line(f"{len(retries)} real-time check(s) retried once")
