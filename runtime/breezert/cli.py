"""The ``breezert`` command line: ``init-random``, ``synth`` (and later ``serve``, ``bench``).

Owns: argument parsing and printing. Must not: hold model or scheduling logic; every command
calls into the library.
"""

from __future__ import annotations

import argparse
import sys
import time
import wave
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from breezert.errors import BreezeRTError


def _chunks(value: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--chunks: {value!r} is not a comma list of ints")
    if not sizes or any(s <= 0 for s in sizes):
        raise argparse.ArgumentTypeError(f"--chunks: {value!r} needs positive frame counts")
    return sizes


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="breezert", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    init = sub.add_parser("init-random", help="write a random-weight checkpoint (released layout)")
    init.add_argument("--preset", choices=["tiny", "full"], default="tiny")
    init.add_argument("--out", required=True, type=Path)
    init.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                      help="weight dtype (default: float32 for tiny, bfloat16 for full)")
    init.add_argument("--seed", type=int, default=0)
    init.add_argument("--tokenizer", type=Path, default=None,
                      help="tokenizer.json to copy (default: a built-in byte-level tokenizer)")
    init.add_argument("--meta", action="store_true",
                      help="build on the meta device and print the parameter count only")

    synth = sub.add_parser("synth", help="stream one utterance to a WAV file")
    synth.add_argument("--model", required=True, type=Path, help="checkpoint folder")
    synth.add_argument("--text", required=True)
    synth.add_argument("--out", required=True, type=Path)
    synth.add_argument("--speaker", default="[S0]")
    synth.add_argument("--instructions", default=None)
    synth.add_argument("--cfg-scale", type=float, default=1.0)
    synth.add_argument("--seed", type=int, default=0)
    synth.add_argument("--temperature", type=float, default=None)
    synth.add_argument("--top-k", type=int, default=None)
    synth.add_argument("--top-p", type=float, default=None)
    synth.add_argument("--repetition-penalty", type=float, default=None)
    synth.add_argument("--max-frames", type=int, default=None)
    synth.add_argument("--ignore-eos", action="store_true")
    synth.add_argument("--chunks", type=_chunks, default=(1, 2, 4, 8, 16),
                       help="frames per chunk, last repeating (default 1,2,4,8,16)")
    synth.add_argument("--device", default="cpu")
    return parser


def cmd_init_random(args: argparse.Namespace) -> int:
    from breezert.random_init import count_live_parameters, write_random_checkpoint

    if args.meta:
        print(f"{args.preset}: {count_live_parameters(args.preset):,} live parameters")
        return 0
    path = write_random_checkpoint(
        args.out, preset=args.preset, dtype=args.dtype, seed=args.seed, tokenizer=args.tokenizer
    )
    print(f"wrote random {args.preset} checkpoint to {path} "
          f"({count_live_parameters(args.preset):,} live parameters)")
    return 0


def cmd_synth(args: argparse.Namespace) -> int:
    import torch

    from breezert.loader import load_checkpoint
    from breezert.offline import default_sampling, stream_sequential
    from breezert.request import SynthesisRequest

    ckpt = load_checkpoint(args.model, device=args.device)
    base = default_sampling(ckpt)
    overrides = {
        "temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p,
        "repetition_penalty": args.repetition_penalty,
    }
    import dataclasses

    sampling = dataclasses.replace(base, **{k: v for k, v in overrides.items() if v is not None})
    request = SynthesisRequest(
        text=args.text, speaker=args.speaker, instructions=args.instructions,
        cfg_scale=args.cfg_scale, sampling=sampling, seed=args.seed,
        chunk_schedule=args.chunks, max_frames=args.max_frames, ignore_eos=args.ignore_eos,
    )
    torch.manual_seed(args.seed)
    start = time.monotonic()
    pieces: list[np.ndarray] = []
    for chunk in stream_sequential(ckpt, request):
        at_ms = (chunk.created_time - start) * 1000
        label = "first chunk" if not pieces else "chunk"
        print(f"{label:>11}: frames {chunk.frame_start:4d}-{chunk.frame_end:<4d} "
              f"at {at_ms:8.1f} ms ({chunk.duration_s * 1000:.0f} ms audio)")
        pieces.append(chunk.pcm)
    elapsed = time.monotonic() - start
    audio = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.float32)
    write_wav(args.out, audio, ckpt.config.codec.sample_rate)
    seconds = len(audio) / ckpt.config.codec.sample_rate
    rtf = elapsed / seconds if seconds else float("inf")
    print(f"wrote {args.out}: {seconds:.2f} s of audio in {elapsed:.2f} s (RTF {rtf:.3f})")
    return 0


def write_wav(path: Path, audio: np.ndarray, sample_rate: int) -> None:
    """Mono 16-bit PCM WAV."""
    path.parent.mkdir(parents=True, exist_ok=True)
    pcm = (np.clip(audio, -1.0, 1.0) * 32767.0).round().astype("<i2")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        w.writeframes(pcm.tobytes())


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    commands = {"init-random": cmd_init_random, "synth": cmd_synth}
    try:
        return commands[args.command](args)
    except (BreezeRTError, ValueError, FileNotFoundError) as exc:
        print(f"breezert {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
