"""The streamed depth frame (kernels/streamed_depth.py) on CPU: what it cannot run is refused
when it is made or called, naming why; its staged input's two shared layouts (stored through one,
read by tile through the other, and the view that stages fewer rows than the tensor cores read)
agree, and the tensor cores' operand loads from it have no bank conflicts (both read from the
layouts as Triton lowers them: a kernel traced for sm_90, not run).
Its kernels build for sm_90 in tests/unit/test_sm90_build.py and run in
tests/gpu/test_gpu_frame_kernels.py (Gluon has no CPU interpreter)."""

from __future__ import annotations

import pytest
import torch

from breezert.models.config import BreezeConfig
from breezert.models.depth import DepthDecoder
from tests.kernel_helpers import needs_triton, random_bf16_fused_
from tests.unit.test_fused_depth_kernels import SMALL

pytestmark = [pytest.mark.unit, needs_triton]


def _meta_inputs(num: int, rows: int) -> dict[str, torch.Tensor]:
    column = torch.zeros(num, device="meta")
    ids = torch.zeros(num, dtype=torch.int64, device="meta")
    return {"hidden": torch.zeros(rows, 2048, dtype=torch.bfloat16, device="meta"),
            "code0": ids, "has_cfg": column.bool(), "cfg_scale": column,
            "depth_sampling": torch.zeros(num, 3, device="meta"), "seeds": ids,
            "frames_at": ids}


def test_refuses_what_it_cannot_run() -> None:
    from breezert.kernels.streamed_depth import StreamedDepthFrame, StreamTiles

    with torch.device("meta"):
        full = random_bf16_fused_(DepthDecoder(BreezeConfig.full().depth))
        unpacked = DepthDecoder(BreezeConfig.full().depth).to(torch.bfloat16)
        fp32 = DepthDecoder(BreezeConfig.full().depth)
        for module in fp32.modules():  # packed as serving packs them, but left in fp32
            if hasattr(module, "fuse_"):
                module.fuse_()
    with pytest.raises(ValueError, match="fuse_projections_"):
        StreamedDepthFrame(unpacked, programs=132)
    with pytest.raises(ValueError, match="bf16"):
        StreamedDepthFrame(fp32, programs=132)
    with pytest.raises(ValueError, match="outside 1..16"):
        StreamedDepthFrame(full, max_rows=17, programs=132)
    with pytest.raises(ValueError, match="down_proj"):
        StreamedDepthFrame(full, programs=132, tiles=StreamTiles(down_split=3))
    torch.manual_seed(0)
    with pytest.raises(ValueError, match="does not fit"):  # head_dim 32: not the depth's shape
        StreamedDepthFrame(random_bf16_fused_(DepthDecoder(SMALL)), programs=4)
    frame = StreamedDepthFrame(full, max_rows=4, programs=132)
    with pytest.raises(ValueError, match="3 rows for 2 requests"):
        frame(**_meta_inputs(2, 3))
    with pytest.raises(ValueError, match="6 rows past"):
        frame(**_meta_inputs(3, 6))


class _Seen(dict):
    """What a traced probe recorded. Triton checks that a kernel's referenced values did not
    change while it was built (a deep copy, then ``!=``): this one is its own copy and equal only
    to itself."""

    def __deepcopy__(self, memo: dict) -> _Seen:
        return self

    __eq__ = object.__eq__
    __ne__ = object.__ne__
    __hash__ = object.__hash__  # type: ignore[assignment]


def _staged_layouts_probe(seen: _Seen):
    """A Gluon kernel that, when traced, puts into ``seen`` the staged input's layouts as Triton
    lowers them and the operand loads' bank conflicts, from it and from v3's plain layout."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    from breezert.kernels.streamed_depth import STAGED, STAGED_ROWS, STAGED_TILE

    @gluon.constexpr_function
    def record(name, value):
        seen[name] = value

    @gluon.jit
    def probe(out, XT: gl.constexpr, RB: gl.constexpr, BK: gl.constexpr, MMA: gl.constexpr,
              RS: gl.constexpr):
        xs = gl.allocate_shared_memory(gl.bfloat16, [XT, RB, BK], STAGED)
        tiles = xs._reinterpret(gl.bfloat16, xs.shape, STAGED_TILE)
        plain = gl.allocate_shared_memory(gl.bfloat16, [RB, BK], gl.SwizzledSharedLayout(
            vec=1, per_phase=1, max_phase=1, order=[1, 0]))
        operand = gl.zeros([BK, RB], gl.bfloat16,
                           gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)).type
        record("staged", gl.to_linear_layout(STAGED, [XT, RB, BK]))
        record("tile", gl.to_linear_layout(STAGED_TILE, [RB, BK]))
        record("rows", gl.to_linear_layout(STAGED_ROWS, [XT, RB // RS, RS, BK]))
        record("conflicts", gl.bank_conflicts(operand, tiles.index(1).permute((1, 0)).type))
        record("plain conflicts", gl.bank_conflicts(operand, plain.permute((1, 0)).type))

    return probe


def test_staged_tiles_are_the_staged_bytes_without_bank_conflicts(tmp_path, monkeypatch) -> None:
    from breezert.kernels.streamed_depth import StreamedDepthFrame, StreamTiles
    from tests.sm90_build import build_only

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # traced here, not from the cache
    with torch.device("meta"):
        full = random_bf16_fused_(DepthDecoder(BreezeConfig.full().depth))
    tiles = StreamTiles()
    frame = StreamedDepthFrame(full, programs=132, tiles=tiles)
    for rows, rs in ((8, 2), (8, 4), (8, 8), (16, 16)):  # the row operands, the rows staged
        seen = _Seen()
        with build_only():
            _staged_layouts_probe(seen).warmup(
                torch.empty(1, device="meta"), XT=frame.staged_tiles, RB=rows, BK=tiles.bk,
                MMA=frame.mma, RS=rs, num_warps=tiles.warps, grid=(1,))
        staged = seen["staged"].offset_bases  # type: ignore[attr-defined]
        tile = seen["tile"].offset_bases  # type: ignore[attr-defined]
        # tile t of the stored layout is tile t of the read one, at t whole tiles
        assert staged == ([[0, *b] for b in tile]
                          + [[1 << i, 0, 0] for i in range(frame.staged_tiles.bit_length() - 1)])
        # the staging view's [t, 0, r, c] (r < RS) is STAGED's [t, r, c]: each address bit that
        # keeps the view's second index 0 names the same element in both, and only the bits of
        # rows RS.. name another
        view = seen["rows"].offset_bases  # type: ignore[attr-defined]
        kept = [(v[0], v[2], v[3]) for v in view if v[1] == 0]
        assert kept == [tuple(s) for s, v in zip(staged, view) if v[1] == 0]
        assert len(view) - len(kept) == (rows // rs).bit_length() - 1
        assert seen["conflicts"] == 0
        assert seen["plain conflicts"] > 0, "the swizzle is what removes the conflicts"
