"""The one-launch depth draw (kernels/depth_draw.py) against the torch path it stands for
(``_guide`` -> ``suppress_reserved`` -> ``RowSampling.draw``), on CPU through Triton's
interpreter: the same codes for greedy and sampled rows, with and without guidance, top-k
(ties with the k-th value kept) and top-p; and a depth frame drawn by it equal to the frame
drawn by the torch path (tests/gpu runs the same on CUDA)."""

from __future__ import annotations

import pytest
import torch

from tests.kernel_helpers import needs_triton, run_in_interpreter

pytestmark = pytest.mark.unit

VOCAB = 2051  # the depth heads' width: 2048 codes and 3 reserved ids


def torch_draw(logits: torch.Tensor, num: int, has_cfg: torch.Tensor, scale: torch.Tensor,
               temp: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, seeds: torch.Tensor,
               counters: torch.Tensor) -> torch.Tensor:
    from breezert.layers.sampling import RowSampling, gumbel_noise, suppress_reserved
    from breezert.stages.depth import _guide

    x = suppress_reserved(_guide(logits, num, has_cfg, scale))
    rows = RowSampling.of(temp, top_k, top_p, num, x.shape[-1], x.device)
    return rows.draw(x, gumbel_noise(seeds, counters, x.shape[-1]))


def random_case(num: int, cfg: bool, seed: int, ties: bool = False,
                device: str = "cpu") -> tuple[torch.Tensor, ...]:
    """Logits and per-request settings: greedy rows, top-k from 1 to past the vocabulary and
    off, top-p off and from 0.1 to 0.95, guidance on and off per request."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn((2 if cfg else 1) * num, VOCAB, generator=gen) * 4
    if ties:  # few distinct values: many ids tied with the k-th
        logits = logits.round()
    pick = torch.randint(0, 1 << 30, (6, num), generator=gen)
    temp = torch.tensor([0.0, 0.7, 0.9, 1.0, 1.3])[pick[0] % 5]
    top_k = torch.tensor([0, 1, 7, 50, 64, 3000])[pick[1] % 6]
    top_p = torch.tensor([1.0, 1.0, 0.95, 0.8, 0.5, 0.1])[pick[2] % 6]
    has_cfg = pick[3] % 3 != 0
    scale = 1.0 + (pick[4] % 5).float() / 2
    seeds = pick[5].long() * 7919 + (1 << 33)
    counters = torch.arange(num) * 16 + 1 + seed % 15
    out = (logits, has_cfg, scale, temp, top_k, top_p, seeds, counters)
    return tuple(t.to(device) for t in out)


def check_draws(cfg: bool, ties: bool) -> None:
    from breezert.kernels.depth_draw import depth_draw_triton

    num = 24
    for seed in range(4):
        case = random_case(num, cfg, seed, ties)
        logits, has_cfg, scale, temp, top_k, top_p, seeds, counters = case
        if ties:  # top-p's order among tied ids is the sort's own: ties test top-k alone
            top_p = torch.ones_like(top_p)
        got = depth_draw_triton(logits, num, has_cfg, scale, temp, top_k, top_p, seeds, counters)
        want = torch_draw(logits, num, has_cfg, scale, temp, top_k, top_p, seeds, counters)
        assert torch.equal(got, want), (seed, got.tolist(), want.tolist())


def check_strided_settings() -> None:
    """The frame's settings are columns of one ``[B, 6]`` tensor: read in place."""
    from breezert.kernels.depth_draw import depth_draw_triton

    num = 5
    logits, has_cfg, scale, temp, top_k, top_p, seeds, counters = random_case(num, True, 9)
    sampling = torch.stack([temp, top_k.float(), top_p, temp, top_k.float(), top_p], dim=1)
    got = depth_draw_triton(logits, num, has_cfg, scale, sampling[:, 3], top_k, sampling[:, 5],
                            seeds, counters)
    want = torch_draw(logits, num, has_cfg, scale, temp, top_k, top_p, seeds, counters)
    assert torch.equal(got, want)


def check_depth_frame() -> None:
    """A whole frame with the kernel's draws equals the frame with the torch draws, with the
    full sort and with ``max_k=64`` (the stage runs that only while every top-k is in 1..64)."""
    from breezert.kernels.depth_draw import depth_draw_triton
    from breezert.models.breeze import BreezeModel
    from breezert.models.config import BreezeConfig
    from breezert.stages.depth import depth_frames
    from tests.unit.test_sampling import frame_inputs

    model = BreezeModel(BreezeConfig.tiny()).init_random_(torch.Generator().manual_seed(0)).eval()
    hidden, inputs = frame_inputs(model)
    inputs["sampling"][1, 3] = 0.0  # a greedy depth row beside the sampled ones
    bounded = inputs["sampling"].clone()
    bounded[2, 4] = 64  # top-k within max_k
    with torch.no_grad():
        for max_k, sampling in ((None, inputs["sampling"]), (64, bounded)):
            inputs["sampling"] = sampling
            want = depth_frames(model, hidden, **inputs, max_k=max_k)["codes"]
            got = depth_frames(model, hidden, **inputs, max_k=max_k,
                               depth_draw=depth_draw_triton)["codes"]
            assert torch.equal(got, want), (got, want)


def check_edge_rows(device: str = "cpu") -> None:
    """Rows that corner top-k's radix select: every logit equal, all but three ids at -inf
    (the k-th largest is -inf itself), one id far above the rest, negative logits only, values
    one ulp apart around the k-th, and the reserved ids holding the largest logits (also run
    on CUDA by tests/gpu)."""
    from breezert.kernels.depth_draw import depth_draw_triton

    gen = torch.Generator().manual_seed(5)
    base = torch.randn(VOCAB, generator=gen)
    near = 1.5 + torch.arange(VOCAB) % 5 * torch.finfo(torch.float32).eps
    sparse = torch.full((VOCAB,), float("-inf"))
    sparse[[3, 700, 2047]] = torch.tensor([0.5, 2.0, -1.0])
    spike = base.clone()
    spike[1234] = 1e4
    reserved = base.clone()
    reserved[2048:] = 50.0
    rows = [torch.full((VOCAB,), 0.25), sparse, spike, -base.abs() - 3, near, reserved]
    logits = torch.stack(rows).to(device)
    num = len(rows)
    for top_k in (1, 2, 5, 50, 2048):
        settings = tuple(t.to(device) for t in (
            torch.zeros(num, dtype=torch.bool), torch.ones(num), torch.full((num,), 0.9),
            torch.full((num,), top_k), torch.ones(num), torch.arange(num) * 7919 + 11,
            torch.arange(num) + 3))
        got = depth_draw_triton(logits, num, *settings)
        want = torch_draw(logits, num, *settings)
        assert torch.equal(got, want), (top_k, got.tolist(), want.tolist())


def check_refusals() -> None:
    from breezert.kernels.depth_draw import depth_draw_triton

    logits, *rest = random_case(4, False, 0)
    with pytest.raises(ValueError, match="fp32"):
        depth_draw_triton(logits.double(), 4, *rest)
    with pytest.raises(ValueError, match="rows"):
        depth_draw_triton(logits, 3, *rest)
    with pytest.raises(ValueError, match="1-D"):
        depth_draw_triton(logits, 4, rest[0][:2], *rest[1:])


@needs_triton
@pytest.mark.parametrize("cfg,ties", [(False, False), (True, False), (True, True)],
                         ids=["cond-rows", "guided", "tied-logits"])
def test_draws_equal_the_torch_path(cfg: bool, ties: bool) -> None:
    run_in_interpreter(__name__, f"check_draws({cfg}, {ties})")


@needs_triton
def test_settings_read_as_strided_columns() -> None:
    run_in_interpreter(__name__, "check_strided_settings()")


@needs_triton
def test_a_depth_frame_drawn_by_the_kernel_equals_the_torch_frame() -> None:
    run_in_interpreter(__name__, "check_depth_frame()")


@needs_triton
def test_top_k_edge_rows_equal_the_torch_path() -> None:
    run_in_interpreter(__name__, "check_edge_rows()")


@needs_triton
def test_bad_inputs_are_refused() -> None:
    run_in_interpreter(__name__, "check_refusals()")
