"""``bench/depth_timeline.py``: its bytes and FLOPs of a depth frame agree with the decoder's own
parameters (counted from the module, not the formula), and a CPU run of the tiny model writes
the record and its plot."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from breezert.models.config import DepthConfig
from breezert.models.depth import DepthDecoder

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


def _timeline(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN202 - a script under bench/
    monkeypatch.syspath_prepend(str(REPO / "bench"))  # its sibling modules, as when it runs
    spec = importlib.util.spec_from_file_location("depth_timeline",
                                                  REPO / "bench" / "depth_timeline.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("cfg", [
    DepthConfig(),
    DepthConfig(hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                head_dim=16, backbone_hidden_size=48, audio_embed_size=48, vocab_size=40),
], ids=["full", "small"])
def test_frame_work_counts_the_decoders_own_weights(cfg: DepthConfig,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    depth = DepthDecoder(cfg).to("meta")
    layer_params = sum(p.numel() for name, p in depth.model.layers.named_parameters()
                       if "layernorm" not in name)  # norms: a few KB, left out by design
    head = depth.codebooks_head.weight[0].numel()  # one codebook's head
    projector = depth.model.inputs_embeds_projector.weight.numel()
    work = _timeline(monkeypatch).frame_work(cfg, rows=6)
    positions = cfg.num_codebooks
    assert work["weight_bytes"] == (2 * layer_params * positions + 4 * head * (positions - 1)
                                    + 2 * projector)
    assert work["flops"] == 2 * 6 * (layer_params * positions + head * (positions - 1)
                                     + projector)
    assert 0 < work["kv_bytes"] < work["weight_bytes"]
    assert work["bytes"] == work["weight_bytes"] + work["kv_bytes"]


def test_full_frame_reads_what_issue_30_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    """The issue's floor: 12 layers' bf16 weights, 667 MB, per position."""
    work = _timeline(monkeypatch).frame_work(DepthConfig(), rows=1)
    per_position = (work["weight_bytes"] - 4 * 1024 * 2048 * 15 - 2 * 2048 * 1024) / 16
    assert per_position == pytest.approx(667e6, rel=0.01)


def test_cpu_run_writes_record_and_plot(tmp_path: Path) -> None:
    out = tmp_path / "timeline.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": os.pathsep.join(
        [str(REPO / "runtime"), str(REPO / "bench"), str(REPO)])}
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "depth_timeline.py"), "--requests", "1,2",
         "--fused-draw", "--out", str(out)],
        env=env, timeout=300, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["git_commit"] and doc["date"]
    [run] = doc["runs"]  # --fused-draw adds a run only on CUDA
    assert run["label"] == "served"
    assert [r["requests"] for r in run["rows"]] == [1, 2]
    for row in run["rows"]:
        assert row["rows"] == 2 * row["requests"] and row["frame_ms"] > 0
        assert row["operators"] > 0  # the CPU census lists operators
    assert out.with_suffix(".png").stat().st_size > 0
