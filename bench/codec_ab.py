"""The serving codec's step with one of its changes against the path that change replaced, in
one process on one GPU.

Usage (GPU machine, repo root): ``PYTHONPATH=runtime:bench python bench/codec_ab.py --change
layout|state|snake|snake-tile|upsampler [--precision tf32] [--out X.json]``; ``--plot X.json``
(any machine) draws a recorded run as ``X.png``.

Changes (``before`` is defined here, ``after`` is the runtime):
- ``layout`` (a candidate, 7 Dec: ``before`` is the runtime as served, ``after`` the runtime's
  ``StreamingCodec(channels_last=True)``, each on its own copy of the weights): the decoder's
  activations channels-last and its convs as 2-D channels-last convolutions. cuDNN runs NHWC
  kernels either way, but the 1-D path makes each conv's input contiguous and transposes it to
  NHWC and back (52 of a CODEC step's 372 launches at 256 streams x 1 frame on the H200, 1.9 of
  its 16.2 ms, ``bench/results/h200-census-256-20261206-10.txt``), and the activations' mixed
  layouts send adds and copies through torch's strided kernels (38 launches, 2.6 ms there).
- ``upsampler``: the decoder's first block upsamples 1536 -> 768 channels as one GEMM
  (``_CausalTransConv._gemm``) on ``[B, 1 + T, Cin]``. Read as the transposed view of the ``[B,
  Cin, 1 + T]`` activation, its leading dimension is ``1 + T`` (always odd), and cuBLAS ran an
  unaligned kernel: 6.4 ms of a 36 ms eager CODEC step at 256 streams x 1 frame on the H100
  (``bench/results/h100-census-256-20261205.txt``); the runtime copies it row-major first.
- ``snake``: the fused SnakeBeta + history kernel (``kernels/snake.py``) ran one program per
  (row, 1024 columns), every lane through the formula however short the row (the first block's
  rows are 7-86 samples wide at one frame: 6.5 ms of the 36 ms step at 256 x 1 on the H100);
  the runtime's programs take a tile of rows x ``BLOCK_T`` columns, ``BLOCK_T`` from the row
  width.
- ``snake-tile``: the same kernel took 1024 flat elements a program, across rows, from 5 Dec
  (sixth session) to 6 Dec; it beat a program per row on short rows and lost on long ones (16 x
  16 16.60 -> 17.92 ms on the H100); the runtime's row tiles replaced it.
- ``state``: the step used to gather every row's whole state (conv histories, 0.54 MB a stream,
  and the 8 layers' K/V windows, 4.6 MB in fp32), run the decoder on the rows (per layer:
  concatenate the new keys, keep the window's last entries, stack; per conv: keep the history's
  last samples, then join them) and scatter the state back; the runtime reads and writes each
  stream's state in its slot: the K/V rings one kernel a layer (``kernels/codec_attention.py``),
  each conv's history read by the kernel that builds the conv's input and its new one written
  back by ``keep_tail`` (``kernels/snake.py``).

For each (streams, frames) shape this times one graph replay of the full-size random serving
codec (``StreamingCodec.for_serving``, ``fast``) both ways, median of 20 CUDA-event timings as
``codec_precision.py`` takes them, and checks the two waveforms of one step agree. Prints a line
per shape; writes JSON with the GPU, torch version, commit and date.

Owns the ``before`` variants for these comparisons only. Must not: be imported by the runtime.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
from collections.abc import Iterator
from pathlib import Path

import torch
import triton
import triton.language as tl

from breezert.kernels import snake
from breezert.models.codec import CodecStreamState, StreamingCodec, _CausalTransConv, tf32_math
from breezert.random_init import build_random
from breezert_bench.provenance import provenance
from codec_precision import time_step

SHAPES = ((1, 1), (16, 1), (64, 1), (256, 1), (64, 4), (16, 16), (32, 16))
GFLOP_PER_FRAME = 5.0


def transposed_view_gemm(self: _CausalTransConv, x: torch.Tensor, num_new: int) -> torch.Tensor:
    """``_gemm`` as it was before 5 Dec (fifth session): the transposed view straight into
    ``@``."""
    b, s = x.shape[0], self.stride
    cout = self.conv.weight.shape[1]
    y = (x.transpose(1, 2) @ self.gemm_weight).view(b, num_new + 1, 2, s, cout)
    out = (y[:, 1:, 0] + y[:, :-1, 1]).reshape(b, num_new * s, cout)
    return (out + self.conv.bias).transpose(1, 2).contiguous()


def gathered_decode(self: StreamingCodec, slot_ids: torch.Tensor, codes: torch.Tensor,
                    num_frames: torch.Tensor | None = None) -> torch.Tensor:
    """``StreamingCodec.decode`` as it was before 5 Dec (sixth session): the rows' whole state
    gathered, the functional step, the state scattered back."""
    state, slot_ids = self.state, slot_ids.to(self.state.pos.device)
    rows = CodecStreamState(state.conv[slot_ids], state.kv[slot_ids], state.pos[slot_ids])
    with tf32_math(self.tf32):
        wav, new = self.decoder.step(codes, rows, num_frames, self.fast, self.tables)
    state.conv.index_copy_(0, slot_ids, new.conv)
    state.kv.index_copy_(0, slot_ids, new.kv)
    state.pos.index_copy_(0, slot_ids, new.pos)
    return wav


@triton.jit(do_not_specialize=["T", "H"])
def _rowwise_snake_cat_kernel(x_ptr, hist_ptr, la_ptr, lb_ptr, out_ptr, C, T, H,
                              sx_b, sx_c, sh_b, sh_c, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    b, c = row // C, row % C
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    width = H + T
    in_hist = cols < H
    in_new = (cols >= H) & (cols < width)
    h = tl.load(hist_ptr + b * sh_b + c * sh_c + cols, mask=in_hist, other=0.0)
    x = tl.load(x_ptr + b * sx_b + c * sx_c + (cols - H), mask=in_new, other=0.0).to(tl.float32)
    alpha = tl.exp(tl.load(la_ptr + c).to(tl.float32))
    inv_beta = 1.0 / (tl.exp(tl.load(lb_ptr + c).to(tl.float32)) + 1e-9)
    s = tl.sin(x * alpha)
    y = x + inv_beta * (s * s)
    val = tl.where(in_hist, h.to(tl.float32), y)
    tl.store(out_ptr + row * width + cols, val.to(out_ptr.dtype.element_ty), mask=cols < width)


def rowwise_snake_cat(x: torch.Tensor, log_alpha: torch.Tensor | None,
                      log_beta: torch.Tensor | None, history: torch.Tensor | None,
                      rows: torch.Tensor | None = None) -> torch.Tensor:
    """``snake.snake_cat_triton`` as it was before 5 Dec (sixth session): a program per (row,
    1024 columns), SnakeBeta always, histories by batch row. Called as today's is: an arena's
    ``rows`` are gathered first, and a conv without SnakeBeta gets the plain ``cat`` (as the
    step did then)."""
    if rows is not None:
        history = history[rows]
    if log_alpha is None:
        return snake.snake_cat_reference(x, None, None, history)
    bsz, channels, t = x.shape
    x = x if x.stride(2) == 1 else x.contiguous()
    if history is None:
        hist, h = x, 0
    else:
        hist = history if history.stride(2) == 1 else history.contiguous()
        h = history.shape[-1]
    out = torch.empty(bsz, channels, h + t, device=x.device, dtype=x.dtype)
    _rowwise_snake_cat_kernel[(bsz * channels, triton.cdiv(h + t, 1024))](
        x, hist, log_alpha, log_beta, out, channels, t, h, x.stride(0), x.stride(1),
        hist.stride(0), hist.stride(1), BLOCK=1024)
    return out


@triton.jit(do_not_specialize=["C", "T", "H", "total"])
def _flat_snake_cat_kernel(x_ptr, hist_ptr, rows_ptr, la_ptr, lb_ptr, out_ptr, C, T, H, total,
                           sx_b, sx_c, sh_b, sh_c, BLOCK: tl.constexpr, APPLY: tl.constexpr,
                           HAS_ROWS: tl.constexpr):
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    width = H + T
    row = idx // width
    col = idx - row * width
    b = (row // C).to(tl.int64)
    c = row % C
    inside = idx < total
    in_hist = inside & (col < H)
    in_new = inside & (col >= H)
    if HAS_ROWS:
        hb = tl.load(rows_ptr + b, mask=in_hist, other=0)
    else:
        hb = b
    h = tl.load(hist_ptr + hb * sh_b + c * sh_c + col, mask=in_hist, other=0.0)
    x = tl.load(x_ptr + b * sx_b + c * sx_c + (col - H), mask=in_new, other=0.0).to(tl.float32)
    if APPLY:
        alpha = tl.exp(tl.load(la_ptr + c, mask=inside, other=0.0).to(tl.float32))
        inv_beta = 1.0 / (tl.exp(tl.load(lb_ptr + c, mask=inside, other=0.0).to(tl.float32))
                          + 1e-9)
        s = tl.sin(x * alpha)
        x = x + inv_beta * (s * s)
    val = tl.where(in_hist, h.to(tl.float32), x)
    tl.store(out_ptr + idx, val.to(out_ptr.dtype.element_ty), mask=inside)


def flat_snake_cat(x: torch.Tensor, log_alpha: torch.Tensor | None,
                   log_beta: torch.Tensor | None, history: torch.Tensor | None,
                   rows: torch.Tensor | None = None) -> torch.Tensor:
    """``snake.snake_cat_triton`` from 5 Dec (sixth session) to 6 Dec: 1024 flat elements of the
    output a program, across rows (one launch: the steps timed here stay under 2**31
    elements)."""
    x, hist, h, out = snake.snake_cat_operands(x, history, rows)
    bsz, channels, t = x.shape
    apply = log_alpha is not None
    assert out.numel() < 2**31
    _flat_snake_cat_kernel[(triton.cdiv(out.numel(), 1024),)](
        x, hist, x if rows is None else rows, log_alpha if apply else x,
        log_beta if apply else x, out, channels, t, h, out.numel(), x.stride(0), x.stride(1),
        hist.stride(0), hist.stride(1), BLOCK=1024, APPLY=apply, HAS_ROWS=rows is not None)
    return out


@contextlib.contextmanager
def patched(owner: object, name: str, value: object) -> Iterator[None]:
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


RUNTIME = contextlib.nullcontext
CHANGES = {
    "upsampler": ("transposed view", "row-major copy",
                  lambda: patched(_CausalTransConv, "_gemm", transposed_view_gemm), RUNTIME),
    "snake": ("a program per row", "row tiles",
              lambda: patched(snake, "snake_cat_triton", rowwise_snake_cat), RUNTIME),
    "snake-tile": ("flat, across rows", "row tiles",
                   lambda: patched(snake, "snake_cat_triton", flat_snake_cat), RUNTIME),
    "state": ("state gathered and scattered", "state in place",
              lambda: patched(StreamingCodec, "decode", gathered_decode), RUNTIME),
}
CHANGES["layout"] = ("channels-first (served)", "channels-last", RUNTIME, RUNTIME)
"""change -> (before's label, after's label, a context that installs before, one that installs
after; ``RUNTIME``: the runtime as it is)."""
CODEC_OPTIONS = {"layout": ({"channels_last": False}, {"channels_last": True})}
"""Changes whose two sides are ``StreamingCodec.for_serving`` options: each side gets its own
codec on its own copy of the weights (``channels_last`` restrides them in place)."""


def one_step(codec: StreamingCodec, streams: int, frames: int) -> tuple[float, torch.Tensor]:
    """Median ms of one graph replay of a ``streams x frames`` step (``codec_precision``'s
    timing), and the waveform of a step on fixed codes from frame 0."""
    ms = time_step(codec, "fp32", streams, frames)  # fp32: the math flags as the codec sets them
    slots = torch.arange(streams, device="cuda")
    codes = torch.randint(0, 2048, (streams, frames, 16), device="cuda",
                          generator=torch.Generator(device="cuda").manual_seed(streams * frames))
    codec.reset(slots)
    with torch.inference_mode():
        wav = codec.decode(slots, codes).float()
    return ms, wav


def plot(path: str) -> str:
    """``path``'s before/after ms per shape as bars, next to it as ``.png``; returns its name."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    doc = json.loads(Path(path).read_text())
    rows = doc["rows"]
    labels = [f"{r['streams']}x{r['frames']}" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(8, 4))
    before, after, _, _ = CHANGES[doc.get("change", "upsampler")]  # 5 Dec's files: upsampler
    ax.bar([i - 0.2 for i in x], [r["before_ms"] for r in rows], 0.4, label=before)
    ax.bar([i + 0.2 for i in x], [r["after_ms"] for r in rows], 0.4, label=after)
    ax.set_xticks(list(x), labels)
    ax.set_xlabel("streams x frames a step")
    ax.set_ylabel("ms a CODEC step (graph replay)")
    ax.set_title(f"{doc.get('gpu')} {doc.get('precision')}, commit {doc.get('git_commit')}, "
                 f"{str(doc.get('date'))[:10]}", fontsize=9)
    ax.legend()
    out = str(Path(path).with_suffix(".png"))
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--change", choices=sorted(CHANGES), default="state")
    parser.add_argument("--precision", default="tf32")
    parser.add_argument("--out", default=None)
    parser.add_argument("--plot", default=None, help="draw this recorded JSON and exit")
    parser.add_argument("--cudnn-benchmark", action="store_true",
                        help="cuDNN picks each convolution's algorithm by timing them "
                             "(torch.backends.cudnn.benchmark) instead of its heuristics, for "
                             "the whole process: compare two processes' runs")
    args = parser.parse_args()
    if args.plot:
        print(plot(args.plot))
        return
    torch.backends.cudnn.benchmark = args.cudnn_benchmark
    _, _, base = build_random("full", seed=0, device="cuda")
    slots = max(s for s, _ in SHAPES)
    before_opts, after_opts = CODEC_OPTIONS.get(args.change, ({}, {}))
    before_codec = StreamingCodec.for_serving(copy.deepcopy(base) if after_opts else base, slots,
                                              args.precision, fast=True, **before_opts)
    after_codec = (StreamingCodec.for_serving(base, slots, args.precision, fast=True,
                                              **after_opts) if after_opts else before_codec)
    rows = []
    for streams, frames in SHAPES:
        result = {"streams": streams, "frames": frames}
        waves = {}
        _, _, install_before, install_after = CHANGES[args.change]
        with install_before():
            result["before_ms"], waves["before"] = one_step(before_codec, streams, frames)
        with install_after():
            result["after_ms"], waves["after"] = one_step(after_codec, streams, frames)
        n = streams * frames
        result["max_abs_diff"] = float((waves["before"] - waves["after"]).abs().max())
        result["after_tflops"] = GFLOP_PER_FRAME * n / result["after_ms"]
        rows.append(result)
        print(f"{streams:3d} x {frames:<3d} before {result['before_ms']:7.2f} ms  after "
              f"{result['after_ms']:7.2f} ms  ({result['after_ms'] / n:.4f} ms a frame, "
              f"{result['after_tflops']:.0f} TFLOP/s)  max |diff| {result['max_abs_diff']:.1e}",
              flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**provenance(precision=args.precision, change=args.change,
                                    cudnn_benchmark=args.cudnn_benchmark), "rows": rows},
                      f, indent=1)
        plot(args.out)


if __name__ == "__main__":
    main()
