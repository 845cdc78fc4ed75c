"""The machine under the real-room tests: who else uses its CPU, and the agent side's priority.

Owns: ``CpuMeter`` (CPU used over an interval by processes outside this test's process tree:
other sessions' builds and test runs on a shared box), ``wait_for_quiet`` and
``agent_priority``, which the fixtures run in the server's and the worker's child processes.

Why: on two shared cores a real-time turn needs the agent's engine thread to get a core when it
wants one. Measured with the engine thread's step time split (``room_worker.StepClock``): two
busy loops elsewhere on the box made it wait 1.9-6.2 s in the runqueue per 2.0 s turn (heard as
3.1-8.2 s), one busy loop 0.65-0.85 s (gaps of 60-770 ms); with the agent side at ``nice -10``
those were 0.64-1.07 s and 0.18-0.50 s (one loop: five turns real-time of five). Load from this
test's own listeners (Chromium, the ``livekit.rtc`` participant) is ours and counts against us.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

AGENT_NICE = int(os.environ.get("BREEZERT_TEST_AGENT_NICE", "-10"))
"""Niceness of the LiveKit server and the agent worker: a real-time agent host gives its agent
the CPU before unrelated work. Needs CAP_SYS_NICE (root here); without it they run at 0."""
FOREIGN_LOAD_LIMIT = 0.25
"""Cores of foreign CPU use, averaged over a turn, above which the turn says more about the box
than about the agent (a quiet box measures 0.00-0.05)."""
_HZ = os.sysconf("SC_CLK_TCK")


def agent_priority() -> None:
    """``preexec_fn`` of the server and the worker: ``nice(AGENT_NICE)`` where permitted."""
    try:
        os.nice(AGENT_NICE)
    except OSError:
        pass


def _busy_ticks() -> int:
    """Clock ticks all CPUs spent busy since boot (user, nice, system, irq, softirq, steal)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(fields[0:3]) + sum(fields[5:8])


def _processes() -> dict[int, tuple[int, str, int]]:
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


def _tree(table: dict[int, tuple[int, str, int]], root: int) -> set[int]:
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


def _own_ticks(root: int) -> int:
    """CPU ticks of ``root`` and every live descendant (their children that exited included)."""
    table = _processes()
    return sum(table[pid][2] for pid in _tree(table, root) if pid in table)


def _ticks_by_part(parts: dict[str, int]) -> dict[str, int]:
    """CPU ticks of each named process tree (``parts``: name -> root pid; a process in two
    trees counts in the innermost); of the rest of this test's own tree, Chromium is
    ``browser``, ``livekit-server`` is ``server`` and the others ``test``."""
    table = _processes()
    owner: dict[int, str] = {}
    for pid in _tree(table, os.getpid()):
        command = table[pid][1].lower()
        owner[pid] = ("browser" if "chrom" in command else
                      "server" if command.startswith("livekit-server") else "test")
    for name, root in parts.items():
        for pid in _tree(table, root):
            owner[pid] = name
    ticks = dict.fromkeys([*parts, "browser", "server", "test"], 0)
    for pid, name in owner.items():
        ticks[name] += table[pid][2] if pid in table else 0
    return ticks


class CpuSplit:
    """Cores used since construction by each named process tree (the agent worker), the LiveKit
    server, this test's listeners (Chromium, this process) and foreign work: where the box's
    cores went during a turn, for a reader of a missed one."""

    def __init__(self, parts: dict[str, int]) -> None:
        self._parts = parts
        self._start = (time.monotonic(), _busy_ticks(), _ticks_by_part(parts))

    def cores(self) -> dict[str, float]:
        wall = time.monotonic() - self._start[0]
        now = _ticks_by_part(self._parts)
        used = {name: max(now[name] - self._start[2].get(name, 0), 0) for name in now}
        used["foreign"] = max(_busy_ticks() - self._start[1] - sum(used.values()), 0)
        return {name: round(ticks / _HZ / wall, 2) if wall > 0 else 0.0
                for name, ticks in used.items()}


class CpuMeter:
    """Foreign CPU (cores) since construction or the last ``reset``."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._start = (time.monotonic(), _busy_ticks(), _own_ticks(os.getpid()))

    def foreign_cores(self) -> float:
        wall = time.monotonic() - self._start[0]
        busy = _busy_ticks() - self._start[1]
        own = _own_ticks(os.getpid()) - self._start[2]
        return max(busy - own, 0) / _HZ / wall if wall > 0 else 0.0


async def wait_for_quiet(timeout_s: float = 30.0, window_s: float = 0.5) -> float:
    """Waits (up to ``timeout_s``) for a ``window_s`` with less than ``FOREIGN_LOAD_LIMIT``
    cores of foreign load; returns the last window's figure (printed when the box stayed busy)."""
    deadline = time.monotonic() + timeout_s
    while True:
        meter = CpuMeter()
        await asyncio.sleep(window_s)
        load = meter.foreign_cores()
        if load < FOREIGN_LOAD_LIMIT or time.monotonic() > deadline:
            if load >= FOREIGN_LOAD_LIMIT:
                print(f"the box stayed busy: {load:.2f} cores of foreign load after {timeout_s} s")
            return load
