"""The fused backbone PREFILL step (kernels/fused_prefill.py) against the eager backbone over the
paged KV cache, on CPU through Triton's interpreter (the GPU tests check it on the H200)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from breezert.layers.attention import GatherKV
from breezert.models.backbone import Qwen3Backbone
from breezert.worker.kv_cache import KVRun
from tests.kernel_helpers import (
    SMALL_BACKBONE,
    needs_triton,
    run_in_interpreter,
    small_backbone,
    small_paged_cache,
)

pytestmark = pytest.mark.unit


@needs_triton
def test_fused_prefill_matches_eager_packed_attention() -> None:
    run_in_interpreter(__name__, "check_prefill()")


def check_prefill() -> None:
    """Two runs packed into one step with padding: a prompt from position 0 (12 tokens) and a
    second chunk (positions 19..25) over 19 cached tokens, in blocks scattered through the pool:
    hidden states and every written cache row match the eager step within bf16 rounding, a larger
    key bucket changes nothing, and a step past ``max_tokens`` runs the eager backbone bit for
    bit."""
    from breezert.kernels.fused_prefill import FusedBackbonePrefill

    backbone = small_backbone()
    fused = FusedBackbonePrefill(SimpleNamespace(backbone_model=backbone), max_tokens=32)
    fused.warm()  # as on CUDA at start-up: a scratch cache, every row-block size, no error
    cache = small_paged_cache(seed=1)
    runs = [KVRun([7], 0, 12), KVRun([3, 11], 19, 7)]
    embeds = torch.randn(19, SMALL_BACKBONE.hidden_size).to(torch.bfloat16)

    def step(num_tokens: int, num_keys: int, use_fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
        meta = cache.packed_meta(runs, num_tokens, num_keys)
        kv = cache.kv.clone()
        rows = torch.cat([embeds, embeds.new_zeros(num_tokens - 19, embeds.shape[1])])
        view = GatherKV(kv, meta.write_rows, meta.read_rows, meta.mask)
        with torch.inference_mode():
            out = (fused if use_fused else backbone)(rows, meta.positions, view)
        return out[:19].float(), kv

    want, eager_kv = step(32, 64, use_fused=False)
    got, fused_kv = step(32, 64, use_fused=True)
    assert (got - want).abs().max() <= 0.03 * want.abs().max(), (got - want).abs().max()
    written = cache.packed_meta(runs, 32, 64).write_rows[:19]
    # Layer 0's new k/v: QK-norm, RoPE and the GEMM at the eager rounding points (a value on a
    # bf16 rounding boundary may still go the other way with the GEMM's sum order).
    assert (fused_kv[0][:, written] != eager_kv[0][:, written]).float().mean() < 0.01
    diff = (fused_kv[:, :, written].float() - eager_kv[:, :, written].float()).abs().max()
    assert diff <= 0.03 * eager_kv[:, :, written].float().abs().max(), diff
    untouched = torch.ones(cache.kv.shape[2], dtype=torch.bool)
    untouched[written] = False
    untouched[cache.scratch_row:] = False  # padding tokens write the scratch block
    assert torch.equal(fused_kv[:, :, untouched], cache.kv[:, :, untouched])
    # a larger key bucket (key blocks all masked for every real query) changes no bit
    assert torch.equal(step(32, 128, use_fused=True)[0], got)
    # past max_tokens: the eager backbone
    assert torch.equal(step(40, 64, use_fused=True)[0], step(40, 64, use_fused=False)[0])


@needs_triton
def test_fused_prefill_rejects_unfused_weights() -> None:
    from breezert.kernels.fused_prefill import FusedBackbonePrefill

    torch.manual_seed(0)
    backbone = Qwen3Backbone(SMALL_BACKBONE).to(torch.bfloat16)
    with pytest.raises(ValueError, match="fuse_projections_"):
        FusedBackbonePrefill(SimpleNamespace(backbone_model=backbone), max_tokens=32)
