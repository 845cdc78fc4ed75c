"""Kernel census of one DEPTH frame and one DECODE step (torch.profiler), for the fast-path work;
optionally of the TEXT_ENCODE stage and a CODEC replay too.

Usage: ``PYTHONPATH=runtime python bench/profile_stages.py [--preset full] [--batch 16]
[--compile]``. Prints, per stage, the number of kernel launches, GPU busy time and the top
kernels by time — the numbers FASTPATH-NOTES §0 says to watch (launches first, bytes second).
Runs on CPU too (tiny preset), where it lists operators instead of kernels.
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from breezert.config import EngineConfig
from breezert.constants import Stage
from breezert.runtime_setup import build_runner, load_engine_checkpoint


def traced(fn, cuda: bool, warmup: int = 3):  # type: ignore[no-untyped-def]  # noqa: ANN201
    """The profiler's per-operator and per-kernel averages of one call of ``fn`` after
    ``warmup`` untraced ones (also ``bench/depth_timeline.py``'s census)."""
    for _ in range(warmup):
        fn()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    return prof.key_averages()


def census(fn, label: str, cuda: bool, top: int) -> None:  # type: ignore[no-untyped-def]
    events = traced(fn, cuda)
    if cuda:
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        launches = sum(e.count for e in kernels)
        busy_ms = sum(e.device_time_total for e in kernels) / 1000
        print(f"{label}: {launches} kernel launches, GPU busy {busy_ms:.2f} ms")
        ranked = sorted(kernels, key=lambda e: e.device_time_total, reverse=True)[:top]
        for e in ranked:
            print(f"  {e.device_time_total / 1000:8.3f} ms  x{e.count:<5d} {e.key[:90]}")
    else:
        print(f"{label}:")
        print(events.table(sort_by="cpu_time_total", row_limit=top))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", choices=["tiny", "full"], default=None)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--fused", action="store_true", help="the fused Triton depth layers")
    parser.add_argument("--fused-decode", action="store_true",
                        help="the fused Triton backbone DECODE step")
    parser.add_argument("--pdl", action="store_true",
                        help="programmatic dependent launch between the fused depth and "
                             "text-encoder kernels (graph.pdl)")
    parser.add_argument("--text-tokens", type=int, default=0,
                        help="also the TEXT_ENCODE stage for one sentence of this many tokens")
    parser.add_argument("--fused-text-encoder", action="store_true",
                        help="the fused Triton text-encoder layers")
    parser.add_argument("--fused-codec", action="store_true",
                        help="the serving codec's kernels, channels-last (graph.fused_codec; "
                             "off: the eager SnakeBeta and convolutions)")
    parser.add_argument("--codec-frames", type=int, default=0,
                        help="also one CODEC replay of this many frames per row (--batch rows)")
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    preset = args.preset or ("full" if cuda else "tiny")
    cfg = EngineConfig.from_dict({
        "model": {"preset": preset, "dtype": "bfloat16" if cuda else "float32",
                  "device": "cuda" if cuda else "cpu"},
        # the DECODE census's rows hold 3/4 of the context each
        "cache": {"block_size": 16, "num_blocks": max(4096, args.batch * (args.context // 16 + 1))},
        "scheduler": {"max_running_requests": args.batch, "max_decode_rows": 2 * args.batch,
                      "max_depth_rows": 2 * args.batch},
        # buckets up to the batch, as a profile serving it has them: the fused kernels size
        # their split-K workspace from the largest, and past it each call allocated and zeroed
        # its own (the 256-request censuses before 7 Dec: 384 fills a DEPTH frame)
        "graph": {"depth_batch_buckets": sorted({1, args.batch}),
                  "decode_batch_buckets": sorted({1, 2 * args.batch}),
                  "codec_buckets": sorted({1, args.batch}),
                  "enable_cuda_graphs": False, "compile_depth": args.compile and cuda,
                  "fused_depth": args.fused and cuda,
                  "fused_decode": args.fused_decode and cuda,
                  "fused_text_encoder": args.fused_text_encoder and cuda,
                  "pdl": args.pdl and cuda,
                  "fused_codec": args.fused_codec and cuda},
    })
    runner = build_runner(cfg, load_engine_checkpoint(cfg.model))
    depth, decode = runner.stages[Stage.DEPTH], runner.stages[Stage.DECODE]
    depth_in = depth.example_inputs(args.batch, False)
    decode_in = decode.example_inputs(args.batch, args.context, cached=3 * args.context // 4)
    with torch.inference_mode():
        if args.text_tokens:
            te = runner.stages[Stage.TEXT_ENCODE]
            te_in = te.example_inputs(args.text_tokens)
            census(lambda: te.graphs.fn(**te_in), f"TEXT_ENCODE, {args.text_tokens} tokens", cuda,
                   args.top)
        if args.codec_frames:
            codec = runner.stages[Stage.CODEC]
            codec_in = codec.example_inputs(args.batch, args.codec_frames)
            census(lambda: codec.graphs.fn(**codec_in),
                   f"CODEC step, {args.batch} rows x {args.codec_frames} frames", cuda, args.top)
        census(lambda: depth.graphs.fn(**depth_in), f"DEPTH frame, batch {args.batch}", cuda,
               args.top)
        census(lambda: decode.graphs.fn(**decode_in),
               f"DECODE step, {args.batch} rows, context {args.context}", cuda, args.top)


if __name__ == "__main__":
    main()
