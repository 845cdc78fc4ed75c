"""Chooses launch shapes (``Tiles``) for the fused backbone DECODE step by measuring them.

Usage (GPU machine, repo root): ``PYTHONPATH=runtime python bench/tune_fused_decode.py
[--rows 2,32,128] [--context 256] [--budget-s 150] [--out X.json]``. Builds the full-size
Qwen3 backbone with random bf16 weights and a paged cache holding ``--context`` tokens per row,
then, by one sweep of coordinate descent from the serving shapes (``fused_decode.DECODE_TILES``),
times one DECODE step (28 layers, captured in a CUDA graph) for each candidate at every row
count and keeps the one with the least summed time. Only fields that leave the bits alone are
searched (column tiles, row blocks, warps, pipeline depths, TMA): the K tiles and the K split
set the order of the sums, so they stay; the script checks that each candidate's hidden states
equal the serving shapes' bit for bit. Prints the per-row table (serving shapes, ``Tiles()``,
the best) and writes JSON with the GPU, torch version, commit and date.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from types import SimpleNamespace

import torch

from breezert.kernels.fused_decode import DECODE_TILES, FusedBackboneDecode
from breezert.kernels.gemm import Tiles
from breezert.layers.attention import GatherKV
from breezert.models.backbone import Qwen3Backbone
from breezert.models.config import BreezeConfig
from breezert_bench.provenance import provenance
from cuda_bench import median_ms, random_bf16_packed

# Fields that do not change which products are summed in which order (see the docstring).
SEARCH = {
    "linear_bn": [16, 32, 64, 128], "gate_bn": [32, 64, 128], "tma": [False, True],
    "num_stages": [3, 4, 5], "gate_stages": [3, 4, 5, 6], "gate_warps": [4, 8],
    "split_bn": [32, 64], "split_stages": [3, 4, 6], "split_warps": [4, 8],
    "gate_bm": [16, 32, 64], "split_bm": [16, 32, 64],
}


def build_backbone() -> SimpleNamespace:
    """The full-size backbone (random bf16, packed projections) as ``model.backbone_model``."""
    torch.manual_seed(0)
    with torch.device("cuda"):
        backbone = Qwen3Backbone(BreezeConfig.full().backbone)
    return SimpleNamespace(backbone_model=random_bf16_packed(backbone))


class Step:
    """One DECODE step's inputs at ``rows`` rows x ``context`` cached tokens (each row its own
    cache rows, full length), and a runner that captures ``FusedBackboneDecode`` on them."""

    def __init__(self, model: SimpleNamespace, rows: int, context: int) -> None:
        cfg = model.backbone_model.cfg
        self.model, self.rows = model, rows
        self.kv = torch.randn(cfg.num_layers, 2, rows * context, cfg.num_kv_heads, cfg.head_dim,
                              device="cuda", dtype=torch.bfloat16)
        slots = torch.arange(rows * context, device="cuda").view(rows, context)
        self.view = GatherKV(self.kv, slots[:, -1].contiguous(), slots,
                             torch.ones(rows, 1, 1, context, dtype=torch.bool, device="cuda"))
        self.embeds = torch.randn(rows, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
        self.positions = torch.full((rows,), context - 1, dtype=torch.long, device="cuda")

    @torch.inference_mode()
    def run(self, tiles: Tiles, iters: int = 20) -> tuple[float, torch.Tensor]:
        """Median ms of one graph replay, and the hidden states it made."""
        fused = FusedBackboneDecode(self.model, self.rows, tiles, warm=False)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            fused(self.embeds, self.positions, self.view)
            with torch.cuda.graph(graph, stream=stream):
                out = fused(self.embeds, self.positions, self.view)
        torch.cuda.current_stream().wait_stream(stream)
        return median_ms(graph.replay, iters), out.clone()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", default="2,32,128", help="DECODE rows (2 per CFG request)")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--budget-s", type=float, default=150.0,
                        help="seconds of tuning (then the best so far)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    model = build_backbone()
    steps = [Step(model, int(r), args.context) for r in args.rows.split(",")]
    reference = {s.rows: s.run(DECODE_TILES)[1] for s in steps}
    tried: dict[Tiles, dict[int, float]] = {}

    def measure(tiles: Tiles) -> float:
        if tiles not in tried:
            try:
                times = {}
                for step in steps:
                    ms, out = step.run(tiles)
                    if not torch.equal(out, reference[step.rows]):
                        raise ValueError("hidden states differ from the serving shapes'")
                    times[step.rows] = ms
                tried[tiles] = times
            except Exception as exc:  # noqa: BLE001 - a shape the kernels or the chip refuse
                print(f"  {tiles}: {type(exc).__name__}: {str(exc)[:100]}")
                tried[tiles] = {s.rows: float("inf") for s in steps}
        return sum(tried[tiles].values())

    deadline = time.monotonic() + args.budget_s
    best = DECODE_TILES
    best_ms = measure(best)
    for name, values in SEARCH.items():
        for value in values:
            if time.monotonic() > deadline:
                break
            candidate = dataclasses.replace(best, **{name: value})
            ms = measure(candidate)
            if ms < best_ms:
                best, best_ms = candidate, ms
                print(f"better: {name}={value}: {tried[best]}")
    table = {"serving": tried[DECODE_TILES], "best": tried[best]}
    table["default_tiles"] = {s.rows: s.run(Tiles())[0] for s in steps}
    for label, times in table.items():
        print(f"{label:14s} " + "  ".join(f"{rows} rows {ms:.3f} ms" for rows, ms in times.items()))
    print(f"best: {best}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**provenance(), "context": args.context,
                       "step_ms": {k: {str(r): ms for r, ms in v.items()} for k, v in table.items()},
                       "best": dataclasses.asdict(best),
                       "tried": [{**dataclasses.asdict(t), "step_ms": {str(r): ms
                                                                        for r, ms in v.items()}}
                                 for t, v in tried.items()]}, f, indent=2)


if __name__ == "__main__":
    main()
