"""Pins the reference-audio encoder (Mimi) to qwen_tts' ``encode`` codes (tiny weights, fp32, CPU).

Owns: ``encoder.*`` released-name loading (direct and through ``load_checkpoint``) and the exact
17 x 16 ``ref_codes`` of ``codec_golden``. Must not: regenerate fixtures or test the decoder.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from breezert.loader import load_checkpoint
from breezert.models.codec_encoder import CodecEncoder
from breezert.reference_audio import encode_reference
from breezert.tokenizer import build_byte_tokenizer
from tests.golden._paths import golden_dir

pytestmark = pytest.mark.golden

PREFIX = "encoder."


@pytest.fixture(scope="module")
def golden() -> Path:
    return golden_dir()


@pytest.fixture(scope="module")
def cases(golden: Path) -> dict[str, torch.Tensor]:
    return load_file(str(golden / "codec_golden.safetensors"))


@pytest.fixture(scope="module")
def encoder(golden: Path) -> CodecEncoder:
    tok = golden / "model" / "audio_tokenizer"
    enc = CodecEncoder(json.loads((tok / "config.json").read_text())["encoder_config"])
    weights = load_file(str(tok / "model.safetensors"))
    state = {k[len(PREFIX):]: v for k, v in weights.items() if k.startswith(PREFIX)}
    assert set(enc.state_dict()) == set(state)
    enc.load_state_dict(state, strict=True)
    return enc.eval()


def test_encoder_reproduces_golden_codes(encoder: CodecEncoder, cases: dict) -> None:
    wav, want = cases["ref_wav"], cases["ref_codes"]  # [31200], [17, 16]
    assert want.shape == (math.ceil(wav.shape[0] / 1920), 16)
    got = encoder.encode(wav[None])[0]
    assert got.dtype == torch.int64
    assert torch.equal(got, want.long()), f"{int((got == want).sum())}/{want.numel()} codes match"


def test_batched_rows_equal_single(encoder: CodecEncoder, cases: dict) -> None:
    wav = cases["ref_wav"]
    batch = torch.stack([wav, wav.flip(0)])
    got = encoder.encode(batch)
    assert torch.equal(got[0], cases["ref_codes"].long())
    assert torch.equal(got[1], encoder.encode(wav.flip(0)[None])[0])


def test_encode_reference_at_24k_matches(encoder: CodecEncoder, cases: dict) -> None:
    wav = cases["ref_wav"].numpy()
    assert encode_reference(encoder, wav, 24000).tolist() == cases["ref_codes"].tolist()
    stereo = np.stack([wav, wav], axis=1)  # [n, 2]: the mean is the same signal
    assert encode_reference(encoder, stereo, 24000).tolist() == cases["ref_codes"].tolist()


def test_loader_builds_the_golden_encoder(
    golden: Path, cases: dict, tmp_path: Path
) -> None:
    root = tmp_path / "model"
    root.mkdir()
    for entry in (golden / "model").iterdir():
        (root / entry.name).symlink_to(entry)
    (root / "tokenizer.json").write_text(build_byte_tokenizer().to_str())
    ckpt = load_checkpoint(root, dtype=torch.float32)
    assert ckpt.codec_encoder is not None
    assert all(p.dtype == torch.float32 for p in ckpt.codec_encoder.parameters())
    got = ckpt.codec_encoder.encode(cases["ref_wav"][None])[0]
    assert torch.equal(got, cases["ref_codes"].long())
