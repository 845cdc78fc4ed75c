"""``bench/depth_gemm_ceiling.py`` on the CPU: through Triton's interpreter (a small decoder)
every call the GPU run times runs once, untimed; the served gate/up and down calls equal torch
at the eager modules' rounding points (their prenorm forms bit for bit) and every plain Triton
GEMM equals ``torch.mm``; the record names each GEMM's FLOP and weight bytes. Built for sm_90a
here, every plain GEMM shape at the full-size GEMMs fits Hopper's limits and runs on wgmma."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.kernel_helpers import needs_triton, run_compile_only

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


@needs_triton
def test_small_run_calls_everything_and_matches_torch(tmp_path: Path) -> None:
    out = tmp_path / "ceiling.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(
        [str(REPO / "runtime"), str(REPO / "bench"), str(REPO)])}
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "depth_gemm_ceiling.py"), "--small",
         "--rows", "3,20", "--out", str(out)],
        env=env, timeout=300, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["git_commit"] and doc["date"] and doc["timed"] is False
    diffs = doc["max_abs_diff"]
    assert {"gate_up", "down", "down triton:16x64x32w4s2k4", "qkv triton:32x128x32w4s2"} <= set(
        diffs), diffs
    assert all(v < 0.05 for v in diffs.values()), diffs
    assert diffs["gate_up prenorm vs served"] == diffs["down prenorm vs served"] == 0.0
    assert diffs["o prenorm+inline vs served"] == 0.0
    assert [r["rows"] for r in doc["results"]] == [3, 20]
    for r in doc["results"]:
        gemms = r["gemms"]
        assert set(gemms) == {"qkv", "o", "gate_up", "down"}
        # the small decoder: hidden 128, 4 + 2 x 2 heads of 32, intermediate 256, bf16
        assert gemms["gate_up"]["weight_bytes"] == 2 * 256 * 128 * 2
        assert gemms["down"]["flop"] == 2 * r["rows"] * 128 * 256
        assert gemms["qkv"]["flop"] == 2 * r["rows"] * (4 + 2 * 2) * 32 * 128
        assert "served" not in gemms["qkv"]  # q/k/v is served inside the layer call only
        assert {"served", "prenorm", "cublas", "triton:16x64x32w4s2",
                "triton:32x128x32w4s2k4"} <= set(gemms["down"])
        assert {"served", "prenorm", "prenorm+inline", "cublas"} <= set(gemms["o"])
        assert gemms["down"]["served"]["us"] is None  # the interpreter times nothing
        assert gemms["down"]["triton_best"] is None
        assert r["served_position_ms"] is None and r["triton_gemms_position_ms"] is None
        assert r["prenorm_position_ms"] is None


@needs_triton
def test_plain_gemms_build_for_sm90a_on_wgmma(tmp_path: Path) -> None:
    stdout = run_compile_only(tmp_path, "depth_gemm_ceiling.py")
    lines = [line for line in stdout.splitlines() if line.startswith("[gemm]")]
    # 3 shapes for each of 4 GEMMs, and down's 3 again split 4 ways along K
    assert len(lines) == 15, stdout
    for line in lines:
        assert " 0 B local" in line and "wgmma sites" in line, line
        assert int(line.split(" wgmma sites")[0].rsplit(" ", 1)[1]) > 0, line
        assert line.rstrip().endswith("wgmma sites"), line  # no problem named after it


@needs_triton
def test_small_weights_are_copied_past_the_flush_size() -> None:
    """A GEMM whose 12 layers' weights fit in L2 is timed over copies of them, so that no
    weight is still in L2 when its turn comes again; one whose weights exceed the size is not
    copied. The copies hold the same values; every kind calls one weight an index."""
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import depth_gemm_ceiling as ceiling
    finally:
        sys.path.remove(str(REPO / "bench"))
    from breezert.kernels.fused_depth import FusedDepthLayers
    from breezert.kernels.gemm import Tiles

    depth = ceiling.build(ceiling.SMALL, "cpu")
    fused = FusedDepthLayers(depth, max_rows=4, tiles=Tiles(qkv_split=1, split_k=2), warm=False)
    o_bytes = 2 * 128 * 128 * 2  # two layers of a 128 x 128 bf16 o_proj
    calls = ceiling.layer_calls(depth, fused, 3, (), None, flush_bytes=4 * o_bytes)
    weights = calls["o"]["weights"]
    assert len(weights) == 8  # the 2 layers and 3 copies of them
    assert all(torch.equal(w, weights[i % 2]) for i, w in enumerate(weights))
    assert weights[2].data_ptr() != weights[0].data_ptr()
    gate_up_bytes = 2 * 2 * 256 * 128 * 2  # 4 o_bytes: no copy
    assert gate_up_bytes == 4 * o_bytes and len(calls["gate_up"]["weights"]) == 2
    assert set(calls["o"]["calls"]) == {"served", "cublas"}
    assert calls["o"]["calls"]["cublas"](5).shape == (3, 128)
