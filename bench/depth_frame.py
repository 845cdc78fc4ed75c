"""The depth frame as the DEPTH stage runs it: the fused step loop (fused Triton layers, PDL, the
fused sampler: ~1,200 launches) through ``stages.depth.depth_frames`` in a CUDA graph, CFG rows,
on the full-size depth decoder with random bf16 weights.

    python bench/depth_frame.py --batches 1,16,64,128,256 --out depth-frame.json

Per batch (requests; 2 rows each with CFG): graph replay ms (median), and a census of one eager
frame (kernel launches and GPU busy ms from torch.profiler), the bytes a frame must read (each
weight once per position) and what that is in TB/s and TFLOP/s at the replay time. Writes JSON
(and a PNG beside it). (The persistent frame it was measured against, 4-5 Dec, is at commit
376e92c; the streamed Gluon frame's ``--streamed`` at commit d507041.)
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from breezert.kernels.fused_depth import FusedDepthLayers  # noqa: E402
from breezert.kernels.fused_sampling import fused_sample  # noqa: E402
from breezert.models.config import BreezeConfig  # noqa: E402
from breezert.models.depth import DepthDecoder  # noqa: E402
from breezert.stages.depth import TOP_K_BOUND, depth_frames  # noqa: E402
from breezert_bench.provenance import provenance  # noqa: E402
from cuda_bench import median_ms, random_bf16_packed  # noqa: E402

def stand_in_model(depth: DepthDecoder, backbone_hidden: int) -> SimpleNamespace:
    """What ``depth_frames`` reads of a ``BreezeModel``: the first code's fp32 head, the
    codebook count and the depth decoder."""
    lm_head = torch.randn(2052, backbone_hidden, device="cuda") * backbone_hidden ** -0.5
    return SimpleNamespace(first_code_logits=lambda h: h.float() @ lm_head.T,
                           cfg=SimpleNamespace(num_codebooks=16), depth_decoder=depth)


def inputs(batch: int, backbone_hidden: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(batch)
    return {
        "hidden": torch.randn(2 * batch, backbone_hidden, device="cuda", generator=gen)
        .to(torch.bfloat16),
        "has_cfg": torch.ones(batch, dtype=torch.bool, device="cuda"),
        "cfg_scale": torch.full((batch,), 2.0, device="cuda"),
        "seen": torch.zeros(batch, 2052, dtype=torch.bool, device="cuda"),
        "penalty": torch.full((batch,), 1.1, device="cuda"),
        "no_eos": torch.ones(batch, dtype=torch.bool, device="cuda"),
        "sampling": torch.tensor([[0.9, 50, 1.0, 0.9, 50, 1.0]], device="cuda").repeat(batch, 1),
        "seeds": torch.arange(batch, device="cuda"),
        "frames_at": torch.arange(batch, device="cuda") + 5,
    }


def graph_ms(fn, args: dict[str, torch.Tensor]) -> float:
    """Median ms of ``fn(**args)`` replayed from a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn(**args)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(**args)
    return median_ms(graph.replay, iters=30, warmup=5)


def census(fn, args: dict[str, torch.Tensor]) -> dict[str, float]:
    """Kernel launches and GPU busy ms of one eager frame."""
    from torch.profiler import ProfilerActivity, profile

    fn(**args)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(**args)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy_us = sum(e.device_time for e in kernels)
    return {"launches": len(kernels), "gpu_busy_ms": round(busy_us / 1e3, 3)}


def frame_bytes_flops(depth: DepthDecoder, rows: int) -> tuple[float, float]:
    """Bytes a frame must read (every depth weight once per position, the head once per
    codebook) and its FLOPs at ``rows`` rows."""
    c = depth.cfg
    per_layer = (c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
                 + c.num_heads * c.head_dim * c.hidden_size
                 + 3 * c.hidden_size * c.intermediate_size)
    proj = c.backbone_hidden_size * c.hidden_size
    head = c.hidden_size * c.vocab_size
    params_pos = c.num_layers * per_layer + proj
    weights = 16 * params_pos + 15 * head
    return 2.0 * weights, 2.0 * rows * weights


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batches", default="1,16,64,128,256")
    ap.add_argument("--out", default="depth-frame.json")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    torch.manual_seed(0)
    cfg = BreezeConfig.full().depth
    with torch.device("cuda"):
        depth = random_bf16_packed(DepthDecoder(cfg))
    model = stand_in_model(depth, cfg.backbone_hidden_size)
    rows_out: list[dict] = []
    depth.run_layers = FusedDepthLayers(depth, 2 * max(batches), pdl=True)
    loop = partial(depth_frames, model, max_k=TOP_K_BOUND, sampler=fused_sample)
    for batch in batches:
        a = inputs(batch, cfg.backbone_hidden_size)
        ms = graph_ms(loop, a)
        nbytes, flops = frame_bytes_flops(depth, 2 * batch)
        row = {"path": "fused-loop", "batch": batch, "rows": 2 * batch,
               "graph_ms": round(ms, 3), **census(loop, a), "bytes_gb": round(nbytes / 1e9, 3),
               "tb_per_s": round(nbytes / ms / 1e9, 3), "tflop_per_s": round(flops / ms / 1e9, 1)}
        rows_out.append(row)
        print(json.dumps(row), flush=True)
    meta = provenance(script="bench/depth_frame.py", batches=batches)
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows_out}, indent=1))
    print("\npath | batch | graph ms | launches | busy ms | TB/s | TFLOP/s")
    for r in rows_out:
        print(f"{r['path']:22s} | {r['batch']:4d} | {r['graph_ms']:7.3f} | {r['launches']:5d} | "
              f"{r['gpu_busy_ms']:7.3f} | {r['tb_per_s']:5.2f} | {r['tflop_per_s']:6.1f}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for path in sorted({r["path"] for r in rows_out}):
            pts = [(r["batch"], r["graph_ms"]) for r in rows_out if r["path"] == path]
            ax.plot(*zip(*pts), marker="o", label=path)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("requests (2 rows each, CFG)")
        ax.set_ylabel("depth frame, graph replay ms")
        ax.set_title(f"depth frame: {meta.get('gpu')}, torch {meta.get('torch_version')}, "
                     f"{meta['git_commit']}", fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.savefig(Path(args.out).with_suffix(".png"), dpi=120, bbox_inches="tight")
    except ImportError:
        print("matplotlib missing: no plot")


if __name__ == "__main__":
    main()
