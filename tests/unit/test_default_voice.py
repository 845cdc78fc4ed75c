"""The embedded default voice's plumbing (issue 35): ``model.path = "@default"`` (the ``cpu-tiny``
profile's) loads the checkpoint installed in ``DEFAULT_VOICE_DIR``, else random tiny weights as
before a voice ships; ``breezert synth`` without ``--model`` speaks with it, or says none is
installed.

Owns CPU checks with a random tiny checkpoint standing in for the trained voice. Must not: need a
trained voice or a GPU.
"""

from __future__ import annotations

import wave
from pathlib import Path

import pytest
from breezert import runtime_setup
from breezert.cli import main
from breezert.config import EngineConfig, ModelConfig
from breezert.profiles import EMBEDDED_PROFILE, profile_path
from breezert.random_init import write_random_checkpoint
from breezert.runtime_setup import DEFAULT_VOICE, load_engine_checkpoint, resolve_model_path

pytestmark = pytest.mark.unit


@pytest.fixture()
def voice_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "voices" / "default"
    monkeypatch.setattr(runtime_setup, "DEFAULT_VOICE_DIR", folder)
    return folder


def test_the_embedded_profile_names_the_default_voice() -> None:
    assert EngineConfig.from_file(profile_path(EMBEDDED_PROFILE)).model.path == DEFAULT_VOICE


def test_default_resolves_to_the_installed_voice_else_to_random_weights(voice_dir: Path) -> None:
    cfg = ModelConfig(path=DEFAULT_VOICE, device="cpu")
    assert resolve_model_path(DEFAULT_VOICE) is None and resolve_model_path("x/y") == "x/y"
    assert load_engine_checkpoint(cfg).path is None  # random tiny, as before a voice ships
    write_random_checkpoint(voice_dir, "tiny", seed=3)
    assert resolve_model_path(DEFAULT_VOICE) == str(voice_dir)
    ckpt = load_engine_checkpoint(cfg)
    assert ckpt.path is not None and Path(ckpt.path) == voice_dir


def test_synth_without_a_model_uses_the_default_voice(voice_dir: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture) -> None:
    args = ["synth", "--text", "Hi.", "--out", str(tmp_path / "a.wav"), "--max-frames", "3"]
    with pytest.raises(SystemExit, match="no default voice is installed"):
        main(args)
    write_random_checkpoint(voice_dir, "tiny")
    assert main(args) == 0
    with wave.open(str(tmp_path / "a.wav")) as f:
        assert f.getnframes() > 0
