"""GPU: the fused Triton depth layers (kernels/fused_depth.py) on the full-size depth decoder —
close to the eager modules, deterministic, batch invariant, and equal inside a CUDA graph.

Run on a CUDA machine: ``python -m pytest tests/gpu -q`` (skipped without CUDA).
"""

from __future__ import annotations

import pytest
import torch

from breezert.models.config import BreezeConfig
from breezert.models.depth import DepthDecoder
from tests.kernel_helpers import fp32_copy, random_bf16_fused_, rel_error

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def depth() -> DepthDecoder:
    torch.manual_seed(0)
    cfg = BreezeConfig.full().depth
    with torch.device("cuda"):
        return random_bf16_fused_(DepthDecoder(cfg))


@pytest.fixture(scope="module")
def depth_fp32(depth: DepthDecoder) -> DepthDecoder:
    """An fp32 copy with the same weights, for reference math."""
    with torch.device("cuda"):
        return fp32_copy(depth, DepthDecoder)


def _frame(fn, depth: DepthDecoder, xs: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """All 16 positions with inputs ``xs [16, R, 2048]`` -> hidden per position, final cache."""
    rows = xs.shape[1]
    cache = depth.new_cache(rows)
    outs = []
    for position in range(depth.max_positions):
        pos = torch.full((1,), position, dtype=torch.long, device="cuda")
        cos, sin = depth.rope.cos_sin(pos.expand(rows), xs.dtype)
        outs.append(fn(xs[position], cos, sin, cache, pos).clone())
    return outs, cache


def _eager_and_replayed(fn, depth: DepthDecoder,  # type: ignore[no-untyped-def]
                        xs: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """A frame of ``fn`` run eagerly, then captured in a CUDA graph and replayed three times:
    each as its hidden states per position followed by the final cache."""
    got, got_cache = _frame(fn, depth, xs)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        replayed, replayed_cache = _frame(fn, depth, xs)
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    return got + [got_cache], replayed + [replayed_cache]


@pytest.mark.parametrize("rows", [1, 16, 32, 100, 160])
def test_fused_matches_eager(depth: DepthDecoder, depth_fp32: DepthDecoder, rows: int) -> None:
    from breezert.kernels.fused_depth import FusedDepthLayers

    fused = FusedDepthLayers(depth, max_rows=128)  # 160 rows: a call-local workspace
    gen = torch.Generator(device="cuda").manual_seed(rows)
    xs = torch.randn(16, rows, 2048, device="cuda", generator=gen).to(torch.bfloat16)
    with torch.inference_mode():
        want, want_cache = _frame(depth.run_layers, depth, xs)
        got, got_cache = _frame(fused, depth, xs)
        again, _ = _frame(fused, depth, xs)
        exact, _ = _frame(depth_fp32.run_layers, depth_fp32, xs.float())

    for position, (w, g, a, e) in enumerate(zip(want, got, again, exact)):
        assert torch.equal(g, a), f"position {position}: not deterministic"
        assert rel_error(g, w) < 2e-2, f"position {position}: {rel_error(g, w)} from eager"
        # As accurate as the eager bf16 modules, measured against fp32 math.
        fused_err, eager_err = rel_error(g, e), rel_error(w, e)
        assert fused_err <= 1.25 * eager_err + 1e-3, (position, fused_err, eager_err)
    assert rel_error(got_cache, want_cache) < 2e-2
    assert torch.count_nonzero(fused.counters).item() == 0


@pytest.mark.parametrize("crowd", [16, 17, 32, 64, 65, 128, 129, 256, 257, 512])
def test_fused_rows_are_batch_invariant(depth: DepthDecoder, crowd: int) -> None:
    """A row's result does not depend on how many rows run beside it, whichever bucket's
    launch shapes (``TILES_BY_ROWS``) the crowd runs with."""
    from breezert.kernels.fused_depth import FusedDepthLayers

    fused = FusedDepthLayers(depth, max_rows=512)
    gen = torch.Generator(device="cuda").manual_seed(7)
    xs = torch.randn(16, crowd, 2048, device="cuda", generator=gen).to(torch.bfloat16)
    with torch.inference_mode():
        alone, _ = _frame(fused, depth, xs[:, :1].contiguous())
        together, _ = _frame(fused, depth, xs)
    for a, c in zip(alone, together):
        assert torch.equal(a[0], c[0])


def test_fused_graph_replay_equals_fused_eager(depth: DepthDecoder) -> None:
    from breezert.kernels.fused_depth import FusedDepthLayers

    fused = FusedDepthLayers(depth, max_rows=32)
    rows = 32
    gen = torch.Generator(device="cuda").manual_seed(3)
    xs = torch.randn(16, rows, 2048, device="cuda", generator=gen).to(torch.bfloat16)
    with torch.inference_mode():
        want, _ = _frame(fused, depth, xs)
        static_x = xs.clone()
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            _frame(fused, depth, static_x)  # warm: Triton compiles outside the capture
            with torch.cuda.graph(graph, stream=stream):
                outs, _ = _frame(fused, depth, static_x)
        torch.cuda.current_stream().wait_stream(stream)
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
    for w, o in zip(want, outs):
        assert torch.equal(w, o)


@pytest.mark.parametrize("rows", [1, 16, 64, 128])
def test_tma_weight_tiles_change_no_bit(depth: DepthDecoder, rows: int) -> None:
    """Weight tiles through TMA descriptors (``Tiles.tma``) give the pointer loads' bits."""
    from breezert.kernels.fused_depth import FusedDepthLayers
    from breezert.kernels.gemm import Tiles

    plain = FusedDepthLayers(depth, max_rows=128, tiles=Tiles())
    tma = FusedDepthLayers(depth, max_rows=128, tiles=Tiles(tma=True))
    gen = torch.Generator(device="cuda").manual_seed(200 + rows)
    xs = torch.randn(16, rows, 2048, device="cuda", generator=gen).to(torch.bfloat16)
    with torch.inference_mode():
        want, want_cache = _frame(plain, depth, xs)
        got, got_cache = _frame(tma, depth, xs)
    for w, g in zip(want + [want_cache], got + [got_cache]):
        assert torch.equal(w, g)


@pytest.mark.parametrize("split", [2, 4])
def test_split_k_qkv_is_close_and_batch_invariant(depth: DepthDecoder, depth_fp32: DepthDecoder,
                                                  split: int) -> None:
    """The q/k/v GEMM split along K (``Tiles.qkv_split_k``) in every bucket of
    ``TILES_BY_ROWS``: as accurate as the eager modules against fp32, and a row alone gives its
    bits in crowds of 16 to 128 (both buckets)."""
    from dataclasses import replace

    from breezert.kernels.fused_depth import TILES_BY_ROWS, FusedDepthLayers

    table = tuple((limit, replace(t, qkv_split_k=split)) for limit, t in TILES_BY_ROWS)
    fused = FusedDepthLayers(depth, max_rows=128, tiles=table)
    gen = torch.Generator(device="cuda").manual_seed(400 + split)
    xs = torch.randn(16, 128, 2048, device="cuda", generator=gen).to(torch.bfloat16)

    with torch.inference_mode():
        alone, _ = _frame(fused, depth, xs[:, :1].contiguous())
        for crowd in (16, 64, 128):
            together, _ = _frame(fused, depth, xs[:, :crowd].contiguous())
            assert all(torch.equal(a[0], c[0]) for a, c in zip(alone, together)), crowd
        got, _ = _frame(fused, depth, xs[:, :16].contiguous())
        want, _ = _frame(depth.run_layers, depth, xs[:, :16].contiguous())
        exact, _ = _frame(depth_fp32.run_layers, depth_fp32, xs[:, :16].float())
    for g, w, e in zip(got, want, exact):
        assert rel_error(g, e) <= 1.25 * rel_error(w, e) + 1e-3
    assert torch.count_nonzero(fused.counters).item() == 0


def _pdl_pair(depth: DepthDecoder) -> tuple[object, object]:
    from breezert.kernels.fused_depth import FusedDepthLayers

    # up to 512 rows: the 512-row bucket launches plainly inside the PDL frame (skip_pdl)
    return (FusedDepthLayers(depth, max_rows=512),
            FusedDepthLayers(depth, max_rows=512, pdl=True))


def _prenorm_pair(depth: DepthDecoder) -> tuple[object, object]:
    from dataclasses import replace

    from breezert.kernels.fused_depth import TILES_BY_ROWS, FusedDepthLayers, prenorm_every_bucket

    # every bucket's shapes with the norms in the GEMM prologues (o_proj's splits apart), against
    # every bucket with them apart (the 256- and 512-row buckets as served)
    prologue = tuple((limit, replace(t, prenorm=False, o_inline=False))
                     for limit, t in TILES_BY_ROWS)
    return (FusedDepthLayers(depth, max_rows=512, tiles=prologue, pdl=True),
            FusedDepthLayers(depth, max_rows=512, tiles=prenorm_every_bucket(), pdl=True))


def _inline_pair(depth: DepthDecoder, **inline: bool) -> tuple[object, object]:
    from dataclasses import replace

    from breezert.kernels.fused_depth import FusedDepthLayers, prenorm_every_bucket

    # the ``inline`` switches (o_proj's and/or down_proj's splits summed in one program) in
    # every bucket, with the norms apart (as a large-row bucket would run them)
    table = tuple((limit, replace(t, **inline)) for limit, t in prenorm_every_bucket())
    return (FusedDepthLayers(depth, max_rows=512, pdl=True),
            FusedDepthLayers(depth, max_rows=512, tiles=table, pdl=True))


SAME_BITS = {"pdl": _pdl_pair, "prenorm": _prenorm_pair,
             "o_inline": lambda depth: _inline_pair(depth, o_inline=True),
             "down_inline": lambda depth: _inline_pair(depth, o_inline=True, down_inline=True)}
"""Switches that must not change a bit: (the path without, the path with) on a decoder."""


@pytest.mark.parametrize(("switch", "rows"), [
    *(("pdl", rows) for rows in (1, 16, 64, 128, 512)),
    *(("prenorm", rows) for rows in (1, 100, 256, 300, 512)),
    *(("o_inline", rows) for rows in (1, 256, 512)),
    *(("down_inline", rows) for rows in (1, 256, 512)),
])
def test_switch_changes_no_bit(depth: DepthDecoder, switch: str, rows: int) -> None:
    """Programmatic dependent launch (``graph.pdl``) gives the same bits as plain launches;
    ``Tiles.prenorm`` in every bucket of ``TILES_BY_ROWS`` (the norms apart, the GEMMs' input
    rows through TMA, PDL as served) the bits of the norms in the GEMM prologues at every size
    up to capacity's 512 rows, and so do ``Tiles.o_inline`` and ``Tiles.down_inline`` with it
    (o_proj's and down_proj's splits summed in one program).
    Both eager and replayed in a CUDA graph (where PDL launches become programmatic edges)."""
    without, with_switch = SAME_BITS[switch](depth)
    gen = torch.Generator(device="cuda").manual_seed(300 + rows)
    xs = torch.randn(16, rows, 2048, device="cuda", generator=gen).to(torch.bfloat16)
    with torch.inference_mode():
        want, want_cache = _frame(without, depth, xs)
        got, replayed = _eager_and_replayed(with_switch, depth, xs)
    for w, g, r in zip(want + [want_cache], got, replayed):
        assert torch.equal(w, g) and torch.equal(w, r)
    assert torch.count_nonzero(with_switch.counters).item() == 0  # type: ignore[attr-defined]
