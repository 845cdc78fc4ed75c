"""The serving codec's switches end to end (CPU, tiny model): mixed-size CODEC replays and the
fast codec path give the audio of the per-size path and of the sequential reference.

Owns: engine-level equivalence of ``graph.codec_mixed_sizes`` / ``graph.fused_codec``, and the
grouping of a step's chunks into replays (``CodecStage.plan_groups``). Must not need a GPU
(tests/gpu checks the same under CUDA graphs, TF32 and bf16).
"""

from __future__ import annotations

import numpy as np
import pytest

from breezert.config import EngineConfig
from breezert.constants import Stage
from breezert.engine import Engine
from breezert.request import RequestStatus
from breezert.sched.plan import CodecItem
from tests.integration.test_engine import (
    ATOL,
    CONFIG,
    _record,
    _staggered_requests,
    audio,
    ranges,
    sequential,
)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def mixed_engine() -> Engine:
    config = EngineConfig.from_file(CONFIG)
    graph = config.graph.model_copy(update={"codec_mixed_sizes": True, "fused_codec": True})
    return Engine(config.model_copy(update={"graph": graph}))


def test_mixed_size_replays_equal_the_sequential_reference(mixed_engine: Engine) -> None:
    requests = _staggered_requests()
    run = _record(mixed_engine, [requests[i : i + 4] for i in range(0, 16, 4)], gap_steps=3)
    codec_steps = [p for p in run.recorder.steps if p.stage is Stage.CODEC]
    mixed = [p for p in codec_steps if len({i.num_frames for i in p.items}) > 1]
    assert mixed, "no CODEC step carried chunks of different sizes"
    stage = mixed_engine.runner.stages[Stage.CODEC]
    assert stage.num_replays < sum(len({i.num_frames for i in p.items}) for p in codec_steps)
    for r in requests:
        assert run.outcomes[r.request_id].status is RequestStatus.FINISHED
        got, reference = run.chunks[r.request_id], sequential(mixed_engine, r)
        assert ranges(got) == ranges(reference), r.request_id
        np.testing.assert_allclose(audio(got), audio(reference), atol=ATOL, rtol=0)


def _items(*sizes: int) -> list[CodecItem]:
    return [CodecItem(f"r{i}", i, 0, n, is_first_chunk=False, is_final=False)
            for i, n in enumerate(sizes)]


def test_plan_groups_trades_padding_against_replays(mixed_engine: Engine) -> None:
    stage = mixed_engine.runner.stages[Stage.CODEC]
    stage.replay_cost_frames = 24.0
    # eager (CPU): rows = items, frames = the group's largest chunk
    sizes = lambda groups: [[i.num_frames for i in g] for g in groups]  # noqa: E731
    assert sizes(stage.plan_groups(_items(16, 2, 16, 8))) == [[2, 8, 16, 16]]
    # 30 one-frame chunks beside two 16s: padding them all to 16 frames costs more than a replay
    assert sizes(stage.plan_groups(_items(*([1] * 30), 16, 16))) == [[1] * 30, [16, 16]]
    stage.replay_cost_frames = 0.0  # free replays: one per size
    assert sizes(stage.plan_groups(_items(4, 1, 4, 2))) == [[1], [2], [4, 4]]
    assert stage.plan_groups([]) == []


@pytest.mark.parametrize("graphs_on", [False, True])
def test_plan_groups_is_the_cheapest_split_by_replay_cost(mixed_engine: Engine,
                                                          graphs_on: bool) -> None:
    """The grouping prices each run once per row bucket; it must pick what the definition
    does: the dynamic programme over ``replay_cost`` of every pair of cut points."""
    stage = mixed_engine.runner.stages[Stage.CODEC]
    saved = stage.graphs.enabled, stage.buckets, stage.replay_cost_frames
    rng = np.random.default_rng(7)
    try:
        stage.graphs.enabled, stage.buckets = graphs_on, (1, 2, 4, 8, 16, 24, 32, 48, 64)
        for _ in range(200):
            stage.replay_cost_frames = float(rng.choice([0.0, 7.5, 24.0, 40.0]))
            sizes = rng.choice([1, 2, 3, 4, 5, 8, 12, 16, 17, 33], size=int(rng.integers(0, 80)))
            ordered = sorted(_items(*sizes), key=lambda item: item.num_frames)
            n = len(ordered)
            best, cut = [0.0] + [float("inf")] * n, [0] * (n + 1)
            for j in range(1, n + 1):
                for i in range(j):
                    cost = best[i] + stage.replay_cost(j - i, ordered[j - 1].num_frames)
                    if cost < best[j]:
                        best[j], cut[j] = cost, i
            want, j = [], n
            while j > 0:
                want.append(ordered[cut[j]:j])
                j = cut[j]
            assert stage.plan_groups(ordered) == want[::-1]
    finally:
        stage.graphs.enabled, stage.buckets, stage.replay_cost_frames = saved
