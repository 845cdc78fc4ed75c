"""``bench/room.py`` end to end, small, so the room benchmark cannot rot: a real
``livekit-server``, the agent worker with the tiny CPU engine, 2 listener rooms, 2 closed-loop
turns each in three feedback variants (two engine settings, so both workers start).

Owns: that every turn is heard and itemised (the transport up to the first sound apart from
the audio's quiet lead-in; the listener process's loop lateness; each room's join), that the ``listener`` variant's reports reach the
engine (as ``livekit-client`` playback reports) while ``agent-queue`` reports only the agent's
source and ``predictor-off`` none, and that the JSON and PNG are written. Must not: judge
latency or gaps (the tiny model on shared cores; the benchmark's figures are for the H200).
A missing server fails under ``CI=true`` (``tests/components.missing``), skips elsewhere.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.livekit.conftest import run_room_bench

pytestmark = pytest.mark.livekit

def test_a_small_room_run_hears_every_turn_in_every_variant(tmp_path: Path) -> None:
    out = tmp_path / "room.json"
    done, wall = run_room_bench(
        tmp_path, "--listeners", "2", "--turns", "2", "--think-s", "0.1",
        "--variants", "listener,agent-queue,predictor-off",
        "--set", "scheduler.predictor_first_chunk_cover=true", "--out", str(out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["provenance"]["git_commit"]
    runs = {run["variant"]: run for run in doc["runs"]}
    assert list(runs) == ["listener", "agent-queue", "predictor-off"]
    for name, run in runs.items():
        summary = run["summary"]
        assert summary["errors"] == [], (name, summary["errors"])
        assert summary["heard"] == summary["turns"] == 4, name
        assert len(run["requests"]) == 4
        for part in ("engine_ttfb", "wire", "transport", "content_lead_in", "jitter_buffer_est",
                     "data_trip"):
            assert summary["itemised_p50"][part] is not None, (name, part)
        transport, wire = summary["itemised_p50"]["transport"], summary["itemised_p50"]["wire"]
        assert 0 < transport <= wire, (name, transport, wire)  # the first sound comes first
        assert summary["listener_loop_lag_max"]["count"] == 4, name
        assert summary["join_s"]["count"] == 2, name
        heard = summary["first_heard_after_say"]
        assert 0 < heard["p50"] <= heard["p95"] < 5.0, (name, heard)
    listener, queue, off = runs["listener"], runs["agent-queue"], runs["predictor-off"]
    assert listener["summary"]["reports_sent"] > 0
    assert listener["summary"]["agent_reports_by_source"].get("livekit-client", 0) > 0
    assert listener["engine_counters"].get("playback_reports_livekit-client", 0) > 0
    assert queue["summary"]["reports_sent"] == 0
    assert set(queue["summary"]["agent_reports_by_source"]) == {"livekit-source"}
    assert "playback_reports_livekit-client" not in queue["engine_counters"]
    assert off["summary"]["agent_reports_by_source"] == {}
    assert out.with_suffix(".png").stat().st_size > 10_000
    assert wall < 60, f"the small room run took {wall:.0f} s (budget 60 s)"


def test_with_the_engine_apart_each_agent_worker_takes_its_share_of_rooms(
        tmp_path: Path) -> None:
    """``--engine server``: one ``bench/room_engine.py`` and, at one room per worker, three
    agent workers for three rooms. A worker declines a room past its share (dispatch
    ``rooms``), so every worker ends with exactly one, and every turn goes through the
    plugin's remote client to the one engine, the listener's reports with it. Then the same
    rooms in two waves (``--wave-gap-s``: all three start each turn together), each wave
    summarized on its own."""
    out = tmp_path / "room.json"
    done, wall = run_room_bench(
        tmp_path, "--engine", "server", "--rooms-per-worker", "1", "--listeners", "3",
        "--turns", "2", "--think-s", "0.1", "--wave-gap-s", "6", "--variants", "listener",
        "--out", str(out), timeout_s=150)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert (doc["provenance"]["engine"], doc["provenance"]["rooms_per_worker"],
            doc["provenance"]["workers"]) == ("server", 1, 3)
    run, waves = doc["runs"]
    assert (run["load"], waves["load"]) == ("closed", "waves")
    assert waves["summary"]["errors"] == [] and waves["summary"]["heard"] == 6
    assert [(w["wave"], w["turns"], w["heard"]) for w in waves["summary"]["by_wave"]] == [
        (0, 3, 3), (1, 3, 3)]
    assert all(t["room_wait_s"] is not None for t in waves["requests"])
    assert waves["placement"]["misplaced"] == 0
    assert (run["engine"], run["dispatch"], run["num_workers"]) == ("server", "rooms", 3)
    summary = run["summary"]
    assert summary["errors"] == [], summary["errors"]
    assert summary["heard"] == summary["turns"] == 6
    workers = run["placement"]["workers"]
    assert sorted(w["rooms"] for w in workers.values()) == [1, 1, 1], workers
    assert run["placement"]["misplaced"] == 0
    pids = {turn["agent"]["pid"] for turn in run["requests"]}
    assert len(pids) == 3, pids  # three agent processes served the turns
    counters = run["engine_counters"]
    assert counters["requests_added"] == counters["requests_finished"] == 6, counters
    assert counters.get("playback_reports_livekit-client", 0) > 0, counters
    # 90 s for the closed run as before, 20 s more for the two 6 s waves (~34 s in all here)
    assert wall < 110, f"the runs with the engine apart took {wall:.0f} s (budget 110 s)"
