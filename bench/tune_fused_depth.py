"""Chooses launch shapes (``Tiles``) for the fused Triton depth layers by measuring them.

Usage (GPU machine, repo root): ``PYTHONPATH=runtime python bench/tune_fused_depth.py
[--rows 16,64,128] [--out X.json]``. Builds the full-size depth decoder with random bf16
weights, then, for each row count in turn (starting from the previous count's best), by one
sweep of coordinate descent from ``Tiles()``, times one frame of layer steps (16 positions, no
sampling) captured in a CUDA graph for each candidate, starting from the bucket's entry in
``TILES_BY_ROWS``. Prints the best shapes per row count and the frame time, then times plain
PyTorch layers, one shape for all rows (``Tiles()``), the per-bucket table without and with
programmatic dependent launch (``graph.pdl``) and with the q/k/v GEMM split along K
(``qkv_split_k`` 2 and 4, each without and with PDL), past 256 rows with PDL in every
bucket (the table's 512-row bucket skips it: ``Tiles.skip_pdl``), and each best at every
``--check-rows``
count in one process (``--rows ''`` skips the tuning); ``TILES_BY_ROWS`` in kernels/fused_depth.py
comes from this. ``prenorm`` (``Tiles.prenorm``) is a searched field like the tiles, and the check
rows also time every bucket with it (``by_rows_prenorm_pdl``; the table itself has it at 256 and
512 rows).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch

from breezert.kernels.fused_depth import (
    TILES_BY_ROWS,
    FusedDepthLayers,
    prenorm_every_bucket,
)
from breezert.kernels.gemm import Tiles
from breezert.models.config import BreezeConfig
from breezert.models.depth import DepthDecoder
from breezert_bench.provenance import provenance
from cuda_bench import graph_ms, random_bf16_packed

# Row blocks, then TMA (it changes which pipeline depths pay). Per-kernel warps/stages after the shapes.
# split_k stays the bucket's: it sets the sum order, and every bucket must give a row the same
# bits (TILES_BY_ROWS all split 4).
# Row blocks of 128 only pay past 128 rows (capacity's 256-512 rows: each block reads its weight
# slice again); below, ``row_block`` caps them at the rows' power of two (the same candidate).
# split_bk 64: the plain TMA GEMM that came within 3 % of cuBLAS on down at 512 rows was
# 128 x 128 x 64, 4 warps, 4 stages (bench/results/h100-depth-gemm-ceiling-20261206-9.json).
SEARCH = {
    "qkv_bm": [16, 32, 64, 128], "gate_bm": [32, 64, 128], "split_bm": [32, 64, 128],
    "tma": [False, True], "gate_bn": [32, 64, 128], "gate_bk": [64, 128],
    "gate_stages": [3, 4, 5, 6], "gate_warps": [4, 8],
    "split_bn": [32, 64, 128], "split_bk": [64, 128, 256], "split_stages": [3, 4, 6],
    "split_warps": [4, 8], "qkv_split": [2, 4], "qkv_bk": [128, 256], "num_stages": [3, 4],
}
# Joint moves a one-field sweep cannot make (each field alone may not pay), tried from the start
# point before the sweep: the plain TMA GEMM shapes that came within 3-13 % of cuBLAS at 512
# rows while the served kernels took 1.4-2x (bench/results/h200-depth-gemm-ceiling-20261206-10
# .json: down 128 x 128 x 64, 4 warps, 4 stages, split 4 ways; gate/up 128 x 256 x 64, 8 warps,
# 3 stages, i.e. 128-wide gate and up halves).
SEEDS = (
    {"split_bm": 128, "split_bn": 128, "split_bk": 64, "split_warps": 4, "split_stages": 4},
    {"gate_bm": 128, "gate_bn": 128, "gate_bk": 64, "gate_warps": 8, "gate_stages": 3},
)
# Like split_k, qkv_split_k sets the sum order: a winner goes into every bucket at once. It is
# searched first (a bounded run reaches it), then prenorm (the norms apart, input rows through
# TMA: the same bits, so a bucket may take it alone), which changes what the tiles after it pay.
# o_inline and down_inline (o_proj's / down_proj's K splits summed inside each program, no
# workspace: the same bits) after it.
SEARCH = {"qkv_split_k": [1, 2, 4], "prenorm": [False, True], "o_inline": [False, True],
          "down_inline": [False, True], **SEARCH}


def build_depth() -> DepthDecoder:
    torch.manual_seed(0)
    with torch.device("cuda"):
        depth = DepthDecoder(BreezeConfig.full().depth)
    return random_bf16_packed(depth)


def frame_ms(depth: DepthDecoder, fn, rows: int, iters: int = 20) -> float:  # type: ignore[no-untyped-def]
    """Median ms of one captured frame: 16 positions of ``fn`` (run_layers' contract)."""
    x = torch.randn(rows, 2048, device="cuda", dtype=torch.bfloat16)
    cache = depth.new_cache(rows)
    positions = [torch.full((1,), p, dtype=torch.long, device="cuda") for p in range(16)]
    tables = [depth.rope.cos_sin(p.expand(rows), torch.bfloat16) for p in positions]

    def frame() -> None:
        for pos, (cos, sin) in zip(positions, tables):
            fn(x, cos, sin, cache, pos)

    return graph_ms(frame, iters)


def tune(depth: DepthDecoder, rows: int, base: Tiles,
         deadline: float) -> tuple[Tiles, float, list[dict]]:
    """``SEEDS`` then one sweep of coordinate descent from ``base``; candidates past ``deadline``
    (``time.monotonic()``) are skipped, so a bounded run still reports."""
    best = base
    tried: dict[Tiles, float] = {}

    def measure(tiles: Tiles) -> float:
        if tiles not in tried:
            try:
                fused = FusedDepthLayers(depth, max_rows=rows, tiles=tiles, warm=False)
                with torch.inference_mode():
                    tried[tiles] = frame_ms(depth, fused, rows)
            except Exception as exc:  # noqa: BLE001 - a shape the kernels or the chip refuse
                print(f"  {tiles}: {type(exc).__name__}: {str(exc)[:80]}")
                tried[tiles] = float("inf")
        return tried[tiles]

    best_ms = measure(best)
    for seed in SEEDS:  # joint moves first (``SEEDS``), each kept if it pays
        if time.monotonic() <= deadline:
            candidate = dataclasses.replace(best, **seed)
            ms = measure(candidate)
            if ms < best_ms:
                best, best_ms = candidate, ms
    for _ in range(1):  # one sweep of coordinate descent
        for name, values in SEARCH.items():
            for value in values:
                if time.monotonic() > deadline:
                    break
                candidate = dataclasses.replace(best, **{name: value})
                ms = measure(candidate)
                if ms < best_ms:
                    best, best_ms = candidate, ms
        print(f"rows {rows}: best so far {best_ms:.3f} ms {best}")
    log = [{**dataclasses.asdict(t), "frame_ms": ms} for t, ms in tried.items()]
    return best, best_ms, log


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", default="32", help="row counts to tune at, in order")
    parser.add_argument("--check-rows", default="1,16,64", help="rows to compare best/default")
    parser.add_argument("--budget-s", type=float, default=1e9,
                        help="seconds of tuning per row count (then the best so far)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    depth = build_depth()
    best_by_rows: dict[int, tuple[Tiles, float]] = {}
    log: list[dict] = []
    for rows in (int(r) for r in args.rows.split(",") if r):
        base = next((t for limit, t in TILES_BY_ROWS if rows <= limit), TILES_BY_ROWS[-1][1])
        base, best_ms, tried = tune(depth, rows, base, time.monotonic() + args.budget_s)
        best_by_rows[rows] = (base, best_ms)
        log += [{**entry, "rows": rows} for entry in tried]
    rows_ms = {}
    with torch.inference_mode():
        for rows in (int(r) for r in args.check_rows.split(",")):
            rows_ms[rows] = {
                "plain_layers": frame_ms(depth, depth.run_layers, rows),
                "one_shape": frame_ms(depth, FusedDepthLayers(depth, rows, Tiles()), rows),
                "by_rows": frame_ms(depth, FusedDepthLayers(depth, rows), rows),
                "by_rows_pdl": frame_ms(depth, FusedDepthLayers(depth, rows, pdl=True), rows),
                "by_rows_prenorm_pdl": frame_ms(depth, FusedDepthLayers(
                    depth, rows, prenorm_every_bucket(), pdl=True), rows),
            }
            if rows > 256:  # the table launches its 512-row bucket plainly in a PDL frame
                table = tuple((limit, dataclasses.replace(t, skip_pdl=False))
                              for limit, t in TILES_BY_ROWS)
                rows_ms[rows]["by_rows_pdl_every_bucket"] = frame_ms(
                    depth, FusedDepthLayers(depth, rows, table, pdl=True), rows)
            for split in (2, 4):  # the q/k/v GEMM split along K in every bucket
                table = tuple((limit, dataclasses.replace(t, qkv_split_k=split))
                              for limit, t in TILES_BY_ROWS)
                for pdl in (False, True):
                    rows_ms[rows][f"by_rows_qkv_split{split}{'_pdl' if pdl else ''}"] = frame_ms(
                        depth, FusedDepthLayers(depth, rows, table, pdl=pdl), rows)
            for tuned, (tiles, _) in best_by_rows.items():
                rows_ms[rows][f"best_at_{tuned}"] = frame_ms(
                    depth, FusedDepthLayers(depth, rows, tiles), rows)
            print(f"rows {rows}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in rows_ms[rows].items()))
    for rows, (tiles, ms) in best_by_rows.items():
        print(f"tuned at {rows} rows: {ms:.3f} ms with {tiles}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**provenance(),
                       "best": {rows: {**dataclasses.asdict(t), "frame_ms": ms}
                                for rows, (t, ms) in best_by_rows.items()},
                       "frame_ms_by_rows": rows_ms, "tried": log}, f, indent=2)


if __name__ == "__main__":
    main()
