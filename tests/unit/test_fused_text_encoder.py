"""The fused T5Gemma2 text-encoder layers (kernels/fused_text_encoder.py) against the eager
encoder, on CPU through Triton's interpreter (tests/gpu checks them on the H200)."""

from __future__ import annotations

import pytest
import torch

from breezert.models.config import TextEncoderConfig
from breezert.models.text_encoder import FULL, SLIDING, T5Gemma2TextEncoder
from tests.kernel_helpers import needs_triton, random_bf16_fused_, run_in_interpreter

pytestmark = pytest.mark.unit

# The smallest encoder the kernels accept: 16-wide tiles, a hidden size that is not a power of
# two (192 = 3 x 64, like 1152 = 9 x 128), grouped queries, both layer kinds, a short window.
SMALL = TextEncoderConfig(vocab_size=300, hidden_size=192, intermediate_size=384, num_layers=2,
                          num_heads=2, num_kv_heads=1, head_dim=64, query_pre_attn_scalar=64.0,
                          sliding_window=6, layer_types=(SLIDING, FULL), eoi_token_id=299)


def encoder(seed: int = 0) -> T5Gemma2TextEncoder:
    torch.manual_seed(seed)
    enc = random_bf16_fused_(T5Gemma2TextEncoder(SMALL))
    with torch.no_grad():  # Gemma norm weights are offsets from 1: keep them small
        for name, p in enc.named_parameters():
            if name.endswith("norm.weight"):
                p.sub_(1.0)
    return enc


def packed(lengths: list[int], pad: int) -> tuple[torch.Tensor, ...]:
    """Pieces of ``lengths`` tokens, then ``pad`` padding tokens as a segment of their own (as
    stages/text_encode.py packs a bucket)."""
    ids = torch.randint(0, SMALL.vocab_size - 1, (sum(lengths) + pad,))
    ids[lengths[0] - 1] = SMALL.eoi_token_id
    seg = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]
                    + [torch.full((pad,), len(lengths))])
    pos = torch.cat([torch.arange(n) for n in lengths] + [torch.arange(pad)])
    return ids, seg, pos


def check_matches_eager() -> None:
    """Three pieces (one past the window, one of a token) and padding, 2 row blocks: the fused
    bf16 encoder is as close to the fp32 encoder as the eager bf16 one is (max and mean error
    within 1.25x of eager's; measured 0.035 / 0.0068 against 0.043 / 0.0069) and within bf16
    tolerance of the eager bf16 encoder; a piece encoded alone gives its rows in the batch."""
    from breezert.kernels.fused_text_encoder import FusedTextEncoder

    enc = encoder()
    exact = T5Gemma2TextEncoder(SMALL)
    exact.load_state_dict({k: v.float() for k, v in enc.state_dict().items()})
    fused = FusedTextEncoder(enc, max_tokens=64)
    torch.manual_seed(1)
    ids, seg, pos = packed([13, 1, 9], pad=3)
    with torch.inference_mode():
        want = exact.encode(ids, seg, pos)
        eager = enc.encode(ids, seg, pos).float()
        got = fused(ids, seg, pos).float()
        alone = fused(ids[:13], seg[:13], pos[:13]).float()
    for stat in (torch.max, torch.mean):
        ours, theirs = stat((got - want).abs()).item(), stat((eager - want).abs()).item()
        assert ours <= 1.25 * theirs, (stat.__name__, ours, theirs)
    assert (got - eager).abs().max().item() <= 0.03 * eager.abs().max().item()
    assert torch.equal(alone, got[:13])


def check_long_batches_run_eager() -> None:
    from breezert.kernels.fused_text_encoder import FusedTextEncoder

    enc = encoder()
    fused = FusedTextEncoder(enc, max_tokens=8)
    ids, seg, pos = packed([10], pad=0)
    with torch.inference_mode():
        assert torch.equal(fused(ids, seg, pos), enc.encode(ids, seg, pos))


def check_wide_tiles() -> None:
    """Past ``WIDE_ROWS`` tokens, ``wide_tiles`` runs 128 x 64 tiles: as close to the fp32
    encoder as the eager bf16 one, within bf16 rounding of the narrow tiles, a piece alone
    gives its rows in the batch; at up to ``WIDE_ROWS`` tokens it runs the narrow tiles."""
    from breezert.kernels import fused_text_encoder as fte

    enc = encoder(3)
    exact = T5Gemma2TextEncoder(SMALL)
    exact.load_state_dict({k: v.float() for k, v in enc.state_dict().items()})
    wide = fte.FusedTextEncoder(enc, max_tokens=256, wide_tiles=True)
    narrow = fte.FusedTextEncoder(enc, max_tokens=256)
    assert wide.wide_gemms["down"].tiles.split_bm == 128 and not narrow.wide_gemms
    assert not fte.FusedTextEncoder(enc, max_tokens=fte.WIDE_ROWS, wide_tiles=True).wide_tiles
    torch.manual_seed(4)
    ids, seg, pos = packed([60, 50, 25], pad=5)  # 140 tokens: two 128-row blocks
    with torch.inference_mode():
        want = exact.encode(ids, seg, pos)
        eager = enc.encode(ids, seg, pos).float()
        got = wide(ids, seg, pos).float()
        apart = narrow(ids, seg, pos).float()
        alone = wide(ids[:60], seg[:60], pos[:60]).float()  # narrow tiles: <= WIDE_ROWS
    for stat in (torch.max, torch.mean):
        ours, theirs = stat((got - want).abs()).item(), stat((eager - want).abs()).item()
        assert ours <= 1.25 * theirs, (stat.__name__, ours, theirs)
    assert (got - apart).abs().max().item() <= 0.03 * apart.abs().max().item()
    assert (alone - got[:60]).abs().max().item() <= 0.03 * got.abs().max().item()


@needs_triton
def test_wide_tiles_past_128_tokens_match_eager() -> None:
    run_in_interpreter(__name__, "check_wide_tiles()")


@needs_triton
def test_fused_text_encoder_matches_eager() -> None:
    run_in_interpreter(__name__, "check_matches_eager()")


@needs_triton
def test_fused_text_encoder_runs_long_batches_eagerly() -> None:
    run_in_interpreter(__name__, "check_long_batches_run_eager()")


@needs_triton
def test_fused_text_encoder_refuses_unpacked_or_unfit_weights() -> None:
    from breezert.kernels.fused_text_encoder import FusedTextEncoder

    plain = T5Gemma2TextEncoder(SMALL).to(torch.bfloat16)
    with pytest.raises(ValueError, match="fuse_projections_"):
        FusedTextEncoder(plain, warm=False)
    with pytest.raises(ValueError, match="bfloat16"):
        FusedTextEncoder(T5Gemma2TextEncoder(SMALL), warm=False)


@needs_triton
def test_full_size_tiles() -> None:
    """The released shapes' tiles: 1152 = 9 x 128 for the norm prologues and GEMM K-blocks,
    o_proj (K 1024) split 4 and down_proj (K 6912 = 27 x 256) split 3 in whole 256-wide tiles."""
    from breezert.kernels.fused_text_encoder import _largest_block, _split_for

    assert _largest_block(1152, 128) == 128 and _largest_block(6912, 64) == 64
    assert _largest_block(1152, 32) == 32 and _largest_block(192, 128) == 64
    assert _split_for(1024, 256) == 4 and _split_for(6912, 256) == 3
