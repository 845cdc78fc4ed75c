"""Codec convolution kernels on one GPU: which formulation reaches the tensor cores.

Usage (GPU machine, repo root): ``PYTHONPATH=runtime python bench/codec_conv_kernels.py --out X.json``

Times, per layer shape of the full-size codec decoder at one step of ``streams x frames``
(default 16 x 16 = 256 frames, the engine's largest CODEC step), each way of computing that
layer, and reports ms and achieved TFLOP/s:

* causal conv (kernel 7, dilation 1/3/9, the residual units' conv1; history prepended):
  ``ncl``: ``F.conv1d`` on ``[B, C, T]`` (today's codec); ``nhwc``: ``F.conv2d`` on a
  channels-last ``[B, C, 1, T]``; ``gemm7``: channels-last ``[B*T, C]`` rows and seven
  accumulated GEMMs over shifted views (rows of one stream are contiguous with their history in
  front, so every tap is one plain 2-D GEMM); ``im2col``: one GEMM over the unfolded taps.
* transposed conv (kernel 2s, stride s, the decoder blocks' upsamplers): ``ncl``:
  ``F.conv_transpose1d``; ``gemm``: one ``[B*T, Cin] @ [Cin, 2s*Cout]`` GEMM and a shifted add.

each in ``tf32`` (fp32 storage, TF32 math) and ``bf16``, checked against strict fp32.
Writes JSON with the GPU, torch version, commit and date.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch
import torch.nn.functional as F

from cuda_bench import median_ms

from breezert_bench.provenance import provenance

K = 7


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

    return {"ncl": ncl, "nhwc": nhwc, "gemm7": gemm7, "im2col": im2col}


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--frames", type=int, default=16)
    args = parser.parse_args()
    torch.manual_seed(0)
    bsz, frames = args.streams, args.frames
    # (name, channels, samples per frame) of the four decoder blocks' residual units
    blocks = [("block1", 768, 32), ("block2", 384, 160), ("block3", 192, 640), ("block4", 96, 1920)]
    tconvs = [("block1.up", 1536, 768, 8, 4), ("block2.up", 768, 384, 5, 32),
              ("block3.up", 384, 192, 4, 160), ("block4.up", 192, 96, 3, 640)]
    results: dict = {"causal_conv": [], "transposed_conv": []}
    for name, c, per_frame in blocks:
        for d in (1, 3, 9):
            t = per_frame * frames
            hist = (K - 1) * d
            x = torch.randn(bsz, c, hist + t, device="cuda")
            w = torch.randn(c, c, K, device="cuda") * (c * K) ** -0.5
            b = torch.zeros(c, device="cuda")
            torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
            ref = F.conv1d(x, w, b, dilation=d)  # [B, C, T] strict fp32
            flop = 2 * bsz * t * c * c * K
            for precision in ("tf32", "bf16"):
                torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = True
                dtype = torch.bfloat16 if precision == "bf16" else torch.float32
                variants = causal_conv_variants(x.to(dtype), w.to(dtype), b.to(dtype), d)
                for vname, fn in variants.items():
                    out = fn()
                    got = out.float() if vname in ("ncl",) else (
                        out.float().squeeze(2) if vname == "nhwc" else out.float().transpose(1, 2))
                    ms = median_ms(fn)
                    row = {"layer": name, "channels": c, "dilation": d, "samples": t,
                           "precision": precision, "variant": vname, "ms": ms,
                           "tflops": flop / ms / 1e9, "rel_err": rel_err(ref, got)}
                    results["causal_conv"].append(row)
                    print(f"{name} C={c:4d} d={d} T={t:6d} {precision:4s} {vname:7s} "
                          f"{ms:7.3f} ms {row['tflops']:6.1f} TFLOP/s err {row['rel_err']:.1e}",
                          flush=True)
            del x
            torch.cuda.empty_cache()
    for name, cin, cout, s, per_frame in tconvs:
        t = per_frame * frames
        x = torch.randn(bsz, cin, t, device="cuda")
        w = torch.randn(cin, cout, 2 * s, device="cuda") * (cin * 2) ** -0.5
        b = torch.zeros(cout, device="cuda")
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
        ref = F.conv_transpose1d(x, w, b, stride=s)[..., : t * s]
        flop = 2 * bsz * t * cin * cout * 2 * s
        for precision in ("tf32", "bf16"):
            torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = True
            dtype = torch.bfloat16 if precision == "bf16" else torch.float32
            for vname, fn in tconv_variants(x.to(dtype), w.to(dtype), b.to(dtype), s).items():
                out = fn()
                got = out.float() if vname == "ncl" else out.float().transpose(1, 2)
                ms = median_ms(fn)
                row = {"layer": name, "cin": cin, "cout": cout, "stride": s, "samples_in": t,
                       "precision": precision, "variant": vname, "ms": ms,
                       "tflops": flop / ms / 1e9, "rel_err": rel_err(ref, got)}
                results["transposed_conv"].append(row)
                print(f"{name} {cin}->{cout} s={s} T={t:6d} {precision:4s} {vname:5s} "
                      f"{ms:7.3f} ms {row['tflops']:6.1f} TFLOP/s err {row['rel_err']:.1e}",
                      flush=True)
    results["metadata"] = provenance(streams=bsz, frames=frames)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
