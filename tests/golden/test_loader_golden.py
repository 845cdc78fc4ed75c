"""The golden folder (released layout) through ``breezert.loader.load_checkpoint``.

Owns: proving the loader's path (index + 2 shards, dead ``codec_model.*`` tensors, absent tied
table, ``audio_tokenizer/`` with ``encoder.*``) yields the modules that reproduce the golden greedy
codes and codec waveform. Must not: regenerate fixtures.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from breezert.options import SamplingParams
from breezert.loader import Checkpoint, load_checkpoint
from breezert.models.config import BreezeConfig
from breezert.models.generate import generate_frames
from breezert.tokenizer import build_byte_tokenizer
from tests.golden._paths import golden_dir
from tests.golden.test_lm_golden import Golden, _prompt

pytestmark = pytest.mark.golden

ATOL = 1e-5


@pytest.fixture(scope="module")
def golden_root() -> Path:
    return golden_dir()


@pytest.fixture(scope="module")
def ckpt(golden_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    """The golden ``model/`` folder plus a byte tokenizer (the fixture ships none)."""
    root = tmp_path_factory.mktemp("golden") / "model"
    root.mkdir()
    for entry in (golden_root / "model").iterdir():
        (root / entry.name).symlink_to(entry)
    (root / "tokenizer.json").write_text(build_byte_tokenizer().to_str())
    # The fixture's config.json carries no dtype (the release says bfloat16); its weights are fp32.
    return load_checkpoint(root, dtype=torch.float32)


def test_golden_folder_loads(ckpt: Checkpoint) -> None:
    tiny = BreezeConfig.tiny()
    for section in ("text_encoder", "backbone", "depth", "codec"):
        assert getattr(ckpt.config, section) == getattr(tiny, section), section
    assert ckpt.model.lm_head.weight.dtype == torch.float32
    assert ckpt.generation.max_new_tokens == 750


def test_loaded_model_reproduces_greedy_codes(ckpt: Checkpoint, golden_root: Path) -> None:
    case = "plain_cfg1"
    tensors = load_file(str(golden_root / "lm_golden.safetensors"))
    prompt = _prompt(Golden(ckpt.model, tensors, {}), case)
    assert prompt.input_ids.tolist()[:2] == [2, 262146]
    expected = tensors[f"{case}.rp1.codes"]  # [12, 16]
    frames = generate_frames(
        ckpt.model, prompt, SamplingParams.greedy(), 0,
        max_frames=expected.shape[0], cfg_scale=1.0,
    )
    assert torch.equal(torch.stack(list(frames)), expected)


@torch.no_grad()
def test_loaded_codec_reproduces_golden_wav(ckpt: Checkpoint, golden_root: Path) -> None:
    cases = load_file(str(golden_root / "codec_golden.safetensors"))
    wav = ckpt.codec.decode(cases["design_cfg1.codes"][None].long())[0]
    torch.testing.assert_close(wav, cases["design_cfg1.wav"], atol=ATOL, rtol=0)
