"""Pins the codec decoder to the qwen_tts golden waveforms (tiny weights, fp32, CPU).

Owns: released-name loading, full decode and streaming decode against ``codec_golden``.
Must not: regenerate fixtures or depend on other stages.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from breezert.models.codec import CodecDecoder, StreamingCodec
from breezert.models.config import BreezeConfig
from safetensors.torch import load_file

from tests.golden._paths import golden_dir

pytestmark = pytest.mark.golden

ATOL = 1e-5
PREFIX = "decoder."


@pytest.fixture(scope="module")
def golden() -> Path:
    return golden_dir()


@pytest.fixture(scope="module")
def decoder(golden: Path) -> CodecDecoder:
    weights = load_file(str(golden / "model" / "audio_tokenizer" / "model.safetensors"))
    dec = CodecDecoder(BreezeConfig.tiny().codec)
    state = {k[len(PREFIX) :]: v for k, v in weights.items() if k.startswith(PREFIX)}
    assert set(dec.state_dict()) == set(state)
    dec.load_state_dict(state, strict=True)
    return dec.eval()


@pytest.fixture(scope="module")
def cases(golden: Path) -> dict[str, torch.Tensor]:
    return load_file(str(golden / "codec_golden.safetensors"))


@pytest.mark.parametrize("case", ["design_cfg1", "random100"])
def test_full_decode_matches_golden(
    decoder: CodecDecoder, cases: dict[str, torch.Tensor], case: str
) -> None:
    codes = cases[f"{case}.codes"]  # [T, 16]
    wav = decoder.decode(codes[None].long())[0]
    torch.testing.assert_close(wav, cases[f"{case}.wav"], atol=ATOL, rtol=0)


def _sizes(kind: str, total: int) -> list[int]:
    if kind == "ramp":
        head = [1, 2, 4, 8, 16]
    elif kind == "ones":
        head = [1]
    else:
        head = torch.randint(1, 20, (total,), generator=torch.Generator().manual_seed(3)).tolist()
    sizes: list[int] = []
    while sum(sizes) < total:
        size = head[len(sizes)] if len(sizes) < len(head) else head[-1]
        sizes.append(min(size, total - sum(sizes)))
    return sizes


@pytest.mark.parametrize("kind", ["ramp", "ones", "random"])
def test_streaming_matches_golden(
    decoder: CodecDecoder, cases: dict[str, torch.Tensor], kind: str
) -> None:
    codes = cases["random100.codes"].long()  # [100, 16], past the 72-frame window
    sc = StreamingCodec(decoder, max_slots=2)
    slot = torch.tensor([1])
    wavs, start = [], 0
    for size in _sizes(kind, codes.shape[0]):
        wavs.append(sc.decode(slot, codes[None, start : start + size])[0])
        start += size
    torch.testing.assert_close(torch.cat(wavs), cases["random100.wav"], atol=ATOL, rtol=0)
