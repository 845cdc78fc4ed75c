"""GPU: the one-launch depth draw (kernels/depth_draw.py) compiled for CUDA against the torch path
it stands for, on the same device: the same codes wherever top-p's boundary is not within the
last bits of its mass (checked in float64 where they differ), and in top-k's corner rows; a
depth frame drawn by it equal to the torch frame, eager and replayed from a CUDA graph; and an
engine with ``graph.fused_depth_draw`` serving a greedy mix (guidance on and off) with the
audio of one without.

Run on a CUDA machine: ``python -m pytest tests/gpu -q`` (skipped without CUDA).
"""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_depth_draw_kernel import check_edge_rows, random_case, torch_draw

pytestmark = pytest.mark.gpu

BOUNDARY = 1e-5
"""How close to p the float64 mass above an id may lie for the two sums to round it apart."""


@pytest.mark.parametrize("cfg", [False, True], ids=["cond-rows", "guided"])
def test_draws_equal_the_torch_path_on_cuda(cfg: bool) -> None:
    from breezert.kernels.depth_draw import depth_draw_triton
    from breezert.layers.sampling import suppress_reserved
    from breezert.stages.depth import _guide

    num, differ = 256, 0
    for seed in range(6):
        case = random_case(num, cfg, seed, device="cuda")
        logits, has_cfg, scale, temp, top_k, top_p, seeds, counters = case
        got = depth_draw_triton(*case[:1], num, *case[1:])
        want = torch_draw(logits, num, has_cfg, scale, temp, top_k, top_p, seeds, counters)
        for b in torch.nonzero(got != want).flatten().tolist():
            differ += 1
            assert top_p[b] < 1, f"row {b}: {got[b]} != {want[b]} without top-p"
            x = suppress_reserved(_guide(logits, num, has_cfg, scale))[b].double() / temp[b]
            if top_k[b] > 0:
                kth = x.topk(int(min(top_k[b], x.numel()))).values[-1]
                x = x.masked_fill(x < kth, float("-inf"))
            prob = x.softmax(0)
            margins = [abs(prob[prob > prob[c]].sum().item() - top_p[b].item())
                       for c in (got[b], want[b])]
            assert min(margins) < BOUNDARY, (b, got[b].item(), want[b].item(), margins)
    assert differ <= 3, f"{differ} of {6 * num} draws at top-p's boundary"


def test_top_k_edge_rows_equal_the_torch_path_on_cuda() -> None:
    """The radix select's corner rows (all equal, -inf k-th, a spike, one-ulp ties, ...)."""
    check_edge_rows("cuda")


def test_a_depth_frame_drawn_by_the_kernel_equals_the_torch_frame_in_a_graph() -> None:
    from breezert.kernels.depth_draw import depth_draw_triton
    from breezert.models.breeze import BreezeModel
    from breezert.models.config import BreezeConfig
    from breezert.stages.depth import depth_frames

    model = BreezeModel(BreezeConfig.tiny()).init_random_(torch.Generator().manual_seed(0))
    model = model.eval().cuda()
    gen = torch.Generator().manual_seed(3)
    num = 8
    hidden = torch.randn(2 * num, model.cfg.backbone.hidden_size, generator=gen).cuda()
    sampling = torch.tensor([[0.9, 50, 1.0, 0.9, 50, 1.0], [1.2, 20, 0.8, 0.0, 5, 1.0]] * 4)
    inputs = {k: v.cuda() for k, v in dict(
        has_cfg=torch.arange(num) % 3 != 0, cfg_scale=1.0 + torch.arange(num) / 4,
        seen=torch.rand(num, 2052, generator=gen) < 0.01, penalty=torch.full((num,), 1.1),
        no_eos=torch.ones(num, dtype=torch.bool), sampling=sampling,
        seeds=torch.arange(num) * 7919 + 3, frames_at=torch.arange(num) * 5).items()}
    with torch.inference_mode():
        want = depth_frames(model, hidden, **inputs, max_k=64)["codes"]
        fused = lambda: depth_frames(model, hidden, **inputs, max_k=64,  # noqa: E731
                                     depth_draw=depth_draw_triton)["codes"]
        assert torch.equal(fused(), want)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            fused()
            with torch.cuda.graph(graph, stream=stream):
                replayed = fused()
        torch.cuda.current_stream().wait_stream(stream)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(replayed, want)


def test_an_engine_with_the_fused_draw_serves_the_same_greedy_codes() -> None:
    from breezert.engine import Engine
    from breezert.options import SamplingParams, SynthesisOptions
    from breezert.request import SynthesisRequest
    from tests.gpu.test_gpu_graphs import _config, _run

    greedy = SamplingParams(temperature=0.0, depth_temperature=0.0)

    def serve(fused: bool) -> dict:
        engine = Engine(_config({"graph": {"fused_depth_draw": fused}}))
        requests = [SynthesisRequest(text=f"Request {i} speaks.", max_frames=12,
                                     options=SynthesisOptions(seed=i, sampling=greedy,
                                                              cfg_scale=1.0 + (i % 2) / 2),
                                     ignore_eos=True, request_id=f"r{i}") for i in range(5)]
        return _run(engine, requests)

    want, got = serve(False), serve(True)
    for key, audio in want.items():
        assert torch.equal(torch.from_numpy(got[key]), torch.from_numpy(audio)), key
