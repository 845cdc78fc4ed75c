"""``bench/latency_bounds.py``'s bookkeeping: each bound and run names the machine it was
measured on, so a tier measured again on another box leaves the others' provenance true."""

from __future__ import annotations

import copy

import pytest

from tests.bench_scripts import bench_script

pytestmark = pytest.mark.unit

latency_bounds = bench_script("latency_bounds")

XEON = {"host": "vm", "cpu": "Intel(R) Xeon(R) Processor", "cores": 2, "python": "3.11.7"}


def _doc() -> dict:
    return {"machine": XEON, "margin": 2.0,
            "bounds": {"a": {"bound_ms": 10.0, "p95_ms": 5.0},
                       "b": {"bound_ms": 20.0, "p95_ms": 10.0, "cpu": "AMD EPYC"}},
            "runs": [{"tier": "livekit", "commit": "abc"},
                     {"tier": "integration", "commit": "def", "machine": {"cpu": "AMD EPYC"}}]}


def test_entries_without_a_machine_take_the_files_one_and_named_ones_keep_theirs() -> None:
    doc = _doc()
    latency_bounds._name_machines(doc)
    assert doc["bounds"]["a"]["cpu"] == XEON["cpu"]
    assert doc["bounds"]["b"]["cpu"] == "AMD EPYC"
    assert doc["runs"][0]["machine"] == XEON
    assert doc["runs"][1]["machine"] == {"cpu": "AMD EPYC"}


def test_a_file_without_a_machine_is_left_as_it_is() -> None:
    doc = _doc()
    del doc["machine"]
    before = copy.deepcopy(doc)
    latency_bounds._name_machines(doc)
    assert doc == before


def test_a_new_bound_names_this_machines_cpu() -> None:
    entry = latency_bounds.bound_entry("x", [1.0, 2.0, 3.0], 2.0, ["t.py"], "livekit", 0.1)
    assert entry["cpu"] == latency_bounds._machine()["cpu"]
    assert entry["bound_ms"] == latency_bounds.bound_ms("x", entry["p95_ms"], 2.0)
