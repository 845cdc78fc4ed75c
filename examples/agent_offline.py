"""A LiveKit ``AgentSession`` speaking two turns with BreezeRT, with no server and no room.

    python examples/agent_offline.py                      # embedded tiny model, in-process
    python examples/agent_offline.py --config configs/tiny.toml --out .cache/turns.wav
    python examples/agent_offline.py --base-url http://127.0.0.1:8080   # a `breezert serve`

The agent's audio goes to ``AudioSourceOutput``: a real ``rtc.AudioSource`` that plays in real
time (its bounded queue paces the session exactly as a room would), whose ``queued_duration`` is
reported to the engine as playback feedback. Turn 1 is ``say()`` of a whole text; turn 2 is
``say()`` of text streamed word by word, as an LLM writes it, so sentences reach the engine while
the turn is already speaking. Per turn it prints the TTFB (first text sent -> first audio), and
it writes everything played to a WAV. The embedded model has random weights: the WAV is noise,
and each sentence runs to ``--max-frames`` (80 ms per frame) because random weights never stop.
"""

from __future__ import annotations

import argparse
import asyncio
import time
import wave
from collections.abc import AsyncIterator
from pathlib import Path

from livekit import rtc
from livekit.agents import Agent, AgentSession
from livekit.agents.metrics import TTSMetrics

from breezert_agent import TTS
from breezert_agent.playout import AudioSourceOutput

TURN_1 = "Hello from BreezeRT. This whole turn is one engine request."
TURN_2 = "Now the text arrives word by word. Each sentence joins the running request!"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(".cache/agent_offline.wav"))
    parser.add_argument("--max-frames", type=int, default=15,
                        help="frame limit per sentence (80 ms each; default 15 = 1.2 s)")
    parser.add_argument("--config", default=None, help="engine TOML (default: embedded tiny)")
    parser.add_argument("--base-url", default=None, help="a `breezert serve` to use instead")
    parser.add_argument("--speaker", default="[S0]")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


async def stream_words(text: str, delay_s: float = 0.03) -> AsyncIterator[str]:
    """``text`` the way an LLM streams it: one word at a time."""
    for i, word in enumerate(text.split(" ")):
        yield word if i == 0 else " " + word
        await asyncio.sleep(delay_s)


def write_wav(path: Path, frames: list[rtc.AudioFrame], sample_rate: int) -> float:
    path.parent.mkdir(parents=True, exist_ok=True)
    pcm = b"".join(bytes(frame.data) for frame in frames)
    with wave.open(str(path), "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(sample_rate)
        wav.writeframes(pcm)
    return len(pcm) / 2 / sample_rate


async def run(args: argparse.Namespace) -> dict[str, object]:
    if args.base_url is None:  # what a worker's prewarm_fnc does: load the model once
        from breezert.async_engine import AsyncEngine  # in-process only: remote needs no torch

        start_time = time.monotonic()
        await asyncio.get_running_loop().run_in_executor(None, AsyncEngine.shared, args.config)
        print(f"engine loaded and warmed in {time.monotonic() - start_time:.2f} s")
        tts = TTS(config=args.config, max_frames=args.max_frames, speaker=args.speaker,
                  seed=args.seed)
    else:
        tts = TTS(base_url=args.base_url, max_frames=args.max_frames, speaker=args.speaker,
                  seed=args.seed)
    ttfbs: list[float] = []
    tts.on("metrics_collected", lambda m: ttfbs.append(m.ttfb) if isinstance(m, TTSMetrics)
           else None)

    played: list[rtc.AudioFrame] = []
    output = AudioSourceOutput(sample_rate=tts.sample_rate, on_frame=played.append)
    tts.attach_audio_output(output)  # the source's queue -> engine playback feedback
    session: AgentSession = AgentSession(tts=tts)
    session.output.audio = output
    await session.start(Agent(instructions="An offline demo agent."))

    turns = []
    for label, text in (("say(text)", TURN_1), ("say(streamed words)", stream_words(TURN_2))):
        start_time = time.monotonic()
        num_frames_before = len(played)
        await session.say(text)
        audio_s = sum(f.duration for f in played[num_frames_before:])
        ttfb_s = ttfbs[-1] if ttfbs else float("nan")
        turns.append({"turn": label, "ttfb_s": ttfb_s, "audio_s": audio_s,
                      "wall_s": time.monotonic() - start_time})
        print(f"turn {len(turns)} {label:20s} TTFB {ttfb_s * 1000:7.1f} ms   "
              f"audio {audio_s:5.2f} s   played in {time.monotonic() - start_time:5.2f} s")

    await session.aclose()
    await output.aclose()
    await tts.aclose()
    total_s = write_wav(args.out, played, tts.sample_rate)
    print(f"wrote {args.out} ({total_s:.2f} s of audio, {tts.sample_rate} Hz mono)")
    return {"turns": turns, "wav": str(args.out), "audio_s": total_s}


def main(argv: list[str] | None = None) -> int:
    asyncio.run(run(parse_args(argv)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
