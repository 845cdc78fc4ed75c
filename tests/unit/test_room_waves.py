"""``bench/room.py``'s runs in waves (issue 34): every room starts its k-th turn together, k x
the gap into the run, and the summary gives each wave's own figures (no LiveKit, no server)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.bench_scripts import bench_script

pytestmark = pytest.mark.unit

room = bench_script("room")


def test_waves_start_every_rooms_kth_turn_together() -> None:
    plan = room.schedule("waves", 3, 2, None, 0, wave_gap_s=12.0)
    assert plan == [(0.0, 0, 0), (0.0, 1, 1), (0.0, 2, 2),
                    (12.0, 0, 3), (12.0, 1, 4), (12.0, 2, 5)]
    # the same rooms and workload indexes as closed loop: only the offsets differ
    closed = room.schedule("closed", 3, 2, None, 0)
    assert [(r, i) for _, r, i in plan] == [(r, i) for _, r, i in closed]


def _turn(index: int, gaps: list[dict[str, Any]]) -> dict[str, Any]:
    return {"index": index, "heard": {"gaps": gaps, "first_arrival": 1.0, "first_heard": 1.02,
                                      "first_sound_arrival": 1.0, "span_s": 5.0,
                                      "audio_s": 5.0, "min_rms": 900.0}}


def test_each_wave_is_summarized_on_its_own() -> None:
    quiet = {"at_s": 0.05, "length_s": 0.14, "kind": "quiet"}
    late = {"at_s": 1.0, "length_s": 0.01, "kind": "late"}
    turns = [_turn(0, [quiet]), _turn(1, [quiet, late]), _turn(2, []), _turn(3, [late])]
    waves = room.wave_summaries(turns, 2, 0.02)
    assert [w["wave"] for w in waves] == [0, 1]
    assert [(w["turns"], w["gaps_quiet"]["count"], w["gaps_late"]["count"]) for w in waves] == [
        (2, 2, 1), (2, 0, 1)]
    assert waves[0]["gaps_quiet"]["turns_with"] == 2 and waves[1]["gaps_late"]["turns_with"] == 1


def test_the_table_gives_each_wave_a_line() -> None:
    quiet = {"at_s": 0.05, "length_s": 0.14, "kind": "quiet"}
    turns = [_turn(0, [quiet]), _turn(1, []), _turn(2, []), _turn(3, [])]
    summary = {**room.heard_summary(turns, 0.02), "engine_ttfb": {"p50": 0.02},
               "beyond_engine_ttfb": {"p50": 0.08}, "reports_sent": 0,
               "by_wave": room.wave_summaries(turns, 2, 0.02)}
    table = room.text_table([{"variant": "listener", "listeners": 2, "load": "waves",
                              "summary": summary}]).splitlines()
    assert len(table) == 4  # the header, the run, its two waves
    assert table[2].split()[:3] == ["wave", "0", "2"] and "1 (1)" in table[2]
    assert table[3].split()[:3] == ["wave", "1", "2"] and "0 (0)" in table[3]


def test_the_command_line_checks_the_wave_gap(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        room.main(["--server-bin", "x", "--wave-gap-s", "0"])
    assert "--wave-gap-s must be > 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # no load left at all
        room.main(["--server-bin", "x", "--no-closed"])
    assert "--no-closed needs --rate or --wave-gap-s" in capsys.readouterr().err
