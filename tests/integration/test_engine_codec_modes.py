"""The serving codec end to end (CPU, tiny model): mixed-size CODEC replays on the fast codec
path (``graph.fused_codec``) give the audio of the sequential reference.

Owns: engine-level equivalence of the CODEC stage's replays and ``graph.fused_codec``, and the
grouping of a step's chunks into replays (``CodecStage.plan_groups``, against a brute force
over every grouping). Must not need a GPU
(tests/gpu checks the same under CUDA graphs, TF32 and bf16).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from breezert.config import EngineConfig
from breezert.constants import Stage
from breezert.engine import Engine
from breezert.request import RequestStatus
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
    graph = config.graph.model_copy(update={"fused_codec": True})
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


def _frames(*sizes: int) -> np.ndarray:
    """A step's chunk sizes (``CodecBatch.num_frames``); chunks are named by their index."""
    return np.array(sizes, np.int64)


def test_plan_groups_trades_padding_against_replays(mixed_engine: Engine) -> None:
    stage = mixed_engine.runner.stages[Stage.CODEC]
    stage.replay_cost_frames = 24.0
    # eager (CPU): rows = items, frames = the group's largest chunk
    sizes = lambda frames: [frames[g].tolist() for g in stage.plan_groups(frames)]  # noqa: E731
    assert sizes(_frames(16, 2, 16, 8)) == [[2, 8, 16, 16]]
    # 30 one-frame chunks beside two 16s: padding them all to 16 frames costs more than a replay
    assert sizes(_frames(*([1] * 30), 16, 16)) == [[1] * 30, [16, 16]]
    stage.replay_cost_frames = 0.0  # free replays: one per size
    assert sizes(_frames(4, 1, 4, 2)) == [[1], [2], [4, 4]]
    assert stage.plan_groups(_frames()) == []


def _partitions(items: list[int]) -> Iterator[list[list[int]]]:
    """Every set partition of ``items`` (Bell(n) of them: 21147 for 9 items)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for partition in _partitions(rest):
        for k in range(len(partition)):
            yield [*partition[:k], [first, *partition[k]], *partition[k + 1:]]
        yield [[first], *partition]


def test_graph_keys_are_the_replays_a_step_can_reach(mixed_engine: Engine) -> None:
    """A bucket is captured at the frame counts its fewest rows can fill within a step's
    frames (written out by hand for buckets up to 64 and 32 frames a step)."""
    stage = mixed_engine.runner.stages[Stage.CODEC]
    saved = stage.buckets
    try:
        stage.buckets = (1, 2, 4, 8, 16, 24, 32, 48, 64)
        keys = stage.graph_keys(16, 32)
    finally:
        stage.buckets = saved
    frames = {b: sorted(f for k, f in keys if k == b) for b in (1, 2, 4, 8, 16, 24, 32, 48, 64)}
    assert frames == {1: [1, 2, 4, 8, 16], 2: [1, 2, 4, 8, 16], 4: [1, 2, 4, 8], 8: [1, 2, 4],
                      16: [1, 2], 24: [1], 32: [1], 48: [], 64: []}
    assert keys == sorted(keys, reverse=True)


CAPTURE_PLANS = {"eager": (False, None), "every key": (True, None), "step of 32": (True, 32)}


@pytest.mark.parametrize("graphs", sorted(CAPTURE_PLANS))
def test_plan_groups_is_the_cheapest_of_all_groupings(mixed_engine: Engine, graphs: str) -> None:
    """Brute force: over every way to split up to 9 chunks into replays (any grouping, not
    only runs of the sorted order), none costs less by ``replay_cost`` than ``plan_groups``'s,
    and that one replays each chunk exactly once; with only the keys a 32-frame step reaches
    captured, every replay of the plan is one of them."""
    stage = mixed_engine.runner.stages[Stage.CODEC]
    saved = stage.graphs.enabled, stage.buckets, stage.replay_cost_frames, stage.graphs._graphs
    graphs_on, max_step = CAPTURE_PLANS[graphs]
    rng = np.random.default_rng(7)
    one_replay_loses = 0  # cases where the naive plans are not the cheapest: the oracle bites
    try:
        stage.graphs.enabled, stage.buckets = graphs_on, (1, 2, 4, 8, 16, 24, 32, 48, 64)
        if max_step:  # stands in for warm-up's captures: only the keys are read when planning
            stage.graphs._graphs = dict.fromkeys(stage.graph_keys(16, max_step))
        for _ in range(80):
            stage.replay_cost_frames = float(rng.choice([0.0, 7.5, 24.0, 40.0]))
            sizes = rng.choice([1, 2, 3, 4, 5, 8, 12, 16, 17, 33], size=int(rng.integers(0, 10)))
            frames = _frames(*sizes)
            items = list(range(len(frames)))
            prices: dict[tuple[int, int], float] = {}

            def cost(groups: list[list[int]]) -> float:
                total = 0.0
                for group in groups:
                    key = (len(group), max(int(frames[i]) for i in group))
                    if key not in prices:
                        prices[key] = stage.replay_cost(*key)
                    total += prices[key]
                return total

            plan = [g.tolist() for g in stage.plan_groups(frames)]
            assert sorted(i for g in plan for i in g) == items
            assert all(plan), "an empty replay"
            cheapest = min(cost(groups) for groups in _partitions(items))
            assert cost(plan) == pytest.approx(cheapest, rel=1e-12), (list(sizes), plan)
            if max_step:
                assert cost(plan) < float("inf"), (list(sizes), plan)
            one_replay_loses += bool(items) and cost([items]) > cheapest + 1e-9
    finally:
        (stage.graphs.enabled, stage.buckets, stage.replay_cost_frames,
         stage.graphs._graphs) = saved
    assert one_replay_loses >= 10, one_replay_loses


def _pairwise_plan(stage, frames: np.ndarray) -> list[list[int]]:
    """The definition ``plan_groups`` computes faster: every run ``ordered[i:j]`` of the chunks
    sorted by size priced by ``replay_cost``, the first cheapest ``i`` on ties (chunks named by
    their index in ``frames``)."""
    ordered = sorted(range(len(frames)), key=lambda i: frames[i])
    n = len(ordered)
    best, cut = [0.0] + [float("inf")] * n, [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j):
            cost = best[i] + stage.replay_cost(j - i, int(frames[ordered[j - 1]]))
            if cost < best[j]:
                best[j], cut[j] = cost, i
    groups, j = [], n
    while j > 0:
        groups.append(ordered[cut[j]:j])
        j = cut[j]
    return groups[::-1]


@pytest.mark.parametrize("graphs", sorted(CAPTURE_PLANS))
def test_plan_groups_is_the_pairwise_split_at_capacity(mixed_engine: Engine, graphs: str) -> None:
    """Up to 300 chunks (the capacity profile's 256 streams and past its largest bucket), with
    its buckets: the windowed ``plan_groups`` makes exactly the pairwise definition's split."""
    stage = mixed_engine.runner.stages[Stage.CODEC]
    saved = stage.graphs.enabled, stage.buckets, stage.replay_cost_frames, stage.graphs._graphs
    graphs_on, max_step = CAPTURE_PLANS[graphs]
    rng = np.random.default_rng(11)
    try:
        stage.graphs.enabled = graphs_on
        stage.buckets = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
        if max_step:
            stage.graphs._graphs = dict.fromkeys(stage.graph_keys(16, 8 * max_step))
        for n in (0, 1, 7, 40, 100, 256, 300):
            stage.replay_cost_frames = float(rng.choice([0.0, 24.0, 40.0]))
            frames = _frames(*rng.choice([1, 2, 3, 4, 8, 12, 16, 16, 16, 24, 40], size=n))
            plan = [g.tolist() for g in stage.plan_groups(frames)]
            assert plan == _pairwise_plan(stage, frames), n
    finally:
        (stage.graphs.enabled, stage.buckets, stage.replay_cost_frames,
         stage.graphs._graphs) = saved
