"""Reference-audio encoder unit tests on a tiny random Mimi encoder: shapes, causality, the SPEC
§2.7 preprocessing (mono mean, 24 kHz length), input errors and the random-checkpoint round trip.

Owns CPU-only checks of ``breezert.models.codec_encoder`` and ``breezert.reference_audio``; the
golden codes live in ``tests/golden/test_codec_encoder_golden.py``. Must not read fixtures.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from breezert.errors import InvalidRequest
from breezert.loader import CODEC_DIR, SINGLE_FILE, CheckpointError, load_checkpoint
from breezert.models.codec_encoder import CodecEncoder, init_codec_encoder_random_
from breezert.models.config import BreezeConfig
from breezert.random_init import build_random_codec_encoder, write_random_checkpoint
from breezert.constants import MAX_REFERENCE_S
from breezert.reference_audio import encode_reference, num_resampled, to_mono_24k
from breezert.request import Reference

pytestmark = pytest.mark.unit

SPF = 1920  # samples per frame at 24 kHz
SEED = 5


@pytest.fixture(scope="module")
def encoder() -> CodecEncoder:
    enc = CodecEncoder(BreezeConfig.tiny().codec_encoder_json)
    return init_codec_encoder_random_(enc, torch.Generator().manual_seed(0)).eval()


@pytest.fixture(scope="module")
def noise() -> np.ndarray:
    return (0.3 * np.random.default_rng(0).standard_normal(3 * SPF + 77)).astype(np.float32)


class _Spy:
    """Wraps ``encoder.encode`` to record the waveform shapes it receives."""

    def __init__(self, encoder: CodecEncoder) -> None:
        self.encoder, self.shapes = encoder, []

    def __call__(self, wav: torch.Tensor) -> torch.Tensor:
        self.shapes.append(tuple(wav.shape))
        return CodecEncoder.encode(self.encoder, wav)


# ----------------------------------------------------------------------------- the module


def test_state_dict_names_match_the_released_layout() -> None:
    with torch.device("meta"):
        tiny = CodecEncoder(BreezeConfig.tiny().codec_encoder_json)
        full = CodecEncoder(BreezeConfig.full().codec_encoder_json)
    keys = set(tiny.state_dict())
    assert "downsample.conv.weight" in keys
    assert "encoder.layers.14.conv.weight" in keys and "encoder.layers.1.block.3.conv.bias" in keys
    assert "encoder_transformer.layers.0.mlp_layer_scale.scale" in keys
    book = "quantizer.acoustic_residual_vector_quantizer.layers.14.codebook."
    assert {book + n for n in ("embed_sum", "cluster_usage", "initialized")} <= keys
    assert not any("input_proj" in k for k in keys)  # vq hidden == hidden in the tiny preset
    proj = full.state_dict()["quantizer.semantic_residual_vector_quantizer.input_proj.weight"]
    assert proj.shape == (256, 512, 1)
    assert tiny.samples_per_frame == full.samples_per_frame == SPF


@pytest.mark.parametrize("num_samples", [1, SPF - 1, SPF, SPF + 1, 4 * SPF + 5])
def test_frames_are_ceil_samples_over_1920(encoder: CodecEncoder, num_samples: int) -> None:
    wav = torch.randn(2, num_samples, generator=torch.Generator().manual_seed(num_samples))
    codes = encoder.encode(wav)
    assert codes.shape == (2, math.ceil(num_samples / SPF), 16)
    assert codes.dtype == torch.int64
    assert 0 <= int(codes.min()) and int(codes.max()) < 2048


def test_encoder_is_causal(encoder: CodecEncoder) -> None:
    wav = torch.randn(1, 5 * SPF, generator=torch.Generator().manual_seed(3))
    full = encoder.encode(wav)
    assert torch.equal(encoder.encode(wav[:, : 2 * SPF]), full[:, :2])
    changed = wav.clone()
    changed[:, 3 * SPF :] = 0.0
    assert torch.equal(encoder.encode(changed)[:, :3], full[:, :3])


def test_keeps_16_of_more_quantizers() -> None:
    cfg = dict(BreezeConfig.tiny().codec_encoder_json, num_quantizers=32)
    enc = init_codec_encoder_random_(CodecEncoder(cfg), torch.Generator().manual_seed(0))
    assert len(enc.quantizer.acoustic_residual_vector_quantizer.layers) == 31
    assert enc.encode(torch.randn(1, SPF)).shape == (1, 1, 16)


def test_bad_encoder_config_names_the_field() -> None:
    cfg = dict(BreezeConfig.tiny().codec_encoder_json, pad_mode="reflect")
    with pytest.raises(ValueError, match="encoder_config.pad_mode"):
        CodecEncoder(cfg)
    with pytest.raises(ValueError, match="encoder_config is empty"):
        CodecEncoder({})


# ----------------------------------------------------------------------------- preprocessing


@pytest.mark.parametrize("rate", [16000, 22050, 44100, 48000, 8000])
def test_resampled_length_is_exact(rate: int) -> None:
    n = rate // 3 + 1  # not a whole number of output samples
    out = to_mono_24k(np.random.default_rng(rate).standard_normal(n), rate)
    assert out.dtype == np.float32
    assert out.shape == (math.ceil(n * 24000 / rate),) == (num_resampled(n, rate),)


def test_16k_input_reaches_the_encoder_at_24k(encoder: CodecEncoder, monkeypatch) -> None:
    n = 16001
    spy = _Spy(encoder)
    monkeypatch.setattr(encoder, "encode", spy)
    codes = encode_reference(encoder, np.zeros(n, dtype=np.float32), 16000)
    target = math.ceil(n * 24000 / 16000)  # 24002
    assert spy.shapes == [(1, target)]
    assert len(codes) == math.ceil(target / SPF) and all(len(f) == 16 for f in codes)


def test_resampling_keeps_a_tone() -> None:
    t = np.arange(16000) / 16000
    out = to_mono_24k(np.sin(2 * np.pi * 440 * t), 16000)
    want = np.sin(2 * np.pi * 440 * np.arange(24000) / 24000)
    assert np.abs(out[200:-200] - want[200:-200]).max() < 1e-2


def test_stereo_is_the_channel_mean(encoder: CodecEncoder, noise: np.ndarray) -> None:
    right = np.roll(noise, 100)
    stereo = np.stack([noise, right], axis=1)  # [n, 2]
    mean = (noise + right) / 2
    np.testing.assert_array_equal(to_mono_24k(stereo, 24000), mean.astype(np.float32))
    np.testing.assert_allclose(to_mono_24k(stereo, 16000), to_mono_24k(mean, 16000), atol=1e-6)
    np.testing.assert_array_equal(encode_reference(encoder, stereo, 24000),
                                  encode_reference(encoder, mean, 24000))


def test_int16_pcm_is_scaled(encoder: CodecEncoder, noise: np.ndarray) -> None:
    pcm = np.round(np.clip(noise, -1, 1) * 32767).astype(np.int16)
    np.testing.assert_allclose(to_mono_24k(pcm, 24000), pcm / 32768.0, atol=1e-7)


@pytest.mark.parametrize(
    ("samples", "rate", "match"),
    [
        (np.zeros(0, np.float32), 24000, r"samples: empty"),
        (np.zeros((0, 2), np.float32), 24000, r"samples: empty"),
        (np.array([0.0, np.nan, 0.0], np.float32), 24000, r"samples: contains NaN"),
        (np.array([0.0, np.inf], np.float32), 24000, r"samples: contains NaN or infinite"),
        (np.zeros(int(MAX_REFERENCE_S * 16000) + 1, np.float32), 16000, r"samples: 30\.00 s"),
        (np.zeros((2, 4800), np.float32), 24000, r"samples: shape \(2, 4800\) has 4800 channels"),
        (np.zeros((1, 2, 3), np.float32), 24000, r"samples: expected \[num_samples\]"),
        (np.zeros(10, bool), 24000, r"samples: dtype bool"),
        (np.zeros(10, np.float32), 0, r"sample_rate=0"),
        (np.zeros(10, np.float32), 16000.0, r"sample_rate=16000\.0"),
    ],
)
def test_bad_input_names_the_field(
    encoder: CodecEncoder, samples: np.ndarray, rate: object, match: str
) -> None:
    with pytest.raises(InvalidRequest, match=match) as info:
        encode_reference(encoder, samples, rate)  # type: ignore[arg-type]
    assert isinstance(info.value, ValueError)


def test_exactly_30_s_is_accepted() -> None:
    assert to_mono_24k(np.zeros(30 * 8000, np.float32), 8000).shape == (30 * 24000,)


def test_non_fp32_encoder_is_refused(noise: np.ndarray) -> None:
    enc = CodecEncoder(BreezeConfig.tiny().codec_encoder_json).to(torch.bfloat16)
    with pytest.raises(ValueError, match="float32"):
        encode_reference(enc, noise, 24000)


# ----------------------------------------------------------------------------- checkpoints


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("enc") / "model", seed=SEED)


def test_random_checkpoint_round_trip(tiny_ckpt: Path, noise: np.ndarray) -> None:
    ckpt = load_checkpoint(tiny_ckpt)
    assert ckpt.codec_encoder is not None and not ckpt.codec_encoder.training
    want = build_random_codec_encoder("tiny", seed=SEED).state_dict()
    got = ckpt.codec_encoder.state_dict()
    assert set(got) == set(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert all(torch.isfinite(v).all() for v in got.values())
    codes = encode_reference(ckpt.codec_encoder, noise, 24000)
    assert len(codes) == math.ceil(noise.shape[0] / SPF)
    assert all(len(f) == 16 and all(0 <= c < 2048 for c in f) for f in codes)
    np.testing.assert_array_equal(Reference("hello", codes).ref_codes, codes)


def _rewrite_codec(root: Path, tmp: Path, edit) -> Path:
    """A copy of ``root`` whose audio_tokenizer weights went through ``edit``."""
    out = tmp / "model"
    for src in root.rglob("*"):
        dst = out / src.relative_to(root)
        if src.is_dir():
            dst.mkdir(parents=True, exist_ok=True)
        else:
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.symlink_to(src)
    file = out / CODEC_DIR / SINGLE_FILE
    tensors = load_file(str(file))
    edit(tensors)
    file.unlink()
    save_file(tensors, str(file))
    return out


def test_no_encoder_tensors_gives_none(tiny_ckpt: Path, tmp_path: Path) -> None:
    def drop(t: dict) -> None:
        for k in [k for k in t if k.startswith("encoder.")]:
            del t[k]

    assert load_checkpoint(_rewrite_codec(tiny_ckpt, tmp_path, drop)).codec_encoder is None


def test_stray_encoder_tensor_is_named(tiny_ckpt: Path, tmp_path: Path) -> None:
    root = _rewrite_codec(
        tiny_ckpt, tmp_path, lambda t: t.update({"encoder.stray.weight": torch.zeros(1)})
    )
    with pytest.raises(CheckpointError, match=r"\(encoder\): unexpected tensor\(s\) 'stray\."):
        load_checkpoint(root)
