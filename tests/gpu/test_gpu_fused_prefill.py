"""GPU: the fused backbone PREFILL step (kernels/fused_prefill.py) on the full-size Qwen3
backbone over a paged cache: as accurate as the eager bf16 step against fp32 math,
deterministic, and equal inside a CUDA graph.

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
from tests.kernel_helpers import fp32_backbone_step, random_bf16_fused_, rel_error

pytestmark = pytest.mark.gpu

CFG = BreezeConfig.full().backbone
BLOCK = 16


@pytest.fixture(scope="module")
def backbone() -> Qwen3Backbone:
    torch.manual_seed(0)
    with torch.device("cuda"):
        return random_bf16_fused_(Qwen3Backbone(CFG))


def _step(lengths: list[tuple[int, int]], num_tokens: int, num_keys: int, seed: int):  # type: ignore[no-untyped-def]
    """A paged cache with random contents and one packed prefill step: run i adds ``new``
    tokens after ``cached`` ones, in blocks scattered through the pool."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(c + n) // BLOCK) for c, n in lengths) + 8
    cache = PagedKVCache(CFG.num_layers, num_blocks, BLOCK, CFG.num_kv_heads, CFG.head_dim,
                         dtype=torch.bfloat16, device="cuda")
    cache.kv.normal_(generator=torch.Generator(device="cuda").manual_seed(seed))
    order = torch.randperm(num_blocks, generator=gen).tolist()
    runs = []
    for cached, new in lengths:
        need = -(-(cached + new) // BLOCK)
        runs.append(KVRun(order[:need], cached, new))
        order = order[need:]
    meta = cache.packed_meta(runs, num_tokens, num_keys)
    real = sum(n for _, n in lengths)
    embeds = torch.randn(num_tokens, CFG.hidden_size, generator=gen).to("cuda", torch.bfloat16)
    embeds[real:] = 0
    tensors = {k: getattr(meta, k).cuda() for k in ("positions", "write_rows", "read_rows", "mask")}
    return cache, tensors, embeds, real


@pytest.mark.parametrize("lengths,tokens,keys", [
    ([(0, 45), (0, 40)], 128, 256),  # one request's two CFG branches
    ([(0, 30), (19, 7), (0, 60)], 128, 256),  # a second chunk over cached tokens
    ([(0, 50)] * 5, 256, 512),  # five requests at the fused limit
])
def test_fused_prefill_matches_eager(backbone: Qwen3Backbone, lengths: list[tuple[int, int]],
                                     tokens: int, keys: int) -> None:
    """Against fp32 math the fused step is as accurate as the eager bf16 step; it is
    deterministic; a larger key bucket changes no bit."""
    from breezert.kernels.fused_prefill import FusedBackbonePrefill

    fused = FusedBackbonePrefill(SimpleNamespace(backbone_model=backbone), max_tokens=256)
    cache, meta, embeds, real = _step(lengths, tokens, keys, seed=len(lengths))
    eager_kv, fused_kv, again_kv = (cache.kv.clone() for _ in range(3))
    args = (meta["write_rows"], meta["read_rows"], meta["mask"])
    with torch.inference_mode():
        want = backbone(embeds, meta["positions"], GatherKV(eager_kv, *args))[:real]
        got = fused(embeds, meta["positions"], GatherKV(fused_kv, *args))[:real]
        again = fused(embeds, meta["positions"], GatherKV(again_kv, *args))[:real]
        wide_meta = _step(lengths, tokens, 2 * keys, seed=len(lengths))[1]
        wide_kv = cache.kv.clone()
        wide = fused(embeds, wide_meta["positions"],
                     GatherKV(wide_kv, wide_meta["write_rows"], wide_meta["read_rows"],
                              wide_meta["mask"]))[:real]
        exact, exact_kv = fp32_backbone_step(backbone, cache.kv, meta, embeds)
    assert torch.equal(got, again), "not deterministic"
    assert torch.equal(wide, got), "the key bucket changed bits"

    exact = exact[:real]
    fused_err, eager_err = rel_error(got, exact), rel_error(want, exact)
    print(f"{lengths}: fused vs fp32 {fused_err:.4f}, eager vs fp32 {eager_err:.4f}, "
          f"fused vs eager {rel_error(got, want):.4f}")
    assert fused_err <= 1.25 * eager_err + 1e-3, (fused_err, eager_err)
    assert rel_error(got, want) <= 2.0 * eager_err + 1e-3
    written = meta["write_rows"][:real]
    kv_err = rel_error(fused_kv[:, :, written], exact_kv[:, :, written])
    assert kv_err <= 1.25 * rel_error(eager_kv[:, :, written], exact_kv[:, :, written]) + 1e-3
    assert torch.count_nonzero(fused.gemms.counters).item() == 0


def test_fused_prefill_graph_replay_equals_eager_fused(backbone: Qwen3Backbone) -> None:
    from breezert.kernels.fused_prefill import FusedBackbonePrefill

    fused = FusedBackbonePrefill(SimpleNamespace(backbone_model=backbone), max_tokens=128)
    cache, meta, embeds, _ = _step([(0, 45), (0, 40)], 128, 256, seed=7)
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
