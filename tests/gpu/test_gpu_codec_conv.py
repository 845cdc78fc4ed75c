"""GPU: the codec's residual-unit kernels (kernels/codec_conv.py) at every full-size unit shape
(96-768 channels, dilations 1, 3, 9) against the strict-fp32 eager unit with its history:
exact indexing (IEEE fp32 dot), TF32 and bf16 within their bounds, streamed = one-shot.

Run on a CUDA machine: ``python -m pytest tests/gpu -q`` (skipped without CUDA).
"""

from __future__ import annotations

import pytest
import torch

from breezert.kernels.codec_conv import (
    CANDIDATE_TILES,
    ConvTiles,
    next_history,
    pack_residual_unit,
    residual_unit,
)
from breezert.models.codec import _Carry, _ResidualUnit

pytestmark = pytest.mark.gpu

UNITS = [(c, per_frame, d) for c, per_frame in ((768, 32), (384, 160), (192, 640), (96, 1920))
         for d in (1, 3, 9)]
# SNR of one unit against strict fp32 (a conv in TF32 is ~70 dB, bf16 ~50 dB on the H200,
# h200-codec-conv-kernels-20261201.json; the whole codec keeps 40 / 20 dB, test_gpu_codec.py)
MIN_SNR_DB = {"tf32": 55.0, "bf16": 30.0}


def _snr_db(ref: torch.Tensor, x: torch.Tensor) -> float:
    return float(10 * torch.log10(ref.double().pow(2).sum() / (x - ref).double().pow(2).sum()))


def _unit(c: int, d: int) -> tuple[_ResidualUnit, tuple]:
    torch.manual_seed(c + d)
    unit = _ResidualUnit(c, d).cuda()
    with torch.no_grad():
        for p in unit.parameters():
            p.copy_(torch.randn_like(p) * (0.1 if p.dim() == 1 else p[0].numel() ** -0.5))
    weights = (unit.conv1.conv.weight, unit.conv1.conv.bias, unit.conv2.conv.weight,
               unit.conv2.conv.bias, (unit.act1.alpha, unit.act1.beta),
               (unit.act2.alpha, unit.act2.beta), d)
    return unit, weights


@pytest.mark.parametrize("c,per_frame,d", UNITS)
@torch.no_grad()
def test_unit_matches_strict_fp32(c: int, per_frame: int, d: int) -> None:
    """3 streams x 2 frames with real frames 2, 1, 2 and a random history: outputs and the
    next history against the eager unit and carry in strict fp32: IEEE fp32 dots (the indexing,
    to fp32 sum order), TF32 at each candidate launch shape with either sine, bf16 storage."""
    unit, weights = _unit(c, d)
    frames, num_frames = 2, torch.tensor([2, 1, 2], device="cuda")
    x = torch.randn(3, c, frames * per_frame, device="cuda")
    flat = torch.randn(3, c * 6 * d, device="cuda") * 0.5
    saved = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        carry = _Carry(flat, (("unit", c, 6 * d),), num_frames, frames)
        ref = unit(x, carry).transpose(1, 2)
    finally:
        torch.backends.cudnn.allow_tf32 = saved
    ref_hist = carry.flat().view(3, c, -1).transpose(1, 2)
    x_cl, hist = x.transpose(1, 2).contiguous(), flat.view(3, c, -1).transpose(1, 2)
    packed = pack_residual_unit(*weights)
    exact = residual_unit(x_cl, hist, packed, precision="ieee")
    assert (exact - ref).abs().max() <= 1e-4 * ref.abs().max()
    for tiles in CANDIDATE_TILES:  # the shapes the bench times (built once, for both)
        for approx_sin in (False, True):
            got = residual_unit(x_cl, hist, packed, tiles, tiles, approx_sin=approx_sin)
            snr = _snr_db(ref, got)
            assert snr >= MIN_SNR_DB["tf32"], (tiles, approx_sin, snr)
    torch.testing.assert_close(next_history(x_cl, hist, packed, num_frames * per_frame),
                               ref_hist, atol=1e-5, rtol=1e-5)
    packed16 = pack_residual_unit(*weights, dtype=torch.bfloat16)
    got16 = residual_unit(x_cl.bfloat16(), hist.bfloat16(), packed16).float()
    assert _snr_db(ref, got16) >= MIN_SNR_DB["bf16"]


@pytest.mark.parametrize("c,per_frame", [(768, 32), (96, 1920)])
@torch.no_grad()
def test_streamed_equals_one_shot(c: int, per_frame: int) -> None:
    """4 streams x 8 frames at once and in chunks 1, 2, 4, 1 through all three units (d = 1,
    3, 9), each carrying its history: within TF32's chunking bound (the whole codec's streamed
    waveform differs from its one-shot by up to 1.4e-3, h200-codec-precision-20261201.json)."""
    units = [pack_residual_unit(*_unit(c, d)[1]) for d in (1, 3, 9)]
    x = torch.randn(4, 8 * per_frame, c, device="cuda")

    def run(chunk: torch.Tensor, hists: list) -> torch.Tensor:
        for i, unit in enumerate(units):
            new = next_history(chunk, hists[i], unit)
            chunk = residual_unit(chunk, hists[i], unit, ConvTiles(), ConvTiles())
            hists[i] = new
        return chunk

    one_shot = run(x, [None] * 3)
    hists: list = [None] * 3
    pieces, start = [], 0
    for size in (1, 2, 4, 1):
        pieces.append(run(x[:, start * per_frame:(start + size) * per_frame], hists))
        start += size
    streamed = torch.cat(pieces, dim=1)
    assert (streamed - one_shot).abs().max() <= 2e-3 * one_shot.abs().max()
