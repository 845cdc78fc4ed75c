"""The depth frame's timeline at 1 / 16 / 64 / 128 / 256 requests (issue 30, deliverable 3).

Usage (GPU machine, repo root): ``PYTHONPATH=runtime:bench python bench/depth_timeline.py
--out X.json`` (also X.png). For each request count, the DEPTH frame as served (the graph
switches of ``--profile``, CFG on: two rows a request) is timed as a CUDA-graph replay (CUDA
events, median) and traced once without the graph (torch.profiler: kernel launches, GPU busy,
the layers' share). Beside each: the bytes a frame must read and the FLOPs it must do (16 layer
passes, 15 fp32 codebook heads, the input projector; from the model's config), the achieved
TB/s and TFLOP/s, and the frame's floor on this device (whichever of the two limits binds).
``--fused-draw``: the same frame with ``graph.fused_depth_draw`` on, side by side in the run.
Runs on CPU too (tiny preset, wall-clock time, operators instead of kernels): a smoke test.
Must not: change what it times (the profile's switches come from the file as served).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from breezert.config import EngineConfig
from breezert.constants import Stage
from breezert.models.config import DepthConfig
from breezert.runtime_setup import build_runner, load_engine_checkpoint
from breezert_bench.provenance import provenance
from profile_stages import traced

PEAKS = {"H200": (4.8e12, 989e12), "H100": (3.35e12, 989e12)}
"""Device name fragment -> (HBM bytes/s, dense bf16 FLOP/s): the SXM parts' data-sheet peaks."""

LAYER_KERNELS = ("norm_gate_up_kernel", "linear_residual_kernel", "_norm_qkv_rope_kernel",
                 "_short_attention_kernel", "rms_norm_rows_kernel")
"""Name fragments of the fused layer kernels (the rest of a frame: heads, sampler, glue)."""


def frame_work(cfg: DepthConfig, rows: int) -> dict[str, float]:
    """What one frame of ``rows`` rows must read and compute: every layer's bf16 weights once
    per position (16 positions), the fp32 codebook head once per depth code (15), the bf16
    input projector once; and the frame cache's K/V (each slot written once, read by every
    later position). The rows' activations (a few MB a frame) are left out."""
    d, i, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    qkv = d * (cfg.num_heads + 2 * cfg.num_kv_heads) * hd
    layer = qkv + cfg.num_heads * hd * d + 2 * d * i + i * d  # q/k/v, o, gate/up, down
    positions, heads = cfg.num_codebooks, cfg.num_codebooks - 1
    head = d * cfg.vocab_size
    projector = cfg.backbone_hidden_size * d
    weight_bytes = cfg.num_layers * layer * 2 * positions + head * 4 * heads + projector * 2
    # K/V: each position writes its slot, attention reads slots 0..p (bf16)
    kv_slot = cfg.num_layers * 2 * cfg.num_kv_heads * hd * 2
    kv_bytes = rows * kv_slot * (positions + positions * (positions + 1) / 2)
    flops = 2 * rows * (cfg.num_layers * layer * positions + head * heads + projector)
    return {"weight_bytes": weight_bytes, "kv_bytes": kv_bytes,
            "bytes": weight_bytes + kv_bytes, "flops": flops}


def peaks(device: torch.device) -> tuple[float, float] | None:
    """(bytes/s, FLOP/s) of this device from ``PEAKS``, or None (CPU, unknown GPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((p for key, p in PEAKS.items() if key in name), None)


def census(fn, cuda: bool) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """Launches, GPU busy and the layer kernels' share of one untraced call of ``fn``."""
    events = traced(fn, cuda, warmup=2)
    if not cuda:
        ops = [e for e in events if e.key.startswith("aten::")]
        return {"operators": sum(e.count for e in ops)}
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    layer = [e for e in kernels if any(k in e.key for k in LAYER_KERNELS)]
    top = sorted(kernels, key=lambda e: e.device_time_total, reverse=True)[:8]
    return {"launches": sum(e.count for e in kernels),
            "busy_ms": sum(e.device_time_total for e in kernels) / 1000,
            "layer_launches": sum(e.count for e in layer),
            "layer_busy_ms": sum(e.device_time_total for e in layer) / 1000,
            "top": [{"kernel": e.key[:80], "count": e.count,
                     "ms": e.device_time_total / 1000} for e in top]}


def time_ms(fn, cuda: bool, iters: int = 20) -> float:  # type: ignore[no-untyped-def]
    """Median ms of ``fn()`` (CUDA events on the GPU, wall clock on the CPU)."""
    if cuda:
        from cuda_bench import median_ms

        return median_ms(fn, iters)
    times = []
    for _ in range(max(3, iters // 4)):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return sorted(times)[len(times) // 2]


def engine_config(profile_path: Path, requests: list[int], cuda: bool,
                  **overrides: Any) -> EngineConfig:
    """The profile's kernel switches (then ``overrides``), depth buckets at ``requests``, every
    other stage at its smallest (this script times the depth frame only)."""
    switches = {key: value
                for key, value in EngineConfig.from_file(profile_path).graph.model_dump().items()
                if not key.endswith("_buckets")}
    switches.update(overrides)
    if not cuda:  # the GPU kernels' switches mean nothing on the CPU: the eager path
        switches = {"enable_cuda_graphs": False}
    top = max(requests)
    return EngineConfig.from_dict({
        "model": {"preset": "full" if cuda else "tiny",
                  "dtype": "bfloat16" if cuda else "float32", "device": "cuda" if cuda else "cpu"},
        "cache": {"block_size": 16, "num_blocks": 4096},
        "scheduler": {"max_running_requests": top, "max_depth_rows": 2 * top,
                      "max_decode_rows": 2 * top, "max_model_len": 2048},
        "graph": {**switches, "depth_batch_buckets": requests, "decode_batch_buckets": [2 * top],
                  "decode_context_buckets": [256], "prefill_token_buckets": [64],
                  "text_encode_buckets": [32], "codec_buckets": [1]},
    })


def measure(cfg: EngineConfig, requests: list[int], label: str) -> dict[str, Any]:
    """The timeline of every request count on one runner built from ``cfg``."""
    cuda = cfg.model.device == "cuda"
    ckpt = load_engine_checkpoint(cfg.model)
    start = time.monotonic()
    runner = build_runner(cfg, ckpt)
    startup = time.monotonic() - start
    depth = runner.stages[Stage.DEPTH]
    model_cfg = runner.ckpt.model.cfg.depth
    limits = peaks(torch.device(cfg.model.device))
    graphed = cuda and cfg.graph.enable_cuda_graphs
    rows_out = []
    with torch.inference_mode():
        for n in requests:
            key, inputs = (n, True), depth.example_inputs(n, True)
            ms = time_ms((lambda: depth.graphs(key, inputs)) if graphed
                         else (lambda: depth.graphs.fn(**inputs)), cuda)
            work = frame_work(model_cfg, 2 * n)
            row = {"requests": n, "rows": 2 * n, "frame_ms": ms, **work,
                   "tb_per_s": work["bytes"] / ms / 1e9,
                   "tflop_per_s": work["flops"] / ms / 1e9,
                   **census(lambda: depth.graphs.fn(**inputs), cuda)}
            if limits is not None:
                read_ms, compute_ms = (1000 * work["bytes"] / limits[0],
                                       1000 * work["flops"] / limits[1])
                floor_ms = max(read_ms, compute_ms)
                row.update(floor_ms=floor_ms, of_floor=floor_ms / ms,
                           bound="bytes" if read_ms > compute_ms else "flops")
            rows_out.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "top"}), flush=True)
    del runner, ckpt
    if cuda:
        torch.cuda.empty_cache()
    return {"label": label, "startup_s": startup, "peaks": limits, "rows": rows_out}


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_ms, ax_rate) = plt.subplots(1, 2, figsize=(11, 4.2))
    for run, style in zip(runs, ("o-", "s--", "^-."), strict=False):
        rows = run["rows"]
        req = [r["requests"] for r in rows]
        ax_ms.plot(req, [r["frame_ms"] for r in rows], style, label=run["label"])
        ax_rate.plot(req, [r["tb_per_s"] for r in rows], style, label=f"{run['label']}: TB/s")
        ax_rate.plot(req, [r["tflop_per_s"] / 100 for r in rows], style, alpha=0.5,
                     label=f"{run['label']}: TFLOP/s / 100")
    rows = runs[0]["rows"]
    if all("floor_ms" in r for r in rows):
        ax_ms.plot([r["requests"] for r in rows], [r["floor_ms"] for r in rows], "k:",
                   label="floor (bytes or FLOPs)")
    for ax in (ax_ms, ax_rate):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("requests (CFG: 2 rows each)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax_ms.set_ylabel("depth frame, ms (graph replay)")
    ax_rate.set_ylabel("achieved")
    fig.suptitle("Depth frame timeline")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", default="1,16,64,128,256")
    parser.add_argument("--profile", type=Path,
                        default=Path(__file__).resolve().parent.parent / "configs"
                        / "h200-capacity.toml")
    parser.add_argument("--fused-draw", action="store_true",
                        help="also the frame with graph.fused_depth_draw on (CUDA), side by side")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    requests = sorted({int(r) for r in args.requests.split(",")})
    cuda = torch.cuda.is_available()
    plans = [("served", {})]
    if args.fused_draw and cuda:
        plans.append(("fused depth draw", {"fused_depth_draw": True}))
    doc: dict[str, Any] = {**provenance(), "profile": str(args.profile), "runs": []}
    for label, overrides in plans:
        cfg = engine_config(args.profile, requests, cuda, **overrides)
        doc["runs"].append(measure(cfg, requests, label))
        if args.out:  # after every run: a timeout keeps what was measured
            args.out.write_text(json.dumps(doc, indent=2))
    if args.out:
        plot(doc["runs"], args.out.with_suffix(".png"))
    for run in doc["runs"]:
        print(f"{run['label']}: start-up {run['startup_s']:.1f} s")
        for r in run["rows"]:
            extra = (f" | floor {r['floor_ms']:.2f} ms ({100 * r['of_floor']:.0f} %, "
                     f"{r['bound']})" if "floor_ms" in r else "")
            print(f"  {r['requests']:4d} req: {r['frame_ms']:7.2f} ms, {r.get('launches', '-')} "
                  f"launches, {r['tb_per_s']:.2f} TB/s, {r['tflop_per_s']:.0f} TFLOP/s{extra}")


if __name__ == "__main__":
    main()
