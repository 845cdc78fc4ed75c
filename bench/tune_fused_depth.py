"""Chooses launch shapes (``Tiles``) for the fused Triton depth layers by measuring them.

Usage (GPU machine, repo root): ``PYTHONPATH=runtime python bench/tune_fused_depth.py
[--rows 32] [--out X.json]``. Builds the full-size depth decoder with random bf16 weights,
then, by coordinate descent from ``Tiles()``, times one frame of layer steps (16 positions, no
sampling) captured in a CUDA graph for each candidate. Prints the best shapes per row count
and the frame time; ``Tiles``' defaults in kernels/fused_depth.py come from this.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from datetime import datetime, timezone

import torch

from breezert.kernels.fused_depth import FusedDepthLayers
from breezert.kernels.gemm import Tiles
from breezert.models.config import BreezeConfig
from breezert.models.depth import DepthDecoder

SEARCH = {
    "qkv_split": [1, 2, 4], "qkv_bk": [64, 128, 256], "gate_bn": [32, 64, 128],
    "gate_bk": [64, 128], "split_k": [4, 8, 16], "split_bn": [32, 64],
    "split_bk": [64, 128, 256], "num_warps": [4, 8], "num_stages": [2, 3, 4],
}


def build_depth() -> DepthDecoder:
    torch.manual_seed(0)
    with torch.device("cuda"):
        depth = DepthDecoder(BreezeConfig.full().depth)
    with torch.no_grad():
        for p in depth.parameters():
            p.normal_(0, p.shape[-1] ** -0.5)
    depth = depth.to(torch.bfloat16).eval()
    for layer in depth.model.layers:
        layer.self_attn.fuse_()
        layer.mlp.fuse_()
    return depth


def frame_ms(depth: DepthDecoder, fn, rows: int, iters: int = 20) -> float:  # type: ignore[no-untyped-def]
    """Median ms of one captured frame: 16 positions of ``fn`` (run_layers' contract)."""
    x = torch.randn(rows, 2048, device="cuda", dtype=torch.bfloat16)
    cache = depth.new_cache(rows)
    positions = [torch.full((1,), p, dtype=torch.long, device="cuda") for p in range(16)]
    tables = [depth.rope.cos_sin(p.expand(rows), torch.bfloat16) for p in positions]

    def frame() -> None:
        for pos, (cos, sin) in zip(positions, tables):
            fn(x, cos, sin, cache, pos)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        frame()
        with torch.cuda.graph(graph, stream=stream):
            frame()
    torch.cuda.current_stream().wait_stream(stream)
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def tune(depth: DepthDecoder, rows: int) -> tuple[Tiles, float, list[dict]]:
    best = Tiles()
    tried: dict[Tiles, float] = {}

    def measure(tiles: Tiles) -> float:
        if tiles not in tried:
            try:
                fused = FusedDepthLayers(depth, max_rows=rows, tiles=tiles)
                with torch.inference_mode():
                    tried[tiles] = frame_ms(depth, fused, rows)
            except Exception as exc:  # noqa: BLE001 - a shape the kernels or the chip refuse
                print(f"  {tiles}: {type(exc).__name__}: {str(exc)[:80]}")
                tried[tiles] = float("inf")
        return tried[tiles]

    best_ms = measure(best)
    for _ in range(1):  # one sweep of coordinate descent
        for name, values in SEARCH.items():
            for value in values:
                candidate = dataclasses.replace(best, **{name: value})
                ms = measure(candidate)
                if ms < best_ms:
                    best, best_ms = candidate, ms
        print(f"rows {rows}: best so far {best_ms:.3f} ms {best}")
    log = [{**dataclasses.asdict(t), "frame_ms": ms} for t, ms in tried.items()]
    return best, best_ms, log


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=32, help="rows to tune at (b16 with CFG)")
    parser.add_argument("--check-rows", default="1,16,64", help="rows to compare best/default")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    depth = build_depth()
    check = [int(r) for r in args.check_rows.split(",")]
    best, best_ms, log = tune(depth, args.rows)
    rows_ms = {}
    with torch.inference_mode():
        for rows in check:
            rows_ms[rows] = {
                "plain_layers": frame_ms(depth, depth.run_layers, rows),
                "default_tiles": frame_ms(depth, FusedDepthLayers(depth, rows), rows),
                "best_tiles": frame_ms(depth, FusedDepthLayers(depth, rows, best), rows),
            }
            print(f"rows {rows}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in rows_ms[rows].items()))
    print(f"tuned at {args.rows} rows: {best_ms:.3f} ms with {best}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "date": datetime.now(timezone.utc).isoformat(), "tuned_rows": args.rows,
                       "best": dataclasses.asdict(best), "best_ms": best_ms,
                       "frame_ms_by_rows": rows_ms, "tried": log}, f, indent=2)


if __name__ == "__main__":
    main()
