"""Latency bounds from committed measurements (``tests/latency_bounds.json``), and their check.

Owns: ``bound_s`` (a named bound: the measured p95 on the two-core CPU machine, tiny profile,
times the file's stated margin) and ``check`` (records the measured figure, then fails with
``LatencyMiss``, an ``AssertionError`` that ``realtime.retry_if_starved`` may retry, when it is
over). ``bench/latency_bounds.py`` measures the figures by running the very tests that check
them with ``BREEZERT_LATENCY_RECORD=path`` (each ``check`` appends its figure there as a JSON
line) and ``BREEZERT_LATENCY_UNBOUNDED=1`` (nothing fails while measuring), and rewrites the file.

Must not: hold a bound that is not in the file (no seconds typed into a test).
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

BOUNDS_FILE = Path(__file__).with_name("latency_bounds.json")
RECORD_ENV = "BREEZERT_LATENCY_RECORD"
UNBOUNDED_ENV = "BREEZERT_LATENCY_UNBOUNDED"


class LatencyMiss(AssertionError):
    """A latency over its committed bound."""


@functools.lru_cache(maxsize=1)
def bounds() -> dict[str, Any]:
    return dict(json.loads(BOUNDS_FILE.read_text()))


def bound_s(name: str) -> float:
    """The bound ``name`` in seconds (``KeyError`` names a bound the file lacks)."""
    return float(bounds()["bounds"][name]["bound_ms"]) / 1000


def describe(name: str) -> str:
    entry, doc = bounds()["bounds"][name], bounds()
    cap = (f", capped at {entry['cap_ms']:.0f} ms: {entry['cap_reason']}" if "cap_ms" in entry
           else "")
    return (f"bound {entry['bound_ms']:.0f} ms (p95 {entry['p95_ms']:.0f} ms x {doc['margin']} "
            f"over {entry['n']} measurements on {doc['machine']['cores']} cores of "
            f"{entry.get('cpu', doc['machine']['cpu'])}, "
            f"{entry['measured']}, {BOUNDS_FILE.name}{cap})")


def check(name: str, measured_s: float) -> None:
    """Records ``measured_s`` for ``bench/latency_bounds.py`` when asked, and raises
    ``LatencyMiss`` when it is over ``bound_s(name)``."""
    record = os.environ.get(RECORD_ENV)
    if record:
        with open(record, "a", encoding="utf-8") as out:
            out.write(json.dumps({"name": name, "ms": round(measured_s * 1000, 3)}) + "\n")
    if os.environ.get(UNBOUNDED_ENV) == "1":
        return
    if measured_s > bound_s(name):
        raise LatencyMiss(f"{name}: {measured_s * 1000:.0f} ms, over its {describe(name)}")
