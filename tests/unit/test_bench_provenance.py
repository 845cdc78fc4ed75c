"""``breezert_bench.provenance``: the one place a benchmark result's machine, versions, commit and
date come from (``breezert-bench`` and the scripts under ``bench/``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from breezert_bench import provenance as prov

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
FIELDS = ("gpu", "torch_version", "cuda_version", "cpu", "num_cpus", "load_avg_1m",
          "python_version", "git_commit", "git_dirty", "date", "hostname")


def test_a_cpu_run_records_every_field_and_no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(prov.COMMIT_ENV, raising=False)
    doc = prov.provenance(device="cpu", rows=[1, 2])
    assert set(FIELDS) <= set(doc) and doc["rows"] == [1, 2]
    assert doc["gpu"] is None and doc["torch_version"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", doc["date"])
    if (REPO / ".git").exists():  # a checkout: git knows the commit and whether it is dirty
        assert re.fullmatch(r"[0-9a-f]{7,}", doc["git_commit"])
        assert isinstance(doc["git_dirty"], bool)


def test_the_environment_then_an_override_name_the_commit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(prov.COMMIT_ENV, "abc1234")
    assert prov.git_commit() == ("abc1234", None)
    doc = prov.provenance(device="remote")
    assert (doc["git_commit"], doc["git_dirty"], doc["gpu"]) == ("abc1234", None, None)
    assert prov.provenance(device="cpu", git_commit_override="def5678")["git_commit"] == "def5678"


def test_no_other_benchmark_code_reads_the_commit() -> None:
    """bench/cpu_commits.py resolves the two revisions it checks out; nothing else asks git."""
    readers = sorted(
        path.relative_to(REPO).as_posix()
        for path in [*(REPO / "bench").glob("*.py"),
                     *(REPO / "bench" / "breezert_bench").glob("*.py")]
        if '"rev-parse"' in path.read_text(encoding="utf-8"))
    assert readers == ["bench/breezert_bench/provenance.py", "bench/cpu_commits.py"]
