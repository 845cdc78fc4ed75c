"""GPU: the depth frame kernel on the full-size depth decoder, up to the rows it serves: the
persistent frame (kernels/persistent_depth.py, one cooperative Triton launch with grid
barriers, up to 512 rows). Its logits against fp32 math fed the same codes (as close as the eager bf16
decoder), its greedy codes the argmax of those logits, its draws equal to
``layers.sampling.sample`` on them, the same bits alone and beside others, run to run and
inside a CUDA graph, with CFG and without, and ``depth_frames`` serving through them.

Run on a CUDA machine: ``python -m pytest tests/gpu -q`` (skipped without CUDA).
"""

from __future__ import annotations

import pytest
import torch

from breezert.layers.sampling import draw_counter, sample
from breezert.models.config import BreezeConfig
from breezert.models.depth import DepthDecoder
from tests.kernel_helpers import (
    fp32_copy,
    guided_depth_logits,
    random_bf16_fused_,
    rel_error,
    teacher_forced_depth_logits,
)

pytestmark = pytest.mark.gpu

RESERVED = 2048


@pytest.fixture(scope="module")
def depth() -> DepthDecoder:
    torch.manual_seed(0)
    with torch.device("cuda"):
        return random_bf16_fused_(DepthDecoder(BreezeConfig.full().depth))


@pytest.fixture(scope="module")
def depth_fp32(depth: DepthDecoder) -> DepthDecoder:
    with torch.device("cuda"):
        return fp32_copy(depth, DepthDecoder)


# per kernel (one today; the streamed Gluon frame's are at commit d507041): the greedy cases
# (requests, CFG), the crowds a request is checked in, and the requests of the other checks
SIZES = {
    "persistent": {"greedy": [(1, True), (1, False), (16, True), (64, True), (256, True)],
                   "crowds": [2, 9, 16, 33, 64, 100, 256], "batch": 16},
}
KINDS = list(SIZES)


@pytest.fixture(scope="module")
def frames(depth: DepthDecoder) -> dict:
    """Each kernel, made once on first use."""
    made: dict = {}

    def get(kind: str):
        if kind not in made:
            from breezert.kernels.persistent_depth import PersistentDepthFrame

            made[kind] = PersistentDepthFrame(depth, max_rows=512)
        return made[kind]

    return get


def _inputs(num: int, cfg: bool, temperature: float, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rows = 2 * num if cfg else num
    return {
        "hidden": torch.randn(rows, 2048, device="cuda", generator=gen).to(torch.bfloat16),
        "code0": torch.randint(0, 2048, (num,), device="cuda", generator=gen),
        "has_cfg": (torch.arange(num, device="cuda") % 3 != 2) & cfg,
        "cfg_scale": torch.linspace(1.0, 3.0, num, device="cuda"),
        "depth_sampling": torch.tensor([[temperature, 50.0, 0.95]], device="cuda").repeat(num, 1),
        "seeds": torch.arange(num, device="cuda") * 7919 + seed,
        "frames_at": torch.arange(num, device="cuda") + 11,
    }


@pytest.mark.parametrize(("kind", "num", "cfg"),
                         [(k, n, c) for k in KINDS for n, c in SIZES[k]["greedy"]])
def test_greedy_frame_as_accurate_as_eager(depth, depth_fp32, frames, kind: str, num: int,
                                           cfg: bool) -> None:
    frame = frames(kind)
    inputs = _inputs(num, cfg, temperature=0.0, seed=num)
    rows = inputs["hidden"].shape[0]
    with torch.inference_mode():
        codes = frame(**inputs)
        logits = frame.frame_logits(rows).clone()
        again = frame(**inputs)
        exact = teacher_forced_depth_logits(depth_fp32, inputs["hidden"].float(), codes)
        eager = teacher_forced_depth_logits(depth, inputs["hidden"], codes)
    assert torch.equal(codes, again), "not deterministic"
    assert torch.equal(codes[:, 0], inputs["code0"])
    for pos in range(1, 16):
        got, want, bf = logits[pos], exact[pos - 1], eager[pos - 1]
        err, eager_err = rel_error(got, want), rel_error(bf, want)
        assert err <= 1.5 * eager_err + 2e-3, (pos, err, eager_err)
        guided = guided_depth_logits(got, inputs)
        assert torch.equal(codes[:, pos], guided.argmax(-1)), pos
        ref = guided_depth_logits(want, inputs)
        picked = ref.gather(1, codes[:, pos : pos + 1])[:, 0]
        margin = ref.max(-1).values - picked  # 0 where fp32 math picks the same code
        assert (margin <= 0.05 * ref.max(-1).values.abs() + 1e-2).all(), (pos, margin.max())
    assert torch.count_nonzero(frame.counters) == 0


@pytest.mark.parametrize("kind", KINDS)
def test_sampled_draws_equal_sample(frames, kind: str) -> None:
    frame, num = frames(kind), SIZES[kind]["batch"]
    inputs = _inputs(num, True, temperature=0.9, seed=3)
    with torch.inference_mode():
        codes = frame(**inputs)
        logits = frame.frame_logits(2 * num).clone()
    params = inputs["depth_sampling"]
    mismatched = 0
    for pos in range(1, 16):
        want = sample(guided_depth_logits(logits[pos], inputs), params[:, 0],
                      params[:, 1].long(), params[:, 2], inputs["seeds"],
                      draw_counter(inputs["frames_at"], pos), max_k=64)
        mismatched += int((codes[:, pos] != want).sum())
    # sample() and the kernel differ only at exact ties or where rounding moves the top-p cut
    assert mismatched <= 1, mismatched


@pytest.mark.parametrize(("kind", "crowd"), [(k, c) for k in KINDS for c in SIZES[k]["crowds"]])
def test_a_request_gets_the_same_bits_in_any_crowd(frames, kind: str, crowd: int) -> None:
    """Row blocks grow with the rows (16 .. 64 a work item): a request's codes and logits do not depend on how many run beside
    it."""
    frame = frames(kind)
    inputs = _inputs(crowd, True, temperature=0.9, seed=crowd)
    alone = {k: (v[[0, crowd]] if k == "hidden" else v[:1]) for k, v in inputs.items()}
    with torch.inference_mode():
        codes_alone = frame(**alone)
        logits_alone = frame.frame_logits(2).clone()
        codes = frame(**inputs)
        logits = frame.frame_logits(2 * crowd)
    assert torch.equal(codes_alone[0], codes[0])
    assert torch.equal(logits_alone[1:, 0], logits[1:, 0])
    assert torch.equal(logits_alone[1:, 1], logits[1:, crowd])


@pytest.mark.parametrize("kind", KINDS)
def test_graph_replay_equals_eager(frames, kind: str) -> None:
    frame = frames(kind)
    inputs = _inputs(SIZES[kind]["batch"], True, temperature=0.9, seed=9)
    with torch.inference_mode():
        eager = frame(**inputs)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            frame(**inputs)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = frame(**inputs)
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
    assert torch.equal(captured, eager)


@pytest.mark.parametrize("kind", KINDS)
def test_cfg_scale_one_is_the_cond_row(frames, kind: str) -> None:
    """With CFG scale 1 the guided logits are the cond row's up to fp32 rounding: greedy codes
    equal those of the same requests without CFG until a position whose top two logits lie
    within that rounding."""
    frame = frames(kind)
    inputs = _inputs(4, True, temperature=0.0, seed=4)
    inputs["cfg_scale"] = torch.ones(4, device="cuda")
    inputs["has_cfg"] = torch.ones(4, dtype=torch.bool, device="cuda")
    plain = dict(inputs, has_cfg=torch.zeros(4, dtype=torch.bool, device="cuda"))
    with torch.inference_mode():
        guided = frame(**inputs)
        codes = frame(**plain)
        logits = frame.frame_logits(8).clone()
    for b in range(4):
        for pos in range(1, 16):
            if guided[b, pos] != codes[b, pos]:
                top2 = logits[pos, b, :RESERVED].topk(2).values
                assert top2[0] - top2[1] < 1e-4, (b, pos, top2)
                break


@pytest.mark.parametrize("kind", KINDS)
def test_serving_depth_frames_run_the_kernel(depth, frames, kind: str) -> None:
    """``depth_frames`` with the kernel: first code drawn as before, the rest from the kernel;
    the same codes as the kernel called directly."""
    frame = frames(kind)
    from types import SimpleNamespace

    from breezert.kernels.fused_sampling import fused_sample
    from breezert.stages.depth import depth_frames

    lm = torch.randn(2052, 2048, device="cuda") * 2048 ** -0.5
    model = SimpleNamespace(first_code_logits=lambda h: h.float() @ lm.T,
                            cfg=SimpleNamespace(num_codebooks=16), depth_decoder=depth)
    num = SIZES[kind]["batch"]
    inputs = _inputs(num, True, temperature=0.9, seed=8)
    args = {"hidden": inputs["hidden"], "has_cfg": inputs["has_cfg"],
            "cfg_scale": inputs["cfg_scale"],
            "seen": torch.zeros(num, 2052, dtype=torch.bool, device="cuda"),
            "penalty": torch.full((num,), 1.1, device="cuda"),
            "no_eos": torch.ones(num, dtype=torch.bool, device="cuda"),
            "sampling": torch.cat([inputs["depth_sampling"], inputs["depth_sampling"]], 1),
            "seeds": inputs["seeds"], "frames_at": inputs["frames_at"]}
    with torch.inference_mode():
        codes = depth_frames(model, **args, max_k=64, sampler=fused_sample,
                             frame_kernel=frame)["codes"]
        direct = frame(**dict(inputs, code0=codes[:, 0]))
    assert torch.equal(codes, direct)
    assert int(codes[:, 1:].max()) < RESERVED
