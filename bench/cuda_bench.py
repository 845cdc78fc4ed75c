"""What the GPU benchmark scripts under bench/ share: CUDA-event timing and random bf16 weights
for the layer stacks they time (where a run ran comes from ``breezert_bench.provenance``).

Imported by the scripts as a sibling module (they run as ``python bench/NAME.py``, so bench/ is
on ``sys.path``). Must not: import the runtime (each script builds what it measures).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def random_bf16_packed(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` with random weights (each ~ N(0, 1/fan_in), from torch's current seed), cast
    to bf16 and in eval mode, every q/k/v and gate/up projection packed (each submodule with a
    ``fuse_``) as serving packs them."""
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, p.shape[-1] ** -0.5)
    module = module.to(torch.bfloat16).eval()
    for sub in module.modules():
        if hasattr(sub, "fuse_"):
            sub.fuse_()
    return module


def median_ms(fn: Callable[[], Any], iters: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of ``fn()`` over ``iters`` runs after ``warmup``, by CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def graph_ms(fn: Callable[[], Any], iters: int = 20) -> float:
    """Median ms of one replay of ``fn`` captured in a CUDA graph, after one eager call on the
    capture stream (which builds every kernel it launches)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        fn()
        with torch.cuda.graph(graph, stream=stream):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    return median_ms(graph.replay, iters)
