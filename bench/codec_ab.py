"""The serving codec's step with one of its changes against the path that change replaced, in
one process on one GPU.

Usage (GPU machine, repo root): ``PYTHONPATH=runtime:bench python bench/codec_ab.py --change
state|upsampler [--precision tf32] [--out X.json]``; ``--plot X.json`` (any machine) draws a
recorded run as ``X.png``.

Changes (``before`` is defined here, ``after`` is the runtime):
- ``upsampler``: the decoder's first block upsamples 1536 -> 768 channels as one GEMM
  (``_CausalTransConv._gemm``) on ``[B, 1 + T, Cin]``. Read as the transposed view of a
  channels-first ``[B, Cin, 1 + T]`` activation, its leading dimension is ``1 + T`` (always
  odd), and cuBLAS ran an unaligned kernel: 6.4 ms of a 36 ms eager CODEC step at 256 streams x
  1 frame on the H100 (``bench/results/h100-census-256-20261205.txt``); the runtime copied it
  row-major first. The fast codec is channels-last now, its activation row-major as it lies:
  ``before`` differs from the runtime only in that GEMM's output, made channels-first.
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
import json
from collections.abc import Iterator
from pathlib import Path

import torch

from breezert.models.codec import CodecStreamState, StreamingCodec, _CausalTransConv, tf32_math
from breezert.random_init import build_random
from breezert_bench.provenance import provenance
from codec_precision import time_step

SHAPES = ((1, 1), (16, 1), (64, 1), (256, 1), (64, 4), (16, 16), (32, 16))
GFLOP_PER_FRAME = 5.0


RUNTIME_GEMM = _CausalTransConv._gemm


def transposed_view_gemm(self: _CausalTransConv, x: torch.Tensor, num_new: int) -> torch.Tensor:
    """``_gemm`` as it was before 5 Dec (fifth session): the transposed view straight into
    ``@``, the result made channels-first; the latent upsamplers (kernel == stride, GEMMs since
    the fast codec went channels-last) as the runtime runs them."""
    if self.history == 0:
        return RUNTIME_GEMM(self, x, num_new)
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
    "state": ("state gathered and scattered", "state in place",
              lambda: patched(StreamingCodec, "decode", gathered_decode), RUNTIME),
}
"""change -> (before's label, after's label, a context that installs before, one that installs
after; ``RUNTIME``: the runtime as it is)."""


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
    change = doc.get("change", "upsampler")  # 5 Dec's files: upsampler
    # a retired change's run (layout, snake, snake-tile) keeps plain labels
    before, after = CHANGES[change][:2] if change in CHANGES else ("before", "after")
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
    codec = StreamingCodec.for_serving(base, slots, args.precision, fast=True)
    rows = []
    for streams, frames in SHAPES:
        result = {"streams": streams, "frames": frames}
        waves = {}
        _, _, install_before, install_after = CHANGES[args.change]
        with install_before():
            result["before_ms"], waves["before"] = one_step(codec, streams, frames)
        with install_after():
            result["after_ms"], waves["after"] = one_step(codec, streams, frames)
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
