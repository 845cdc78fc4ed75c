"""Host time of one DEPTH step's input packing: the repetition mask as kept now (a bool row per
segment, one element set per frame) against the path it replaced (each segment's list of first
codes turned into a tensor and scattered, every step), side by side in one process.

Usage (repo root, CPU is enough: this is host work): ``PYTHONPATH=runtime python
bench/depth_host_inputs.py [--out X.json]``. Builds the tiny model's DEPTH stage, fills B
segments with H frames of history, and times ``DepthStage._inputs`` (median of 30 calls) with
the current masks and with the old construction of the ``seen`` input (each measured alone, the exact code of each path);
both give the same tensor (checked). Prints one line per (B, H) and writes JSON with where it
ran (``breezert.bench.provenance``).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from breezert.bench.provenance import provenance
from breezert.config import EngineConfig
from breezert.constants import Stage
from breezert.runtime_setup import build_runner, load_engine_checkpoint
from breezert.sched.plan import DepthItem
from breezert.worker.batch_state import SegmentState, SlotState
from breezert.options import SamplingParams

SHAPES = ((16, 100), (64, 100), (64, 400), (64, 750))


def median_s(fn, iters: int = 30) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def old_seen(histories: list[list[int]], size: int, vocab: int) -> torch.Tensor:
    """The replaced construction: a list of first codes per segment, scattered every step."""
    seen = torch.zeros(size, vocab, dtype=torch.bool)
    for i, history in enumerate(histories):
        if history:
            seen[i, torch.tensor(history)] = True
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    cfg = EngineConfig.from_dict({"model": {"preset": "tiny", "device": "cpu"},
                                  "scheduler": {"max_running_requests": 64}})
    stage = build_runner(cfg, load_engine_checkpoint(cfg.model)).stages[Stage.DEPTH]
    vocab = stage.model.cfg.backbone.vocab_size
    hidden = stage.model.cfg.hidden_size
    rng = np.random.default_rng(0)
    rows = []
    for num, frames in SHAPES:
        histories = [rng.integers(0, 2048, frames).tolist() for _ in range(num)]
        slots, segments, items = [], [], []
        for i, history in enumerate(histories):
            seg = SegmentState(prompts=[], hidden=[torch.zeros(hidden)])
            seg.seen = np.zeros(vocab, dtype=bool)
            seg.seen[history] = True
            slots.append(SlotState(f"r{i}", 1, 1.0, SamplingParams(), i, False, {0: seg}))
            segments.append(seg)
            items.append(DepthItem(request_id=f"r{i}", slot=i, segment_index=0,
                                   frame_index=frames, num_branches=1,
                                   output_frame_index=frames))
        new = stage._inputs(items, slots, segments, num, False)
        assert torch.equal(new["seen"], old_seen(histories, num, vocab))
        inputs_s = median_s(lambda: stage._inputs(items, slots, segments, num, False))
        seen_old_s = median_s(lambda: old_seen(histories, num, vocab))
        seen_new_s = median_s(lambda: torch.from_numpy(stage.seen_rows(segments, num)))
        rows.append({"requests": num, "history_frames": frames, "inputs_ms": 1e3 * inputs_s,
                     "seen_ms_old": 1e3 * seen_old_s, "seen_ms_new": 1e3 * seen_new_s})
        print(f"B={num} H={frames}: repetition mask {1e3 * seen_old_s:.3f} -> "
              f"{1e3 * seen_new_s:.3f} ms; the step's whole input packing now "
              f"{1e3 * inputs_s:.3f} ms")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**provenance(device="cpu"), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
