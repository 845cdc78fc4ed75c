"""The fused sampler (kernels/fused_sampling.py) against ``layers.sampling.sample``, on CPU
through Triton's interpreter (tests/gpu/test_fused_sampling_gpu.py checks it on CUDA)."""

from __future__ import annotations

import pytest
import torch

from breezert.layers.sampling import sample, suppress_reserved
from tests.kernel_helpers import needs_triton, run_in_interpreter

pytestmark = pytest.mark.unit


def parameter_mix(rows: int) -> dict[str, torch.Tensor]:
    """Per-row settings cycling through greedy and sampled rows, top-k 1..64 (the bound) and
    top-p from none to tight; seeds of both signs and above 32 bits."""
    def cycle(values: list[float], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor([values[i % len(values)] for i in range(rows)], dtype=dtype)

    return {
        "temperature": cycle([0.0, 0.7, 1.0, 1.3, 0.9], torch.float32),
        "top_k": cycle([1, 5, 50, 64, 7, 33], torch.long),
        "top_p": cycle([1.0, 0.9, 0.5, 0.95, 0.3, 0.8, 0.99], torch.float32),
        "seeds": torch.tensor([(i * 7919 - 5) * (1 << (33 if i % 3 == 0 else 0))
                               for i in range(rows)], dtype=torch.long),
        "counters": torch.arange(rows, dtype=torch.long) * 16 + 3,
    }


def _draw(fn, logits: torch.Tensor, mix: dict[str, torch.Tensor]) -> torch.Tensor:
    return fn(logits, mix["temperature"], mix["top_k"], mix["top_p"], mix["seeds"],
              mix["counters"], 64)


def check_matches_sample() -> None:
    """Every row draws what ``sample`` draws: a 300-id vocabulary (not a power of two) over a
    12-row mix, and the backbone's 2052 ids (reserved ids suppressed) on a sampled row (the
    interpreter is slow on 4096-wide rows); never a suppressed id; a row alone draws what it
    draws in the batch."""
    from breezert.kernels.fused_sampling import fused_sample

    torch.manual_seed(0)
    drawn = {}
    for vocab, rows in ((300, 12), (2052, 1)):
        logits = suppress_reserved(torch.randn(rows, vocab) * 3)
        mix = {k: v[1:1 + rows] if vocab == 2052 else v[:rows]  # 2052: one sampled row
               for k, v in parameter_mix(12).items()}
        want, got = _draw(sample, logits, mix), _draw(fused_sample, logits, mix)
        assert torch.equal(got, want), (vocab, got.tolist(), want.tolist())
        drawn[vocab] = logits, mix, got
    assert not ((drawn[2052][2] >= 2048) & (drawn[2052][2] < 2051)).any()
    logits, mix, got = drawn[300]
    alone = fused_sample(logits[3:4], mix["temperature"][3:4], mix["top_k"][3:4],
                         mix["top_p"][3:4], mix["seeds"][3:4], mix["counters"][3:4], 64)
    assert int(alone) == int(got[3])


def check_scalars_and_cuts() -> None:
    """Scalar settings read with stride 0; top-k 1 and a tiny top-p give the argmax; a peaked
    row at top-p 0.5 draws only its peak; temperature 0 ignores the filters."""
    from breezert.kernels.fused_sampling import fused_sample

    torch.manual_seed(1)
    logits = torch.randn(3, 128)
    seeds, counters = torch.arange(3), torch.arange(3) + 40
    for k, p in ((50, 0.9), (1, 1.0), (64, 0.01)):
        want = sample(logits, 0.8, k, p, seeds, counters, 64)
        assert torch.equal(fused_sample(logits, 0.8, k, p, seeds, counters, 64), want)
    argmax = logits.argmax(-1)
    assert torch.equal(fused_sample(logits, 1.0, 1, 1.0, seeds, counters, 64), argmax)
    assert torch.equal(fused_sample(logits, 1.0, 50, 1e-6, seeds, counters, 64), argmax)
    assert torch.equal(fused_sample(logits, 0.0, 5, 0.5, seeds, counters, 64), argmax)
    peaked = logits.clone()
    peaked[:, 17] = 20.0
    assert (fused_sample(peaked, 1.0, 50, 0.5, seeds, counters, 64) == 17).all()


@needs_triton
def test_fused_sample_matches_sample() -> None:
    run_in_interpreter(__name__, "check_matches_sample()")


@needs_triton
def test_fused_sample_scalars_and_cuts() -> None:
    run_in_interpreter(__name__, "check_scalars_and_cuts()")


@needs_triton
def test_fused_sample_refuses_what_it_cannot_do() -> None:
    from breezert.kernels.fused_sampling import fused_sample

    logits, seeds = torch.zeros(2, 16), torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match="top-k bound"):
        fused_sample(logits, 1.0, 5, 1.0, seeds, seeds, None)
    with pytest.raises(ValueError, match="own noise"):
        fused_sample(logits, 1.0, 5, 1.0, seeds, seeds, 64, gumbel=torch.zeros(2, 16))
    with pytest.raises(ValueError, match="rows, vocab"):
        fused_sample(logits[0], 1.0, 5, 1.0, seeds, seeds, 64)
    with pytest.raises(ValueError, match="per-row parameter"):
        fused_sample(logits, torch.ones(3), 5, 1.0, seeds, seeds, 64)
