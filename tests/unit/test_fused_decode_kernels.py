"""The fused backbone DECODE step (kernels/fused_decode.py) against the eager backbone over the
paged KV cache, on CPU through Triton's interpreter (the GPU tests check it on the H200)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from breezert.layers.attention import GatherKV
from breezert.models.backbone import Qwen3Backbone
from breezert.worker.kv_cache import KVRun
from tests.kernel_helpers import (
    SMALL_BACKBONE,
    decode_meta,
    needs_triton,
    run_in_interpreter,
    small_backbone,
    small_paged_cache,
)

pytestmark = pytest.mark.unit

@needs_triton
def test_fused_decode_matches_eager_paged_attention() -> None:
    run_in_interpreter(__name__, "check_decode()")


def check_decode() -> None:
    """Rows with 0, 19 and 100 cached tokens (blocks scattered through the pool) and a padding
    row, attention in 64-token splits (one 64-token tile each): hidden states and every written
    cache row match the eager step, and a larger context bucket (more splits, all past the rows'
    lengths) changes no bit."""
    from breezert.kernels.fused_decode import FusedBackboneDecode

    backbone = small_backbone()
    fused = FusedBackboneDecode(SimpleNamespace(backbone_model=backbone), max_rows=8,
                                split_tokens=64)
    cache = small_paged_cache(seed=1)
    runs = [KVRun([7], 0, 1), KVRun([3, 11], 19, 1), KVRun([2, 9, 5, 14, 4, 12, 8], 100, 1)]
    meta = decode_meta(cache, runs, 4, 128)
    embeds = torch.randn(4, SMALL_BACKBONE.hidden_size).to(torch.bfloat16)
    eager_kv, fused_kv = cache.kv.clone(), cache.kv.clone()
    with torch.inference_mode():
        view = GatherKV(eager_kv, meta["write_rows"], meta["read_rows"], meta["mask"])
        want = backbone(embeds, meta["positions"], view).float()
        got = fused(embeds, meta["positions"],
                    GatherKV(fused_kv, meta["write_rows"], meta["read_rows"], meta["mask"])).float()
    assert (got - want).abs().max() <= 0.03 * want.abs().max(), (got - want).abs().max()
    written = meta["write_rows"]
    # Layer 0's new k/v: QK-norm, RoPE and the GEMM at the eager rounding points (a value on a
    # bf16 rounding boundary may still go the other way with the GEMM's sum order).
    assert (fused_kv[0][:, written] != eager_kv[0][:, written]).float().mean() < 0.01
    diff = (fused_kv[:, :, written].float() - eager_kv[:, :, written].float()).abs().max()
    assert diff <= 0.03 * eager_kv[:, :, written].float().abs().max(), diff
    wide = decode_meta(cache, runs, 4, 256)
    wide_kv = cache.kv.clone()
    with torch.inference_mode():
        view = GatherKV(wide_kv, wide["write_rows"], wide["read_rows"], wide["mask"])
        again = fused(embeds, wide["positions"], view).float()
    assert torch.equal(again, got) and torch.equal(wide_kv, fused_kv)
    untouched = torch.ones(cache.kv.shape[2], dtype=torch.bool)
    untouched[written] = False
    assert torch.equal(fused_kv[:, :, untouched], cache.kv[:, :, untouched])
    assert torch.count_nonzero(fused.counters) == 0


@needs_triton
def test_the_shapes_the_decode_tuner_searches_keep_every_bit() -> None:
    run_in_interpreter(__name__, "check_tuner_fields_keep_bits()")


def check_tuner_fields_keep_bits() -> None:
    """``bench/tune_fused_decode.py`` searches column tiles and row blocks only (the K tiles and
    split set the sum order): with any of them the step's hidden states are the same bits."""
    from dataclasses import replace

    from breezert.kernels.fused_decode import DECODE_TILES, FusedBackboneDecode

    backbone = small_backbone()
    model = SimpleNamespace(backbone_model=backbone)
    cache = small_paged_cache(seed=2)
    meta = decode_meta(cache, [KVRun([3, 11], 19, 1), KVRun([2, 9, 5], 40, 1)], 2, 64)
    embeds = torch.randn(2, SMALL_BACKBONE.hidden_size).to(torch.bfloat16)

    def step(tiles: object) -> torch.Tensor:
        fused = FusedBackboneDecode(model, max_rows=2, tiles=tiles, split_tokens=64)
        with torch.inference_mode():
            return fused(embeds, meta["positions"], GatherKV(cache.kv.clone(), meta["write_rows"],
                                                          meta["read_rows"], meta["mask"]))

    want = step(DECODE_TILES)
    for fields in ({"linear_bn": 16}, {"linear_bn": 32, "gate_bn": 32}, {"split_bn": 64},
                   {"gate_bm": 16, "split_bm": 16}):
        assert torch.equal(step(replace(DECODE_TILES, **fields)), want), fields


@needs_triton
def test_fused_decode_rejects_unfused_weights() -> None:
    from breezert.kernels.fused_decode import FusedBackboneDecode

    backbone = Qwen3Backbone(SMALL_BACKBONE).to(torch.bfloat16)
    with pytest.raises(ValueError, match="fuse_projections_"):
        FusedBackboneDecode(SimpleNamespace(backbone_model=backbone), max_rows=4)


@needs_triton
def test_gemm_shapes_and_dtype_are_checked_before_any_launch() -> None:
    from breezert.kernels.fused_decode import FusedBackboneDecode
    from breezert.kernels.gemm import FusedGemms, Tiles

    gemms = FusedGemms(Tiles(split_k=8, split_bk=128), max_rows=4, max_n=256,
                       device=torch.device("cpu"))
    gemms.check("fits", norm_k=128, linear=(128, 128), gate_up=(128, 128), split=(256, 2048))
    with pytest.raises(ValueError, match="odd-split"):  # 192 per split: not whole 128 tiles
        gemms.check("odd-split", split=(256, 8 * 192))
    with pytest.raises(ValueError, match="too-wide"):  # past the workspace
        gemms.check("too-wide", split=(512, 128))
    with pytest.raises(ValueError, match="odd-norm"):  # the RMSNorm prologue reads 256 at once
        gemms.check("odd-norm", norm_k=384)
    with pytest.raises(ValueError, match="bfloat16"):
        FusedBackboneDecode(SimpleNamespace(backbone_model=Qwen3Backbone(SMALL_BACKBONE)),
                            max_rows=4)
