"""Start-up progress: ``capture_all`` calls the callback once per captured graph bucket (with a
total known up front), and ``ConsoleProgress`` prints phases and a bar."""

from __future__ import annotations

import io
from typing import Any

import pytest
from breezert.config import GraphConfig
from breezert.constants import Stage
from breezert.server.health import ConsoleProgress, Lifecycle
from breezert.worker.warmup import PHASE_CAPTURE, capture_all

pytestmark = pytest.mark.unit


class _Graphs:
    def __init__(self, log: list[Any]) -> None:
        self.log = log

    def capture(self, key: Any, inputs: Any) -> None:
        self.log.append(key)


class _Stage:
    def __init__(self, log: list[Any]) -> None:
        self.graphs = _Graphs(log)
        self.full_sort_graphs = _Graphs(log)

    def example_inputs(self, *key: Any) -> tuple[Any, ...]:
        return key

    def graph_keys(self, max_frames: int, max_step_frames: int) -> list[tuple[int, int]]:
        return [(1, 2), (1, 1)]


def test_capture_all_reports_every_bucket() -> None:
    captured: list[Any] = []
    stages = {stage: _Stage(captured) for stage in Stage}
    calls: list[tuple[str, int, int, str]] = []
    graph = GraphConfig(decode_batch_buckets=(1, 2), decode_context_buckets=(256, 512),
                        depth_batch_buckets=(1, 2), prefill_token_buckets=(16,),
                        text_encode_buckets=(32,), codec_buckets=(1,))
    capture_all(graph, stages, 16, lambda *a: calls.append(a))
    total = len(captured)
    assert total == 1 + 2 + 4 + 2 * 4 + 2
    assert calls[0] == (PHASE_CAPTURE, 0, total, "")
    assert [c[1] for c in calls] == list(range(total + 1))
    assert {c[2] for c in calls} == {total} and {c[0] for c in calls} == {PHASE_CAPTURE}
    assert calls[-1][3].startswith("codec")


def test_console_progress_lines_and_lifecycle() -> None:
    out = io.StringIO()
    lifecycle = Lifecycle(console=ConsoleProgress(out, width=10))
    lifecycle.progress("loading weights", detail="random tiny")
    for done in range(21):
        lifecycle.progress("capturing graphs", done, 20, f"decode ({done}, 256)")
    assert lifecycle.as_json()["phase"] == "capturing graphs"
    assert (lifecycle.as_json()["done"], lifecycle.as_json()["total"]) == (20, 20)
    lifecycle.progress("warming up")
    lines = out.getvalue().splitlines()
    assert "loading weights (random tiny)" in lines[0]
    assert any(line.endswith("capturing graphs") for line in lines)
    bars = [line for line in lines if "[" in line.split("]", 1)[1]]
    assert 5 <= len(bars) <= 12  # a line per tenth, not one per bucket
    assert "[##########] 20/20" in bars[-1]
    assert lines[-1].endswith("warming up")
