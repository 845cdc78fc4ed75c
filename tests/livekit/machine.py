"""The machine under the real-room tests: who else uses its CPU, and the agent side's priority.

Owns: ``CpuSplit`` (where the box's cores went during a turn, by process tree) and
``agent_priority``, which the fixtures run in the server's, LiveKit SIP's and the worker's child
processes.
The foreign-load meter and the one retry it grants are ``tests/realtime.py``'s.

Why: on two shared cores a real-time turn needs the agent's engine thread to get a core when it
wants one. Measured with the engine thread's step time split (``room_worker.StepClock``): two
busy loops elsewhere on the box made it wait 1.9-6.2 s in the runqueue per 2.0 s turn (heard as
3.1-8.2 s), one busy loop 0.65-0.85 s (gaps of 60-770 ms); with the agent side at ``nice -10``
those were 0.64-1.07 s and 0.18-0.50 s (one loop: five turns real-time of five). Load from this
test's own listeners (Chromium, the ``livekit.rtc`` participant) is ours and counts against us.
"""

from __future__ import annotations

import os
import time

from tests.realtime import AGENT_NICE, busy_ticks, processes, tree



def agent_priority() -> None:
    """``preexec_fn`` of the server and the worker: ``nice(AGENT_NICE)`` where permitted."""
    try:
        os.nice(AGENT_NICE)
    except OSError:
        pass


def _ticks_by_part(parts: dict[str, int]) -> dict[str, int]:
    """CPU ticks of each named process tree (``parts``: name -> root pid; a process in two
    trees counts in the innermost); of the rest of this test's own tree, Chromium is
    ``browser``, ``livekit-server`` is ``server`` and the others ``test``."""
    table = processes()
    owner: dict[int, str] = {}
    for pid in tree(table, os.getpid()):
        command = table[pid][1].lower()
        owner[pid] = ("browser" if "chrom" in command else
                      "server" if command.startswith("livekit-server") else "test")
    for name, root in parts.items():
        for pid in tree(table, root):
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
        self._start = (time.monotonic(), busy_ticks(), _ticks_by_part(parts))

    def cores(self) -> dict[str, float]:
        wall = time.monotonic() - self._start[0]
        now = _ticks_by_part(self._parts)
        used = {name: max(now[name] - self._start[2].get(name, 0), 0) for name in now}
        used["foreign"] = max(busy_ticks() - self._start[1] - sum(used.values()), 0)
        return {name: round(ticks / os.sysconf("SC_CLK_TCK") / wall, 2) if wall > 0 else 0.0
                for name, ticks in used.items()}
