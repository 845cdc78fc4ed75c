"""GPU: the fused text-encoder layers (kernels/fused_text_encoder.py) at full size against the
eager bf16 and fp32 encoders and under graph replay.

Run on a CUDA machine: ``python -m pytest tests/gpu -q`` (skipped without CUDA).
"""

from __future__ import annotations

import pytest
import torch

from breezert.models.config import TextEncoderConfig
from breezert.models.text_encoder import T5Gemma2TextEncoder
from tests.kernel_helpers import random_bf16_fused_

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def encoders() -> tuple[T5Gemma2TextEncoder, T5Gemma2TextEncoder]:
    """A full-size random encoder in bf16 (packed projections) and its fp32 copy."""
    torch.manual_seed(0)
    enc = T5Gemma2TextEncoder(TextEncoderConfig()).cuda()
    enc = random_bf16_fused_(enc)
    with torch.no_grad():
        for name, p in enc.named_parameters():
            if name.endswith("norm.weight"):
                p.sub_(1.0)  # Gemma norm weights are offsets from 1
    exact = T5Gemma2TextEncoder(TextEncoderConfig()).cuda()
    exact.load_state_dict({k: v.float() for k, v in enc.state_dict().items()})
    return enc, exact


def _packed(lengths: list[int], pad: int) -> tuple[torch.Tensor, ...]:
    ids = torch.randint(0, 262000, (sum(lengths) + pad,), device="cuda")
    seg = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]
                    + [torch.full((pad,), len(lengths))]).cuda()
    pos = torch.cat([torch.arange(n) for n in lengths] + [torch.arange(pad)]).cuda()
    return ids, seg, pos


def _replayed(fn, *args: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """``fn(*args)`` captured in a CUDA graph and replayed once: the graph's output."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*args)
    graph.replay()
    torch.cuda.synchronize()
    return out


BURST = [23, 31, 12, 27, 19, 44, 23, 8, 25, 30, 16, 21, 35, 23, 14, 29]
"""16 sentences' token counts (``texts_en.tsv`` averages 23): an opening burst's TEXT_ENCODE step,
380 tokens padded to the 512 bucket (``graph.fused_text_encoder_max_tokens``)."""


@pytest.mark.parametrize("lengths,pad", [([1], 0), ([17], 15), ([9, 23], 0), ([40, 30, 20], 38),
                                         (BURST, 512 - sum(BURST))])
def test_fused_is_as_close_to_fp32_as_eager(encoders, lengths: list[int], pad: int) -> None:
    from breezert.kernels.fused_text_encoder import FusedTextEncoder

    enc, exact = encoders
    fused = FusedTextEncoder(enc, max_tokens=max(128, sum(lengths) + pad))
    ids, seg, pos = _packed(lengths, pad)
    with torch.inference_mode():
        want = exact.encode(ids, seg, pos)
        eager = enc.encode(ids, seg, pos).float()
        got = fused(ids, seg, pos).float()
    # The mean error is the measure (as close to fp32 as eager bf16); the largest error of a
    # random network's output is one element of a few thousand and moves with every rounding
    # point: it only has to stay of the same size (a wrong mask or norm would be far off).
    err = {stat.__name__: (stat((got - want).abs()).item(), stat((eager - want).abs()).item())
           for stat in (torch.max, torch.mean)}
    print(f"lengths {lengths} pad {pad}: |fused - fp32| / |eager - fp32| {err}")
    assert err["mean"][0] <= 1.25 * err["mean"][1] + 1e-4, err
    assert err["max"][0] <= 2.0 * err["max"][1] + 1e-3, err


def test_fused_graph_replay_equals_fused_eager(encoders) -> None:
    from breezert.kernels.fused_text_encoder import FusedTextEncoder

    enc, _ = encoders
    fused = FusedTextEncoder(enc)
    ids, seg, pos = _packed([20, 12], 0)
    with torch.inference_mode():
        want = fused(ids, seg, pos)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fused(ids, seg, pos)
        ids.copy_(_packed([20, 12], 0)[0])
        graph.replay()
        assert torch.equal(out, fused(ids, seg, pos))
        assert not torch.equal(out, want)  # the replay read the new ids


def test_pdl_changes_no_bit(encoders) -> None:
    """Programmatic dependent launch (``graph.pdl``): the plain launches' bits, eager and in a
    replayed CUDA graph."""
    from breezert.kernels.fused_text_encoder import FusedTextEncoder

    enc, _ = encoders
    ids, seg, pos = _packed([30, 20, 9], 5)
    with torch.inference_mode():
        want = FusedTextEncoder(enc)(ids, seg, pos)
        pdl = FusedTextEncoder(enc, pdl=True)
        got = pdl(ids, seg, pos)
        out = _replayed(pdl, ids, seg, pos)
    assert torch.equal(got, want) and torch.equal(out, want)


@pytest.mark.parametrize("lengths,pad", [(BURST, 512 - sum(BURST)), ([90, 70], 0)])
def test_wide_tiles_are_as_close_to_fp32_and_replay(encoders, lengths: list[int],
                                                    pad: int) -> None:
    """``wide_tiles`` (128 x 64 GEMM tiles past 128 tokens) at an opening burst's 512 tokens and
    at 160: as close to the fp32 encoder as the eager bf16 one, within bf16 rounding of the
    narrow tiles (on the H200, 3 Dec: the same bits, which the profile relies on),
    deterministic, and the same bits replayed in a CUDA graph with PDL."""
    from breezert.kernels.fused_text_encoder import FusedTextEncoder

    enc, exact = encoders
    wide = FusedTextEncoder(enc, max_tokens=512, wide_tiles=True, pdl=True)
    narrow = FusedTextEncoder(enc, max_tokens=512, pdl=True)
    ids, seg, pos = _packed(lengths, pad)
    with torch.inference_mode():
        want = exact.encode(ids, seg, pos)
        eager = enc.encode(ids, seg, pos).float()
        got = wide(ids, seg, pos)
        again = wide(ids, seg, pos)
        apart = narrow(ids, seg, pos).float()
        out = _replayed(wide, ids, seg, pos)
    assert torch.equal(got, again) and torch.equal(out, got)
    got = got.float()
    err = {stat.__name__: (stat((got - want).abs()).item(), stat((eager - want).abs()).item())
           for stat in (torch.max, torch.mean)}
    same = (got == apart).float().mean().item()
    print(f"wide tiles, {sum(lengths) + pad} tokens: |wide - fp32| / |eager - fp32| {err}; "
          f"bits equal to the narrow tiles: {same:.4f}")
    assert err["mean"][0] <= 1.25 * err["mean"][1] + 1e-4, err
    assert err["max"][0] <= 2.0 * err["max"][1] + 1e-3, err
    assert torch.equal(got, apart)  # same K split and K tiles: each sum in the same order
