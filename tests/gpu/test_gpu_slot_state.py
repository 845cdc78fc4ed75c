"""GPU: the slot table under CUDA graphs — the CPU test's request mix
(tests/integration/test_engine_slot_state.py) runs on replays only, twice on the same engine
with the same codes and audio (nothing of a freed slot leaks), every freed slot back to the
defaults; and every captured DEPTH, DECODE and CODEC bucket, replayed on a few slots' state,
writes what its eager function writes.

Run on a CUDA machine: ``python -m pytest tests/gpu -q`` (skipped without CUDA).
"""

from __future__ import annotations

import pytest

from breezert.constants import Stage
from breezert.engine import Engine
from tests.gpu.test_gpu_graphs import _compare, _config, _stage_inputs
from tests.integration.test_engine_slot_state import (
    ARRIVALS,
    assert_mix_ran,
    assert_same_trace,
    assert_slots_reset,
    deterministic_engine,
    drive,
)

pytestmark = pytest.mark.gpu

VARIANTS = {
    "3-slots": {"scheduler": {"max_running_requests": 3}},  # later arrivals reuse slots
    "16-slots-fused-codec": {"graph": {"fused_codec": True}},
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def engine(request: pytest.FixtureRequest) -> Engine:
    """The tiny model with every bucket captured."""
    overrides = {section: dict(values) for section, values in VARIANTS[request.param].items()}
    engine = deterministic_engine(_config(overrides))
    assert engine.runner.warmup_s is not None
    return engine


def test_engine_mix_runs_on_replays_and_repeats_itself(engine: Engine) -> None:
    first = drive(engine)
    requests = sum(len(wave) for wave in ARRIVALS.values())
    assert_mix_ran(first, slots_reused=engine.config.scheduler.max_running_requests < requests)
    for stage in (Stage.DEPTH, Stage.DECODE, Stage.CODEC):
        graphs = engine.runner.stages[stage].graphs
        assert graphs.num_replays > 0 and graphs.num_eager == 0, (stage, graphs.num_eager)
    assert_slots_reset(engine)
    assert_same_trace(first, drive(engine))  # the same kernels: bit for bit
    assert_slots_reset(engine)


def _fitting(keys: list, slots: int, rows_per_slot: int = 1) -> list:
    """The captured keys whose rows fit in ``slots`` slots (all of them with 16 slots)."""
    fitting = [key for key in keys if -(-key[0] // rows_per_slot) <= slots]
    assert fitting, keys
    return fitting


@pytest.mark.parametrize("stage", [Stage.DEPTH, Stage.DECODE, Stage.CODEC])
def test_every_slot_bucket_replay_writes_what_eager_writes(engine: Engine, stage: Stage) -> None:
    """Rows of the first slots hold random state (no request: admission resets a slot's rows,
    so a later request sees none of it)."""
    runner = engine.runner
    runner.kv.kv.normal_()  # every row holds finite, non-zero values
    stage_runner = runner.stages[stage]
    slots = runner.slots.scratch_slot
    rows_per_slot = 2 if stage is Stage.DECODE else 1
    for graphs in (stage_runner.graphs, getattr(stage_runner, "full_sort_graphs", None)):
        if graphs is None:
            continue
        for key in _fitting(graphs.keys, slots, rows_per_slot):
            _compare(graphs, key, _stage_inputs(stage, key, engine), runner)
