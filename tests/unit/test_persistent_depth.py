"""The persistent depth frame (kernels/persistent_depth.py) on CPU through Triton's
interpreter, one phase per launch (the GPU tests run it as one launch with its grid barriers):
its logits against the eager depth decoder fed the same codes, its draws against
``layers.sampling.sample`` on those logits, batch invariance, and its refusals."""

from __future__ import annotations

import pytest
import torch

from breezert.models.depth import DepthDecoder
from tests.kernel_helpers import (
    guided_depth_logits,
    needs_triton,
    random_bf16_fused_,
    rel_error,
    run_in_interpreter,
    teacher_forced_depth_logits,
)
from tests.unit.test_fused_depth_kernels import SMALL

pytestmark = pytest.mark.unit

RESERVED = 2048  # ids 2048.. are never drawn in the depth codebooks
MAX_K = 4  # the interpreter's top-k sort is slow: a small bound keeps a frame near a minute


def _decoder(seed: int) -> DepthDecoder:
    torch.manual_seed(seed)
    return random_bf16_fused_(DepthDecoder(SMALL))


def _inputs(num: int, cfg: bool, temperature: float, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    rows = 2 * num if cfg else num
    return {
        "hidden": torch.randn(rows, SMALL.backbone_hidden_size, generator=gen).to(torch.bfloat16),
        "code0": torch.randint(0, 2048, (num,), generator=gen).index_fill_(0, torch.tensor([0]),
                                                                           2051),  # EOS: clamped
        "has_cfg": torch.tensor([i % 2 == 0 for i in range(num)]) & cfg,
        "cfg_scale": torch.linspace(1.5, 3.0, num),
        "depth_sampling": torch.tensor([[temperature, float(MAX_K), 0.9]]).repeat(num, 1),
        "seeds": torch.arange(num, dtype=torch.long) * 7919 + seed,
        "frames_at": torch.arange(num, dtype=torch.long) + 3,
    }


def check_greedy_frame(num: int, cfg: bool) -> None:
    """Greedy draws: each position's logits close to the eager decoder's on the same codes,
    each code the argmax of the guided logits (the eager argmax too, unless a near tie)."""
    from breezert.kernels.persistent_depth import PersistentDepthFrame

    depth = _decoder(1)
    inputs = _inputs(num, cfg, temperature=0.0, seed=2)
    frame = PersistentDepthFrame(depth, max_rows=8, programs=3, max_k=MAX_K)
    with torch.inference_mode():
        codes = frame(**inputs)
        logits = frame.frame_logits(inputs["hidden"].shape[0]).clone()
        want = teacher_forced_depth_logits(depth, inputs["hidden"], codes)
    assert torch.equal(codes[:, 0], inputs["code0"])
    assert int(codes[:, 1:].max()) < RESERVED and int(codes.min()) >= 0
    for pos in range(1, 16):
        got, ref = logits[pos], want[pos - 1]
        assert rel_error(got, ref) < 2e-2, (pos, rel_error(got, ref))
        guided, ref_guided = guided_depth_logits(got, inputs), guided_depth_logits(ref, inputs)
        assert torch.equal(codes[:, pos], guided.argmax(-1)), pos
        picked = ref_guided.gather(1, codes[:, pos : pos + 1])[:, 0]
        margin = ref_guided.max(-1).values - picked  # 0 where eager picks the same code
        assert (margin <= 0.02 * ref_guided.max(-1).values.abs() + 1e-3).all(), (pos, margin)
    assert torch.count_nonzero(frame.counters) == 0


def check_sampled_frame() -> None:
    """Sampled draws equal ``layers.sampling.sample`` on the kernel's own guided logits with
    counter ``frame * 16 + position``; a request alone gets the bits it gets in a crowd."""
    from breezert.kernels.persistent_depth import PersistentDepthFrame
    from breezert.layers.sampling import draw_counter, sample

    depth = _decoder(3)
    inputs = _inputs(2, cfg=True, temperature=0.9, seed=5)
    frame = PersistentDepthFrame(depth, max_rows=8, programs=2, max_k=MAX_K)
    with torch.inference_mode():
        codes = frame(**inputs)
        logits = frame.frame_logits(4).clone()
        params = inputs["depth_sampling"]
        for pos in range(1, 16):
            want = sample(guided_depth_logits(logits[pos], inputs), params[:, 0],
                          params[:, 1].long(), params[:, 2], inputs["seeds"],
                          draw_counter(inputs["frames_at"], pos), max_k=MAX_K)
            assert torch.equal(codes[:, pos], want), pos
        alone = {k: (v[[1, 3]] if k == "hidden" else v[1:2]) for k, v in inputs.items()}
        codes_alone = frame(**alone)
        logits_alone = frame.frame_logits(2)
    assert torch.equal(codes_alone[0], codes[1])
    assert torch.equal(logits_alone[1:, 0], logits[1:, 1])
    assert torch.equal(logits_alone[1:, 1], logits[1:, 3])


@needs_triton
def test_greedy_frame_matches_eager() -> None:
    run_in_interpreter(__name__, "check_greedy_frame(2, True)")


@needs_triton
def test_sampled_frame_matches_sample_and_is_batch_invariant() -> None:
    run_in_interpreter(__name__, "check_sampled_frame()")


def test_refuses_what_it_cannot_run() -> None:
    from breezert.kernels.persistent_depth import FrameTiles, PersistentDepthFrame

    depth = _decoder(0)
    unpacked = DepthDecoder(SMALL).to(torch.bfloat16)
    with pytest.raises(ValueError, match="fuse_projections_"):
        PersistentDepthFrame(unpacked, max_rows=4)
    with pytest.raises(ValueError, match="bfloat16"):
        PersistentDepthFrame(DepthDecoder(SMALL), max_rows=4)
    with pytest.raises(ValueError, match="down_proj"):
        PersistentDepthFrame(depth, max_rows=4, tiles=FrameTiles(down_split=3))
    frame = PersistentDepthFrame(depth, max_rows=4)
    inputs = _inputs(2, cfg=True, temperature=0.0, seed=0)
    with pytest.raises(ValueError, match="3 rows for 2 requests"):
        frame(**dict(inputs, hidden=inputs["hidden"][:3]))
    with pytest.raises(ValueError, match="6 rows past"):
        frame(**_inputs(3, cfg=True, temperature=0.0, seed=0))
