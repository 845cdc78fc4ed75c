"""Host time of one DEPTH, DECODE and CODEC step with the slot state on the host (today's path)
and in the device slot table (``graph.device_slot_state``), side by side in one process.

Usage (repo root, CPU is enough: this is host work): ``PYTHONPATH=runtime python
bench/slot_state_host.py [--out X.json]``. Builds the tiny model's stages both ways over one
checkpoint, puts B requests (every other one with CFG) in steady state (frame 100 of a
segment, repetition masks filled, frames waiting for the codec) and times ``stage.run`` (median
of 30 calls) with each graph replaced by a stub that returns outputs of the right shape: what is
left is the host's part of a step (packing inputs, reading results back, the stage's Python).
Also counts, per step, the input tensors a GPU step copies host -> device and their bytes
(DEPTH's backbone states are stacked on the device and DECODE's key positions made once, so
they are not counted; with the table a new segment's block tables are uploaded once, outside
these steady-state steps). Prints one line
per (stage, B) and writes JSON with where it ran (``breezert.bench.provenance``).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import numpy as np
import torch

from breezert.bench.provenance import provenance
from breezert.config import EngineConfig
from breezert.constants import Stage
from breezert.options import SamplingParams
from breezert.runtime_setup import build_runner, load_engine_checkpoint
from breezert.sched.plan import CodecItem, DecodeBranch, DecodeItem, DepthItem
from breezert.worker.batch_state import SegmentState, SlotState
from breezert.worker.model_runner import ModelRunner

BATCHES = (16, 64)
FRAME, PROMPT, CHUNK = 100, 60, 4  # steady state: frame 100 after a 60-token prompt; 4-frame chunks
BLOCK = 16


class StubGraphs:
    """Stands in for a ``GraphRunner``: outputs of the right shape, no model; records what a
    replay would copy host -> device."""

    enabled = False

    def __init__(self, hidden_size: int) -> None:
        self.hidden_size = hidden_size
        self.uploads: tuple[int, int] = (0, 0)  # (tensors, bytes) of the last call
        self._static: dict[tuple, torch.Tensor] = {}  # like a graph's outputs: made once

    def _zeros(self, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self._static.setdefault((shape, dtype), torch.zeros(shape, dtype=dtype))

    def __call__(self, key, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:  # noqa: ANN001
        # DEPTH's states are stacked on the device, DECODE's key slots are made once; inputs
        # that are views of one tensor (DECODE's row ids and positions) are one upload
        sent = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for name, t in inputs.items() if name not in ("hidden", "key_slots")}
        self.uploads = (len(sent), sum(sent.values()))
        if "row_ids" in inputs and inputs["row_ids"].dim() == 2:  # DEPTH on the table
            return {"first_codes": self._zeros(inputs["row_ids"].shape[1], dtype=torch.long)}
        if "has_cfg" in inputs:  # DEPTH, host path
            return {"codes": self._zeros(inputs["has_cfg"].shape[0], 16, dtype=torch.long)}
        if "positions" in inputs:  # DECODE
            return {"hidden": self._zeros(inputs["positions"].shape[0], self.hidden_size)}
        rows = inputs.get("rows")
        size, frames = (rows.shape[0], rows.shape[1] - 1) if rows is not None \
            else inputs["codes"].shape[:2]
        return {"wav": self._zeros(size, frames * 1920)}


def populate(runner: ModelRunner, num: int) -> None:
    """``num`` requests in slots 0..num-1 at frame ``FRAME`` of their first segment."""
    rng = np.random.default_rng(0)
    vocab, d = runner.ckpt.config.backbone.vocab_size, runner.ckpt.config.hidden_size
    for i in range(num):
        branches = 2 if i % 2 else 1
        state = SlotState(f"r{i}", branches, 2.0 if branches == 2 else 1.0, SamplingParams(),
                          i, False)
        segment = SegmentState(prompts=[], hidden=[torch.randn(d) for _ in range(branches)])
        segment.seen = np.zeros(vocab, dtype=bool)
        segment.seen[rng.integers(0, 2048, FRAME)] = True
        segment.last_frame = torch.randint(0, 2048, (16,))
        state.segments[0] = segment
        runner.batch.add(i, state)
    if runner.table is not None:
        from breezert.worker.model_runner import _slot_params

        states = [runner.batch.get(i, f"r{i}") for i in range(num)]
        runner.table.admit(list(range(num)), [_slot_params(s) for s in states])
        runner.table.start_segments(list(range(num)), [s.segments[0].hidden for s in states])


def items_of(num: int) -> dict[Stage, list]:
    blocks = -(-(PROMPT + FRAME + 1) // BLOCK)
    depth = [DepthItem(f"r{i}", i, 0, FRAME, 2 if i % 2 else 1, FRAME) for i in range(num)]
    decode = [DecodeItem(f"r{i}", i, 0, FRAME - 1, tuple(
        DecodeBranch(PROMPT + FRAME - 1, tuple(range((2 * i + b) * blocks, (2 * i + b + 1) * blocks)))
        for b in range(2 if i % 2 else 1))) for i in range(num)]
    codec = [CodecItem(f"r{i}", i, FRAME - CHUNK, CHUNK, False, False) for i in range(num)]
    return {Stage.DEPTH: depth, Stage.DECODE: decode, Stage.CODEC: codec}


def refill_frames(runner: ModelRunner, num: int) -> None:
    """The host path's CODEC step pops its frames: put them back (not timed)."""
    for i in range(num):
        frames = runner.batch.get(i, f"r{i}").frames
        for f in range(FRAME - CHUNK, FRAME):
            frames[f] = torch.randint(0, 2048, (16,))


def median_s(fn: Callable[[], object], setup: Callable[[], None], iters: int = 30) -> float:
    times = []
    for _ in range(iters):
        setup()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    num_slots = max(BATCHES)
    base = {"model": {"preset": "tiny", "device": "cpu"},
            "scheduler": {"max_running_requests": num_slots},
            "cache": {"num_blocks": 2 * num_slots * (-(-(PROMPT + FRAME + 1) // BLOCK))}}
    ckpt = load_engine_checkpoint(EngineConfig.from_dict(base).model)
    runners = {}
    for on in (False, True):
        cfg = EngineConfig.from_dict({**base, "graph": {"device_slot_state": on}})
        runners[on] = runner = build_runner(cfg, ckpt)
        for stage in (Stage.DEPTH, Stage.DECODE, Stage.CODEC):
            stub = StubGraphs(ckpt.config.hidden_size)
            runner.stages[stage].graphs = stub
            if stage is Stage.DEPTH:
                runner.stages[stage].full_sort_graphs = stub
    rows = []
    for num in BATCHES:
        items = items_of(num)
        for stage in (Stage.DEPTH, Stage.DECODE, Stage.CODEC):
            row = {"stage": stage.value, "requests": num}
            for on, name in ((False, "host"), (True, "device")):
                runner = runners[on]
                runner.batch = type(runner.batch)(num_slots)
                populate(runner, num)
                run = runner.stages[stage].run
                setup = (lambda r=runner: refill_frames(r, num)) if not on else (lambda: None)
                row[f"{name}_ms"] = 1e3 * median_s(lambda: run(items[stage], runner.batch), setup)
                row[f"{name}_uploads"], row[f"{name}_upload_bytes"] = \
                    runner.stages[stage].graphs.uploads
            rows.append(row)
            print(f"{stage.value:6s} B={num:3d}: host path {row['host_ms']:.3f} ms "
                  f"({row['host_uploads']} uploads, {row['host_upload_bytes']} B) -> device "
                  f"table {row['device_ms']:.3f} ms ({row['device_uploads']} uploads, "
                  f"{row['device_upload_bytes']} B)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**provenance(device="cpu"),
                       "config": {"frame": FRAME, "prompt_tokens": PROMPT, "chunk_frames": CHUNK,
                                  "cfg": "every other request", "iters": 30},
                       "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
