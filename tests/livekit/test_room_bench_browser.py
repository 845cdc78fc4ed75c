"""``bench/room.py --browser-listeners`` end to end, small: a real ``livekit-server``, the agent
worker with the tiny CPU engine, 2 rooms in variant ``listener``, one played by a Python
listener and one by headless Chromium with livekit-client (``bench/room_browser.py``), one turn
each.

Owns: that both kinds of listener hear their turn through the same trigger protocol, that the
browser's ``examples/playout_reporter.js`` reports reach the engine for the browser's own turn
(the agent counts them per room as ``livekit-client`` playback reports), that every turn and
room says its ``listener_kind`` and that the summary gives first audio and gaps per kind. Must
not: judge latency or gaps (the tiny model and Chromium on shared cores). A missing Chromium or
livekit-client fails under ``CI=true`` and skips elsewhere (``tests/components.missing``), as
a missing server does (``run_room_bench``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from breezert_bench.chromium import listener_page_missing

from tests.components import REPO, missing
from tests.livekit.conftest import run_room_bench

pytestmark = pytest.mark.livekit

BUDGET_S = 45  # 19-25 s on the two shared cores (5 Dec), most of it the agent's and Chromium's start


def test_a_browser_and_a_python_listener_hear_their_turns_in_one_run(tmp_path: Path) -> None:
    lacking = listener_page_missing()
    if lacking is not None:
        missing(lacking, "chromium livekit-web", REPO / ".cache" / "chromium-install.log")
    out = tmp_path / "room.json"
    done, wall = run_room_bench(
        tmp_path, "--listeners", "2", "--browser-listeners", "1", "--turns", "1",
        "--variants", "listener", "--out", str(out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["provenance"]["browser_listeners"] == 1
    [run] = doc["runs"]
    summary = run["summary"]
    assert summary["errors"] == [], summary["errors"]
    assert summary["heard"] == summary["turns"] == 2
    turns = {t["listener_kind"]: t for t in run["requests"]}
    rooms = {r["listener_kind"]: r for r in run["rooms"]}
    assert sorted(turns) == sorted(rooms) == ["browser", "python"], (turns.keys(), rooms.keys())
    for kind in ("python", "browser"):
        by_kind = summary["by_listener_kind"][kind]
        assert by_kind["heard"] == by_kind["turns"] == by_kind["rooms"] == 1, (kind, by_kind)
        heard = by_kind["first_heard_after_say"]["p50"]
        assert 0 < heard < 5.0, (kind, heard)
        assert turns[kind]["agent"]["reports"].get("livekit-client", 0) > 0, (kind, turns[kind])
        assert rooms[kind]["reports_sent"] > 0, (kind, rooms[kind])
    browser = turns["browser"]
    assert browser["sent"] < browser["agent"]["received"], browser  # one clock for both
    assert browser["heard"]["first_arrival"] > browser["agent"]["playback_started"], browser
    assert browser["jitter_buffer_s"] is not None
    assert run["engine_counters"].get("playback_reports_livekit-client", 0) > 0
    assert "browser listeners" in done.stdout  # the table's per-kind rows
    assert wall < BUDGET_S, f"the run took {wall:.0f} s (budget {BUDGET_S} s)"
