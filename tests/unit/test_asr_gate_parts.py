"""The ASR gate's parts that need no ASR: the gate's sentences, its pass/fail rule and the Opus
round trip. The ASR runs in ``tests/integration/test_asr_gate.py``; WER in ``test_wer.py``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from breezert_bench.workload import default_texts_path
from breezert_train.asr_gate import GATE_SENTENCES, gate_failures, read_sentences, select
from breezert_train.gate_audio import BreezeSubject, frame_pieces, opus_round_trip

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------ sentences
def test_the_gate_sentences_are_every_40th_of_texts_en() -> None:
    gate = read_sentences(GATE_SENTENCES)
    assert len(gate) == 20 and gate[0].sentence_id == "61-70970-0007"
    assert select(gate, 20) == gate and select(gate, 2) == [gate[0], gate[10]]
    texts = default_texts_path(REPO)
    if texts is None:
        pytest.skip("../shared/bench/texts_en.tsv is not here; the copy is checked where it is")
    assert select(read_sentences(texts), 20) == gate


def test_select_refuses_more_sentences_than_there_are() -> None:
    with pytest.raises(ValueError, match="sentences=21"):
        select(read_sentences(GATE_SENTENCES), 21)


# ------------------------------------------------------------------------------ the rule
def test_gate_failures_name_the_path_and_the_figure() -> None:
    ok = {"mean_wer": {"offline": 0.20, "chunks_1": 0.24, "opus": 0.25}}
    assert gate_failures(ok) == []
    bad = {"mean_wer": {"offline": 0.38, "chunks_1": 0.41, "opus": 0.44}}
    assert gate_failures(bad) == [
        "chunks_1: mean WER 0.410 > 0.400", "opus: mean WER 0.440 > 0.400",
        "opus: mean WER 0.440 is +0.060 from offline (allowed +0.050)",
    ]


# ------------------------------------------------------------------------------ Opus
def test_opus_round_trip_keeps_length_and_waveform() -> None:
    t = np.arange(24000) / 24000
    tone = (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)  # 1 s at 24 kHz
    out = opus_round_trip(frame_pieces(tone))
    assert out.sample_rate == 48000
    # 50 frames of 20 ms carry the second; 3 silent ones follow
    assert len(out.pcm) == 53 * 960
    # the tone comes back at its pitch and level (past Opus's 6.5 ms delay and ramp-up)
    steady = out.pcm[4800:48000]
    spectrum = np.abs(np.fft.rfft(steady))
    assert abs(np.argmax(spectrum) * 48000 / len(steady) - 440) < 2
    assert abs(np.sqrt(np.mean(steady**2)) / (0.3 / np.sqrt(2)) - 1) < 0.1


def test_breeze_paths_carry_the_same_audio() -> None:
    """Same seed on every path: the streams at 1 and 16 frames equal one-shot synthesis."""
    subject = BreezeSubject(None, max_frames_scale=0.5, chunk_sizes=(1, 16))
    assert subject.paths == ("offline", "chunks_1", "chunks_16", "opus")
    audio = subject.render("Hello there, friend.", seed=3)  # 8 frames: 0.64 s
    offline = audio["offline"].pcm
    assert len(offline) == 8 * 1920 and audio["offline"].sample_rate == 24000
    for path in ("chunks_1", "chunks_16"):
        np.testing.assert_allclose(audio[path].pcm, offline, atol=1e-4)
    assert audio["opus"].sample_rate == 48000 and len(audio["opus"].pcm) == (32 + 3) * 960
