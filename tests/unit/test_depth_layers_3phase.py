"""Issue 30's 3-phase depth body (``bench/depth_layers_3phase.py``): its packed weights hold each
unit's tiles where the loader reads them (q/k/v and o units along K, the MLP units' gate and up
tiles interleaved, then down's 16 output blocks of the unit's 64 features), and the kernel builds
for the H200 (sm_90a) on this GPU-less machine at the smallest and largest padded row counts
within Hopper's limits (no spills, HGMMA batched per tile)."""

from __future__ import annotations

import re
import sys

import pytest

from tests.kernel_helpers import REPO, needs_triton, run_compile_only

pytestmark = pytest.mark.unit


@needs_triton
def test_packed_layer_gives_each_unit_its_tiles_in_the_loaders_order() -> None:
    import torch

    sys.path.insert(0, str(REPO / "bench"))
    import depth_layers_3phase as m

    gen = torch.Generator().manual_seed(0)
    qkv, o = (torch.randn(n, 1024, generator=gen).to(torch.bfloat16) for n in (m.Q_OUT, 1024))
    gate_up = torch.randn(2 * m.FFN, 1024, generator=gen).to(torch.bfloat16)
    down = torch.randn(1024, m.FFN, generator=gen).to(torch.bfloat16)
    packed = torch.cat([m.pack_layer(qkv, o, gate_up, down)] * 2)  # two layers alike
    assert packed.shape == (2 * m.LAYER_TILES * m.TILE, m.TILE)

    def block(w, n, k):
        return w[n * 64:(n + 1) * 64, k * 64:(k + 1) * 64]

    for layer in (0, 1):
        for a in (0, 7, m.A_UNITS - 1):
            tiles = m.unit_tiles(packed, layer, a * m.A_TILES, m.KT)
            assert all(torch.equal(tiles[kb], block(qkv, a, kb)) for kb in range(m.KT))
        for b in (0, m.B_UNITS - 1):
            tiles = m.unit_tiles(packed, layer, m.B_BASE + b * m.B_TILES, m.KT)
            assert all(torch.equal(tiles[kb], block(o, b, kb)) for kb in range(m.KT))
        for c in (0, 45, m.C_UNITS - 1):
            tiles = m.unit_tiles(packed, layer, m.C_BASE + c * m.C_TILES, m.C_TILES)
            for kb in range(m.KT):
                assert torch.equal(tiles[2 * kb], block(gate_up, c, kb))
                assert torch.equal(tiles[2 * kb + 1], block(gate_up, m.C_UNITS + c, kb))
            for mb in range(16):
                assert torch.equal(tiles[2 * m.KT + mb], block(down, mb, c))


@needs_triton
def test_three_phase_body_builds_for_sm90a(tmp_path) -> None:
    stdout = run_compile_only(tmp_path, "depth_layers_3phase.py", "--rows", "2,64",
                              "--attention", "items", timeout_s=600)
    lines = [line for line in stdout.splitlines() if line.startswith("3phase-items")]
    assert [int(re.search(r"\(RP (\d+)\)", line).group(1)) for line in lines] == [8, 64]
    for line in lines:
        assert "sm_90a" in line and "problems: none" in line and "spills 0 B" in line, line
        hgmma, batches = map(int, re.search(r"(\d+) HGMMA in (\d+) batches", line).groups())
        assert 0 < batches < hgmma, f"HGMMA missing or serialized: {line}"
