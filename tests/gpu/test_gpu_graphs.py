"""GPU: every captured graph equals its eager function, engine audio with graphs equals eager,
batch invariance with fixed buckets, and the full-size random model streams.

Run on a CUDA machine: ``python -m pytest tests/gpu -q`` (skipped without CUDA).
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from breezert.config import EngineConfig
from breezert.constants import Stage
from breezert.engine import Engine, RequestOutcome
from breezert.options import SamplingParams
from breezert.options import SynthesisOptions
from breezert.request import SynthesisRequest

pytestmark = pytest.mark.gpu

TINY = {
    "model": {"preset": "tiny", "dtype": "float32", "device": "cuda", "seed": 0},
    "cache": {"block_size": 16, "num_blocks": 512},
    "scheduler": {"max_running_requests": 16, "max_model_len": 512, "max_prefill_tokens": 256,
                  "max_decode_rows": 32, "max_depth_rows": 32, "default_max_frames": 64},
    "graph": {"enable_cuda_graphs": True, "compile_depth": False,
              "decode_batch_buckets": [1, 2, 4, 8, 16, 32], "decode_context_buckets": [64, 512],
              "depth_batch_buckets": [1, 2, 4, 8, 16], "prefill_token_buckets": [32, 64, 256],
              "text_encode_buckets": [32, 64, 128, 256], "codec_buckets": [1, 2, 4, 8, 16]},
}


def _config(overrides: dict | None = None) -> EngineConfig:
    data = {k: dict(v) for k, v in TINY.items()}
    for section, values in (overrides or {}).items():
        data[section].update(values)
    return EngineConfig.from_dict(data)


def _run(engine: Engine, requests: list[SynthesisRequest]) -> dict[str, np.ndarray]:
    audio: dict[str, list[np.ndarray]] = {r.request_id: [] for r in requests}
    for r in requests:
        engine.add_request(r)
    while engine.has_work():
        for out in engine.step():
            if isinstance(out, RequestOutcome):
                assert out.error is None, out.error
            else:
                audio[out.request_id].append(out.pcm)
    return {k: np.concatenate(v) for k, v in audio.items()}


def _requests(n: int, prefix: str, greedy: bool = False) -> list[SynthesisRequest]:
    sampling = SamplingParams.greedy() if greedy else SamplingParams()
    return [
        SynthesisRequest(text=f"Request {i} speaks a short sentence.",
                         options=SynthesisOptions(
                             seed=100 + i, sampling=sampling, cfg_scale=1.0 if i % 3 else 2.0,
                             instructions=None if i % 3 else "calm"),
                         max_frames=24 + i, ignore_eos=True, request_id=f"{prefix}{i}")
        for i in range(n)
    ]


@pytest.fixture(scope="module")
def graph_engine() -> Engine:
    engine = Engine(_config())
    assert engine.runner.warmup_s is not None
    return engine


def _stage_inputs(stage: Stage, key, engine: Engine) -> dict[str, torch.Tensor]:
    """Realistic inputs for one captured bucket: real KV rows and slots, random values (padding
    rows/tokens that all write one scratch row would make the comparison racy). DECODE, DEPTH and
    CODEC read the slot table: their rows' state is written there first."""
    from breezert.layers.attention import KVRun
    from breezert.stages.backbone import _meta_inputs

    runner = engine.runner
    st, table = runner.stages[stage], runner.slots
    gen = torch.Generator(device="cuda").manual_seed(0)
    if stage is Stage.PREFILL:
        n, k = key
        runs = [KVRun(list(range(n // 16 + 1)), 0, n)]
        inputs = {"embeds": torch.randn(n, engine.checkpoint.config.hidden_size, device="cuda",
                                        generator=gen),
                  **_meta_inputs(runner.kv.packed_meta(runs, n, k), torch.device("cuda"))}
        return inputs
    if stage is Stage.DECODE:
        r, t = key
        positions = [min(t - 1, 10 + i) for i in range(r)]
        for row in range(r):  # slot row // 2, branch row % 2: its own three blocks
            table.set_block_table(row, (3 * row, 3 * row + 1, 3 * row + 2))
        table.last_frame.random_(0, 2048, generator=gen)
        return st.slot_inputs(list(range(r)), positions, r, t)
    if stage is Stage.DEPTH:
        size, use_cfg = key
        table.hidden.normal_(generator=gen)
        table.seen.copy_(torch.rand(table.seen.shape, device="cuda", generator=gen) < 0.02)
        table.frame_count.random_(0, 100, generator=gen)
        branches = [2 if use_cfg and i % 2 == 0 else 1 for i in range(size)]
        return {"row_ids": st.row_ids(np.arange(size), np.array(branches), size, use_cfg)}
    inputs = st.example_inputs(*key) if isinstance(key, tuple) else st.example_inputs(key)
    if stage is Stage.TEXT_ENCODE:
        inputs["input_ids"].random_(3, 5000, generator=gen)
    elif stage is Stage.CODEC:
        b, f = key
        table.ring.random_(0, 2048, generator=gen)
        inputs["rows"][:, 0] = torch.arange(b, device="cuda")  # distinct real slots
        inputs["rows"][:, 1:] = torch.arange(f, device="cuda")  # frames 0..f-1 of each
    return inputs


def test_every_graph_equals_eager(graph_engine: Engine) -> None:
    runner = graph_engine.runner
    clean = {name: t.clone() for name, t in _state(runner).items()}
    try:
        runner.kv.kv.normal_()  # every row holds finite, non-zero values
        for stage, stage_runner in runner.stages.items():
            for graphs in (stage_runner.graphs, getattr(stage_runner, "full_sort_graphs", None)):
                if graphs is None:
                    continue
                assert graphs.keys, f"no {graphs.name} graph captured"
                for key in graphs.keys:
                    _compare(graphs, key, _stage_inputs(stage, key, graph_engine), runner)
    finally:  # the module's engine serves the next tests: its free rows back at the defaults
        for name, t in _state(runner).items():
            t.copy_(clean[name])


def _state(runner) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    """Every tensor a stage function writes: the codec arena, the KV cache, the slot table."""
    state = runner.codec.state
    tensors = {"codec.conv": state.conv, "codec.kv": state.kv, "codec.pos": state.pos,
               "kv": runner.kv.kv}
    tensors.update({f"slots.{name}": t for name, t in vars(runner.slots).items()
                    if isinstance(t, torch.Tensor)})
    return tensors


def _compare(graphs, key, inputs: dict[str, torch.Tensor], runner) -> None:
    """The replay's outputs and its writes (slot table, KV cache, codec state) equal the eager
    function's from the same starting state."""
    saved = {name: t.clone() for name, t in _state(runner).items()}
    eager = {k: v.clone() for k, v in graphs.fn(**inputs).items()}
    eager.update({name: t.clone() for name, t in _state(runner).items()})
    for name, t in _state(runner).items():
        t.copy_(saved[name])
    replay = dict(graphs(key, inputs))
    replay.update(_state(runner))
    for name, value in eager.items():
        got = replay[name]
        if value.dtype in (torch.long, torch.int32, torch.bool):
            assert torch.equal(got, value), f"{graphs.name} {key} {name} differs"
        else:
            err = (got.float() - value.float()).abs().max().item()
            scale = max(1.0, value.float().abs().max().item())
            assert err <= 1e-4 * scale, f"{graphs.name} {key} {name}: max error {err}"


def test_text_past_the_largest_bucket_replays_graphs(graph_engine: Engine) -> None:
    """A burst of text (5 x 80 tokens > the 256-token bucket) goes in two graph replays, none
    eager, with rows equal to one packed eager call."""
    stage = graph_engine.runner.stages[Stage.TEXT_ENCODE]
    graphs = stage.graphs
    pieces = [torch.randint(3, 5000, (80,)) for _ in range(5)]
    eager_before, replays_before = graphs.num_eager, graphs.num_replays
    with torch.inference_mode():
        got = stage._encode(pieces)
        want = graphs.fn(**stage.pack(pieces, 400))["rows"]
    assert graphs.num_eager == eager_before and graphs.num_replays == replays_before + 2
    err = (got.float() - want.float()).abs().max().item()
    assert err <= 1e-4 * max(1.0, want.float().abs().max().item()), err


def test_engine_audio_graphs_equal_eager(graph_engine: Engine) -> None:
    eager = Engine(_config({"graph": {"enable_cuda_graphs": False}}))
    with_graphs = _run(graph_engine, _requests(6, "g", greedy=True))
    without = _run(eager, _requests(6, "g", greedy=True))
    for key, audio in without.items():
        assert with_graphs[key].shape == audio.shape
        assert np.abs(with_graphs[key] - audio).max() < 1e-3
    replays = {s.value: r.graphs.num_replays for s, r in graph_engine.runner.stages.items()}
    assert all(n > 0 for n in replays.values()), replays


def test_batch_invariance_with_fixed_buckets() -> None:
    # One bucket per stage: a request runs the same kernels alone or among 15 others.
    fixed = {"decode_batch_buckets": [32], "decode_context_buckets": [512],
             "depth_batch_buckets": [16], "prefill_token_buckets": [256],
             "text_encode_buckets": [256], "codec_buckets": [16]}
    engine = Engine(_config({"graph": fixed}))
    alone = _run(engine, _requests(1, "solo"))["solo0"]
    crowd = _requests(16, "crowd")
    crowd[0] = _requests(1, "solo")[0]
    together = _run(engine, crowd)["solo0"]
    np.testing.assert_array_equal(alone, together)


def test_full_size_random_model_streams() -> None:
    config = EngineConfig.from_dict({
        "model": {"preset": "full", "dtype": "bfloat16", "device": "cuda"},
        "cache": {"block_size": 16, "num_blocks": 2048},
        "scheduler": {"max_running_requests": 4, "max_model_len": 2048},
        "graph": {"enable_cuda_graphs": True, "compile_depth": False,
                  "decode_batch_buckets": [1, 2], "decode_context_buckets": [256],
                  "depth_batch_buckets": [1, 2], "prefill_token_buckets": [64],
                  "text_encode_buckets": [64], "codec_buckets": [1, 2]},
    })
    start = time.monotonic()
    engine = Engine(config)
    startup = time.monotonic() - start
    assert engine.checkpoint.model.count_parameters() == 2_850_155_520
    request = SynthesisRequest(text="The full-size model streams.",
                               options=SynthesisOptions(seed=1), max_frames=20,
                               ignore_eos=True, request_id="full")
    t0 = time.monotonic()
    audio = _run(engine, [request])["full"]
    print(f"full-size: start-up {startup:.1f} s, 20 frames in {time.monotonic() - t0:.3f} s")
    assert audio.shape == (20 * 1920,)
    assert np.isfinite(audio).all() and np.abs(audio).max() > 0
