"""The DECODE step's attention alone, at capacity's rows and contexts, against its K/V read.

Usage (GPU machine, repo root): ``PYTHONPATH=runtime:bench python bench/decode_attention_ab.py
[--rows 64,256,512] [--contexts 256,512,1024,2048] [--variants 32/128/4,64/256/8,...]
[--out X.json]``. On a CPU (``TRITON_INTERPRET=1``, small ``--heads/--kv-heads/--head-dim``)
it checks the variants and times nothing; ``--compile-only`` builds each one for sm_90a here
(no GPU) and prints its registers, shared memory and spills.

Why: 6 Dec's H100 runs put the DECODE attention kernel (then an elementwise one) at 8.9 of a
256-row DECODE step's 16.3 ms at 512 tokens (kernel census), twice the time its K/V read takes at
the card's bandwidth, and a 256-row step at >1k-token contexts at 48.9 ms (``bench/README.md``,
"H100, 6 Dec (second session)"). One layer's attention (the kernel plus its split combine, as
``FusedBackboneDecode`` launches them: ``fused_decode.decode_attention``) runs here on a paged
cache of the backbone's shape (8 KV heads, 16 query heads, head_dim 128, 16-token blocks in
shuffled order), every row's cached length drawn between half the context and all of it, for
each variant ``dot:BT/SPLIT_TOKENS/WARPS/STAGES`` of the served kernel (tokens per tile, tokens
per split program, warps, the tile loop's pipeline depth; served: ``dot:64/256/4/3``, both
products on tensor cores, the G query heads of a KV head padded to 16 rows) and
``BT/SPLIT_TOKENS/WARPS``, the elementwise kernel it replaced (the "before": its tile step below,
products on CUDA cores reduced across the threads, in the served kernel's program; served as
``32/128/4``, always run). Per variant and shape: the median time (CUDA events), the K/V bytes it
must read, their rate (GB/s) and, for the whole step, x28 layers; the output's largest
difference from an fp32 torch reference of the same attention (QK-norm, RoPE, softmax over the
cached tokens and the new one; up to 64 x 2048 row-tokens) beside the served variant's, and from
the served variant's output at every shape. A variant whose difference passes twice the served
one's plus 1e-3 is marked wrong (exit 1). Writes JSON + PNG with the GPU, torch version, commit
and date.

Owns the elementwise tile step (the "before") and nothing the runtime uses; a winning shape
becomes ``fused_decode``'s ``ATTENTION_TILE`` / ``SPLIT_TOKENS`` / ``ATTENTION_WARPS`` /
``ATTENTION_STAGES`` only after the GPU tests pass with it served.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl

from breezert.kernels import fused_decode as fd
from breezert.kernels.gemm import bf16
from breezert_bench.provenance import provenance

SERVING = (f"dot:{fd.ATTENTION_TILE}/{fd.SPLIT_TOKENS}/{fd.ATTENTION_WARPS}/"
           f"{fd.ATTENTION_STAGES}")
BEFORE = "32/128/4"  # the elementwise kernel as it was served
DEFAULT_VARIANTS = (SERVING, BEFORE, "dot:64/128/4/3", "dot:128/256/8/3", "dot:64/512/4/4")
BLOCK = 16  # tokens a cache block (paged KV)
LAYERS = 28  # the backbone's layers: a DECODE step runs this attention once each


def parse_variant(text: str) -> tuple[str, int, int, int, int | None]:
    """``"dot:BT/SPLIT/WARPS/STAGES"`` (the served kernel) or ``"BT/SPLIT/WARPS"`` (the
    elementwise one it replaced) -> (kernel, BT, SPLIT, WARPS, STAGES; None for the elementwise
    kernel, its loop as it was served); raises ValueError for shapes the kernels cannot take."""
    kernel, _, shape = text.rpartition(":")
    kernel = kernel or "elementwise"
    try:
        values = [int(v) for v in shape.split("/")]
    except ValueError:
        values = []
    want = 4 if kernel == "dot" else 3
    if kernel not in ("elementwise", "dot") or len(values) != want:
        raise ValueError(f"variant {text!r}: expected dot:BT/SPLIT_TOKENS/WARPS/STAGES (e.g. "
                         "dot:64/256/4/3) or BT/SPLIT_TOKENS/WARPS (e.g. 32/128/4)")
    bt, split, warps = values[:3]
    stages = values[3] if kernel == "dot" else None
    if (bt & (bt - 1) or split % bt or warps not in (1, 2, 4, 8, 16)
            or not 1 <= (stages or 1) <= 6 or (kernel == "dot" and bt < 16)):
        raise ValueError(f"variant {text!r}: BT a power of two (>= 16 for dot), SPLIT a multiple "
                         "of it, WARPS in 1..16, STAGES in 1..6")
    return kernel, bt, split, warps, stages


@triton.jit
def _attend_tile_elementwise(q_lo, q_hi, m, total, acc_lo, acc_hi, kv_ptr, read_ptr, step,
                             cached, c_kv, c_row, c_head, g, scale, D: tl.constexpr,
                             BT: tl.constexpr):
    """The "before": ``fused_decode._attend_tile``'s step as it was served until the tensor-core
    one replaced it, both products on CUDA cores (broadcast multiplies summed across the
    threads) over the G unpadded query rows."""
    HALF: tl.constexpr = D // 2
    d = tl.arange(0, HALF)
    t = step * BT + tl.arange(0, BT)
    live = t < cached
    rows = tl.load(read_ptr + t, mask=live, other=0)
    key = kv_ptr + rows[:, None] * c_row + g * c_head + d[None, :]
    kt_lo = tl.load(key, mask=live[:, None], other=0.0).to(tl.float32)  # [BT, HALF]
    kt_hi = tl.load(key + HALF, mask=live[:, None], other=0.0).to(tl.float32)
    s = (tl.sum(q_lo[:, None, :] * kt_lo[None, :, :], axis=2)
         + tl.sum(q_hi[:, None, :] * kt_hi[None, :, :], axis=2)) * scale  # [G, BT]
    s = tl.where(live[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(s - m_new[:, None])
    total = total * alpha + tl.sum(p, axis=1)
    p = bf16(p)  # as flash attention rounds P for P @ V
    vt_lo = tl.load(key + c_kv, mask=live[:, None], other=0.0).to(tl.float32)
    vt_hi = tl.load(key + c_kv + HALF, mask=live[:, None], other=0.0).to(tl.float32)
    acc_lo = acc_lo * alpha[:, None] + tl.sum(p[:, :, None] * vt_lo[None, :, :], axis=1)
    acc_hi = acc_hi * alpha[:, None] + tl.sum(p[:, :, None] * vt_hi[None, :, :], axis=1)
    return m_new, total, acc_lo, acc_hi


class Case:
    """One layer's inputs: ``rows`` rows whose cached lengths lie in [context/2, context)."""

    def __init__(self, rows: int, context: int, heads: int, kv_heads: int, head_dim: int,
                 device: str, seed: int = 0) -> None:
        seed = seed * 1_000_003 + rows * 7919 + context  # one case, one draw
        g = torch.Generator(device="cpu").manual_seed(seed)
        self.rows, self.context = rows, context
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        blocks_a_row = context // BLOCK
        total_blocks = rows * blocks_a_row + (rows + BLOCK - 1) // BLOCK
        order = torch.randperm(total_blocks, generator=g)
        table = order[: rows * blocks_a_row].reshape(rows, blocks_a_row)
        tokens = torch.arange(BLOCK)
        self.read = (table[:, :, None] * BLOCK + tokens).reshape(rows, context)
        spare = order[rows * blocks_a_row:]  # the new tokens' slots, outside every row's table
        self.write = (spare[:, None] * BLOCK + tokens).reshape(-1)[:rows]
        # cached tokens in [context/2, context - 1]; the length counts the new token too
        cached = torch.randint(context // 2, context, (rows,), generator=g)
        self.lengths = cached + 1
        slots = total_blocks * BLOCK
        width = (heads + 2 * kv_heads) * head_dim
        self.qkv = torch.randn(rows, width, generator=g).to(torch.bfloat16)
        # the cache (up to ~1 M slots, 4 GB at 512 x 2048) drawn where it lives: on a GPU
        # that takes milliseconds, on this host's one thread tens of seconds
        on = torch.Generator(device=device).manual_seed(seed)
        self.kv = (torch.randn(2, slots, kv_heads, head_dim, generator=on, device=device)
                   * 0.5).to(torch.bfloat16)
        self.q_norm = (1 + 0.1 * torch.randn(head_dim, generator=g)).to(torch.bfloat16)
        self.k_norm = (1 + 0.1 * torch.randn(head_dim, generator=g)).to(torch.bfloat16)
        positions = cached.double()
        inv = 1.0 / (1e6 ** (torch.arange(0, head_dim, 2).double() / head_dim))
        freqs = positions[:, None] * inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos, self.sin = emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)
        for name in ("read", "write", "lengths", "qkv", "q_norm", "k_norm", "cos", "sin"):
            setattr(self, name, getattr(self, name).to(device))
        self.out = torch.empty(rows, heads * head_dim, dtype=torch.bfloat16, device=device)
        self.parts: dict[int, torch.Tensor] = {}  # the splits' partials, by split count

    def kv_bytes(self) -> int:
        """K and V bytes the attention must read: every row's cached tokens, every KV head."""
        cached = int((self.lengths - 1).sum())
        return cached * self.kv_heads * self.head_dim * 2 * self.kv.element_size()

    def launch(self, kernel: str, bt: int, split: int, warps: int, stages: int | None) -> None:
        """The attention and its combine, as ``FusedBackboneDecode.__call__`` launches them
        (``kernel="elementwise"``: the tile step it replaced, over unpadded query rows)."""
        splits = math.ceil(self.context / split)
        part = self.parts.get(splits)  # made once: no allocation inside a timed launch
        if part is None:
            part = self.parts[splits] = torch.empty(
                self.rows, self.kv_heads, splits, self.heads // self.kv_heads,
                self.head_dim + 2, dtype=torch.float32, device=self.qkv.device)
        before = ({"step": _attend_tile_elementwise, "min_rows": 1}
                  if kernel == "elementwise" else {})
        fd.decode_attention(
            self.qkv, self.q_norm, self.k_norm, self.cos, self.sin, self.kv, self.write,
            self.read, self.lengths, part, self.out, 1e-6, self.head_dim ** -0.5, self.heads,
            split_tokens=split, tile=bt, warps=warps, stages=stages, **before)

    def reference(self) -> torch.Tensor:
        """fp32 torch: QK-norm and RoPE of the new q and k, softmax over the row's cached keys
        and the new one, times the values -> ``[rows, heads * head_dim]``."""
        h, kvh, d = self.heads, self.kv_heads, self.head_dim
        qkv = self.qkv.float().cpu()
        cos, sin = self.cos.float().cpu(), self.sin.float().cpu()

        def norm_rope(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # [rows, n, d]
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float().cpu()
            rot = torch.cat((-x[..., d // 2:], x[..., : d // 2]), dim=-1)
            return x * cos[:, None, :] + rot * sin[:, None, :]

        q = norm_rope(qkv[:, : h * d].reshape(-1, h, d), self.q_norm)
        k_new = norm_rope(qkv[:, h * d:(h + kvh) * d].reshape(-1, kvh, d), self.k_norm)
        v_new = qkv[:, (h + kvh) * d:].reshape(-1, kvh, d)
        kv = self.kv.float().cpu()
        out = torch.empty(self.rows, h, d)
        for r in range(self.rows):
            slots = self.read[r, : int(self.lengths[r]) - 1].cpu()
            keys = torch.cat((kv[0, slots], k_new[r][None]), 0)  # [T, kvh, d]
            values = torch.cat((kv[1, slots], v_new[r][None]), 0)
            keys = keys.repeat_interleave(h // kvh, dim=1)
            values = values.repeat_interleave(h // kvh, dim=1)
            scores = torch.einsum("hd,thd->ht", q[r], keys) * d ** -0.5
            out[r] = torch.einsum("ht,thd->hd", scores.softmax(-1), values)
        return out.reshape(self.rows, h * d)


def measure(case: Case, variants: list[str], timed: bool) -> list[dict[str, Any]]:
    """Each variant's difference from the reference and from the served variant (run first,
    whether named or not) and, if ``timed``, its median ms."""
    ref = case.reference() if case.rows * case.context <= 64 * 2048 else None
    rows, outs = [], {}
    for name in [SERVING, *(v for v in variants if v != SERVING)]:
        shape = parse_variant(name)
        case.launch(*shape)
        out = outs[name] = case.out.float().cpu()
        row: dict[str, Any] = {"variant": name, "rows": case.rows, "context": case.context,
                               "kv_bytes": case.kv_bytes(),
                               "max_abs_diff_vs_serving": float((out - outs[SERVING]).abs().max())}
        if ref is not None:
            row["max_abs_diff_vs_fp32"] = float((out - ref).abs().max())
        if timed:
            from cuda_bench import median_ms
            ms = median_ms(lambda: case.launch(*shape), iters=30, warmup=5)
            row.update(ms=round(ms, 4), gb_per_s=round(case.kv_bytes() / ms / 1e6, 1),
                       step_ms_28_layers=round(ms * LAYERS, 3))
        rows.append(row)
    if ref is not None:
        bound = 2 * rows[0]["max_abs_diff_vs_fp32"] + 1e-3  # rows[0]: the served variant
        for row in rows:
            row["wrong"] = row["max_abs_diff_vs_fp32"] > bound
    return rows


def compile_only(variants: list[str], heads: int, kv_heads: int, head_dim: int
                 ) -> list[dict[str, Any]]:
    """Builds each variant's attention kernel for sm_90a here (no GPU, ``tests/sm90_build.py``'s
    stand-in driver) and says what it needs per block: registers, shared memory, spills."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.sm90_build import build_only, resources

    case = Case(2, 256, heads, kv_heads, head_dim, "cpu")  # a build needs shapes, not values
    builds = []
    for name in variants:
        with build_only(90) as built:
            case.launch(*parse_variant(name))
        r = resources(built[0], name)  # the attention (built[1] is the combine)
        row = {"variant": name, "registers": r.registers, "shared_bytes": r.shared_bytes,
               "local_bytes": r.local_bytes, "stack_bytes": r.stack_bytes,
               "num_warps": r.num_warps, "num_stages": r.num_stages, "problems": r.problems(),
               "mma": sum(built[0].asm["ptx"].count(op) for op in ("wgmma.mma_async", "mma.sync"))}
        builds.append(row)
        problems = "  " + "; ".join(row["problems"]) if row["problems"] else ""
        print(f"{name:>16s}  {r.registers:3d} registers x {32 * r.num_warps} threads, "
              f"{r.shared_bytes} B shared, {r.local_bytes} B local, {r.stack_bytes} B stack, "
              f"{row['mma']} MMA sites{problems}", flush=True)
    return builds


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = sorted({(r["rows"], r["context"]) for r in rows})
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(6, len(shapes) * 0.9), 4))
    width = 0.8 / len(variants)
    for i, v in enumerate(variants):
        rates = [next((r.get("gb_per_s", 0) for r in rows
                       if r["variant"] == v and (r["rows"], r["context"]) == s), 0)
                 for s in shapes]
        ax.bar([j + i * width for j in range(len(shapes))], rates, width, label=v)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))])
    ax.set_xticklabels([f"{r}x{c}" for r, c in shapes], rotation=45)
    ax.set_ylabel("K/V read, GB/s")
    ax.set_title("DECODE attention, one layer (rows x context)")
    ax.legend(fontsize=7, title="[dot:]BT/split/warps[/stages]")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="64,256,512")  # DECODE rows: 2 a request with CFG
    parser.add_argument("--contexts", default="256,512,1024,2048")
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS))
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--compile-only", action="store_true",
                        help="build each variant for sm_90a here (no GPU) and print its needs")
    parser.add_argument("--git-commit", default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    for v in variants:
        parse_variant(v)
    for v in (BEFORE, SERVING):  # the A/B: the served kernel first, then the one it replaced
        if v not in variants:
            variants.insert(0, v)
    if args.compile_only:
        builds = compile_only(variants, args.heads, args.kv_heads, args.head_dim)
        if args.out:
            Path(args.out).write_text(json.dumps({**provenance(device="cpu",
                                                               git_commit_override=args.git_commit),
                                                  "builds": builds}, indent=1))
        sys.exit(1 if any(b["problems"] for b in builds) else 0)
    cuda = torch.cuda.is_available() and not os.environ.get("TRITON_INTERPRET")
    device = "cuda" if cuda else "cpu"
    results: list[dict[str, Any]] = []
    for r in (int(v) for v in args.rows.split(",")):
        for c in (int(v) for v in args.contexts.split(",")):
            if c % BLOCK:
                raise SystemExit(f"context {c}: a multiple of {BLOCK}")
            case = Case(r, c, args.heads, args.kv_heads, args.head_dim, device)
            for row in measure(case, variants, timed=cuda):
                results.append(row)
                timing = (f"{row['ms']:8.4f} ms  {row['gb_per_s']:7.1f} GB/s  x28 "
                          f"{row['step_ms_28_layers']:7.2f} ms" if "ms" in row else "")
                diff = (f"  max|diff| {row['max_abs_diff_vs_fp32']:.2e}"
                        f"{'  WRONG' if row.get('wrong') else ''}"
                        if "max_abs_diff_vs_fp32" in row else "")
                print(f"{r:4d} x {c:5d}  {row['variant']:>10s}  {timing}{diff}", flush=True)
            del case
    if args.out:
        out = Path(args.out)
        out.write_text(json.dumps({**provenance(device=device, git_commit_override=args.git_commit),
                                   "serving": SERVING, "before": BEFORE,
                                   "results": results}, indent=1))
        if cuda:
            plot(results, out.with_suffix(".png"))
    if any(r.get("wrong") for r in results):
        print("a variant's output is further from the reference than the served one's",
              file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
