"""Codec convolution kernels on one GPU: which formulation reaches the tensor cores.

Usage (GPU machine, repo root): ``PYTHONPATH=runtime:bench python bench/codec_conv_kernels.py
--out X.json [--sections conv,tconv,unit] [--shapes 16x16,64x4,256x1]``

Times, per layer shape of the full-size codec decoder at one step of ``streams x frames``
(``--shapes``; default 16 x 16 = 256 frames, the engine's largest CODEC step), each way of
computing that layer, and reports ms and achieved TFLOP/s:

* causal conv (kernel 7, dilation 1/3/9, the residual units' conv1; history prepended):
  ``ncl``: ``F.conv1d`` on ``[B, C, T]`` (today's codec); ``nhwc``: ``F.conv2d`` on a
  channels-last ``[B, C, 1, T]``; ``gemm7``: channels-last ``[B*T, C]`` rows and seven
  accumulated GEMMs over shifted views (rows of one stream are contiguous with their history in
  front, so every tap is one plain 2-D GEMM); ``im2col``: one GEMM over the unfolded taps;
  ``triton``: ``kernels/codec_conv.py``'s implicit GEMM (history through its own pointer),
  without its SnakeBeta prologue and epilogue, so it computes what the others do.
* transposed conv (kernel 2s, stride s, the decoder blocks' upsamplers): ``ncl``:
  ``F.conv_transpose1d``; ``gemm``: one ``[B*T, Cin] @ [Cin, 2s*Cout]`` GEMM and a shifted add.

* residual unit (issue 31 item 3: SnakeBeta -> causal conv k=7 -> SnakeBeta -> conv k=1 ->
  residual add, with each stream's history and the next history): ``served``: today's serving
  path (``_ResidualUnit`` with the fused ``snake_cat``, cuDNN convolutions in TF32);
  ``fused/<tiles>``: ``kernels/codec_conv.py``'s two launches plus ``next_history``, TF32, for
  each of its candidate launch shapes; ``fused-approx/<tiles>``: the same with SnakeBeta's sine
  on the SFU (its prologue recomputes SnakeBeta for every tap and column block); ``fused-bf16``: the same on bf16 storage; ``gemm-only``:
  its two launches without SnakeBeta (the kernels' GEMM ceiling; no error: other math). Error
  as SNR in dB against the strict-fp32 unit, FLOPs 16 * rows * C^2; a summary line per shape
  sums the twelve units (ms a frame, TFLOP/s; the issue's target is <= 0.025 ms a frame for the
  whole codec, >= 200 TFLOP/s-equivalent).

each in ``tf32`` (fp32 storage, TF32 math) and ``bf16``, checked against strict fp32.
Writes JSON with the GPU, torch version, commit and date, after every section and shape (a
timed-out run keeps what it measured).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch
import torch.nn.functional as F

from cuda_bench import median_ms

from breezert.kernels.codec_conv import (
    CANDIDATE_TILES,
    ConvTiles,
    PackedUnit,
    conv_launch,
    next_history,
    pack_residual_unit,
    pad_rows,
    residual_unit,
)
from breezert.models.codec import _Carry, _ResidualUnit
from breezert_bench.provenance import provenance

K = 7
DEVICE = "cuda"  # a CPU smoke run of the code paths (Triton's interpreter) sets "cpu"


def causal_conv_variants(x_ncl: torch.Tensor, w: torch.Tensor, b: torch.Tensor,
                         dilation: int) -> dict[str, Callable[[], torch.Tensor]]:
    """``x_ncl [B, C, h + T]`` (history in front) -> ``[B, Cout, T]`` four ways; the channels-
    last ones return ``[B, T, Cout]``."""
    bsz, cin, total = x_ncl.shape
    hist = (K - 1) * dilation
    t = total - hist
    cout = w.shape[0]
    x_nlc = x_ncl.transpose(1, 2).contiguous()  # [B, h + T, C]
    flat = x_nlc.view(bsz * total, cin)
    taps = [w[:, :, j].t().contiguous() for j in range(K)]  # each [Cin, Cout]
    x_nhwc = x_ncl.unsqueeze(2).contiguous(memory_format=torch.channels_last)
    w4 = w.unsqueeze(2).contiguous(memory_format=torch.channels_last)
    w_cat = torch.cat(taps, dim=0)  # [K * Cin, Cout]
    w_pad = pad_rows(w_cat.t(), w_cat.dtype)  # the Triton kernel's layout [Cout', K * Cin]
    rows = bsz * total - hist

    def ncl() -> torch.Tensor:
        return F.conv1d(x_ncl, w, b, dilation=dilation)

    def nhwc() -> torch.Tensor:
        return F.conv2d(x_nhwc, w4, b, dilation=(1, dilation))

    def gemm7() -> torch.Tensor:
        out = torch.addmm(b, flat[0:rows], taps[0])
        for j in range(1, K):
            out.addmm_(flat[j * dilation: j * dilation + rows], taps[j])
        # row r of stream s sits at s * total + r (r < T); the h rows after it are garbage
        return out.as_strided((bsz, t, cout), (total * cout, cout, 1))

    def im2col() -> torch.Tensor:
        cols = torch.cat([flat[j * dilation: j * dilation + rows] for j in range(K)], dim=1)
        out = torch.addmm(b, cols, w_cat)
        return out.as_strided((bsz, t, cout), (total * cout, cout, 1))

    def triton() -> torch.Tensor:  # history and new samples as two views of x_nlc
        return conv_launch(x_nlc[:, hist:], x_nlc[:, :hist], hist, dilation, w_pad, b, None,
                           None, None, ConvTiles())

    return {"ncl": ncl, "nhwc": nhwc, "gemm7": gemm7, "im2col": im2col, "triton": triton}


def tconv_variants(x_ncl: torch.Tensor, w: torch.Tensor, b: torch.Tensor,
                   stride: int) -> dict[str, Callable[[], torch.Tensor]]:
    """``x [B, Cin, T]``, ``w [Cin, Cout, 2s]`` -> the first ``T * s`` outputs (no history:
    the shape and cost are what matter here)."""
    bsz, cin, t = x_ncl.shape
    cout, k = w.shape[1], w.shape[2]
    assert k == 2 * stride
    x_nlc = x_ncl.transpose(1, 2).contiguous().view(bsz * t, cin)
    w_mat = w.permute(0, 2, 1).reshape(cin, k * cout).contiguous()  # [Cin, (k, Cout)]

    def ncl() -> torch.Tensor:
        return F.conv_transpose1d(x_ncl, w, b, stride=stride)[..., : t * stride]

    def gemm() -> torch.Tensor:
        y = (x_nlc @ w_mat).view(bsz, t, 2, stride, cout)  # tap r + s*half of input t
        out = y[:, :, 0].clone()  # [B, T, s, Cout]: output t*s + r gets tap r of input t
        out[:, 1:] += y[:, :-1, 1]  # ... and tap s + r of input t - 1
        return (out.view(bsz, t * stride, cout) + b)

    return {"ncl": ncl, "gemm": gemm}


def rel_err(ref: torch.Tensor, x: torch.Tensor) -> float:
    return float((x.float() - ref).norm() / ref.norm())


def snr_db(ref: torch.Tensor, x: torch.Tensor) -> float:
    return float(10 * torch.log10(ref.double().pow(2).sum()
                                  / (x.double() - ref.double()).pow(2).sum()))


def set_tf32(enabled: bool) -> None:
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = enabled


# (name, channels, samples per frame) of the four decoder blocks' residual units
BLOCKS = [("block1", 768, 32), ("block2", 384, 160), ("block3", 192, 640), ("block4", 96, 1920)]
TCONVS = [("block1.up", 1536, 768, 8, 4), ("block2.up", 768, 384, 5, 32),
          ("block3.up", 384, 192, 4, 160), ("block4.up", 192, 96, 3, 640)]


def conv_section(bsz: int, frames: int) -> list[dict]:
    rows = []
    for name, c, per_frame in BLOCKS:
        for d in (1, 3, 9):
            t = per_frame * frames
            hist = (K - 1) * d
            x = torch.randn(bsz, c, hist + t, device=DEVICE)
            w = torch.randn(c, c, K, device=DEVICE) * (c * K) ** -0.5
            b = torch.zeros(c, device=DEVICE)
            set_tf32(False)
            ref = F.conv1d(x, w, b, dilation=d)  # [B, C, T] strict fp32
            flop = 2 * bsz * t * c * c * K
            for precision in ("tf32", "bf16"):
                set_tf32(True)
                dtype = torch.bfloat16 if precision == "bf16" else torch.float32
                variants = causal_conv_variants(x.to(dtype), w.to(dtype), b.to(dtype), d)
                for vname, fn in variants.items():
                    out = fn()
                    got = out.float() if vname in ("ncl",) else (
                        out.float().squeeze(2) if vname == "nhwc" else out.float().transpose(1, 2))
                    ms = median_ms(fn)
                    row = {"layer": name, "channels": c, "dilation": d, "samples": t,
                           "streams": bsz, "frames": frames,
                           "precision": precision, "variant": vname, "ms": ms,
                           "tflops": flop / ms / 1e9, "rel_err": rel_err(ref, got)}
                    rows.append(row)
                    print(f"{name} C={c:4d} d={d} T={t:6d} {precision:4s} {vname:7s} "
                          f"{ms:7.3f} ms {row['tflops']:6.1f} TFLOP/s err {row['rel_err']:.1e}",
                          flush=True)
            del x
            torch.cuda.empty_cache()
    return rows


def tconv_section(bsz: int, frames: int) -> list[dict]:
    rows = []
    for name, cin, cout, s, per_frame in TCONVS:
        t = per_frame * frames
        x = torch.randn(bsz, cin, t, device=DEVICE)
        w = torch.randn(cin, cout, 2 * s, device=DEVICE) * (cin * 2) ** -0.5
        b = torch.zeros(cout, device=DEVICE)
        set_tf32(False)
        ref = F.conv_transpose1d(x, w, b, stride=s)[..., : t * s]
        flop = 2 * bsz * t * cin * cout * 2 * s
        for precision in ("tf32", "bf16"):
            set_tf32(True)
            dtype = torch.bfloat16 if precision == "bf16" else torch.float32
            for vname, fn in tconv_variants(x.to(dtype), w.to(dtype), b.to(dtype), s).items():
                out = fn()
                got = out.float() if vname == "ncl" else out.float().transpose(1, 2)
                ms = median_ms(fn)
                row = {"layer": name, "cin": cin, "cout": cout, "stride": s, "samples_in": t,
                       "streams": bsz, "frames": frames,
                       "precision": precision, "variant": vname, "ms": ms,
                       "tflops": flop / ms / 1e9, "rel_err": rel_err(ref, got)}
                rows.append(row)
                print(f"{name} {cin}->{cout} s={s} T={t:6d} {precision:4s} {vname:5s} "
                      f"{ms:7.3f} ms {row['tflops']:6.1f} TFLOP/s err {row['rel_err']:.1e}",
                      flush=True)
    return rows


def random_unit(c: int, d: int) -> _ResidualUnit:
    """A residual unit with ``init_codec_random_``'s scales (conv2 x 0.3), random biases."""
    unit = _ResidualUnit(c, d).to(DEVICE)
    with torch.no_grad():
        for conv, gain in ((unit.conv1.conv, 1.0), (unit.conv2.conv, 0.3)):
            conv.weight.copy_(torch.randn_like(conv.weight) * gain * conv.weight[0].numel() ** -0.5)
            conv.bias.copy_(torch.randn_like(conv.bias) * 0.02)
        for act in (unit.act1, unit.act2):
            act.alpha.copy_(torch.randn_like(act.alpha) * 0.1)
            act.beta.copy_(torch.randn_like(act.beta) * 0.1)
    return unit


def unit_variants(unit: _ResidualUnit, x: torch.Tensor, flat: torch.Tensor,
                  tiles: tuple[ConvTiles, ...]) -> dict[str, Callable[[], torch.Tensor]]:
    """``x [B, C, T]``, ``flat [B, C * 6d]`` (the arena's history) -> each way's unit output,
    ``[B, T, C]`` (``served``: ``[B, C, T]``), with the next history made too."""
    c, d = x.shape[1], unit.conv1.conv.dilation[0]
    spec = (("unit", c, (K - 1) * d),)
    x_cl = x.transpose(1, 2).contiguous()  # [B, T, C]
    hist = flat.view(x.shape[0], c, -1).transpose(1, 2)  # [B, 6d, C], the arena's strides
    weights = (unit.conv1.conv.weight, unit.conv1.conv.bias, unit.conv2.conv.weight,
               unit.conv2.conv.bias, (unit.act1.alpha, unit.act1.beta),
               (unit.act2.alpha, unit.act2.beta), d)
    packed = pack_residual_unit(*weights)
    packed16 = pack_residual_unit(*weights, dtype=torch.bfloat16)
    x16, hist16 = x_cl.bfloat16(), hist.bfloat16()

    def served() -> torch.Tensor:
        carry = _Carry(flat, spec, fast=True)
        out = unit(x, carry)
        carry.flat()
        return out

    def fused(t: ConvTiles, xs: torch.Tensor, hs: torch.Tensor, p: PackedUnit,
              approx_sin: bool = False) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            out = residual_unit(xs, hs, p, t, t, approx_sin=approx_sin)
            next_history(xs, hs, p)
            return out
        return run

    def gemm_only() -> torch.Tensor:
        g = conv_launch(x_cl, hist, packed.history, d, packed.w1, packed.b1, None, None, None,
                        ConvTiles())
        return conv_launch(g, None, 0, 1, packed.w2, packed.b2, None, None, x_cl, ConvTiles())

    out = {"served": served}
    out.update({f"fused/{t.name()}": fused(t, x_cl, hist, packed) for t in tiles})
    out.update({f"fused-approx/{t.name()}": fused(t, x_cl, hist, packed, approx_sin=True)
                for t in tiles})
    out["fused-bf16"] = fused(ConvTiles(), x16, hist16, packed16)
    out["gemm-only"] = gemm_only
    return out


def unit_section(bsz: int, frames: int, tiles: tuple[ConvTiles, ...]) -> list[dict]:
    rows = []
    for name, c, per_frame in BLOCKS:
        for d in (1, 3, 9):
            t = per_frame * frames
            unit = random_unit(c, d)
            x = torch.randn(bsz, c, t, device=DEVICE)
            flat = torch.randn(bsz, c * (K - 1) * d, device=DEVICE) * 0.5
            set_tf32(False)
            with torch.no_grad():  # strict fp32, the eager carry
                ref = unit(x, _Carry(flat, (("unit", c, (K - 1) * d),))).transpose(1, 2)
            set_tf32(True)
            flop = 16 * bsz * t * c * c
            for vname, fn in unit_variants(unit, x, flat, tiles).items():
                try:
                    with torch.no_grad():
                        out = fn()
                        ms = median_ms(fn)
                except Exception as e:  # noqa: BLE001 - a launch shape that fails is a result
                    print(f"{name} C={c} d={d} {vname}: FAILED {type(e).__name__}: {e}"[:300])
                    rows.append({"layer": name, "channels": c, "dilation": d, "variant": vname,
                                 "streams": bsz, "frames": frames, "error": str(e)[:500]})
                    continue
                got = out.transpose(1, 2) if vname == "served" else out
                snr = None if vname == "gemm-only" else snr_db(ref, got.float())
                row = {"layer": name, "channels": c, "dilation": d, "samples": t,
                       "streams": bsz, "frames": frames, "variant": vname, "ms": ms,
                       "tflops": flop / ms / 1e9, "snr_db": snr}
                rows.append(row)
                print(f"{bsz}x{frames} {name} C={c:4d} d={d} {vname:28s} {ms:7.3f} ms "
                      f"{row['tflops']:6.1f} TFLOP/s SNR {snr if snr is None else round(snr, 1)}",
                      flush=True)
            del x, ref
            torch.cuda.empty_cache()
    return rows


def unit_summary(rows: list[dict], frames_total: int) -> dict[str, dict]:
    """Per variant, the twelve units' ms summed (a variant missing a unit is left out), and
    ``fused-best`` / ``fused-approx-best``: each unit's fastest launch shape of the kind."""
    ok = [r for r in rows if "ms" in r]
    units = {(r["layer"], r["dilation"]) for r in ok}
    by_variant: dict[str, dict] = {}
    for v in sorted({r["variant"] for r in ok}):
        picked = [r for r in ok if r["variant"] == v]
        if len(picked) == len(units):
            by_variant[v] = picked
    for kind in ("fused", "fused-approx"):
        best = []
        for u in sorted(units):
            fused = [r for r in ok if (r["layer"], r["dilation"]) == u
                     and r["variant"].startswith(kind + "/")]
            if fused:
                best.append(min(fused, key=lambda r: r["ms"]))
        if len(best) == len(units):
            by_variant[kind + "-best"] = best
    out = {}
    for v, picked in by_variant.items():
        ms = sum(r["ms"] for r in picked)
        flop = sum(r["tflops"] * r["ms"] * 1e9 for r in picked)
        out[v] = {"ms": ms, "ms_per_frame": ms / frames_total, "tflops": flop / ms / 1e9,
                  "min_snr_db": min((r["snr_db"] for r in picked if r["snr_db"] is not None),
                                    default=None)}
    return out


def parse_shapes(text: str) -> list[tuple[int, int]]:
    return [(int(a), int(b)) for a, b in (s.split("x") for s in text.split(","))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--sections", default="conv,tconv,unit")
    parser.add_argument("--shapes", default="16x16", help="streams x frames, comma-separated")
    parser.add_argument("--tiles", default="all",
                        help="'all' (CANDIDATE_TILES) or 'default' for the fused units")
    args = parser.parse_args()
    torch.manual_seed(0)
    tiles = CANDIDATE_TILES if args.tiles == "all" else (ConvTiles(),)
    sections = args.sections.split(",")
    results: dict = {"causal_conv": [], "transposed_conv": [], "residual_unit": [],
                     "unit_summary": {}}
    for bsz, frames in parse_shapes(args.shapes):
        if "conv" in sections:
            results["causal_conv"] += conv_section(bsz, frames)
        if "tconv" in sections:
            results["transposed_conv"] += tconv_section(bsz, frames)
        if "unit" in sections:
            rows = unit_section(bsz, frames, tiles)
            results["residual_unit"] += rows
            summary = unit_summary(rows, bsz * frames)
            results["unit_summary"][f"{bsz}x{frames}"] = summary
            for v, s in summary.items():
                print(f"[units {bsz}x{frames}] {v:28s} {s['ms']:7.2f} ms "
                      f"{s['ms_per_frame']:.4f} ms/frame {s['tflops']:6.1f} TFLOP/s "
                      f"min SNR {s['min_snr_db']}", flush=True)
        results["metadata"] = provenance(shapes=args.shapes, sections=args.sections)
        with open(args.out, "w") as f:  # after every shape: a timeout keeps what it measured
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
