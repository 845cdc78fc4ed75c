"""The room benchmark's browser listener (``bench/room_browser.py``) against synthetic page
edges with known gaps, and ``bench/room.py``'s split of a run into listener kinds (which rooms
get a browser, the per-kind summary).

Owns: the browser listener's arithmetic. Must not: need Chromium, a LiveKit server or a model.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.bench_scripts import bench_script

pytestmark = pytest.mark.unit

RATE = 48000.0
room_browser = bench_script("room_browser")
room = bench_script("room")


def _edge(loud: bool, frame_s: float, t_s: float, **extra: Any) -> dict[str, Any]:
    return {"loud": loud, "frame": round(frame_s * RATE), "t": t_s * 1000, **extra}


def test_the_turn_heard_from_the_pages_edges() -> None:
    offset = 1000.0  # epoch = monotonic + 1000
    edges = [_edge(True, 0.0, 1009.0), _edge(False, 0.1, 1009.1, minRms=0.02),  # the turn before
             _edge(True, 10.0, 1010.20), _edge(False, 10.5, 1010.70, minRms=0.03),
             _edge(True, 10.54, 1010.74), _edge(False, 11.0, 1011.20, minRms=0.01),
             _edge(True, 11.5, 1011.70)]  # a loud run still open: not part of the turn yet
    sounds = [{"sound": True, "frame": 0, "t": 1008.9e3}, {"sound": True, "frame": 0,
                                                             "t": 1010.19e3}]
    heard = room_browser.heard_from_edges(edges, sounds, RATE, since_epoch=1010.0,
                                          epoch_offset=offset, prebuffer_s=0.02)
    assert heard["first_arrival"] == pytest.approx(10.20)
    assert heard["first_heard"] == pytest.approx(10.22)
    assert heard["first_sound_arrival"] == pytest.approx(10.19)
    assert heard["span_s"] == heard["audio_s"] == pytest.approx(1.0)
    assert heard["gaps"] == [{"at_s": 0.5, "length_s": 0.04, "kind": "quiet"}]
    assert heard["min_rms"] == pytest.approx(0.01 * 32768, abs=0.1)
    assert room_browser.heard_from_edges(edges[:2], sounds, RATE, 1010.0, offset, 0.02) is None


def test_the_first_sound_never_comes_after_the_first_audio() -> None:
    edges = [_edge(True, 0.0, 10.0), _edge(False, 0.5, 10.5, minRms=0.1)]
    late = [{"sound": True, "frame": 0, "t": 10.4e3}]  # armed late: the loud edge came first
    heard = room_browser.heard_from_edges(edges, late, RATE, 9.0, 0.0, 0.0)
    assert heard["first_sound_arrival"] == heard["first_arrival"] == pytest.approx(10.0)


def test_the_last_rooms_get_the_browsers_in_one_process() -> None:
    assert room.listener_groups(5, 2, 2) == [("python", [0, 1]), ("python", [2]),
                                             ("browser", [3, 4])]
    assert room.listener_groups(2, 0, 16) == [("python", [0, 1])]
    assert room.listener_groups(2, 2, 16) == [("browser", [0, 1])]


def test_the_summary_gives_each_listener_kind_beside_the_overall_figures() -> None:
    def turn(kind: str, heard_s: float, gaps: list[dict[str, Any]]) -> dict[str, Any]:
        return {"listener_kind": kind, "sent": 0.0,
                "agent": {"said": 0.0, "received": 0.001, "opened": 0.002, "first_audio": 0.05,
                          "playback_started": 0.06},
                "heard": {"first_arrival": heard_s - 0.02, "first_heard": heard_s,
                          "first_sound_arrival": heard_s - 0.02, "span_s": 1.0, "audio_s": 1.0,
                          "gaps": gaps, "min_rms": 500.0}}

    quiet = [{"at_s": 0.3, "length_s": 0.02, "kind": "quiet"}]
    run = {"turns": [turn("python", 0.10, []), turn("python", 0.12, []),
                     turn("browser", 0.20, quiet)],
           "rooms": [{"reports_sent": 5, "listener_kind": "python"},
                     {"reports_sent": 7, "listener_kind": "browser"}],
           "ready": [], "wall_s": 2.0}
    summary = room.summarize_run(run, 0.02)
    assert summary["heard"] == 3 and summary["gaps_quiet"]["count"] == 1
    python, browser = summary["by_listener_kind"]["python"], summary["by_listener_kind"]["browser"]
    assert python["first_heard_after_say"]["count"] == 2
    assert python["gaps_quiet"]["count"] == 0 and python["reports_sent"] == 5
    assert browser["first_heard_after_say"]["p50"] == pytest.approx(0.20)
    assert browser["gaps_quiet"] == {"turns_with": 1, "count": 1, "total_s": 0.02,
                                     "longest_s": 0.02}
    assert browser["rooms"] == 1 and browser["reports_sent"] == 7
    table = room.text_table([{"variant": "listener", "listeners": 3, "load": "closed",
                              "summary": {**summary, "engine_ttfb": {"p50": 0.05}}}])
    assert "browser listeners" in table and "python listeners" in table
    assert not summary["harness_lagged"] and "LAGGED" not in table  # no loop lag recorded


def test_a_run_whose_listener_loops_lagged_is_flagged() -> None:
    def turn(lag_s: float) -> dict[str, Any]:
        return {"sent": 0.0, "loop_lag_max_s": lag_s,
                "heard": {"first_arrival": 0.1, "first_heard": 0.12, "first_sound_arrival": 0.1,
                          "span_s": 1.0, "audio_s": 1.0, "gaps": [], "min_rms": 500.0}}

    def summary(lags: list[float]) -> dict[str, Any]:
        run = {"turns": [turn(lag) for lag in lags], "rooms": [{"reports_sent": 1}],
               "ready": [], "wall_s": 2.0}
        return room.summarize_run(run, 0.02)

    calm, lagged = summary([0.002] * 19 + [0.03]), summary([0.002] * 10 + [0.05] * 10)
    assert calm["listener_loop_lag_max"]["p95"] <= room.HARNESS_LAG_LIMIT_S
    assert not calm["harness_lagged"] and lagged["harness_lagged"]
    table = room.text_table([{"variant": "listener", "listeners": 20, "load": "closed",
                              "summary": {**lagged, "engine_ttfb": {"p50": 0.05}}}])
    assert "50 LAGGED" in table
