"""GPU: ``graph.device_slot_state`` under CUDA graphs gives what the host path gives — every
captured DEPTH, DECODE and CODEC bucket replayed on the same values both ways (codes, hidden
states, waveforms, and the table's own updates), and the engine's plans, codes and audio for
the CPU test's request mix (tests/integration/test_engine_slot_state.py) with slots reused.

Run on a CUDA machine: ``python -m pytest tests/gpu -q`` (skipped without CUDA).
"""

from __future__ import annotations

import pytest
import torch

from breezert.constants import FRAME_EOS_ID, Stage
from breezert.engine import Engine
from breezert.options import SamplingParams
from breezert.sched.plan import DepthItem
from breezert.stages.backbone import _meta_inputs
from breezert.worker.kv_cache import KVRun
from breezert.worker.slot_table import SlotParams, SlotTable, sampling_row
from tests.gpu.test_gpu_graphs import _config
from tests.integration.test_engine_slot_state import (
    assert_same_trace,
    deterministic_engine,
    drive,
)

pytestmark = pytest.mark.gpu

VARIANTS = {
    "3-slots": {"scheduler": {"max_running_requests": 3}},  # later arrivals reuse slots
    "16-slots-mixed-codec": {"graph": {"codec_mixed_sizes": True, "fused_codec": True}},
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def engines(request: pytest.FixtureRequest) -> dict[bool, Engine]:
    """Key: ``device_slot_state``; both with every bucket captured."""
    overrides = VARIANTS[request.param]
    out = {}
    for on in (False, True):
        data = {section: dict(values) for section, values in overrides.items()}
        data.setdefault("graph", {})["device_slot_state"] = on
        out[on] = deterministic_engine(_config(data))
        assert out[on].runner.warmup_s is not None
    return out


def test_engine_mix_equals_the_host_path(engines: dict[bool, Engine]) -> None:
    host, device = drive(engines[False]), drive(engines[True])
    assert_same_trace(host, device, audio_atol=1e-5)
    for stage in (Stage.DEPTH, Stage.DECODE, Stage.CODEC):
        graphs = engines[True].runner.stages[stage].graphs
        assert graphs.num_replays > 0 and graphs.num_eager == 0, (stage, graphs.num_eager)


def _depth_values(size: int, use_cfg: bool, table: SlotTable) -> dict:
    """Random state of slots 0..size-1 in ``table`` and the host inputs holding the same."""
    gen = torch.Generator(device="cuda").manual_seed(size)
    slots = list(range(size))
    has_cfg = [use_cfg and i % 2 == 0 for i in slots]
    params = [SlotParams(SamplingParams(temperature=0.6 + 0.05 * i, top_k=1 + 3 * i,
                                        top_p=0.8 + 0.01 * i, repetition_penalty=1.3,
                                        depth_temperature=0.7, depth_top_k=40,
                                        depth_top_p=0.95),
                         1000 + i, 1.5 + 0.1 * i, has_cfg[i], i % 3 == 0) for i in slots]
    table.admit(slots, params)
    hidden = torch.randn(size, 2, table.hidden.shape[-1], device="cuda", generator=gen)
    hidden = hidden.to(table.hidden.dtype)
    table.start_segments(slots, [[h[0], h[1]] if cfg else [h[0]] for h, cfg in zip(hidden, has_cfg)])
    seen = torch.rand(size, table.seen.shape[1], device="cuda", generator=gen) < 0.02
    table.seen[:size] = seen
    frames_at = torch.arange(size, device="cuda") * 7 + 3
    table.frame_count[:size] = frames_at
    cfg = torch.tensor(has_cfg, device="cuda")
    rows = [hidden[:, 0]] + ([torch.where(cfg[:, None], hidden[:, 1], hidden[:, 0])]
                             if use_cfg else [])
    dev = "cuda"
    host = {
        "hidden": torch.cat(rows), "has_cfg": cfg,
        "cfg_scale": torch.tensor([p.cfg_scale for p in params], device=dev),
        "seen": seen.clone(), "penalty": torch.full((size,), 1.3, device=dev),
        "no_eos": torch.tensor([p.ignore_eos for p in params], device=dev),
        "sampling": torch.tensor([sampling_row(p.sampling) for p in params], device=dev),
        "seeds": torch.tensor([p.seed for p in params], device=dev), "frames_at": frames_at,
    }
    items = [DepthItem(f"r{i}", i, 0, 1, 2 if has_cfg[i] else 1, 0) for i in slots]
    return {"host": host, "items": items}


def _fitting(keys: list, table: SlotTable, rows_per_slot: int = 1) -> list:
    """The captured keys whose rows fit in the table's slots (all of them with 16 slots)."""
    fitting = [key for key in keys if -(-key[0] // rows_per_slot) <= table.scratch_slot]
    assert fitting, keys
    return fitting


def test_every_depth_bucket_equals_the_host_path(engines: dict[bool, Engine]) -> None:
    host_stage = engines[False].runner.stages[Stage.DEPTH]
    stage = engines[True].runner.stages[Stage.DEPTH]
    table = engines[True].runner.table
    for name in ("graphs", "full_sort_graphs"):
        host_graphs, graphs = getattr(host_stage, name), getattr(stage, name)
        assert graphs.keys and set(graphs.keys) == set(host_graphs.keys)
        for size, use_cfg in _fitting(graphs.keys, table):
            values = _depth_values(size, use_cfg, table)
            host = values["host"]
            want = host_graphs((size, use_cfg), host)["codes"].clone()  # [size, 16]
            replays = graphs.num_replays
            row_ids = stage.row_ids(values["items"], size, use_cfg)
            got = graphs((size, use_cfg), {"row_ids": row_ids})["first_codes"]
            assert graphs.num_replays == replays + 1
            assert torch.equal(got, want[:, 0]), (name, size, use_cfg)
            keep = want[:, 0] != FRAME_EOS_ID
            at = host["frames_at"] % table.ring_frames
            assert torch.equal(table.last_frame[:size][keep], want[keep])
            assert torch.equal(table.ring[torch.arange(size, device="cuda"), at][keep], want[keep])
            assert torch.equal(table.frame_count[:size], host["frames_at"] + keep.long())
            marked = host["seen"].clone()
            marked[torch.arange(size, device="cuda")[keep], want[keep, 0]] = True
            assert torch.equal(table.seen[:size], marked)
            table.release(list(range(size)))


def test_every_decode_bucket_equals_the_host_path(engines: dict[bool, Engine]) -> None:
    runners = engines[False].runner, engines[True].runner
    table = runners[1].table
    gen = torch.Generator(device="cuda").manual_seed(0)
    kv = torch.randn(runners[0].kv.kv.shape, device="cuda", generator=gen)
    host_graphs = runners[0].stages[Stage.DECODE].graphs
    stage = runners[1].stages[Stage.DECODE]
    for rows, context in _fitting(stage.graphs.keys, table, rows_per_slot=2):
        for runner in runners:
            runner.kv.kv.copy_(kv)
        runs = [KVRun([3 * i, 3 * i + 1, 3 * i + 2], min(context - 1, 10 + i), 1)
                for i in range(rows)]
        meta = _meta_inputs(runners[0].kv.decode_meta(runs, rows, context), torch.device("cuda"))
        row_ids = list(range(rows))  # slot i // 2, branch i % 2
        table.last_frame[: -(-rows // 2)] = torch.randint(
            0, 2048, (-(-rows // 2), 16), device="cuda", generator=gen)
        codes = table.last_frame[torch.tensor(row_ids, device="cuda") // 2]
        want = host_graphs((rows, context), {"codes": codes, **meta})["hidden"].clone()
        for row, run in zip(row_ids, runs):
            table.set_block_table(row, tuple(run.block_ids))
        inputs = stage.slot_inputs(row_ids, [run.start for run in runs], rows, context)
        got = stage.graphs((rows, context), inputs)
        assert torch.equal(got["hidden"], want), (rows, context)
        assert torch.equal(table.hidden.view(-1, want.shape[-1])[:rows], want)
    table.release(list(range(table.scratch_slot)))


def test_every_codec_bucket_equals_the_host_path(engines: dict[bool, Engine]) -> None:
    runners = engines[False].runner, engines[True].runner
    table = runners[1].table
    host_stage, stage = runners[0].stages[Stage.CODEC], runners[1].stages[Stage.CODEC]
    gen = torch.Generator(device="cuda").manual_seed(1)
    for size, frames in _fitting(stage.graphs.keys, table):
        slot_ids = torch.arange(size, device="cuda")
        for runner in runners:
            runner.codec.reset(slot_ids)
        counts = torch.tensor([frames - i % frames for i in range(size)], device="cuda")
        if not stage.mixed_sizes:
            counts.fill_(frames)
        table.ring[:size, :frames] = torch.randint(0, 2048, (size, frames, 16), device="cuda",
                                                   generator=gen)
        index = torch.arange(frames, device="cuda")[None, :].expand(size, frames)
        rows = torch.cat([slot_ids[:, None], torch.where(index < counts[:, None], index, -1)], 1)
        codes = table.ring[:size, :frames].masked_fill((index >= counts[:, None])[..., None], 0)
        host = {"slot_ids": slot_ids, "codes": codes}
        if stage.mixed_sizes:
            host["num_frames"] = counts
        want = host_stage.graphs((size, frames), host)["wav"].clone()
        got = stage.graphs((size, frames), {"rows": rows})["wav"]
        assert (got.float() - want.float()).abs().max().item() <= 1e-5, (size, frames)
        assert torch.equal(runners[1].codec.state.pos[:size], runners[0].codec.state.pos[:size])
    table.release(list(range(table.scratch_slot)))
