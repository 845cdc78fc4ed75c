"""The streamed depth frame's refusals (kernels/streamed_depth.py), on CPU: what it cannot run
is refused when it is made or called, naming why. Its kernels build for sm_90 in
tests/unit/test_sm90_build.py and run in tests/gpu/test_gpu_frame_kernels.py (Gluon has no
CPU interpreter)."""

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
