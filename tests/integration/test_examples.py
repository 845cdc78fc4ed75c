"""``examples/`` run as a user runs them: ``python examples/<name>.py`` from the repo root.

Owns: that each example finishes and prints what its docstring promises. Must not check timings
(they vary by machine), only that they are there and consistent.
"""

from __future__ import annotations

import re
import subprocess
import sys
import wave
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_example(name: str, *args: str) -> str:
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "examples" / name), *args], cwd=REPO_ROOT,
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_concurrent_streams_prints_ttfb_and_timeline_per_request() -> None:
    stdout = run_example("concurrent_streams.py")
    heads = re.findall(r"^(stream-\d): TTFB +([\d.]+) ms +([\d.]+) s audio +RTF ([\d.]+)$",
                       stdout, re.MULTILINE)
    assert [h[0] for h in heads] == [f"stream-{i}" for i in range(8)]
    assert all(float(ttfb) > 0 and float(rtf) > 0 for _, ttfb, _, rtf in heads)
    timelines = re.findall(r"^    (.+)$", stdout, re.MULTILINE)
    assert len(timelines) == 8
    for (_, _, audio_s, _), line in zip(heads, timelines):
        ranges = [(int(a), int(b)) for a, b in re.findall(r"\d+ms\[(\d+)-(\d+)\)", line)]
        assert ranges[:4] == [(0, 1), (1, 3), (3, 7), (7, 15)]  # the default schedule
        assert [a for a, _ in ranges[1:]] == [b for _, b in ranges[:-1]]
        assert ranges[-1][1] * 0.08 == pytest.approx(float(audio_s))
    assert re.search(r"^summary: 8 streams, .* \(aggregate RTF [\d.]+\), TTFB p50 [\d.]+ ms",
                     stdout, re.MULTILINE)


def test_synthesize_cpu_writes_a_wav(tmp_path: Path) -> None:
    out = tmp_path / "hello.wav"
    stdout = run_example("synthesize_cpu.py", str(out))
    assert f"wrote {out}: 5 chunks, 2.00 s of audio" in stdout
    with wave.open(str(out), "rb") as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 24000)
        assert w.getnframes() == 25 * 1920
