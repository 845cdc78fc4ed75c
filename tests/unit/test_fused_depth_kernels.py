"""The hand-fused Triton depth layers (kernels/fused_depth.py) against the eager depth decoder,
run on CPU through Triton's interpreter (the GPU tests check them compiled on the H200)."""

from __future__ import annotations

import importlib
import importlib.util
import sys

import pytest
import torch

from breezert.models.config import DepthConfig
from breezert.models.depth import DepthDecoder

pytestmark = pytest.mark.unit

# The smallest depth decoder the kernels accept: tensor-core tiles need >= 16 on every dot axis.
SMALL = DepthConfig(
    hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
    head_dim=32, backbone_hidden_size=64, audio_embed_size=64,
)


@pytest.fixture(scope="module")
def fused_module():  # type: ignore[no-untyped-def]
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    mp = pytest.MonkeyPatch()
    mp.setenv("TRITON_INTERPRET", "1")  # read when the kernels are defined
    sys.modules.pop("breezert.kernels.fused_depth", None)
    yield importlib.import_module("breezert.kernels.fused_depth")
    sys.modules.pop("breezert.kernels.fused_depth", None)
    mp.undo()


def _decoder(seed: int) -> DepthDecoder:
    torch.manual_seed(seed)
    depth = DepthDecoder(SMALL)
    with torch.no_grad():
        for p in depth.parameters():
            p.copy_(torch.randn_like(p) * 0.05)
        for layer in depth.model.layers:  # norm weights near 1, as trained ones are
            layer.input_layernorm.weight.add_(1.0)
            layer.post_attention_layernorm.weight.add_(1.0)
        depth.model.norm.weight.add_(1.0)
    depth = depth.to(torch.bfloat16).eval()
    for layer in depth.model.layers:
        layer.self_attn.fuse_()
        layer.mlp.fuse_()
    return depth


@pytest.mark.parametrize("rows", [3, 20])
def test_fused_frame_matches_eager_within_bf16(fused_module, rows: int) -> None:  # type: ignore[no-untyped-def]
    """All 16 positions of a frame: hidden states and the cache match the eager modules."""
    depth = _decoder(rows)
    tiles = fused_module.Tiles(qkv_split=1)  # head_dim 32: one program per head
    fused = fused_module.FusedDepthLayers(depth, max_rows=16, tiles=tiles)  # 20 rows: own ws
    eager_cache, fused_cache = depth.new_cache(rows), depth.new_cache(rows)
    torch.manual_seed(1)
    with torch.inference_mode():
        for position in range(depth.max_positions if rows < 16 else 4):
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


def test_fused_rejects_unfused_weights_and_odd_sizes(fused_module) -> None:  # type: ignore[no-untyped-def]
    depth = DepthDecoder(SMALL).to(torch.bfloat16)
    with pytest.raises(ValueError, match="fuse_projections_"):
        fused_module.FusedDepthLayers(depth, max_rows=4, tiles=fused_module.Tiles(qkv_split=1))
    with pytest.raises(ValueError, match="head_dim"):  # 16-column slices need head_dim >= 128
        fused_module.FusedDepthLayers(depth, max_rows=4)
    odd = DepthDecoder(DepthConfig(hidden_size=32, intermediate_size=96, num_layers=1,
                                   num_heads=4, num_kv_heads=2, head_dim=8,
                                   backbone_hidden_size=64, audio_embed_size=64))
    with pytest.raises(ValueError, match="hidden_size"):
        fused_module.FusedDepthLayers(odd, max_rows=4)
