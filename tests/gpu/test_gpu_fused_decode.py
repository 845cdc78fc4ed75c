"""GPU: the fused backbone DECODE step (kernels/fused_decode.py) on the full-size Qwen3 backbone
over a paged cache: as accurate as the eager bf16 step against fp32 math, deterministic, and
equal inside a CUDA graph.

Run on a CUDA machine: ``python -m pytest tests/gpu -q`` (skipped without CUDA).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from breezert.layers.attention import GatherKV
from breezert.models.backbone import Qwen3Backbone
from breezert.models.config import BreezeConfig
from breezert.worker.kv_cache import KVRun, PagedKVCache
from tests.kernel_helpers import decode_meta, fp32_backbone_step, random_bf16_fused_, rel_error

pytestmark = pytest.mark.gpu

CFG = BreezeConfig.full().backbone
BLOCK = 16


@pytest.fixture(scope="module")
def backbone() -> Qwen3Backbone:
    torch.manual_seed(0)
    with torch.device("cuda"):
        return random_bf16_fused_(Qwen3Backbone(CFG))


def _step(rows: int, context: int, seed: int):  # type: ignore[no-untyped-def]
    """A paged cache with random contents and one decode step's metadata: row i has a random
    number of cached tokens (< context) in blocks scattered through the pool."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = rows * (context // BLOCK) + 8
    cache = PagedKVCache(CFG.num_layers, num_blocks, BLOCK, CFG.num_kv_heads, CFG.head_dim,
                         dtype=torch.bfloat16, device="cuda")
    cache.kv.normal_(generator=torch.Generator(device="cuda").manual_seed(seed))
    order = torch.randperm(num_blocks, generator=gen).tolist()
    runs = []
    for i in range(rows):
        cached = int(torch.randint(0, context - 1, (1,), generator=gen))
        need = cached // BLOCK + 1
        runs.append(KVRun(order[:need], cached, 1))
        order = order[need:]
    embeds = torch.randn(rows, CFG.hidden_size, generator=gen).to("cuda", torch.bfloat16)
    return cache, _meta(cache, runs, rows, context), embeds, runs


def _meta(cache: PagedKVCache, runs: list[KVRun], rows: int, context: int) -> dict:
    return decode_meta(cache, runs, rows, context)


@pytest.mark.parametrize("rows,context", [(1, 256), (16, 512), (32, 2048), (128, 256)])
def test_fused_decode_matches_eager(backbone: Qwen3Backbone, rows: int, context: int) -> None:
    """Against fp32 math the fused step is as accurate as the eager bf16 step (28 layers of bf16
    rounding leave both a few percent off, in different directions); it is deterministic, and the
    largest context bucket (more attention splits, past every row's length) changes no bit."""
    from breezert.kernels.fused_decode import FusedBackboneDecode

    fused = FusedBackboneDecode(SimpleNamespace(backbone_model=backbone), max_rows=128)
    cache, meta, embeds, runs = _step(rows, context, seed=rows)
    eager_kv, fused_kv, again_kv, wide_kv = (cache.kv.clone() for _ in range(4))
    wide = _meta(cache, runs, rows, 2048)  # the largest bucket of the profile
    with torch.inference_mode():
        view = GatherKV(eager_kv, meta["write_rows"], meta["read_rows"], meta["mask"])
        want = backbone(embeds, meta["positions"], view)
        args = (meta["write_rows"], meta["read_rows"], meta["mask"])
        got = fused(embeds, meta["positions"], GatherKV(fused_kv, *args))
        again = fused(embeds, meta["positions"], GatherKV(again_kv, *args))
        widened = fused(embeds, wide["positions"],
                        GatherKV(wide_kv, wide["write_rows"], wide["read_rows"], wide["mask"]))
        exact, exact_kv = fp32_backbone_step(backbone, cache.kv, meta, embeds)
    assert torch.equal(got, again), "not deterministic"
    if context < 2048:  # the 2048 case has no larger bucket in the profile
        assert torch.equal(widened, got) and torch.equal(wide_kv, fused_kv), "bucket changed bits"

    fused_err, eager_err = rel_error(got, exact), rel_error(want, exact)
    print(f"rows={rows} context={context}: fused vs fp32 {fused_err:.4f}, eager vs fp32 "
          f"{eager_err:.4f}, fused vs eager {rel_error(got, want):.4f}")
    assert fused_err <= 1.25 * eager_err + 1e-3, (fused_err, eager_err)
    assert rel_error(got, want) <= 2.0 * eager_err + 1e-3  # two independent bf16 errors at most
    written = meta["write_rows"]
    kv_err = rel_error(fused_kv[:, :, written], exact_kv[:, :, written])
    assert kv_err <= 1.25 * rel_error(eager_kv[:, :, written], exact_kv[:, :, written]) + 1e-3
    assert torch.count_nonzero(fused.counters).item() == 0


def test_fused_decode_graph_replay_equals_eager_fused(backbone: Qwen3Backbone) -> None:
    from breezert.kernels.fused_decode import FusedBackboneDecode

    fused = FusedBackboneDecode(SimpleNamespace(backbone_model=backbone), max_rows=16)
    cache, meta, embeds, _ = _step(16, 512, seed=5)
    start = cache.kv.clone()
    view = GatherKV(cache.kv, meta["write_rows"], meta["read_rows"], meta["mask"])
    with torch.inference_mode():
        want = fused(embeds, meta["positions"], view).clone()
        cache.kv.copy_(start)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            fused(embeds, meta["positions"], view)  # builds outside the capture
            cache.kv.copy_(start)
            with torch.cuda.graph(graph, stream=stream):
                out = fused(embeds, meta["positions"], view)
        torch.cuda.current_stream().wait_stream(stream)
        cache.kv.copy_(start)
        graph.replay()
        torch.cuda.synchronize()
    assert torch.equal(out, want)


def test_tma_decode_changes_no_bit(backbone: Qwen3Backbone) -> None:
    """The DECODE step's GEMMs with TMA weight tiles (``Tiles.tma``): the pointer loads' bits."""
    from breezert.kernels.fused_decode import FusedBackboneDecode
    from breezert.kernels.gemm import Tiles

    model = SimpleNamespace(backbone_model=backbone)
    outs = []
    cache, meta, embeds, _ = _step(16, 512, seed=11)
    start = cache.kv.clone()
    view = GatherKV(cache.kv, meta["write_rows"], meta["read_rows"], meta["mask"])
    with torch.inference_mode():
        for tiles in (Tiles(), Tiles(tma=True)):
            cache.kv.copy_(start)
            fused = FusedBackboneDecode(model, max_rows=16, tiles=tiles)
            outs += [fused(embeds, meta["positions"], view).clone(), cache.kv.clone()]
    assert torch.equal(outs[0], outs[2]) and torch.equal(outs[1], outs[3])


def test_pdl_decode_changes_no_bit(backbone: Qwen3Backbone) -> None:
    """The DECODE step with programmatic dependent launch (``Tiles.pdl``): the plain launches'
    bits, eager and in a replayed CUDA graph."""
    from breezert.kernels.fused_decode import FusedBackboneDecode
    from breezert.kernels.gemm import Tiles

    model = SimpleNamespace(backbone_model=backbone)
    cache, meta, embeds, _ = _step(16, 512, seed=13)
    start = cache.kv.clone()
    view = GatherKV(cache.kv, meta["write_rows"], meta["read_rows"], meta["mask"])
    with torch.inference_mode():
        want = FusedBackboneDecode(model, max_rows=16)(embeds, meta["positions"], view).clone()
        want_kv = cache.kv.clone()
        pdl = FusedBackboneDecode(model, max_rows=16, tiles=Tiles(pdl=True))
        cache.kv.copy_(start)
        got = pdl(embeds, meta["positions"], view).clone()
        got_kv = cache.kv.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            out = pdl(embeds, meta["positions"], view)
        torch.cuda.current_stream().wait_stream(stream)
        cache.kv.copy_(start)
        graph.replay()
        torch.cuda.synchronize()
    assert torch.equal(got, want) and torch.equal(got_kv, want_kv)
    assert torch.equal(out, want) and torch.equal(cache.kv, want_kv)
