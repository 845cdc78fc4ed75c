"""GPU: the fused backbone DECODE step (kernels/fused_decode.py) on the full-size Qwen3 backbone
over a paged cache: as accurate as the eager bf16 step against fp32 math, deterministic, and
equal inside a CUDA graph.

Run on a CUDA machine: ``python -m pytest tests/gpu -q`` (skipped without CUDA).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from breezert.models.backbone import Qwen3Backbone
from breezert.models.config import BreezeConfig
from breezert.worker.kv_cache import GatherKV, KVRun, PagedKVCache
from tests.kernel_helpers import random_bf16_fused_

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
    meta = cache.decode_meta(runs, rows, context)
    to = {k: getattr(meta, k).cuda() for k in ("positions", "write_rows", "read_rows", "mask")}
    embeds = torch.randn(rows, CFG.hidden_size, generator=gen).to("cuda", torch.bfloat16)
    return cache, to, embeds


@pytest.mark.parametrize("rows,context", [(1, 256), (16, 512), (32, 2048), (128, 256)])
def test_fused_decode_matches_eager(backbone: Qwen3Backbone, rows: int, context: int) -> None:
    from breezert.kernels.fused_decode import FusedBackboneDecode

    fused = FusedBackboneDecode(SimpleNamespace(backbone_model=backbone), max_rows=128)
    cache, meta, embeds = _step(rows, context, seed=rows)
    eager_kv, fused_kv, again_kv = (cache.kv.clone() for _ in range(3))
    with torch.inference_mode():
        view = GatherKV(eager_kv, meta["write_rows"], meta["read_rows"], meta["mask"])
        want = backbone(embeds, meta["positions"], view)
        args = (meta["write_rows"], meta["read_rows"], meta["mask"])
        got = fused(embeds, meta["positions"], GatherKV(fused_kv, *args))
        again = fused(embeds, meta["positions"], GatherKV(again_kv, *args))
        exact = _fp32_step(backbone, cache.kv, meta, embeds)
    assert torch.equal(got, again), "not deterministic"

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    assert rel(got, want) < 2e-2, rel(got, want)
    assert rel(got, exact) <= 1.25 * rel(want, exact) + 1e-3, (rel(got, exact), rel(want, exact))
    written = meta["write_rows"]
    assert rel(fused_kv[:, :, written], eager_kv[:, :, written]) < 2e-2
    assert torch.count_nonzero(fused.counters).item() == 0


def _fp32_step(backbone: Qwen3Backbone, kv: torch.Tensor, meta, embeds) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """The same step in fp32 (weights and cache upcast), layer by layer to bound memory."""
    with torch.device("cuda"):
        ref = Qwen3Backbone(CFG)
    ref.load_state_dict({k: v.float() for k, v in backbone.state_dict().items()})
    view = GatherKV(kv.float(), meta["write_rows"], meta["read_rows"], meta["mask"])
    out = ref.eval()(embeds.float(), meta["positions"], view)
    del ref
    torch.cuda.empty_cache()
    return out


def test_fused_decode_graph_replay_equals_eager_fused(backbone: Qwen3Backbone) -> None:
    from breezert.kernels.fused_decode import FusedBackboneDecode

    fused = FusedBackboneDecode(SimpleNamespace(backbone_model=backbone), max_rows=16)
    cache, meta, embeds = _step(16, 512, seed=5)
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
