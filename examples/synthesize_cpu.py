"""The smallest end-to-end use of BreezeRT: stream one request to a WAV on the CPU.

Random tiny weights (``configs/tiny.toml``), so expect noise, not speech. The main loop this
drives is ``Engine.step`` in ``runtime/breezert/engine.py``.

    python examples/synthesize_cpu.py [out.wav]
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import numpy as np

from breezert.async_engine import AsyncEngine
from breezert.cli import write_wav
from breezert.config import EngineConfig
from breezert.options import SynthesisOptions
from breezert.request import SynthesisRequest

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tiny.toml"


async def main(out: Path) -> None:
    engine = AsyncEngine.from_config(EngineConfig.from_file(CONFIG))
    request = SynthesisRequest(text="Hello from BreezeRT.", options=SynthesisOptions(seed=0),
                               max_frames=25, ignore_eos=True)
    chunks = [chunk async for chunk in engine.synthesize(request)]
    await engine.aclose()
    audio = np.concatenate([chunk.pcm for chunk in chunks])
    write_wav(out, audio, chunks[0].sample_rate)
    print(f"wrote {out}: {len(chunks)} chunks, {len(audio) / chunks[0].sample_rate:.2f} s of audio")


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1] if len(sys.argv) > 1 else "synthesize_cpu.wav")))
