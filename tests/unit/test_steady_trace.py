"""``bench/steady_trace.py`` on the tiny CPU engine: a loaded step split into schedule, input
prep, the stage functions' work, post and commit; every stream started, the parts within each
step's wall, the JSON complete."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
PARTS = ("schedule", "prep", "gpu", "post", "commit")


def steady(out: Path, *args: str) -> dict:
    """``bench/steady_trace.py`` on the tiny CPU profile with ``args`` -> its JSON."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO / "runtime"), str(REPO / "bench"), str(REPO)])}
    subprocess.run(
        [sys.executable, str(REPO / "bench" / "steady_trace.py"), "--config",
         str(REPO / "runtime" / "breezert" / "profiles" / "cpu-tiny.toml"), *args,
         "--out", str(out)],
        check=True, env=env, timeout=240, capture_output=True)
    return json.loads(out.read_text())


def test_a_steady_run_splits_each_step_into_its_parts(tmp_path: Path) -> None:
    doc = steady(tmp_path / "steady.json", "--streams", "1,4", "--steps", "30", "--settle", "2",
                 "--start-timeout", "120")
    assert doc["git_commit"] and doc["date"] and doc["torch_version"]
    assert [run["streams"] for run in doc["runs"]] == [1, 4]
    for run in doc["runs"]:
        assert run["started"] == run["streams"]
        steps = run["steps"]
        assert len(steps) == 30 and run["summary"]["steps"] == 30
        assert {s["stage"] for s in steps} >= {"decode", "depth"}
        for s in steps:
            assert all(s[part] >= 0 for part in PARTS), s
            assert s["gpu"] > 0  # the stage functions ran (eagerly, on the CPU)
            assert sum(s[part] for part in PARTS) <= s["wall"] + 1e-3, s
        assert 0 < run["summary"]["gpu_busy_share"] < 1
        assert max(s["rows"] for s in steps if s["stage"] == "depth") == run["streams"]
        summary = run["summary"]
        depth = [s for s in steps if s["stage"] == "depth"]
        wall = sum(s["wall"] for s in steps)
        assert summary["frame_period_ms"] == pytest.approx(wall / len(depth), rel=1e-3)
        assert summary["audio_s_per_s"] == pytest.approx(
            0.08 * sum(s["rows"] for s in depth) / (wall / 1000), rel=1e-2)
        assert sum(summary["gpu_share_by_stage"].values()) == pytest.approx(
            summary["gpu_busy_share"], abs=1e-3)


def test_text_lengths_replace_each_finished_stream(tmp_path: Path) -> None:
    """``--lengths text`` (the default): requests as long as their texts (4-5 frames here), each
    replaced when it ends, so the recorded steps run the serving mix (PREFILL among them) and
    never hold more than N streams; ``long`` replaces none."""
    texts = tmp_path / "texts.tsv"
    texts.write_text("id\ttext\n1\tGood day.\n2\tHi there!\n3\tWell, okay.\n")
    docs = {lengths: steady(tmp_path / f"{lengths}.json", "--streams", "3", "--steps", "40",
                            "--settle", "2", "--texts", str(texts), "--lengths", lengths)["runs"][0]
            for lengths in ("text", "long")}
    text, long = docs["text"], docs["long"]
    assert text["lengths"] == "text" and text["started"] == 3
    assert text["replaced_while_recording"] >= 3  # each 4-5 frame stream ended at least once
    assert "prefill" in {s["stage"] for s in text["steps"]}
    assert max(s["rows"] for s in text["steps"] if s["stage"] == "depth") <= 3
    assert long["lengths"] == "long" and long["replaced_while_recording"] == 0
