"""``breezert-bench soak`` (short form): a bounded mix of normal and faulty traffic against a
started ``breezert serve``; no gauge left busy, RSS growth bounded, every answer as expected."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from breezert_bench.soak import _leaks, parse_metrics

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


def test_short_soak_finds_no_leak(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO / "runtime"), str(REPO / "bench"), str(REPO), os.environ.get("PYTHONPATH", "")])}
    out = tmp_path / "soak.json"
    run = subprocess.run(
        [sys.executable, "-m", "breezert_bench", "soak", "--duration", "20", "--burst-every", "3",
         "--out", str(out)], env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["ok"] and not report["leaks"] and not report["unexpected"]
    assert report["requests"] >= 40 and report["duration_s"] >= 20
    assert report["rss_start_bytes"] and report["rss_end_bytes"]
    kinds = report["by_kind"]
    for kind in ("http_stream", "http_abort", "ws_say", "ws_cancel", "ws_idle_turn",
                 "ws_drop", "bad_http", "ws_bad", "burst"):
        assert kinds.get(kind), kind
    assert report["statuses"].get("burst:503"), "the burst never went past capacity"


def test_leak_check_flags_busy_gauges() -> None:
    idle = parse_metrics('breezert_running_requests 0\nbreezert_kv_blocks{state="free"} 8\n'
                         "breezert_kv_blocks_total 8\n")
    assert _leaks(idle) == []
    busy = parse_metrics('breezert_running_requests 1\nbreezert_kv_blocks{state="free"} 6\n'
                         'breezert_kv_blocks_total 8\nbreezert_open_turns{kind="websocket"} 1\n')
    leaks = _leaks(busy)
    assert len(leaks) == 3 and any("KV blocks free 6.0 of 8.0" in leak for leak in leaks)
    assert _leaks({}) == ["the server exports no capacity gauges (breezert_running_requests)"]
