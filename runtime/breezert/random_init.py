"""Random-weight checkpoints in the released layout, for development, tests and benchmarks.

Owns: building the tiny or full model with seeded random weights and writing it (with a
tokenizer) through ``loader.save_checkpoint``; counting live parameters on the meta device.
Must not: invent a layout of its own (the loader's writer is the only one).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from breezert.loader import save_checkpoint
from breezert.models.breeze import BreezeModel
from breezert.models.codec import CodecDecoder, init_codec_random_
from breezert.models.codec_encoder import CodecEncoder, init_codec_encoder_random_
from breezert.models.config import BreezeConfig
from breezert.tokenizer import BreezeTokenizer, build_byte_tokenizer

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def count_live_parameters(preset: str) -> int:
    """Live LM parameters of ``preset`` (built on the meta device: no memory used)."""
    with torch.device("meta"):
        return BreezeModel(BreezeConfig.preset(preset)).count_parameters()


def build_random(
    preset: str, seed: int = 0, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> tuple[BreezeConfig, BreezeModel, CodecDecoder]:
    """Random LM and codec of ``preset`` on ``device``; the codec stays fp32."""
    config = BreezeConfig.preset(preset)
    generator = torch.Generator(device="cpu").manual_seed(seed)
    with torch.device(device):
        model = BreezeModel(config)
        codec = CodecDecoder(config.codec)
    if torch.device(device).type == "cpu":
        model.init_random_(generator)
    else:  # a CPU generator cannot fill CUDA tensors: draw on the device, seeded
        model.init_random_(torch.Generator(device=device).manual_seed(seed))
    init_codec_random_(codec, generator)
    if dtype is not None:
        model.to(dtype)
    return config, model.eval(), codec.eval()


def build_random_codec_encoder(
    preset: str, seed: int = 0, device: str | torch.device = "cpu"
) -> CodecEncoder:
    """Random fp32 reference-audio encoder of ``preset`` (its own generator, seeded ``seed``,
    so adding it leaves the LM and codec weights of a seed unchanged)."""
    config = BreezeConfig.preset(preset)
    with torch.device(device):
        encoder = CodecEncoder(config.codec_encoder_json)
    if torch.device(device).type == "meta":
        return encoder.eval()
    init_codec_encoder_random_(encoder, torch.Generator(device="cpu").manual_seed(seed))
    return encoder.eval()


def write_random_checkpoint(
    out: str | Path,
    preset: str = "tiny",
    dtype: str | None = None,
    seed: int = 0,
    tokenizer: str | Path | None = None,
) -> Path:
    """Writes a random ``preset`` checkpoint to ``out`` and returns the folder."""
    dtype = dtype or ("float32" if preset == "tiny" else "bfloat16")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r}: choose one of {sorted(_DTYPES)}")
    config, model, codec = build_random(preset, seed=seed, dtype=_DTYPES[dtype])
    from dataclasses import replace

    config = replace(config, dtype=dtype)
    if tokenizer is not None:
        BreezeTokenizer.from_file(tokenizer)  # checks the special ids before copying
        tokenizer_json = Path(tokenizer).read_text()
    else:
        tokenizer_json = build_byte_tokenizer().to_str()
    encoder = build_random_codec_encoder(preset, seed=seed)
    root = save_checkpoint(out, config, model, codec, tokenizer_json, codec_encoder=encoder)
    if tokenizer is not None and Path(tokenizer).with_name("tokenizer_config.json").is_file():
        shutil.copy(Path(tokenizer).with_name("tokenizer_config.json"), root)
    return root
