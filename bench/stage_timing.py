"""Per-stage step times of the full-size random model on one GPU (CUDA events, graph replays).

Usage (GPU machine, repo root): ``PYTHONPATH=runtime python bench/stage_timing.py --out X.json``
Prints a table and writes JSON: for each depth-kernel mode and batch size, eager vs graph times
of one DECODE step (context 512), one DEPTH frame (15-step loop with sampling), one CODEC chunk
and text encoding. Modes: ``plain`` (graphs only), ``inductor`` (torch.compile of the depth step,
sampler and text encoder), ``fused`` (the Triton depth layers, compiled sampler), ``fused-decode``
(``fused`` plus the Triton backbone DECODE step), ``fused-first`` (``fused-decode`` with the
fused Triton text-encoder layers), ``fused-pdl`` (``fused-decode`` with programmatic dependent launch
between the fused depth kernels, ``graph.pdl``), ``fused-te-pdl`` (``fused-pdl`` with the fused
text encoder, the serving profile's kernels). ``profile``: every kernel switch of
``configs/h200-latency.toml``'s ``[graph]`` as served (the modes above leave the codec eager and
fp32); ``profile-te-eager``: the same without the fused text encoder;
``profile-te-wide-tiles``: with it up to 1024 tokens (the wide tiles past 128).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from breezert_bench.provenance import provenance
from breezert.config import EngineConfig
from breezert.constants import Stage
from breezert.runtime_setup import build_runner, load_engine_checkpoint
from cuda_bench import median_ms


MODES = {
    "plain": {"compile_depth": False, "fused_depth": False},
    "inductor": {"compile_depth": True, "fused_depth": False},
    "fused": {"compile_depth": True, "fused_depth": True},
    "fused-decode": {"compile_depth": True, "fused_depth": True, "fused_decode": True},
    "fused-first": {"compile_depth": True, "fused_depth": True, "fused_decode": True,
                    "fused_text_encoder": True},
    "fused-pdl": {"compile_depth": True, "fused_depth": True, "fused_decode": True, "pdl": True},
    "fused-te-pdl": {"compile_depth": True, "fused_depth": True, "fused_decode": True,
                     "fused_text_encoder": True, "pdl": True},
}

_PROFILE_PATH = Path(__file__).resolve().parent.parent / "configs" / "h200-latency.toml"
PROFILE = {key: value
           for key, value in EngineConfig.from_file(_PROFILE_PATH).graph.model_dump().items()
           if not key.endswith("_buckets")}
"""The serving profile's kernel switches (the buckets are this script's own)."""
MODES["profile"] = PROFILE
MODES["profile-te-eager"] = {**PROFILE, "fused_text_encoder": False}
MODES["profile-te-wide-tiles"] = {**PROFILE, "fused_text_encoder_max_tokens": 1024}


def measure(batches: list[int], mode: str, context: int,
            text_tokens: tuple[int, ...] = (32, 64, 128)) -> dict:
    # every DECODE row (two a request: CFG) holds a whole context bucket of blocks, plus spare
    # (5 Dec: 4,096 blocks stopped the 256-request row, which needs 6,400 for 384 cached tokens)
    block = 16
    blocks = max(4096, 2 * max(batches) * -(-context // block) + 64)
    cfg = EngineConfig.from_dict({
        "model": {"preset": "full", "dtype": "bfloat16", "device": "cuda"},
        "cache": {"block_size": block, "num_blocks": blocks},
        "scheduler": {"max_running_requests": max(batches), "max_model_len": 2048,
                      "max_decode_rows": 2 * max(batches), "max_depth_rows": 2 * max(batches)},
        "graph": {"enable_cuda_graphs": True, **MODES[mode], 
                  "decode_batch_buckets": batches, "decode_context_buckets": [context],
                  "depth_batch_buckets": batches, "prefill_token_buckets": [64],
                  "text_encode_buckets": list(text_tokens), "codec_buckets": batches},
    })
    ckpt = load_engine_checkpoint(cfg.model)
    start = time.monotonic()
    runner = build_runner(cfg, ckpt)
    startup = time.monotonic() - start
    rows = []
    with torch.inference_mode():
        for b in batches:
            row = {"batch": b}
            for name, stage, key in (("decode", Stage.DECODE, (b, context)),
                                     ("depth", Stage.DEPTH, (b, False)),
                                     ("depth_cfg", Stage.DEPTH, (b, True)),
                                     ("codec", Stage.CODEC, (b, 1)),
                                     ("codec16", Stage.CODEC, (b, 16))):
                st = runner.stages[stage]
                # DECODE rows hold 3/4 of the context bucket: attention reads a real context.
                extra = {"cached": 3 * context // 4} if stage is Stage.DECODE else {}
                inputs = st.example_inputs(*key, **extra)
                row[f"{name}_eager_ms"] = median_ms(lambda: st.graphs.fn(**inputs), 5)
                row[f"{name}_graph_ms"] = median_ms(lambda: st.graphs(key, inputs))
            row["frame_step_graph_ms"] = row["decode_graph_ms"] + row["depth_graph_ms"]
            if b == batches[0]:  # text encode is per token bucket, not per batch
                te = runner.stages[Stage.TEXT_ENCODE]
                for tokens in text_tokens:
                    inputs = te.example_inputs(tokens)
                    row[f"text_encode{tokens}_eager_ms"] = median_ms(lambda: te.graphs.fn(**inputs), 5)
                    row[f"text_encode{tokens}_graph_ms"] = median_ms(lambda: te.graphs(tokens, inputs))
            rows.append(row)
            print(json.dumps(row))
    warmup_stage_s = runner.warmup_stage_s
    del runner, ckpt
    torch.cuda.empty_cache()
    return {"mode": mode, **MODES[mode], "context": context, "startup_s": startup,
            "warmup_stage_s": warmup_stage_s, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", default="1,4,16,32,64")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--modes", default="plain,fused",
                        help=f"comma-separated, from {','.join(MODES)}")
    parser.add_argument("--text-tokens", default="32,64,128",
                        help="text-encoder token buckets timed (a burst of 16 sentences packs "
                             "~370 tokens into one step)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    text_tokens = tuple(int(t) for t in args.text_tokens.split(","))
    batches = [int(b) for b in args.batches.split(",")]
    modes = args.modes.split(",")
    if unknown := set(modes) - set(MODES):
        parser.error(f"unknown modes {sorted(unknown)}; choose from {', '.join(MODES)}")
    doc = {**provenance(), "runs": []}
    for mode in modes:  # one failing mode (a kernel that does not build) leaves the others
        try:
            doc["runs"].append(measure(batches, mode, args.context, text_tokens))
        except Exception as exc:  # noqa: BLE001 (recorded in the results and printed)
            print(f"mode={mode} failed: {type(exc).__name__}: {exc}")
            doc.setdefault("failed", {})[mode] = f"{type(exc).__name__}: {exc}"
            torch.cuda.empty_cache()
        if args.out:  # after every mode: a run stopped at its time limit keeps what it measured
            with open(args.out, "w") as f:
                json.dump(doc, f, indent=2)
    for run in doc["runs"]:
        print(f"mode={run['mode']} start-up {run['startup_s']:.1f} s "
              f"{run['warmup_stage_s']}")
        print("batch | decode eager/graph | depth eager/graph | depth+cfg | codec 1f/16f | frame")
        for r in run["rows"]:
            print(f"{r['batch']:5d} | {r['decode_eager_ms']:6.2f} / {r['decode_graph_ms']:6.2f} | "
                  f"{r['depth_eager_ms']:6.2f} / {r['depth_graph_ms']:6.2f} | "
                  f"{r['depth_cfg_graph_ms']:6.2f} | {r['codec_graph_ms']:5.2f} / "
                  f"{r['codec16_graph_ms']:6.2f} | {r['frame_step_graph_ms']:6.2f}")


if __name__ == "__main__":
    main()
