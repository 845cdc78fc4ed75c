"""Where the persistent depth frame's time goes: its grid barriers against its work.

    python bench/depth_anatomy.py --rows 2,32,128 --out depth-anatomy.json

One launch of ``kernels/persistent_depth._frame_kernel`` over a whole frame (full-size depth
decoder, random bf16 weights), timed by CUDA events (median of 20), four ways:

- ``barriers``: zero rows, so every phase has no work item: the 1,008 grid barriers alone;
- ``frame``: the kernel as it serves (work and barriers);
- ``no-barrier``: the same work with the barriers compiled out (programs race through the
  phases, so its codes are wrong: a timing of the work alone, never a result);
- the same at other program counts (``--programs``; racing programs beyond one wave read
  workspaces that other programs are writing: 264 programs ended in an illegal address).

``frame - no-barrier`` against ``barriers`` says whether the waits or the work miss the weight-
read floor. Writes JSON; prints a table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import breezert.kernels.persistent_depth as pd  # noqa: E402
from breezert.models.config import BreezeConfig  # noqa: E402
from breezert.models.depth import DepthDecoder  # noqa: E402
from breezert_bench.provenance import provenance  # noqa: E402
from cuda_bench import median_ms, random_bf16_packed  # noqa: E402
from depth_frame import frame_bytes_flops  # noqa: E402


class _NoBarrier:
    """Stands in for ``_frame_kernel`` so that its launch compiles the barriers out (and is
    not cooperative): the module's own launch code runs unchanged."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            kwargs["BARRIER"] = False
            kwargs.pop("launch_cooperative_grid", None)
            return self.kernel[grid](*args, **kwargs)
        return launch


def frame_inputs(rows: int, backbone_hidden: int) -> tuple:
    batch = rows // 2
    gen = torch.Generator(device="cuda").manual_seed(rows)
    hidden = torch.randn(rows, backbone_hidden, device="cuda", generator=gen).to(torch.bfloat16)
    return (hidden, torch.zeros(batch, dtype=torch.long, device="cuda"),
            torch.ones(batch, dtype=torch.bool, device="cuda"),
            torch.full((batch,), 2.0, device="cuda"),
            torch.tensor([[0.9, 50, 1.0]], device="cuda").repeat(batch, 1),
            torch.arange(batch, device="cuda"), torch.arange(batch, device="cuda") + 5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", default="2,32,128")
    ap.add_argument("--programs", default="132", help="program counts to time (a cooperative "
                    "grid must be co-resident: 264 is not, at 8 warps)")
    ap.add_argument("--out", default="depth-anatomy.json")
    args = ap.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    torch.manual_seed(0)
    cfg = BreezeConfig.full().depth
    with torch.device("cuda"):
        depth = random_bf16_packed(DepthDecoder(cfg))
    real = pd._frame_kernel
    out = []
    phases = 0
    for programs in [int(p) for p in args.programs.split(",")]:
        frame = pd.PersistentDepthFrame(depth, max(rows_list), programs=programs)
        phases = frame.phases
        for rows in [0] + rows_list:
            x = frame_inputs(rows, cfg.backbone_hidden_size)
            modes = ["barriers"] if rows == 0 else ["frame", "no-barrier"]
            for mode in modes:
                pd._frame_kernel = _NoBarrier(real) if mode == "no-barrier" else real
                try:
                    ms = median_ms(lambda: frame(*x), iters=20, warmup=3)
                except Exception as exc:  # a grid that cannot be co-resident
                    print(f"programs={programs} rows={rows} {mode}: {exc!r}"[:300], flush=True)
                    continue
                finally:
                    pd._frame_kernel = real
                    frame.counters.zero_()  # racing split-K tiles may leave counts behind
                nbytes, _ = frame_bytes_flops(depth, max(rows, 1))
                row = {"programs": programs, "rows": rows, "mode": mode, "ms": round(ms, 3),
                       "us_per_phase": round(1e3 * ms / frame.phases, 2),
                       "tb_per_s": round(nbytes / ms / 1e9, 3) if rows else None}
                out.append(row)
                print(json.dumps(row), flush=True)
        del frame
        torch.cuda.empty_cache()
    meta = provenance(script="bench/depth_anatomy.py", phases=phases, tiles=str(pd.FrameTiles()))
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": out}, indent=1))
    print("\nprograms | rows | mode | ms | us/phase | TB/s")
    for r in out:
        print(f"{r['programs']:4d} | {r['rows']:4d} | {r['mode']:10s} | {r['ms']:7.3f} | "
              f"{r['us_per_phase']:6.2f} | {r['tb_per_s']}")


if __name__ == "__main__":
    main()
