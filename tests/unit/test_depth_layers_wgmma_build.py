"""Issue 30's 12-layer depth body on the wgmma weight ring (``bench/depth_layers_wgmma.py``)
builds for the H200 (sm_90a) on this GPU-less machine at every padded row count its harness
can select (rows 2-512: wgmma's N of 8-512, two configs), within Hopper's limits: no spills,
no stack frame up to 64 rows, the tensor cores' HGMMA batched per tile rather than serialized,
and the proxy fences on both sides of every X/Y hand-over (4 CUDA-core phases that write, 4
activation-loader waits that TMA-read)."""

from __future__ import annotations

import re

import pytest

from tests.kernel_helpers import needs_triton, run_compile_only

pytestmark = pytest.mark.unit

# rows 2..512 pad to these (a power of 2, at least 8 per warpgroup along N)
ROWS = "8,16,32,64,128,256,512"
BUILT = {"64x64x8w8": [16, 32, 64, 128, 256, 512], "64x128x6w4": [8, 16, 32, 64, 128, 256]}


@needs_triton
def test_depth_layers_build_for_sm90a_at_every_selectable_row_count(tmp_path) -> None:
    stdout = run_compile_only(tmp_path, "depth_layers_wgmma.py", "--configs", ",".join(BUILT),
                              "--rows", ROWS)
    lines = [line for line in stdout.splitlines() if " layers " in line]
    built: dict[str, set[int]] = {}
    for line in lines:
        config, rp = line.split()[0], int(re.search(r"\(RP (\d+)\)", line).group(1))
        built.setdefault(config, set()).add(rp)
        assert "sm_90a" in line and "problems: none" in line, line
        assert "spills 0 B" in line, line
        if rp <= 64:  # (triton 3.6.0, the H100's, puts 48 B there at 128 rows x 4 warps)
            assert "stack 0 B" in line, line
        hgmma, batches = map(int, re.search(r"(\d+) HGMMA in (\d+) batches", line).groups())
        assert 0 < batches < hgmma, f"HGMMA missing or serialized: {line}"
        assert int(re.search(r"(\d+) proxy fences", line).group(1)) == 8, line
    assert {c: sorted(r) for c, r in built.items()} == BUILT, stdout
    # the 4-warp consumer at 512 rows would hold 256 accumulator registers a thread: refused
    assert "64x128x6w4 r512: not built" in stdout, stdout

