"""``breezert init-random`` and ``breezert synth`` end to end on the tiny preset, in-process.

Owns: the CLI contract (exit codes, WAV format, printed timings, field-naming errors) and the
offline invariant that streaming output equals one whole decode. Must not: need a GPU or weights.
"""

from __future__ import annotations

import re
import wave
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from breezert.cli import main
from breezert.loader import Checkpoint, load_checkpoint
from breezert.offline import stream_sequential, synthesize_whole
from breezert.options import SynthesisOptions
from breezert.request import SynthesisRequest

pytestmark = pytest.mark.integration

SAMPLE_RATE = 24000
SAMPLES_PER_FRAME = 1920
FRAMES = re.compile(r"frames\s+(\d+)-(\d+)")


def _run(argv: Sequence[str]) -> int:
    """``main``'s exit status, whether it returns it or argparse exits."""
    try:
        return main([str(a) for a in argv])
    except SystemExit as exc:
        return int(exc.code or 0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("cli") / "tiny"
    assert _run(["init-random", "--preset", "tiny", "--out", out]) == 0
    return out


def _synth(model: Path, out: Path, *extra: str, frames: int = 24) -> None:
    argv = ["synth", "--model", model, "--text", "Hello from Breeze.", "--out", out,
            "--max-frames", str(frames), "--ignore-eos", *extra]
    assert _run(argv) == 0


def _ranges(stdout: str) -> list[tuple[int, int]]:
    return [(int(a), int(b)) for a, b in FRAMES.findall(stdout)]


# ----------------------------------------------------------------------------- init-random


def test_init_random_writes_released_layout(model_dir: Path) -> None:
    for name in ("config.json", "generation_config.json", "tokenizer.json",
                 "model.safetensors.index.json", "model-00001-of-00001.safetensors",
                 "audio_tokenizer/config.json", "audio_tokenizer/model.safetensors",
                 "audio_tokenizer/preprocessor_config.json"):
        assert (model_dir / name).is_file(), name


def test_init_random_prints_what_it_wrote(tmp_path: Path, capsys) -> None:
    assert _run(["init-random", "--preset", "tiny", "--out", tmp_path / "m", "--seed", "4"]) == 0
    out = capsys.readouterr().out
    assert f"wrote random tiny checkpoint to {tmp_path / 'm'}" in out
    assert "11,736,224 live parameters" in out


def test_full_preset_on_meta_prints_exact_count(tmp_path: Path, capsys) -> None:
    assert _run(["init-random", "--preset", "full", "--meta", "--out", tmp_path / "f"]) == 0
    assert "2,850,155,520" in capsys.readouterr().out
    assert not (tmp_path / "f").exists()


# ----------------------------------------------------------------------------- synth


def test_synth_streams_and_writes_wav(model_dir: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "x.wav"
    _synth(model_dir, out, "--seed", "1")
    stdout = capsys.readouterr().out
    with wave.open(str(out), "rb") as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, SAMPLE_RATE)
        assert w.getnframes() == 24 * SAMPLES_PER_FRAME
    lines = [line for line in stdout.splitlines() if FRAMES.search(line)]
    assert "first chunk" in lines[0]
    assert all("first chunk" not in line for line in lines[1:])
    assert _ranges(stdout) == [(0, 1), (1, 3), (3, 7), (7, 15), (15, 24)]
    assert re.search(r"RTF \d+\.\d+", stdout)


def test_synth_custom_chunks(model_dir: Path, tmp_path: Path, capsys) -> None:
    _synth(model_dir, tmp_path / "x.wav", "--chunks", "2,3", frames=10)
    assert _ranges(capsys.readouterr().out) == [(0, 2), (2, 5), (5, 8), (8, 10)]


def test_synth_seed_is_reproducible(model_dir: Path, tmp_path: Path) -> None:
    paths = {name: tmp_path / f"{name}.wav" for name in ("a", "b", "c")}
    for name, seed in (("a", "1"), ("b", "1"), ("c", "2")):
        _synth(model_dir, paths[name], "--seed", seed, frames=6)
    assert paths["a"].read_bytes() == paths["b"].read_bytes()
    assert paths["a"].read_bytes() != paths["c"].read_bytes()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--text", "  "], r"text="),
        (["--temperature", "-1"], r"temperature=-1\.0 must be >= 0"),
        (["--top-p", "1.5"], r"top_p=1\.5 must be in \(0, 1\]"),
        (["--top-p", "nan"], r"top_p=nan must be finite"),
        (["--speaker", "[S12]"], r"speaker='\[S12\]' is unknown"),
        (["--chunks", "0,1"], r"argument --chunks: --chunks=\[0, 1\]: entries must be ints in 1\.\."),
        (["--chunks", "1,x"], r"argument --chunks: '1,x' is not a comma list of ints"),
    ],
    ids=["blank-text", "negative-temperature", "top-p-1.5", "top-p-nan", "speaker-S12",
         "chunks-0", "chunks-x"],
)
def test_synth_bad_input_exits_2(
    model_dir: Path, tmp_path: Path, capsys, extra: list[str], message: str
) -> None:
    out = tmp_path / "bad.wav"
    argv = ["synth", "--model", model_dir, "--text", "Hi", "--out", out, *extra]
    assert _run(argv) == 2
    err = capsys.readouterr().err
    assert re.search(rf"error: {message}", err), err  # the message starts with the field
    assert not out.exists()


def test_synth_missing_model_folder(tmp_path: Path, capsys) -> None:
    missing = tmp_path / "no-such-model"
    argv = ["synth", "--model", missing, "--text", "Hi", "--out", tmp_path / "x.wav"]
    assert _run(argv) == 2
    assert str(missing) in capsys.readouterr().err


# ----------------------------------------------------------------------------- offline paths


@pytest.fixture(scope="module")
def ckpt(model_dir: Path) -> Checkpoint:
    return load_checkpoint(model_dir)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"chunk_schedule": (1, 2, 4, 8, 16)},
        {"chunk_schedule": (3, 5),
         "options": SynthesisOptions(seed=7, instructions="A calm voice.", cfg_scale=2.0)},
    ],
    ids=["plain", "design_cfg2"],
)
def test_streaming_equals_whole(ckpt: Checkpoint, kwargs: dict) -> None:
    def request() -> SynthesisRequest:
        return SynthesisRequest(text="Hello there.", max_frames=20, ignore_eos=True,
                                **{"options": SynthesisOptions(seed=7), **kwargs})

    chunks = list(stream_sequential(ckpt, request()))
    assert [c.frame_start for c in chunks[1:]] == [c.frame_end for c in chunks[:-1]]
    assert chunks[-1].frame_end == 20 and chunks[-1].is_final
    streamed = np.concatenate([c.pcm for c in chunks])
    whole = synthesize_whole(ckpt, request())
    assert streamed.shape == whole.shape == (20 * SAMPLES_PER_FRAME,)
    np.testing.assert_allclose(streamed, whole, atol=1e-5, rtol=0)


def test_synth_clones_a_reference_wav(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ref = tmp_path / "ref.wav"
    tone = (np.sin(np.arange(24000) * 2 * np.pi * 220 / 16000) * 8000).astype("<i2")
    with wave.open(str(ref), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(tone.tobytes())
    out = tmp_path / "clone.wav"
    _synth(model_dir, out, "--reference-audio", str(ref), "--reference-text", "A tone.",
           frames=6)
    with wave.open(str(out), "rb") as w:
        assert w.getnframes() == 6 * 1920
    argv = ["synth", "--model", model_dir, "--text", "x", "--out", tmp_path / "no.wav",
            "--reference-audio", str(ref)]
    assert _run(argv) == 2  # audio without its transcript
    assert "--reference-audio and --reference-text go together" in capsys.readouterr().err
