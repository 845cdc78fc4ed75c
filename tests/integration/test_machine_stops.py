"""``tests.realtime.MachineStops``, the probe behind the real-time checks' retry on a stopped
machine, read back against a stop made on purpose (real time: not a unit test)."""

from __future__ import annotations

import signal
import time

import pytest

from tests import realtime

pytestmark = pytest.mark.integration


def test_machine_stops_sees_its_probe_held_off() -> None:
    """A stop of the probe (SIGSTOP for 0.1 s: as if the machine had not run it) is read back as
    one stop of about that length where it runs at real-time priority (root, as ``make test``
    runs in CI), and as none where it may not (its lateness would be load, not a stop)."""
    stops = realtime.MachineStops()
    try:
        time.sleep(0.05)
        held = time.monotonic()
        stops._proc.send_signal(signal.SIGSTOP)
        time.sleep(0.1)
        stops._proc.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 2.0
        while not stops.stops and time.monotonic() < deadline:
            time.sleep(0.01)
        longest = stops.longest_s(held - 0.01, time.monotonic())
        if stops.real_time:
            assert 0.09 <= longest <= 0.2, stops.stops
        else:
            assert stops.stops == []
    finally:
        stops.close()
