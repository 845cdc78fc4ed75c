"""CUDA-graph capture and replay per (stage, bucket), with an eager fallback on the same code path.

Owns: static input/output buffers per key, capture (after warm-up, in one shared memory pool,
largest bucket first), replay with loud shape checks, and the eager path used on CPU, when graphs
are disabled (config or ``BREEZERT_NO_CUDA_GRAPH=1``) or for a shape that was never captured.
Must not: know about requests or stages; a graphed function is ``tensors in -> tensors out``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass

import torch

logger = logging.getLogger("breezert.graphs")

GraphFn = Callable[..., dict[str, torch.Tensor]]


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: dict[str, torch.Tensor]
    outputs: dict[str, torch.Tensor]


class GraphRunner:
    """Runs ``fn(**inputs) -> dict`` eagerly or by replaying a graph captured for ``key``.

    Replay copies the caller's inputs into the captured static buffers (shapes must match
    exactly) and returns the static outputs: read or copy them before the next replay of the
    same key. ``fn`` must be free of host syncs and of data-dependent control flow.
    """

    def __init__(self, name: str, fn: GraphFn, *, enabled: bool, device: torch.device) -> None:
        self.name = name
        self.fn = fn
        self.enabled = enabled and device.type == "cuda"
        self.device = device
        self._graphs: dict[Hashable, _Captured] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.enabled else None
        self.num_replays = 0
        self.num_eager = 0

    @property
    def keys(self) -> list[Hashable]:
        return list(self._graphs)

    def captured_graph(self, key: Hashable) -> torch.cuda.CUDAGraph:
        """The graph captured for ``key`` (for probes that time or inspect it)."""
        return self._graphs[key].graph

    @torch.inference_mode()
    def capture(self, key: Hashable, example: Mapping[str, torch.Tensor], warmup: int = 2) -> None:
        """Captures ``fn`` on copies of ``example`` (run ``warmup`` times eagerly first)."""
        if not self.enabled or key in self._graphs:
            return
        inputs = {name: t.clone() for name, t in example.items()}
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(warmup):  # lazy inits, cuBLAS handles, compile, autotune
                self.fn(**inputs)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            outputs = self.fn(**inputs)
        self._graphs[key] = _Captured(graph, inputs, outputs)

    @torch.inference_mode()
    def __call__(self, key: Hashable, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        captured = self._graphs.get(key) if self.enabled else None
        if captured is None:
            self.num_eager += 1
            return self.fn(**inputs)
        for name, static in captured.inputs.items():
            value = inputs[name]
            if value.shape != static.shape or value.dtype != static.dtype:
                raise ValueError(
                    f"{self.name} graph {key!r}: input {name!r} is {tuple(value.shape)} "
                    f"{value.dtype}, captured {tuple(static.shape)} {static.dtype}; pad the batch "
                    "to the bucket (or disable graphs with BREEZERT_NO_CUDA_GRAPH=1)"
                )
            static.copy_(value, non_blocking=True)
        captured.graph.replay()
        self.num_replays += 1
        return captured.outputs

