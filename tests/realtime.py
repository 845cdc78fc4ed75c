"""The real-time checks' one retry: granted only when the machine was measurably starved.

Owns: ``CpuMeter`` (CPU used over an interval by processes outside this test's process tree:
other sessions' builds and test runs on a shared box, steal time included, read from
``/proc``), ``MachineStops`` (stops of the whole machine, which no process can see in ``/proc``:
a probe at the top real-time priority that should wake every 2 ms), ``wait_for_quiet``, and
``retry_if_starved``: a real-time attempt that misses is run again at most once, and only when,
over that attempt, ``CpuMeter`` says other work took at least ``FOREIGN_LOAD_LIMIT`` cores or
``MachineStops`` saw the machine stop for ``MACHINE_STOP_LIMIT_S`` or longer. The miss itself is
never the evidence: a late sender on a quiet box fails at once, and so does a second miss. Each
retry is recorded on the test (``record_property``-style ``user_properties``, so it lands in
JUnit XML) and listed in pytest's terminal summary by ``tests/conftest.py``.

Must not: retry anything but the ``misses`` it is given, or more than once.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import os
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

T = TypeVar("T")

FOREIGN_LOAD_LIMIT = 0.25
"""Cores of foreign CPU use, averaged over an attempt, from which the attempt says more about the
box than about the product (a quiet two-core box measures 0.00-0.05 here)."""
MACHINE_STOP_LIMIT_S = 0.040
"""A stop of the whole machine (no process runs, not even one at the top real-time priority) from
which an attempt says more about the box than about the product: one that long turns a 20 ms
packet interval into a gap over the real-time checks' 60 ms bound by itself. Measured on this
shared two-core VM (4 Dec, SIP calls with ``MachineStops`` running): such a stop froze the agent's
sender, LiveKit's server and LiveKit SIP's 20 ms clock together, and the caller heard it whole
(67 ms in a 50 ms stop, 62 ms in a 53 ms one, 44 ms in a 31 ms one). The guest counts none of
it as busy (its steal time stays near 0 here), so ``CpuMeter`` cannot see it: a fresh clone's
SIP test heard a 65 ms gap at 0.00 cores of foreign load with the agent's queue never dry."""
AGENT_NICE = int(os.environ.get("BREEZERT_TEST_AGENT_NICE", "-10"))
"""Niceness of the product under a real-time check (the LiveKit server and agent worker, the
in-process server of the integration tests): a real-time agent host gives its agent the CPU
before unrelated work. Needs CAP_SYS_NICE (root here); without it they run at 0."""
RETRY_PROPERTY = "realtime_retry"
"""The ``user_properties`` key of a retry (one per retried check; its value says why)."""
_HZ = os.sysconf("SC_CLK_TCK")

current_item: pytest.Item | None = None
"""The test running now (set by ``tests/conftest.py``'s ``pytest_runtest_call``)."""


def busy_ticks() -> int:
    """Clock ticks all CPUs spent busy since boot (user, nice, system, irq, softirq, steal)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(fields[0:3]) + sum(fields[5:8])


def processes() -> dict[int, tuple[int, str, int]]:
    """Every live process: pid -> (parent, command name, CPU ticks of it and its reaped
    children: utime stime cutime cstime)."""
    table: dict[int, tuple[int, str, int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        table[int(entry)] = (int(fields[1]), stat[stat.index("(") + 1:stat.rindex(")")],
                             sum(int(v) for v in fields[11:15]))
    return table


def tree(table: dict[int, tuple[int, str, int]], root: int) -> set[int]:
    """``root`` and its live descendants."""
    ours = {root}
    changed = True  # pids are not ordered by ancestry: grow the set to a fixpoint
    while changed:
        changed = False
        for pid, (parent, _, _) in table.items():
            if parent in ours and pid not in ours:
                ours.add(pid)
                changed = True
    return ours


def own_ticks(root: int) -> int:
    """CPU ticks of ``root`` and every live descendant (their children that exited included)."""
    table = processes()
    return sum(table[pid][2] for pid in tree(table, root) if pid in table)


class CpuMeter:
    """Foreign CPU (cores) since construction or the last ``reset``: all CPUs' busy time less
    this process tree's (the product under test and its listeners are ours). Read in /proc's
    1/HZ ticks per CPU, so a window must be long against 10 ms: the suite reads it over 0.5 s or
    more (a 20 ms window read 2.1 cores on a two-core box)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._start = (time.monotonic(), busy_ticks(), own_ticks(os.getpid()))

    def foreign_cores(self) -> float:
        wall = time.monotonic() - self._start[0]
        busy = busy_ticks() - self._start[1]
        own = own_ticks(os.getpid()) - self._start[2]
        return max(busy - own, 0) / _HZ / wall if wall > 0 else 0.0


_PROBE = """
import ctypes, os, signal, time
ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: it ends with the test process
try:
    os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(50))
    print("fifo", flush=True)
except (OSError, AttributeError) as exc:
    print("normal", exc, flush=True)
due = time.monotonic() + 0.002
while True:
    time.sleep(max(due - time.monotonic(), 0.0))
    now = time.monotonic()
    if now - due > 0.005:
        print(f"{due!r} {now!r}", flush=True)
    due = now + 0.002
"""


class MachineStops:
    """Stops of the whole machine, from a child process at ``SCHED_FIFO`` priority 50 (above
    every process of the suite and of other work) that sleeps 2 ms at a time and reports each
    wake-up more than 5 ms late: nothing it shares the CPUs with can hold it off, so a late one
    means that no process of the box ran, e.g. a VM its host did not run. One per test session
    (``shared``), stopped at exit. Without the right to real-time priority (root here, as
    ``make test`` runs in CI) it reports nothing: its lateness would then be load, not stops."""

    _shared: MachineStops | None = None

    def __init__(self) -> None:
        self.stops: list[tuple[float, float]] = []  # (from, to) on time.monotonic()'s clock
        self.real_time = False
        self._proc = subprocess.Popen([sys.executable, "-c", _PROBE], stdout=subprocess.PIPE,
                                      stdin=subprocess.DEVNULL, text=True)
        assert self._proc.stdout is not None
        self.real_time = self._proc.stdout.readline().startswith("fifo")
        self._reader = threading.Thread(target=self._read, name="machine-stops", daemon=True)
        self._reader.start()

    @classmethod
    def shared(cls) -> MachineStops:
        if cls._shared is None:
            cls._shared = cls()
            atexit.register(cls._shared.close)
        return cls._shared

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            due, woke = (float(v) for v in line.split())
            if self.real_time:
                self.stops.append((due, woke))

    def longest_s(self, since: float, until: float) -> float:
        """The longest stop overlapping ``[since, until]``; 0.0 when none (or no probe)."""
        return max((b - a for a, b in self.stops if b > since and a < until), default=0.0)

    def close(self) -> None:
        self._proc.kill()
        self._proc.wait()


def machine_stops() -> MachineStops:
    """The session's ``MachineStops``, started by the first real-time attempt."""
    return MachineStops.shared()


async def wait_below(start: Callable[[], Callable[[], float]], limit: float, window_s: float,
                     timeout_s: float) -> tuple[float, bool]:
    """Measures windows of ``window_s`` (``start()`` opens one and returns its reading) until one
    reads under ``limit`` or ``timeout_s`` has passed; returns the last reading and whether it
    was under."""
    deadline = time.monotonic() + timeout_s
    while True:
        read = start()
        await asyncio.sleep(window_s)
        value = read()
        if value < limit or time.monotonic() > deadline:
            return value, value < limit


async def wait_for_quiet(timeout_s: float = 30.0, window_s: float = 0.5) -> float:
    """Waits (up to ``timeout_s``) for a ``window_s`` with less than ``FOREIGN_LOAD_LIMIT``
    cores of foreign load; returns the last window's figure (printed when the box stayed busy)."""
    load, quiet = await wait_below(lambda: CpuMeter().foreign_cores, FOREIGN_LOAD_LIMIT,
                                   window_s, timeout_s)
    if not quiet:
        print(f"the box stayed busy: {load:.2f} cores of foreign load after {timeout_s} s")
    return load


def record_retry(reason: str) -> None:
    """Records a retry of the running test: in its ``user_properties`` (JUnit XML) and on
    stdout; ``tests/conftest.py`` lists them in the terminal summary."""
    print(f"REAL-TIME RETRY: {reason}")
    if current_item is not None:
        current_item.user_properties.append((RETRY_PROPERTY, reason))


def starved(load: float, stopped_s: float = 0.0) -> bool:
    return load >= FOREIGN_LOAD_LIMIT or stopped_s >= MACHINE_STOP_LIMIT_S


def _machine(load: float, stopped_s: float) -> str:
    return (f"{load:.2f} cores of foreign load and the machine stopped for at most "
            f"{stopped_s * 1000:.0f} ms")


async def retry_if_starved(attempt: Callable[[], Awaitable[T]],
                           misses: tuple[type[BaseException], ...] = (AssertionError,),
                           what: str = "real-time check") -> T:
    """Runs ``attempt`` once the box is quiet (up to 5 s of waiting); when it raises one of
    ``misses`` while ``CpuMeter`` measured ``FOREIGN_LOAD_LIMIT`` cores or more of foreign
    load during it, or ``MachineStops`` a stop of ``MACHINE_STOP_LIMIT_S`` or longer, records
    the retry with its reason and runs it once more. A miss on a box that was not starved, or a
    second miss, fails with the figures."""
    stops = machine_stops()
    await wait_for_quiet(timeout_s=5.0)
    meter = CpuMeter()
    since = time.monotonic()
    try:
        return await attempt()
    except misses as miss:
        load = meter.foreign_cores()
        stopped = stops.longest_s(since, time.monotonic())
        if not starved(load, stopped):
            raise type(miss)(f"{miss} ({_machine(load, stopped)} during the attempt: the "
                             "machine was not starved, no retry)") from None
        first = f"{what}: {miss} with {_machine(load, stopped)} (starved)"
    record_retry(first)
    await wait_for_quiet(timeout_s=15.0)
    meter = CpuMeter()
    since = time.monotonic()
    try:
        return await attempt()
    except misses as miss:
        stopped = stops.longest_s(since, time.monotonic())
        raise type(miss)(f"{miss} ({_machine(meter.foreign_cores(), stopped)}) on the one "
                         f"retry; the first attempt: {first}") from None


@contextlib.contextmanager
def agent_priority_here() -> Iterator[None]:
    """Every thread of this process (the in-process server's engine thread, its event loop) at
    ``AGENT_NICE`` while inside, as the LiveKit tests run their server and worker; threads and
    processes started inside inherit it. Linux keeps a niceness per thread: each is set and
    restored; without the right to raise priority, nothing changes."""
    previous: dict[int, int] = {}
    for tid in (int(t) for t in os.listdir("/proc/self/task")):
        try:
            previous[tid] = os.getpriority(os.PRIO_PROCESS, tid)
            os.setpriority(os.PRIO_PROCESS, tid, AGENT_NICE)
        except OSError:  # the thread ended, or no CAP_SYS_NICE
            previous.pop(tid, None)
    try:
        yield
    finally:
        for tid, nice in previous.items():
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, tid, nice)


def retried_when_starved(*misses: type[BaseException],
                         what: str = "") -> Callable[[Callable[..., Awaitable[T]]],
                                                     Callable[..., Awaitable[T]]]:
    """A decorator for an async test of the in-process product whose whole body is one
    real-time attempt: the body runs under ``retry_if_starved`` (fixtures are shared by both
    runs) with the process at the agent's priority (``agent_priority_here``)."""
    def wrap(test: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
        @functools.wraps(test)
        async def run(*args: object, **kwargs: object) -> T:
            with agent_priority_here():
                return await retry_if_starved(lambda: test(*args, **kwargs),
                                              misses or (AssertionError,), what or test.__name__)
        return run
    return wrap
