"""Issue 30's wgmma weight-stream experiment (``bench/depth_stream_wgmma.py``) builds for the
H200 (sm_90a) on this GPU-less machine: its ``--compile-only`` path at 2 rows (one TMA box of
activations) and 512 rows (two boxes, two warpgroups over one weight tile), ``phased`` mode (the
per-phase waits and the cross-proxy fence on top of ``stream``'s code), within Hopper's limits,
with the tensor cores' HGMMA batched per tile rather than serialized by ptxas."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.kernel_helpers import REPO, needs_triton, sm90_build_env

pytestmark = pytest.mark.unit


@needs_triton
def test_wgmma_stream_builds_for_sm90a_at_2_and_512_rows(tmp_path) -> None:
    env = sm90_build_env(tmp_path)
    proc = subprocess.run([sys.executable, "bench/depth_stream_wgmma.py", "--compile-only",
                           "--configs", "64x64x8w8", "--rows", "2,512", "--modes", "phased"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    lines = [line for line in proc.stdout.splitlines() if " phased " in line]
    assert [line.split()[1] for line in lines] == ["r2", "r512"], proc.stdout
    for line in lines:
        assert "sm_90a" in line and "problems: none" in line, line
        hgmma, batches = map(int, re.search(r"(\d+) HGMMA in (\d+) batches", line).groups())
        assert 0 < batches < hgmma, f"HGMMA missing or serialized: {line}"
    assert "spills 0 B, stack 0 B" in lines[0], lines[0]  # 2 rows: nothing spilled
