"""The serving codec's precision on one GPU: waveform error against strict fp32, and step time.

Usage (GPU machine, repo root): ``PYTHONPATH=runtime python bench/codec_precision.py --out X.json``

For each precision (``fp32``: the process's default math flags, which the engine runs today;
``fp32-strict``: TF32 off for cuDNN convolutions and matmuls; ``tf32``: TF32 on for both;
``bf16`` / ``fp16``: the decoder and its streaming state in bfloat16 / float16) it
  1. streams the same random codes through the full-size random codec for 4 streams with
     chunks 1, 2, 4, 8, 16, 16, ... and reports the SNR against a strict-fp32 one-shot decode,
     plus the difference between that streamed waveform and the same precision's one-shot
     decode (any chunking must give the one-shot waveform);
  2. times one graph replay of a decode step per (streams, frames) shape with CUDA events, and
     reports ms per step, ms per frame and the achieved TFLOP/s (5.0 GFLOP per frame, counted
     with torch's FLOP counter on this decoder).
Prints one line per measurement and writes JSON with the GPU, torch version, commit and date.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json

import torch

from breezert.models.codec import HALF_PRECISION_DTYPES, StreamingCodec, tf32_math
from breezert.random_init import build_random
from breezert_bench.provenance import provenance

PRECISIONS = ("fp32", "fp32-strict", "tf32", "bf16", "fp16", "tf32-fast", "bf16-fast",
              "fp16-fast")
"""``-fast``: the serving kernels (``graph.fused_codec``: SnakeBeta fused with each conv's
history, codebook tables, the upsamplers as GEMMs, activations and convs channels-last)."""
SHAPES = ((1, 1), (16, 1), (64, 1), (256, 1), (16, 4), (64, 4), (16, 16), (32, 16))
SLOTS = max(streams for streams, _ in SHAPES)
"""The codec arena's slots: every timed shape's streams get their own (a slot past the arena
reads out of bounds: 5 Dec's run died on a device-side assert at 256 streams with 65 slots)."""
GFLOP_PER_FRAME = 5.0


def math_flags(precision: str) -> contextlib.AbstractContextManager[None]:
    """TF32 on (``tf32``) or off (``fp32-strict``) while the block runs; others: as set."""
    return tf32_math({"fp32-strict": False, "tf32": True}.get(precision))


def make_codec(base: torch.nn.Module, precision: str, slots: int) -> StreamingCodec:
    if precision.endswith("-fast"):  # on its own copy: the fast codec restrides the conv weights
        return StreamingCodec.for_serving(copy.deepcopy(base), slots,
                                          precision.removesuffix("-fast"), fast=True)
    dtype = HALF_PRECISION_DTYPES.get(precision, torch.float32)
    decoder = copy.deepcopy(base).to(dtype) if dtype != torch.float32 else base
    return StreamingCodec(decoder, slots, device="cuda", dtype=dtype)


def decode(codec: StreamingCodec, precision: str, slots: torch.Tensor,
           codes: torch.Tensor) -> torch.Tensor:
    with math_flags(precision), torch.inference_mode():
        return codec.decode(slots, codes).float()


def streamed(codec: StreamingCodec, precision: str, codes: torch.Tensor) -> torch.Tensor:
    """``codes [B, F, 16]`` decoded in chunks 1, 2, 4, 8, 16, 16, ... -> ``[B, F * 1920]``."""
    slots = torch.arange(codes.shape[0], device="cuda")
    codec.reset(slots)
    pieces, start, size = [], 0, 1
    while start < codes.shape[1]:
        pieces.append(decode(codec, precision, slots, codes[:, start:start + size]))
        start += size
        size = min(size * 2, 16)
    return torch.cat(pieces, dim=1)


def snr_db(ref: torch.Tensor, x: torch.Tensor) -> float:
    noise = (x - ref).double().pow(2).sum()
    return float(10 * torch.log10(ref.double().pow(2).sum() / noise.clamp_min(1e-30)))


def time_step(codec: StreamingCodec, precision: str, streams: int, frames: int) -> float:
    """Median ms of one graph replay of a ``streams x frames`` decode step."""
    slots = torch.arange(streams, device="cuda")
    codes = torch.randint(0, 2048, (streams, frames, 16), device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # warm up kernels and cuDNN's algorithm choice before capture
            decode(codec, precision, slots, codes)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode(codec, precision, slots, codes)
    times = []
    for _ in range(20):
        codec.reset(slots)  # positions stay inside the sliding window
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def measure(base: torch.nn.Module, precision: str, codes: torch.Tensor,
            ref: torch.Tensor) -> dict:
    slots_all = torch.arange(codes.shape[0], device="cuda")
    codec = make_codec(base, precision, SLOTS)
    stream_wav = streamed(codec, precision, codes)
    codec.reset(slots_all)
    whole = decode(codec, precision, slots_all, codes)
    entry = {
        "snr_db_vs_fp32_strict": snr_db(ref, stream_wav),
        "max_abs_err_vs_fp32_strict": float((stream_wav - ref).abs().max()),
        "max_abs_streamed_vs_one_shot": float((stream_wav - whole).abs().max()),
        "steps": [],
    }
    for streams, frames in SHAPES:
        ms = time_step(codec, precision, streams, frames)
        n = streams * frames
        entry["steps"].append({"streams": streams, "frames": frames, "ms": ms,
                               "ms_per_frame": ms / n,
                               "tflops": GFLOP_PER_FRAME * n / ms})
        print(f"{precision:12s} {streams:3d}x{frames:<3d} {ms:7.2f} ms  "
              f"{ms / n:6.3f} ms/frame  {GFLOP_PER_FRAME * n / ms:6.1f} TFLOP/s", flush=True)
    print(f"{precision:12s} SNR {entry['snr_db_vs_fp32_strict']:.1f} dB vs strict fp32, "
          f"max err {entry['max_abs_err_vs_fp32_strict']:.2e}, streamed vs one-shot "
          f"{entry['max_abs_streamed_vs_one_shot']:.2e}", flush=True)
    return entry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--frames", type=int, default=64, help="frames per stream for the SNR")
    parser.add_argument("--precisions", default=",".join(PRECISIONS),
                        help=f"comma list of {', '.join(PRECISIONS)}")
    args = parser.parse_args()
    precisions = args.precisions.split(",")
    if unknown := set(precisions) - set(PRECISIONS):
        parser.error(f"unknown precisions {sorted(unknown)}; choose from {', '.join(PRECISIONS)}")
    _, _, base = build_random("full", seed=0, device="cuda")
    generator = torch.Generator(device="cpu").manual_seed(1)
    codes = torch.randint(0, 2048, (4, args.frames, 16), generator=generator).cuda()
    slots_all = torch.arange(4, device="cuda")
    strict = make_codec(base, "fp32-strict", SLOTS)
    strict.reset(slots_all)
    ref = decode(strict, "fp32-strict", slots_all, codes)  # one-shot strict fp32
    results: dict = {"precisions": {}}
    for precision in precisions:
        try:
            results["precisions"][precision] = measure(base, precision, codes, ref)
        except Exception as exc:  # noqa: BLE001 - report it and go on with the next precision
            print(f"{precision:12s} FAILED: {type(exc).__name__}: {exc}", flush=True)
            results["precisions"][precision] = {"error": f"{type(exc).__name__}: {exc}"}
        torch.cuda.empty_cache()
        with open(args.out, "w") as f:  # after each precision: a run cut short keeps the rest
            json.dump(results, f, indent=2)
    results["metadata"] = provenance(**{
        "default_flags": {"cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
                          "matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32},
        "snr_frames": args.frames, "gflop_per_frame": GFLOP_PER_FRAME,
    })
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
