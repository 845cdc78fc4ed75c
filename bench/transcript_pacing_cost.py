"""What livekit-agents' transcript synchronizer (RoomIO's default) costs an agent job's loop:
its hyphenation table's first build (``tokenize.basic.hyphenate_word``, which the plugin's
``TTS.prewarm`` now does off the loop) and its speaking-rate FFT on 1 s of 24 kHz audio, three
times. Prints JSON.

    PYTHONPATH=bench .venv/bin/python bench/transcript_pacing_cost.py > OUT.json

Owns: this measurement. Must not: start a room or an engine.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import numpy as np
from livekit import rtc
from livekit.agents.tokenize import basic
from livekit.agents.voice.transcription._speaking_rate import SpeakingRateDetector

from breezert_bench.provenance import provenance


def hyphenate_ms() -> tuple[float, float]:
    """The first call (builds the table) and a second one, in ms."""
    t = time.perf_counter()
    basic.hyphenate_word("transcription")
    first = time.perf_counter() - t
    t = time.perf_counter()
    basic.hyphenate_word("another")
    return 1e3 * first, 1e3 * (time.perf_counter() - t)


async def speaking_rate_ms() -> list[float]:
    """The speaking-rate stream over 1 s of noise, three fresh streams, in ms."""
    frame = rtc.AudioFrame(data=(np.random.default_rng(0).standard_normal(24000) * 3000)
                           .astype(np.int16).tobytes(), sample_rate=24000, num_channels=1,
                           samples_per_channel=24000)
    out = []
    for _ in range(3):
        stream = SpeakingRateDetector().stream()
        t = time.perf_counter()
        stream.push_frame(frame)
        stream.end_input()
        async for _ev in stream:
            pass
        out.append(1e3 * (time.perf_counter() - t))
    return out


def main() -> None:
    first, again = hyphenate_ms()
    json.dump({**provenance(device="cpu"),
               "hyphenate_first_ms": first, "hyphenate_again_ms": again,
               "speaking_rate_1s_audio_ms": asyncio.run(speaking_rate_ms())}, sys.stdout,
              indent=1)


if __name__ == "__main__":
    main()
