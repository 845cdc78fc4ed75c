"""Eight concurrent streams on the tiny CPU model: each request's TTFB and chunk timeline.

Requests arrive staggered (one every 40 ms) and share one ``AsyncEngine``; the scheduler
interleaves their stages, so a newcomer's first chunk does not wait for the others to finish.
The weights are random (``configs/tiny.toml``), so the audio is noise; the timings are real.

    python examples/concurrent_streams.py
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from breezert.async_engine import AsyncEngine
from breezert.config import EngineConfig
from breezert.options import SynthesisOptions
from breezert.request import SynthesisRequest

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tiny.toml"
NUM_STREAMS = 8
ARRIVAL_GAP_S = 0.04
FRAME_S = 0.08  # one codec frame of audio


@dataclass
class Timeline:
    request_id: str
    enqueue_time: float
    chunks: list[tuple[float, int, int]]  # (created_time, frame_start, frame_end)

    @property
    def ttfb_s(self) -> float:
        return self.chunks[0][0] - self.enqueue_time

    @property
    def audio_s(self) -> float:
        return self.chunks[-1][2] * FRAME_S

    @property
    def rtf(self) -> float:
        """Wall time from enqueue to the last chunk, per second of audio."""
        return (self.chunks[-1][0] - self.enqueue_time) / self.audio_s


async def one_stream(engine: AsyncEngine, index: int) -> Timeline:
    await asyncio.sleep(index * ARRIVAL_GAP_S)
    request = SynthesisRequest(
        text=f"This is stream number {index}, speaking over the others.",
        options=SynthesisOptions(seed=index), max_frames=16 + 4 * index, ignore_eos=True,
        request_id=f"stream-{index}",
    )
    timeline = Timeline(str(request.request_id), time.monotonic(), [])
    async for chunk in engine.synthesize(request):
        timeline.chunks.append((chunk.created_time, chunk.frame_start, chunk.frame_end))
    return timeline


def report(timeline: Timeline) -> str:
    steps = " ".join(f"{(t - timeline.enqueue_time) * 1000:.0f}ms[{a}-{b})"
                     for t, a, b in timeline.chunks)
    return (f"{timeline.request_id}: TTFB {timeline.ttfb_s * 1000:6.1f} ms  "
            f"{timeline.audio_s:4.2f} s audio  RTF {timeline.rtf:.3f}\n    {steps}")


async def main() -> None:
    engine = AsyncEngine.from_config(EngineConfig.from_file(CONFIG))
    start = time.monotonic()
    try:
        timelines = await asyncio.gather(*(one_stream(engine, i) for i in range(NUM_STREAMS)))
    finally:
        await engine.aclose()
    wall_s = time.monotonic() - start
    for timeline in timelines:
        print(report(timeline))
    ttfbs = [t.ttfb_s * 1000 for t in timelines]
    audio_s = sum(t.audio_s for t in timelines)
    print(f"summary: {NUM_STREAMS} streams, {audio_s:.2f} s audio in {wall_s:.2f} s wall "
          f"(aggregate RTF {wall_s / audio_s:.3f}), TTFB p50 {statistics.median(ttfbs):.1f} ms, "
          f"max {max(ttfbs):.1f} ms")


if __name__ == "__main__":
    asyncio.run(main())
