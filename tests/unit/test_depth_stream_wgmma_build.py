"""Issue 30's wgmma weight-stream experiment (``bench/depth_stream_wgmma.py``) builds for the
H200 (sm_90a) on this GPU-less machine: its ``--compile-only`` path at 2 rows (one TMA box of
activations) and 512 rows (two boxes, two warpgroups over one weight tile), ``phased`` mode (the
per-phase waits and the cross-proxy fence on top of ``stream``'s code), within Hopper's limits,
with the tensor cores' HGMMA batched per tile rather than serialized by ptxas."""

from __future__ import annotations

import re

import pytest

from tests.kernel_helpers import needs_triton, run_compile_only

pytestmark = pytest.mark.unit


@needs_triton
def test_wgmma_stream_builds_for_sm90a_at_2_and_512_rows(tmp_path) -> None:
    stdout = run_compile_only(tmp_path, "depth_stream_wgmma.py", "--configs", "64x64x8w8",
                              "--rows", "2,512", "--modes", "phased")
    lines = [line for line in stdout.splitlines() if " phased " in line]
    assert [line.split()[1] for line in lines] == ["r2", "r512"], stdout
    for line in lines:
        assert "sm_90a" in line and "problems: none" in line, line
        hgmma, batches = map(int, re.search(r"(\d+) HGMMA in (\d+) batches", line).groups())
        assert 0 < batches < hgmma, f"HGMMA missing or serialized: {line}"
    assert "spills 0 B, stack 0 B" in lines[0], lines[0]  # 2 rows: nothing spilled
