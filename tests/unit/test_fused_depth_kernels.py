"""The hand-fused Triton depth layers (kernels/fused_depth.py) against the eager depth decoder,
run on CPU through Triton's interpreter (the GPU tests check them compiled on the H200)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from breezert.models.config import DepthConfig
from breezert.models.depth import DepthDecoder
from tests.kernel_helpers import needs_triton, random_bf16_fused_, run_in_interpreter

pytestmark = pytest.mark.unit

# The smallest depth decoder the kernels accept: tensor-core tiles need >= 16 on every dot axis.
SMALL = DepthConfig(
    hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
    head_dim=32, backbone_hidden_size=64, audio_embed_size=64,
)


def _decoder(seed: int, head_dim: int = 32) -> DepthDecoder:
    torch.manual_seed(seed)
    cfg = SMALL if head_dim == 32 else replace(SMALL, num_layers=1, num_heads=2, num_kv_heads=1,
                                               head_dim=head_dim)
    return random_bf16_fused_(DepthDecoder(cfg))


@needs_triton
@pytest.mark.parametrize("rows", [3, 20])
def test_fused_frame_matches_eager_within_bf16(rows: int) -> None:
    run_in_interpreter(__name__, f"check_frame({rows}, qkv_split=1)")


@needs_triton
def test_small_row_blocks_match_eager() -> None:
    """20 rows as two 16-row blocks in the q/k/v and gate/up GEMMs (``qkv_bm``, ``gate_bm``)."""
    run_in_interpreter(__name__, "check_frame(20, qkv_split=1, qkv_bm=16, gate_bm=16, "
                                 "positions=2)")


@needs_triton
def test_fused_head_slices_match_eager() -> None:
    """head_dim 128 split into 4 programs per head (the full-size layout), one layer."""
    run_in_interpreter(__name__, "check_frame(3, qkv_split=4, head_dim=128, positions=3)")


@needs_triton
def test_split_k_qkv_matches_eager() -> None:
    """The q/k/v GEMM split along K (``Tiles.qkv_split_k``): 3 rows in the preallocated
    workspace (its counters end at 0), 20 rows (two 16-row blocks) in a call-local one."""
    run_in_interpreter(__name__, "check_frame(3, qkv_split=1, qkv_split_k=2, positions=4)")
    run_in_interpreter(__name__, "check_frame(20, qkv_split=1, qkv_split_k=2, qkv_bm=16, "
                                 "positions=2)")


@needs_triton
def test_fused_tma_weight_tiles_match_eager() -> None:
    """Weight tiles read through TMA descriptors (``Tiles.tma``), the full-size head layout and
    a two-layer decoder: the same checks, and the same bits as pointer loads."""
    run_in_interpreter(__name__, "check_frame(3, qkv_split=4, head_dim=128, positions=3, "
                                 "tma=True)")
    run_in_interpreter(__name__, "check_tma_bits()")


def check_tma_bits() -> None:
    from breezert.kernels import fused_depth

    depth = _decoder(4)
    outs = []
    for tma in (False, True):
        fused = fused_depth.FusedDepthLayers(depth, max_rows=4,
                                             tiles=fused_depth.Tiles(qkv_split=1, tma=tma))
        cache = depth.new_cache(3)
        torch.manual_seed(3)
        with torch.inference_mode():
            for position in range(2):
                x = torch.randn(3, SMALL.backbone_hidden_size).to(torch.bfloat16)
                pos = torch.full((1,), position, dtype=torch.long)
                cos, sin = depth.rope.cos_sin(pos.expand(3), torch.bfloat16)
                outs.append(fused(x, cos, sin, cache, pos))
        outs.append(cache)
    assert all(torch.equal(a, b) for a, b in zip(outs[:3], outs[3:]))


def check_frame(rows: int, qkv_split: int, head_dim: int = 32, positions: int = 16,
                **tile_fields: object) -> None:
    """Positions of a frame: hidden states and the cache match the eager modules. Of 16
    positions the first three and the last run (the last attends over the whole cache; those
    skipped leave zero keys in both caches): each interpreted position costs seconds."""
    from breezert.kernels import fused_depth

    depth = _decoder(rows, head_dim)
    tiles = fused_depth.Tiles(qkv_split=qkv_split, **tile_fields)
    fused = fused_depth.FusedDepthLayers(depth, max_rows=16,  # 20 rows: a call-local workspace
                                         tiles=tiles)
    eager_cache, fused_cache = depth.new_cache(rows), depth.new_cache(rows)
    torch.manual_seed(1)
    with torch.inference_mode():
        steps = range(positions if rows < 16 else min(positions, 4))
        for position in (*steps[:3], steps[-1]) if len(steps) > 4 else steps:
            x = torch.randn(rows, SMALL.backbone_hidden_size).to(torch.bfloat16)
            pos = torch.full((1,), position, dtype=torch.long)
            cos, sin = depth.rope.cos_sin(pos.expand(rows), torch.bfloat16)
            want = depth.run_layers(x, cos, sin, eager_cache, pos).float()
            got = fused(x, cos, sin, fused_cache, pos).float()
            if position == 0:  # one key: the eager rounding points, up to GEMM sum order
                assert (got != want).float().mean() < 0.02
            assert (got - want).abs().max() <= 0.03 * want.abs().max(), position
            assert (fused_cache.float() - eager_cache.float()).abs().max() <= 0.03 * (
                eager_cache.float().abs().max())
        assert torch.count_nonzero(fused.counters) == 0  # the last program of a tile resets


@needs_triton
def test_fused_rejects_unfused_weights_and_odd_sizes() -> None:
    from breezert.kernels import fused_depth

    depth = DepthDecoder(SMALL).to(torch.bfloat16)
    with pytest.raises(ValueError, match="fuse_projections_"):
        fused_depth.FusedDepthLayers(depth, max_rows=4, tiles=fused_depth.Tiles(qkv_split=1))
    with pytest.raises(ValueError, match="head_dim"):  # 16-column slices need head_dim >= 128
        fused_depth.FusedDepthLayers(depth, max_rows=4)
    odd = DepthDecoder(DepthConfig(hidden_size=32, intermediate_size=96, num_layers=1,
                                   num_heads=4, num_kv_heads=2, head_dim=8,
                                   backbone_hidden_size=64, audio_embed_size=64))
    with pytest.raises(ValueError, match="bfloat16"):  # fp32 weights: the kernels store bf16
        fused_depth.FusedDepthLayers(odd, max_rows=4)
    with pytest.raises(ValueError, match="hidden_size"):
        fused_depth.FusedDepthLayers(odd.to(torch.bfloat16), max_rows=4)
    fused = random_bf16_fused_(DepthDecoder(SMALL))
    with pytest.raises(ValueError, match="hidden_size"):  # 128 in 3 splits: no whole tiles
        fused_depth.FusedDepthLayers(fused, max_rows=4, warm=False,
                                     tiles=fused_depth.Tiles(qkv_split=1, qkv_split_k=3))
    with pytest.raises(ValueError, match="qkv_split_k"):  # a row's bits would follow its bucket
        fused_depth.FusedDepthLayers(fused, max_rows=4, warm=False, tiles=(
            (2, fused_depth.Tiles(qkv_split=1)), (4, fused_depth.Tiles(qkv_split=1,
                                                                        qkv_split_k=2))))


@needs_triton
def test_row_buckets_pick_their_tiles_and_keep_row_bits() -> None:
    run_in_interpreter(__name__, "check_row_buckets()")


def check_row_buckets() -> None:
    """Per-bucket launch shapes: 2 rows run the first bucket's tiles, 6 rows the second's; a
    row gets the same bits alone as in the larger bucket (same split-K), close to eager."""
    from breezert.kernels import fused_depth
    from breezert.kernels.gemm import Tiles

    depth = _decoder(6)
    small, large = Tiles(qkv_split=1, split_k=4), Tiles(qkv_split=1, split_k=4, gate_bn=32,
                                                         split_bn=64, tma=True)
    fused = fused_depth.FusedDepthLayers(depth, max_rows=8, tiles=[(2, small), (8, large)])
    assert fused.gemms_for(2).tiles == small and fused.gemms_for(6).tiles == large
    assert fused.gemms_for(9).tiles == large  # past the last bucket: its tiles, more rows
    torch.manual_seed(4)
    xs = torch.randn(2, 6, SMALL.backbone_hidden_size).to(torch.bfloat16)
    caches = [depth.new_cache(1), depth.new_cache(6), depth.new_cache(6)]
    with torch.inference_mode():
        for position in range(2):
            pos = torch.full((1,), position, dtype=torch.long)
            cos, sin = depth.rope.cos_sin(pos.expand(6), torch.bfloat16)
            alone = fused(xs[position, :1], cos[:1], sin[:1], caches[0], pos)
            crowd = fused(xs[position], cos, sin, caches[1], pos)
            want = depth.run_layers(xs[position], cos, sin, caches[2], pos)
            assert torch.equal(alone[0], crowd[0]), position
            assert (crowd.float() - want.float()).abs().max() <= 0.03 * want.float().abs().max()
    assert torch.count_nonzero(fused.counters) == 0


@needs_triton
def test_prenormed_rows_through_tma_give_the_same_bits() -> None:
    """``Tiles.prenorm`` (the norms apart, every GEMM's input rows through TMA): the same
    hidden states and cache, bit for bit, as the norm prologues, at 3 rows and 20 (two 16-row
    blocks, the second past the tensor's end), with split-K q/k/v too; a row alone in the
    prenorm bucket equals it in a crowd of the prologue bucket."""
    run_in_interpreter(__name__, "check_switch_bits(3, qkv_split_k=1)")
    run_in_interpreter(__name__, "check_switch_bits(20, qkv_split_k=2)")


@needs_triton
def test_o_proj_and_down_splits_summed_in_one_program_give_the_same_bits() -> None:
    """``Tiles.o_inline`` and ``Tiles.down_inline`` (o_proj's and down_proj's K splits made and
    summed in split order inside each program, no workspace): the same bits as the last program
    summing them, at 3 rows (o_proj's alone) and 20 rows (both, with ``Tiles.prenorm``, as the
    large-row buckets would run them)."""
    run_in_interpreter(__name__, "check_switch_bits(3, qkv_split_k=1, switches=('o_inline',))")
    run_in_interpreter(__name__, "check_switch_bits(20, qkv_split_k=1, "
                                 "switches=('o_inline', 'down_inline', 'prenorm'))")


def check_switch_bits(rows: int, qkv_split_k: int, switches: tuple[str, ...] = ("prenorm",),
                      ) -> None:
    """The decoder with ``switches`` on against it without, bit for bit: every position's
    hidden states and the cache, and a row alone (with them) against the crowd (without)."""
    from breezert.kernels import fused_depth
    from breezert.kernels.gemm import Tiles

    depth = _decoder(8)
    shape = {"qkv_split": 1, "split_k": 4, "qkv_bm": 16, "gate_bm": 16, "split_bm": 16,
             "qkv_split_k": qkv_split_k, "tma": True}
    plain = fused_depth.FusedDepthLayers(depth, max_rows=32, tiles=Tiles(**shape))
    prenorm = fused_depth.FusedDepthLayers(
        depth, max_rows=32, tiles=Tiles(**shape, **{name: True for name in switches}))
    caches = [depth.new_cache(rows), depth.new_cache(rows), depth.new_cache(1)]
    torch.manual_seed(5)
    with torch.inference_mode():
        for position in range(3):
            x = torch.randn(rows, SMALL.backbone_hidden_size).to(torch.bfloat16)
            pos = torch.full((1,), position, dtype=torch.long)
            cos, sin = depth.rope.cos_sin(pos.expand(rows), torch.bfloat16)
            want = plain(x, cos, sin, caches[0], pos)
            got = prenorm(x, cos, sin, caches[1], pos)
            alone = prenorm(x[:1], cos[:1], sin[:1], caches[2], pos)
            assert torch.equal(got, want), position
            assert torch.equal(alone[0], want[0]), position
    assert torch.equal(caches[0], caches[1])
    assert torch.count_nonzero(prenorm.counters) == 0


@needs_triton
def test_the_widest_buckets_run_the_norms_apart_with_every_buckets_k_splits() -> None:
    """The 256- and 512-row buckets are the ones with ``Tiles.prenorm`` (faster there, slower at
    128 rows and under); every bucket splits o_proj/down and q/k/v along K alike, so a row's
    bits do not depend on its bucket; ``prenorm_every_bucket`` (the tests' prenorm path) only
    turns the norms apart on."""
    from dataclasses import replace

    from breezert.kernels.fused_depth import TILES_BY_ROWS, prenorm_every_bucket

    assert [(limit, t.prenorm) for limit, t in TILES_BY_ROWS] == [
        (64, False), (128, False), (256, True), (512, True)]
    first = TILES_BY_ROWS[0][1]
    for _, tiles in TILES_BY_ROWS:
        assert (tiles.split_k, tiles.qkv_split_k, tiles.qkv_bk) == (
            first.split_k, first.qkv_split_k, first.qkv_bk)
    assert prenorm_every_bucket() == tuple(
        (limit, replace(t, prenorm=True)) for limit, t in TILES_BY_ROWS)


@needs_triton
def test_a_bucket_may_launch_without_pdl_where_the_frame_asks_for_it() -> None:
    """``Tiles.skip_pdl``: that bucket's tiles launch plainly under ``pdl=True``; the others
    keep PDL, and without ``pdl`` nothing changes."""
    from breezert.kernels import fused_depth
    from breezert.kernels.gemm import Tiles

    depth = _decoder(8)
    table = ((2, Tiles(qkv_split=1)), (32, Tiles(qkv_split=1, skip_pdl=True)))
    with_pdl = fused_depth.FusedDepthLayers(depth, max_rows=32, tiles=table, warm=False,
                                            pdl=True)
    assert [with_pdl.gemms_for(rows).tiles.pdl for rows in (1, 32)] == [True, False]
    plain = fused_depth.FusedDepthLayers(depth, max_rows=32, tiles=table, warm=False)
    assert [plain.gemms_for(rows).tiles.pdl for rows in (1, 32)] == [False, False]
