"""The room benchmark's scale-out arithmetic (``bench/room_scaleout.py``) on hand-built records:
the placement check, peak concurrent turns, which worker served what, the aggregate audio
rate, the merge of several results; and ``bench/room_procs.py``'s GPU pinning.

Owns: that arithmetic. Must not: need a LiveKit server, a worker or a model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.bench_scripts import bench_script

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


scaleout = bench_script("room_scaleout")


def test_a_call_on_a_full_worker_counts_only_while_another_had_room() -> None:
    capacity = {"w0": 2, "w1": 2}
    # w0 takes two, then a third while w1 is empty: misplaced; w1 then fills to two
    placements = [(1.0, "w0", 0), (2.0, "w0", 1), (3.0, "w0", 2), (4.0, "w1", 0), (5.0, "w1", 1)]
    assert scaleout.count_misplaced(placements, capacity, {}) == 1
    # spread evenly: none; both full and one more call: nowhere had room, not misplaced
    even = [(1.0, "w0", 0), (2.0, "w1", 0), (3.0, "w0", 1), (4.0, "w1", 1), (5.0, "w1", 2)]
    assert scaleout.count_misplaced(even, capacity, {}) == 0
    # order is by job start, not by list order
    assert scaleout.count_misplaced(list(reversed(placements)), capacity, {}) == 1


def test_the_placement_check_reads_each_workers_own_reports() -> None:
    capacity = {"w0": 2, "w1": 2}
    # w1 still ran two jobs from the run before: w0's third call had nowhere else to go
    assert scaleout.count_misplaced([(1.0, "w0", 2)], capacity, {"w0": 2, "w1": 2}) == 0
    # a worker full by its own report (a job left over) while the other is empty
    assert scaleout.count_misplaced([(1.0, "w0", 2)], capacity, {"w1": 0}) == 1
    # one worker alone is never misplaced, whatever it holds
    assert scaleout.count_misplaced([(1.0, "w0", 5)], {"w0": 2}, {}) == 0


def test_peak_concurrent_turns() -> None:
    assert scaleout.peak_concurrent([]) == 0
    assert scaleout.peak_concurrent([(0.0, 1.0), (0.5, 2.0), (0.7, 0.8)]) == 3
    assert scaleout.peak_concurrent([(0.0, 1.0), (1.0, 2.0)]) == 1  # back to back
    assert scaleout.peak_concurrent([(0.0, 1.0), (2.0, 3.0), (2.5, 4.0)]) == 2


def _run() -> dict[str, Any]:
    ready = [{"pid": 11, "job_started": 1.0, "jobs_held": 0},
             {"pid": 22, "job_started": 1.1, "jobs_held": 0},
             {"pid": 11, "job_started": 1.2, "jobs_held": 1}]
    turns = [{"agent": {"pid": 11, "said": 2.0, "done": 4.0}, "heard": {"audio_s": 1.5}},
             {"agent": {"pid": 11, "said": 3.0, "done": 5.0}, "heard": {"audio_s": 2.0}},
             {"agent": {"pid": 22, "said": 2.0, "done": 3.0}, "heard": {"audio_s": 0.5}},
             {"agent": {"pid": 99, "said": 2.0, "done": 3.0}, "error": "no audio heard"},
             {"error": "no bench.turn from the agent in 120 s"}]
    return {"ready": ready, "turns": turns, "wall_s": 8.0}


def test_placement_names_the_worker_of_every_room_and_turn() -> None:
    place = scaleout.placement(_run(), {11: "w0", 22: "w1"}, {"w0": 2, "w1": 2}, {"w0": 0})
    assert place["workers"] == {
        "w0": {"pid": 11, "rooms": 2, "turns": 2, "peak_concurrent_turns": 2, "max_jobs": 2,
               "jobs_at_start": 0},
        "w1": {"pid": 22, "rooms": 1, "turns": 1, "peak_concurrent_turns": 1, "max_jobs": 2,
               "jobs_at_start": 0}}
    assert place["misplaced"] == 0
    assert place["unknown"] == 1  # pid 99 is none of ours; a turn never answered names none
    tight = scaleout.placement(_run(), {11: "w0", 22: "w1"}, {"w0": 1, "w1": 2}, {})
    assert tight["misplaced"] == 1  # w0's second room while w1 held one of two


def test_with_engines_apart_a_room_is_misplaced_on_a_full_engine_while_another_had_room(
        ) -> None:
    # four agents, two per engine; rooms in order of their jobs' starts
    workers = {11: "w0", 22: "w1", 33: "w2", 44: "w3"}
    engine_of = {"w0": "e0", "w1": "e1", "w2": "e0", "w3": "e1"}
    ready = [{"pid": 11, "job_started": 1.0}, {"pid": 33, "job_started": 2.0},
             {"pid": 11, "job_started": 3.0}, {"pid": 22, "job_started": 4.0},
             {"pid": 99, "job_started": 5.0}]  # none of ours: left to placement()'s unknown
    place = scaleout.engine_placement({"ready": ready}, workers, engine_of, {"e0": 2, "e1": 2})
    # e0 took its third room while e1 had none: misplaced; e1's first is fine
    assert place == {"engines": {"e0": {"rooms": 3, "max_jobs": 2},
                                 "e1": {"rooms": 1, "max_jobs": 2}}, "misplaced": 1}
    spread = [dict(r, pid={11: 22, 33: 44}.get(r["pid"], r["pid"])) if i % 2 else r
              for i, r in enumerate(ready[:4])]
    even = scaleout.engine_placement({"ready": spread}, workers, engine_of, {"e0": 2, "e1": 2})
    assert even["misplaced"] == 0
    assert [e["rooms"] for e in even["engines"].values()] == [2, 2]


def test_k_is_the_engines_apart_else_the_workers() -> None:
    assert scaleout.scale_k({"num_workers": 16, "num_engines": 4}) == 4
    assert scaleout.scale_k({"num_workers": 2, "num_engines": None}) == 2
    assert scaleout.scale_k({}) == 1


def test_audio_rate_is_the_audio_heard_over_all_rooms_per_second() -> None:
    assert scaleout.audio_rate(_run()) == {"audio_s": 4.0, "audio_per_s": 0.5}


def _result(path: Path, k: int, dispatch: str, rate: float) -> Path:
    summary = {"audio_per_s": rate, "heard": 4, "turns": 4,
               "first_heard_after_say": {"p50": 0.1, "p95": 0.2},
               "gaps_quiet": {"count": 0}, "gaps_late": {"count": 0}}
    run = {"variant": "none", "listeners": 4 * k, "load": "closed", "num_workers": k,
           "dispatch": dispatch, "summary": summary, "requests": [{"x": 1}], "rooms": [],
           "placement": {"misplaced": 0, "workers": {f"w{i}": {"rooms": 4,
                                                              "peak_concurrent_turns": 4}
                                                    for i in range(k)}}}
    path.write_text(json.dumps({"provenance": {"git_commit": "abc"}, "runs": [run]}))
    return path


def test_merge_puts_every_k_in_one_document_with_capacity_over_k1(tmp_path: Path) -> None:
    paths = [_result(tmp_path / f"k{k}-{d}.json", k, d, rate)
             for k, d, rate in ((4, "engine", 3.8), (1, "engine", 1.0), (2, "engine", 1.9),
                                (1, "cpu", 1.0), (4, "cpu", 2.5))]
    doc = scaleout.merge(paths)
    assert [(r["num_workers"], r["dispatch"]) for r in doc["runs"]] == [
        (1, "cpu"), (1, "engine"), (2, "engine"), (4, "cpu"), (4, "engine")]
    assert all("requests" not in r for r in doc["runs"])
    assert doc["capacity_vs_k1"] == {"cpu none": {"K=1": 1.0, "K=4": 2.5},
                                     "engine none": {"K=1": 1.0, "K=2": 1.9, "K=4": 3.8}}
    table = scaleout.scaleout_table(doc["runs"])
    assert "4/4/4/4" in table and len(table.splitlines()) == 6


def test_workers_are_pinned_to_gpus_only_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    procs = bench_script("room_procs")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert procs.pinned_gpus(None, "", 2) is None  # the embedded cpu-tiny
    latency = str(REPO / "configs" / "h200-latency.toml")
    assert procs.pinned_gpus(latency, "", 4) == ["0", "1", "2", "3"]
    assert procs.pinned_gpus(None, "model.device=cuda", 2) == ["0", "1"]  # after --set
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert procs.pinned_gpus(latency, "", 2) == ["2", "3"]
    with pytest.raises(ValueError, match="only 2 GPUs"):
        procs.pinned_gpus(latency, "", 4)
