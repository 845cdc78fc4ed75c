"""Measures the suite's latency figures and writes their bounds: ``tests/latency_bounds.json``.

    PYTHONPATH=runtime:. .venv/bin/python bench/latency_bounds.py --runs 10 --tier integration
    PYTHONPATH=runtime:. .venv/bin/python bench/latency_bounds.py --runs 3 --tier livekit
    PYTHONPATH=runtime:. .venv/bin/python bench/latency_bounds.py --runs 10 --tier interrupt
    PYTHONPATH=runtime:. .venv/bin/python bench/latency_bounds.py --runs 3 --tier over_ttfb

Runs the very tests that check each figure (``tests.latency.check``), ``--runs`` times each in
a fresh pytest process, with ``BREEZERT_LATENCY_RECORD`` (each check appends its measured figure)
and ``BREEZERT_LATENCY_UNBOUNDED=1`` (nothing fails on the old bounds while measuring). A bound is
the figures' p95 times ``--margin`` (2.0: a regression that doubles the tail goes red, the spread
of a two-core box does not), rounded up to the millisecond, and at most a listener's perceptual
limit where one applies (``CAPS``: the interrupt, 200 ms). Bounds of a tier not measured this
time keep their entry. Records the date, commit, machine and the foreign CPU load (other
processes on the box) during each tier's runs, since figures from a busy box are wider; each
bound names its CPU (the file's ``machine`` is the last measurement's).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.latency import BOUNDS_FILE, RECORD_ENV, UNBOUNDED_ENV  # noqa: E402
from tests.realtime import CpuMeter  # noqa: E402

TIERS: dict[str, dict[str, list[str]]] = {
    "integration": {
        "agent_stream_ttfb": [
            "tests/integration/test_agent_engine.py::"
            "test_stream_one_request_per_turn_with_segments_in_order"],
        "first_audio_after_idle_timeout": [
            "tests/integration/test_server_limits.py::"
            "test_idle_open_turns_do_not_starve_the_next_caller"],
        "webrtc_first_audio": [
            "tests/integration/test_server_webrtc.py::test_opus_turn_first_audio_then_cancel"],
        "chromium_first_audible": ["tests/integration/test_server_chromium.py"],
    },
    "livekit": {
        "sip_first_audio": [
            "tests/livekit/test_sip.py::test_a_call_hears_the_agents_greeting_whole"],
        "room_python_first_audio": ["tests/livekit/test_room_python.py"],
        "room_browser_first_audio": ["tests/livekit/test_room_latency.py"],
    },
    "over_ttfb": {  # a listener's first audio less the agent's TTFB in the same turn
        "room_python_over_ttfb": ["tests/livekit/test_room_latency.py"],
        "room_browser_over_ttfb": ["tests/livekit/test_room_latency.py"],
    },
    "interrupt": {  # one figure per livekit run: this tier gathers more of them
        "room_interrupt_stop": [
            "tests/livekit/test_room_python.py::"
            "test_interrupt_stops_the_listener_and_frees_the_request_then_a_second_turn"],
    },
}
"""Tier -> bound name -> the tests that measure it (a test may measure several)."""
CAPS: dict[str, tuple[float, str]] = {
    "room_interrupt_stop": (
        200.0, "what a listener perceives: people take the floor about 200 ms after the other "
               "speaker stops (mean turn-transition gap across ten languages, Stivers et al., "
               "PNAS 2009); an agent still audible later than that talks over the user's reply"),
}
"""Bound name -> (ms, why): a ceiling on ``p95 x margin`` where a listener's perception sets one."""


def _machine() -> dict[str, Any]:
    cpu = next((line.split(":", 1)[1].strip() for line in
                Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")),
               platform.processor())
    return {"host": platform.node(), "cpu": cpu, "cores": os.cpu_count(),
            "python": platform.python_version()}


def _name_machines(doc: dict[str, Any]) -> None:
    """Names the machine in every bound (``cpu``) and run (``machine``) measured before each
    carried its own (the file's one ``machine`` was theirs), so that a tier measured again on
    another box leaves the others' provenance true."""
    old = doc.get("machine")
    if not old:
        return
    for entry in doc.get("bounds", {}).values():
        entry.setdefault("cpu", old["cpu"])
    for run in doc.get("runs", []):
        run.setdefault("machine", old)


def _commit() -> str:
    """The commit the bounds were measured at (``breezert_bench.provenance``), with a note
    when the tree had uncommitted changes."""
    from breezert_bench.provenance import git_commit

    commit, dirty = git_commit()
    return commit + (" (dirty tree)" if dirty else "")


def measure(tier: str, runs: int) -> tuple[dict[str, list[float]], float, list[str]]:
    """Runs the tier's tests ``runs`` times: figures by bound name (ms), the mean foreign load
    (cores) over the runs, and the failures' summaries (a run's other assertions still count)."""
    tests = sorted({test for nodes in TIERS[tier].values() for test in nodes})
    figures: dict[str, list[float]] = {name: [] for name in TIERS[tier]}
    failures: list[str] = []
    meter = CpuMeter()
    with tempfile.TemporaryDirectory() as folder:
        record = Path(folder) / "figures.jsonl"
        env = {**os.environ, RECORD_ENV: str(record), UNBOUNDED_ENV: "1",
               "PYTHONPATH": os.pathsep.join([str(REPO / "runtime"), str(REPO),
                                              os.environ.get("PYTHONPATH", "")])}
        for run in range(runs):
            start = time.monotonic()
            done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                   *tests], cwd=REPO, env=env, capture_output=True,
                                  text=True)
            tail = done.stdout.strip().splitlines()[-1:] or ["(no output)"]
            print(f"{tier} run {run + 1}/{runs}: {tail[0]} ({time.monotonic() - start:.0f} s)",
                  flush=True)
            if done.returncode != 0:
                failures.append(tail[0])
                errors = [line for line in done.stdout.splitlines() if line.startswith("E ")]
                for line in done.stdout.splitlines():  # pytest's short summary of each failure
                    if line.startswith(("FAILED", "ERROR")):
                        print(f"  {line[:300]}", flush=True)
                for line in errors[:4]:  # what the first failure asserted
                    print(f"    {line[:300]}", flush=True)
        for line in record.read_text().splitlines() if record.exists() else []:
            row = json.loads(line)
            figures.setdefault(row["name"], []).append(float(row["ms"]))
    return figures, round(meter.foreign_cores(), 2), failures


def bound_ms(name: str, p95_ms: float, margin: float) -> float:
    """``ceil(p95 x margin)``, at most the name's perceptual cap (``CAPS``)."""
    return min(float(math.ceil(p95_ms * margin)), CAPS.get(name, (math.inf, ""))[0])


def bound_entry(name: str, values: list[float], margin: float, tests: list[str], tier: str,
                load: float) -> dict[str, Any]:
    data = np.array(values, dtype=float)
    p95 = round(float(np.percentile(data, 95)), 1)
    entry = {"bound_ms": bound_ms(name, p95, margin), "p50_ms": round(float(np.median(data)), 1),
             "p95_ms": p95, "max_ms": round(float(data.max()), 1), "n": int(data.size),
             "tier": tier, "tests": tests, "foreign_load_cores": load,
             "measured": datetime.date.today().isoformat(), "cpu": _machine()["cpu"]}
    return {**entry, **_cap(name)}


def _cap(name: str) -> dict[str, Any]:
    return {"cap_ms": CAPS[name][0], "cap_reason": CAPS[name][1]} if name in CAPS else {}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--tier", choices=[*TIERS, "all"], default="integration")
    parser.add_argument("--margin", type=float, default=2.0)
    parser.add_argument("--out", type=Path, default=BOUNDS_FILE)
    parser.add_argument("--recompute", action="store_true",
                        help="measure nothing: recompute each bound from its stored p95")
    args = parser.parse_args(argv)
    doc: dict[str, Any] = (json.loads(args.out.read_text()) if args.out.exists()
                           else {"bounds": {}})
    if doc.get("margin", args.margin) != args.margin:
        parser.error(f"{args.out} holds bounds at margin {doc['margin']}: measure every tier "
                     "again into a new file to change it")
    tiers = [] if args.recompute else TIERS if args.tier == "all" else [args.tier]
    _name_machines(doc)
    for name, entry in doc["bounds"].items() if args.recompute else ():
        entry.update(bound_ms=bound_ms(name, entry["p95_ms"], args.margin), **_cap(name))
    for tier in tiers:
        figures, load, failures = measure(tier, args.runs)
        for name, values in figures.items():
            if name not in TIERS[tier]:
                continue  # a figure its tests also check, measured by its own tier
            if not values:
                print(f"{name}: no figure measured (the test failed or skipped before it)")
                continue
            doc["bounds"][name] = bound_entry(name, values, args.margin,
                                              TIERS[tier].get(name, []), tier, load)
            entry = doc["bounds"][name]
            print(f"{name}: p50 {entry['p50_ms']} ms, p95 {entry['p95_ms']} ms, max "
                  f"{entry['max_ms']} ms over {entry['n']}: bound {entry['bound_ms']:.0f} ms")
        if failures:
            print(f"{tier}: {len(failures)} runs failed an assertion: {failures}")
    doc.update({"schema": "breezert.latency_bounds/1", "margin": args.margin,
                "rule": f"bound = ceil(p95 x {args.margin}) of the figures the tests measure, "
                        "at most cap_ms where a listener's perception sets one",
                "profile": "embedded cpu-tiny (random tiny model), CPU, torch 1 thread",
                "machine": _machine()})
    runs = doc.setdefault("runs", [])
    for tier in tiers:
        runs.append({"tier": tier, "commit": _commit(), "machine": _machine(),
                     "command_line": "bench/latency_bounds.py " + " ".join(argv or sys.argv[1:]),
                     "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                         timespec="seconds")})
    doc["bounds"] = dict(sorted(doc["bounds"].items()))
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
