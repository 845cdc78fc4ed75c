"""GPU: the fused sampler (kernels/fused_sampling.py) draws what ``layers.sampling.sample``
draws, alone and under graph replay.

Run on a CUDA machine: ``python -m pytest tests/gpu -q`` (skipped without CUDA).
"""

from __future__ import annotations

import pytest
import torch

from breezert.layers.sampling import sample, suppress_reserved
from tests.unit.test_fused_sampling import parameter_mix

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("vocab", [2048, 2052])
@pytest.mark.parametrize("rows", [1, 16, 64, 128])
def test_fused_sample_matches_sample_on_cuda(vocab: int, rows: int) -> None:
    from breezert.kernels.fused_sampling import fused_sample

    torch.manual_seed(vocab + rows)
    logits = suppress_reserved(torch.randn(rows, vocab, device="cuda") * 3)
    mix = {k: v.cuda() for k, v in parameter_mix(rows).items()}
    args = (mix["temperature"], mix["top_k"], mix["top_p"], mix["seeds"], mix["counters"], 64)
    want, got = sample(logits, *args), fused_sample(logits, *args)
    # libdevice's logf is CUDA's: the same noise bits, so the same draws but for exact ties
    assert (got == want).float().mean().item() == 1.0, (got != want).nonzero().flatten().tolist()


def test_fused_sample_under_graph_replay() -> None:
    from breezert.kernels.fused_sampling import fused_sample

    rows, vocab = 16, 2048
    logits = torch.randn(rows, vocab, device="cuda")
    mix = {k: v.cuda() for k, v in parameter_mix(rows).items()}
    args = (mix["temperature"], mix["top_k"], mix["top_p"], mix["seeds"], mix["counters"], 64)
    fused_sample(logits, *args)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_sample(logits, *args)
    for scale in (1.0, 4.0):
        logits.copy_(torch.randn_like(logits) * scale)
        mix["counters"].add_(16)
        graph.replay()
        assert torch.equal(out, sample(logits, *args))
