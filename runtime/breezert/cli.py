"""The ``breezert`` command line: ``init-random``, ``synth``, ``serve``.

Owns: argument parsing and printing. Must not: hold model or scheduling logic; every command
calls into the library.
"""

from __future__ import annotations

import argparse
import sys
import time
import wave
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np

from breezert.errors import BreezeRTError, InvalidRequest
from breezert.request import check_chunk_schedule


def _chunks(value: str) -> tuple[int, ...]:
    """``--chunks 1,2,4``: parsed here, checked by the request's own rule (one message)."""
    try:
        return check_chunk_schedule([int(v) for v in value.split(",") if v.strip()], "--chunks")
    except ValueError as exc:  # int() of a non-number, or InvalidRequest
        bad = f"{value!r} is not a comma list of ints"
        text = str(exc) if isinstance(exc, InvalidRequest) else bad
        raise argparse.ArgumentTypeError(text) from None


def config_argument(value: str) -> Path:
    """``--config``: a TOML path, or the name of a packaged profile (``cpu-tiny``). Also the
    argument type of ``breezert-bench``'s ``--config`` (one message for a missing profile)."""
    from breezert.profiles import config_path

    try:
        return config_path(value)
    except FileNotFoundError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="breezert", description=__doc__.splitlines()[0],
        epilog="The serving benchmark and the soak check are the lab's `breezert-bench` "
               "(bench/; `make test` installs it).")
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
    synth.add_argument("--model", default=None, type=Path,
                       help="checkpoint folder (default: the embedded default voice)")
    synth.add_argument("--text", required=True)
    synth.add_argument("--out", required=True, type=Path)
    synth.add_argument("--speaker", default="[S0]")
    synth.add_argument("--instructions", default=None)
    synth.add_argument("--reference-audio", type=Path, default=None,
                       help="WAV of the voice to clone (needs --reference-text)")
    synth.add_argument("--reference-text", default=None,
                       help="transcript of --reference-audio")
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

    serve = sub.add_parser("serve", help="HTTP/WebSocket/WebRTC server with the demo page")
    serve.add_argument("--config", type=config_argument, default=None,
                       help="engine profile, a TOML path or a packaged profile name (cpu-tiny) "
                            "(default: built-in defaults, tiny random model)")
    serve.add_argument("--model", default=None, help="checkpoint folder (sets model.path)")
    serve.add_argument("--host", default=None, help="bind address (default: [serving] host)")
    serve.add_argument("--port", type=int, default=None, help="bind port (default: [serving] port)")
    serve.add_argument("--ice-address", action="append", default=None, metavar="IP",
                       help="gather WebRTC candidates on this address only (repeatable; default: "
                            "every interface, plus loopback when bound to loopback)")
    serve.add_argument("--frame-ms", type=int, choices=[10, 20], default=20,
                       help="default WebRTC frame duration")
    serve.add_argument("--device", choices=["cpu", "cuda", "auto"], default=None,
                       help="sets model.device")
    serve.add_argument("--allow-unauthenticated", action="store_true", default=None,
                       help="serve a non-loopback --host with no [serving] auth_token (sets "
                            "serving.allow_unauthenticated); without it such a bind refuses to "
                            "start. Browser pages of other origins are refused unless listed "
                            "in serving.allowed_origins; WebRTC peers must connect within "
                            "serving.webrtc_connect_timeout_s (default 10 s)")
    serve.add_argument("--shutdown-grace", type=float, default=None, metavar="S",
                       help="on SIGTERM/SIGINT: refuse new work (503 + Retry-After, /readyz 503), "
                            "close idle sockets at once, give running turns up to S seconds "
                            "(default: [serving] shutdown_grace_s, 10)")
    serve.add_argument("--no-access-log", action="store_true", help="no per-request log line")
    serve.add_argument("--max-frames", type=int, default=None,
                       help="server policy: codec frames per request at most (80 ms each)")
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
    from breezert.loader import load_checkpoint
    from breezert.offline import stream_sequential
    from breezert.options import SynthesisOptions
    from breezert.request import SynthesisRequest

    from breezert.runtime_setup import DEFAULT_VOICE, DEFAULT_VOICE_DIR, resolve_model_path

    model = args.model or resolve_model_path(DEFAULT_VOICE)
    if model is None:
        raise SystemExit(f"no default voice is installed (in {DEFAULT_VOICE_DIR}): "
                         "pass --model DIR")
    ckpt = load_checkpoint(model, device=args.device)
    options = SynthesisOptions(
        speaker=args.speaker, instructions=args.instructions, cfg_scale=args.cfg_scale,
        seed=args.seed, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        repetition_penalty=args.repetition_penalty,
    )
    request = SynthesisRequest(
        text=args.text, options=options,
        reference=_reference(ckpt, args.reference_audio, args.reference_text),
        chunk_schedule=args.chunks, max_frames=args.max_frames, ignore_eos=args.ignore_eos,
    )
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


def cmd_serve(args: argparse.Namespace) -> int:
    import logging

    cfg = serve_config(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    import asyncio

    return asyncio.run(_serve(cfg, args))


def serve_config(  # type: ignore[no-untyped-def]
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
):
    """The config ``breezert serve`` runs: the file, the command line over it, then the
    environment (``apply_env_overrides``). Raises ``InvalidConfig`` for a bind it refuses."""
    from breezert.config import EngineConfig, apply_env_overrides
    from breezert.errors import InvalidConfig

    cfg = EngineConfig.from_file(args.config) if args.config else EngineConfig()
    model = {k: v for k, v in {"path": args.model, "device": args.device}.items() if v is not None}
    serving = {k: v for k, v in {"host": args.host, "port": args.port,
                                 "allow_unauthenticated": args.allow_unauthenticated,
                                 "shutdown_grace_s": args.shutdown_grace}.items()
               if v is not None}
    cfg = EngineConfig.from_dict({
        **cfg.model_dump(), "model": {**cfg.model.model_dump(), **model},
        "serving": {**cfg.serving.model_dump(), **serving},
    }, source="command line")
    cfg = apply_env_overrides(cfg, environ)
    if (problem := cfg.serving.binding_problem()) is not None:
        raise InvalidConfig(problem)
    return cfg


async def _serve(cfg, args: argparse.Namespace) -> int:  # type: ignore[no-untyped-def]
    """Listens at once, builds the engine in the background (progress on the console and in
    ``/readyz``), serves until SIGTERM/SIGINT, then drains within ``serving.shutdown_grace_s``."""
    import asyncio
    import signal

    from aiohttp import web
    from aiohttp.log import access_logger

    from breezert.async_engine import AsyncEngine
    from breezert.runtime_setup import freeze_startup_heap
    from breezert.server import health
    from breezert.server.app import create_app
    from breezert.server.state import STATE

    policy = {"max_frames": args.max_frames} if args.max_frames else {}
    app = create_app(None, cfg.serving, request_options=policy,
                     ice_addresses=args.ice_address, frame_ms=args.frame_ms)
    app[health.LIFECYCLE].console = health.ConsoleProgress()

    def build(progress: Callable[..., None]) -> AsyncEngine:
        engine = AsyncEngine.from_config(cfg, progress=progress)
        freeze_startup_heap()  # the server's engine lives as long as the process
        return engine

    health.build_engine_in_background(app, build)
    grace = cfg.serving.shutdown_grace_s
    # after the drain nothing should be left: give handlers one second, then cancel them
    runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=1.0,
                           access_log=None if args.no_access_log else access_logger)
    await runner.setup()
    host, port = cfg.serving.host, cfg.serving.port
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0][1] if runner.addresses else port
    shown = f"[{host}]" if ":" in host else host
    print(f"BreezeRT serving on http://{shown}:{bound}/  (demo page; API under /v1/, "
          f"/healthz, /readyz, /metrics); starting the engine", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
        print(f"breezert: shutting down (grace {grace:g} s)", flush=True)
        summary = await health.drain(app, grace)
        print(f"breezert: drained in {summary['drain_s']:.2f} s "
              f"(closed {summary['closed_idle']} idle connections; still running: "
              f"{summary['left_running']})", flush=True)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        await runner.cleanup()
        engine = app[STATE].engine
        if engine is not None:
            await engine.aclose()
    return 0


def _reference(ckpt, audio: Path | None, text: str | None):  # type: ignore[no-untyped-def]
    """``Reference`` from a WAV file and its transcript (None when neither is given)."""
    from breezert.reference_audio import encode_reference
    from breezert.request import Reference

    if audio is None and text is None:
        return None
    if audio is None or not text:
        raise ValueError("--reference-audio and --reference-text go together")
    if ckpt.codec_encoder is None:
        raise ValueError(f"{ckpt.path}: the checkpoint has no audio-tokenizer encoder")
    samples, rate = read_wav(audio)
    return Reference(ref_text=text, ref_codes=encode_reference(ckpt.codec_encoder, samples, rate))


def read_wav(path: Path) -> tuple[np.ndarray, int]:
    """PCM16 WAV → (samples ``[n]`` or ``[n, channels]`` int16, sample rate)."""
    if not path.is_file():
        raise FileNotFoundError(f"--reference-audio: no such file: {path}")
    try:
        with wave.open(str(path), "rb") as w:
            if w.getsampwidth() != 2:
                raise ValueError(f"--reference-audio: {path} is not 16-bit PCM")
            data = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")
            return data.reshape(-1, w.getnchannels()), w.getframerate()
    except wave.Error as exc:
        raise ValueError(f"--reference-audio: {path} is not a WAV file ({exc})") from None


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
    commands = {"init-random": cmd_init_random, "synth": cmd_synth, "serve": cmd_serve}
    try:
        return commands[args.command](args)
    except (BreezeRTError, ValueError, FileNotFoundError) as exc:
        print(f"breezert {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        extra = _EXTRA_OF.get((exc.name or "").partition(".")[0])
        if extra is None:
            raise
        print(f"breezert {args.command}: error: {exc.name} is not installed; this command "
              f"needs: pip install 'breezert[{extra}]'", file=sys.stderr)
        return 2


_EXTRA_OF = {"torch": "engine", "safetensors": "engine", "tokenizers": "engine",
             "aiohttp": "serve", "aiortc": "serve", "av": "serve"}
"""The distribution extra that brings each optional import (the core installs without torch)."""


if __name__ == "__main__":
    sys.exit(main())
