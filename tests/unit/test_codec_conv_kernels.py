"""The codec's residual-unit kernels (kernels/codec_conv.py) against the incremental codec's
eager ``_ResidualUnit`` with its ``_Carry``, on CPU through Triton's interpreter: outputs, the
history carried to the next step (rows of different real frame counts), streamed = one-shot,
and bf16 storage. Tiny shapes: 32 channels, tiles of 16, row blocks spanning two streams."""

from __future__ import annotations

import pytest
import torch

from tests.kernel_helpers import needs_triton, run_in_interpreter

pytestmark = pytest.mark.unit

C, PER_FRAME = 32, 6  # channels, samples a frame
TILES = dict(bm=16, bn=16, bk=16, num_warps=1, num_stages=1)


def _unit(dilation: int, seed: int):  # noqa: ANN202 - (eager unit, packed weights)
    from breezert.kernels.codec_conv import pack_residual_unit
    from breezert.models.codec import _ResidualUnit

    torch.manual_seed(seed)
    unit = _ResidualUnit(C, dilation)
    with torch.no_grad():
        for p in unit.parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() == 1 else p[0].numel() ** -0.5))
    packed = pack_residual_unit(unit.conv1.conv.weight, unit.conv1.conv.bias,
                                unit.conv2.conv.weight, unit.conv2.conv.bias,
                                (unit.act1.alpha, unit.act1.beta),
                                (unit.act2.alpha, unit.act2.beta), dilation)
    return unit, packed


def _eager(unit, x_ncl, flat, num_frames, frames):  # noqa: ANN001, ANN202
    """The incremental codec's step of one unit -> ([B, T, C], new history [B, 6d, C])."""
    from breezert.models.codec import _Carry

    spec = (("unit", C, unit.conv1.history),)
    carry = _Carry(flat, spec, num_frames, frames)
    with torch.no_grad():
        y = unit(x_ncl, carry)
    hist = carry.flat().view(x_ncl.shape[0], C, -1)
    return y.transpose(1, 2), hist.transpose(1, 2)


def check_matches_eager() -> None:
    """Every dilation (histories of 6, 18, 54 samples against 3 frames of 6 samples: taps
    reach back past the step), three streams with 3, 1 and 2 real frames."""
    from breezert.kernels.codec_conv import ConvTiles, next_history, residual_unit

    tiles = ConvTiles(**TILES)
    frames, num_frames = 3, torch.tensor([3, 1, 2])
    for dilation in (1, 3, 9):
        unit, packed = _unit(dilation, seed=dilation)
        history = 6 * dilation
        x = torch.randn(3, C, frames * PER_FRAME) * 2  # [B, C, T]
        flat = torch.randn(3, C * history)  # arena layout [B, C, 6d], flattened
        want, want_hist = _eager(unit, x, flat, num_frames, frames)
        x_cl = x.transpose(1, 2).contiguous()  # [B, T, C]
        hist = flat.view(3, C, history).transpose(1, 2)  # the arena's view, strided
        got = residual_unit(x_cl, hist, packed, tiles, tiles)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
        # the SFU sine's plumbing (the interpreter runs no PTX: tl.sin, the same bits; the GPU
        # test bounds the real one)
        assert torch.equal(residual_unit(x_cl, hist, packed, tiles, tiles, approx_sin=True), got)
        got_hist = next_history(x_cl, hist, packed, num_frames * PER_FRAME)
        torch.testing.assert_close(got_hist, want_hist, atol=1e-6, rtol=1e-6)
        # no history (None) is a zero history
        zero = residual_unit(x_cl, None, packed, tiles, tiles)
        want_zero, _ = _eager(unit, x, torch.zeros_like(flat), None, frames)
        torch.testing.assert_close(zero, want_zero, atol=2e-5, rtol=2e-5)


def check_streamed_equals_one_shot() -> None:
    """Two streams decoded 5 frames at once and in chunks of 1, 3, 1 frames, each chunk's
    history from ``next_history``: the same samples (to fp32 sum-order rounding)."""
    from breezert.kernels.codec_conv import ConvTiles, next_history, residual_unit

    tiles = ConvTiles(**TILES)
    unit, packed = _unit(3, seed=7)
    x = torch.randn(2, 5 * PER_FRAME, C) * 2
    one_shot = residual_unit(x, None, packed, tiles, tiles)
    pieces, hist, start = [], None, 0
    for size in (1, 3, 1):
        chunk = x[:, start * PER_FRAME:(start + size) * PER_FRAME]
        pieces.append(residual_unit(chunk, hist, packed, tiles, tiles))
        hist = next_history(chunk, hist, packed)
        start += size
    torch.testing.assert_close(torch.cat(pieces, dim=1), one_shot, atol=2e-5, rtol=2e-5)


def check_bf16_storage() -> None:
    """bf16 activations and weights, fp32 accumulation: within bf16 rounding of the fp32 unit;
    one column block of 32 (the tiles need not divide the rows)."""
    from breezert.kernels.codec_conv import ConvTiles, pack_residual_unit, residual_unit

    tiles = ConvTiles(bm=16, bn=32, bk=16, num_warps=1, num_stages=1)
    unit, packed = _unit(1, seed=3)
    packed16 = pack_residual_unit(unit.conv1.conv.weight, unit.conv1.conv.bias,
                                  unit.conv2.conv.weight, unit.conv2.conv.bias,
                                  (unit.act1.alpha, unit.act1.beta),
                                  (unit.act2.alpha, unit.act2.beta), 1, torch.bfloat16)
    x = torch.randn(3, 7, C) * 2  # 21 rows: two row blocks, the second partial
    hist = torch.randn(3, 6, C)
    want = residual_unit(x, hist, packed, tiles, tiles)
    got = residual_unit(x.bfloat16(), hist.bfloat16(), packed16, tiles, tiles)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    err = (got.float() - want).norm() / want.norm()
    assert err < 2e-2, err


@needs_triton
def test_residual_unit_matches_the_incremental_codec() -> None:
    run_in_interpreter(__name__, "check_matches_eager()")


@needs_triton
def test_streamed_equals_one_shot() -> None:
    run_in_interpreter(__name__, "check_streamed_equals_one_shot()")


@needs_triton
def test_bf16_storage() -> None:
    run_in_interpreter(__name__, "check_bf16_storage()")


def check_bench_runs() -> None:
    """``bench/codec_conv_kernels.py``'s sections on CPU (tiny layer list, no timing): every
    unit variant runs and the summary covers them; the kernels match the strict unit."""
    import json
    import sys
    import tempfile

    from tests.kernel_helpers import REPO

    sys.path.insert(0, str(REPO / "bench"))  # the script, and its own import of cuda_bench
    import codec_conv_kernels as bench

    bench.DEVICE = "cpu"
    bench.BLOCKS = [("tiny", 32, 4)]
    bench.TCONVS = [("tiny.up", 64, 32, 3, 2)]
    bench.median_ms = lambda fn: (fn(), 1.0)[1]
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        sys.argv = ["bench", "--out", out.name, "--shapes", "2x3"]
        bench.main()
        doc = json.load(open(out.name))
    summary = doc["unit_summary"]["2x3"]
    assert {"served", "fused-bf16", "gemm-only", "fused-best", "fused-approx-best"} <= set(
        summary), summary
    assert not [r for r in doc["residual_unit"] if "error" in r]
    assert all(s["min_snr_db"] > 100 for v, s in summary.items()
               if v.startswith(("fused/", "fused-approx/")))
    assert {r["variant"] for r in doc["causal_conv"]} >= {"ncl", "gemm7", "triton"}


@needs_triton
def test_the_codec_conv_bench_runs() -> None:
    run_in_interpreter(__name__, "check_bench_runs()")
