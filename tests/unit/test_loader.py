"""``breezert.loader`` on tiny random checkpoints: round trip, decoy keys, and named errors.

One tiny checkpoint is written per session; each test works on a cheap clone of it (JSON files
copied, weight files symlinked and only ever replaced, never written through).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, models

from breezert.options import SamplingParams
from breezert.loader import (
    CODEC_DIR,
    INDEX_FILE,
    SINGLE_FILE,
    TIED_AUDIO_TABLE,
    CheckpointError,
    GenerationDefaults,
    load_checkpoint,
    read_config,
)
from breezert.models.breeze import BreezeModel
from breezert.models.codec import CodecDecoder
from breezert.models.config import BreezeConfig
from breezert.random_init import build_random, write_random_checkpoint
from breezert.tokenizer import SPECIAL_TOKENS, TokenizerError

pytestmark = pytest.mark.unit

SEED = 3
SHARD = "model-00001-of-00001.safetensors"  # the tiny preset fits one shard
GATE = "backbone_model.layers.0.mlp.gate_proj.weight"  # [128, 64] in the tiny preset
NORM = "backbone_model.norm.weight"


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("tiny") / "model", seed=SEED)


@pytest.fixture(scope="session")
def reference() -> tuple[BreezeConfig, BreezeModel, CodecDecoder]:
    """The same random model, built in memory (the writer must not have changed anything)."""
    return build_random("tiny", seed=SEED)


@pytest.fixture
def ckpt(tiny_ckpt: Path, tmp_path: Path) -> Path:
    """A private clone of the session checkpoint: JSON copied, safetensors symlinked."""
    root = tmp_path / "model"
    for src in tiny_ckpt.rglob("*"):
        dst = root / src.relative_to(tiny_ckpt)
        if src.is_dir():
            dst.mkdir(parents=True, exist_ok=True)
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.suffix == ".safetensors":
            dst.symlink_to(src)
        else:
            shutil.copy(src, dst)
    return root


# ----------------------------------------------------------------------------- helpers


def _edit_json(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.unlink()  # never write through a symlink into the session checkpoint
    path.write_text(json.dumps(data))


def _rewrite(path: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    """Loads a safetensors file, edits its tensors in place and writes a fresh file."""
    tensors = load_file(str(path))
    edit(tensors)
    path.unlink()
    save_file(tensors, str(path), metadata={"format": "pt"})


def _add_to_shard(root: Path, extra: dict[str, torch.Tensor]) -> None:
    _rewrite(root / SHARD, lambda t: t.update(extra))
    _edit_json(root / INDEX_FILE, lambda d: d["weight_map"].update({k: SHARD for k in extra}))


def _re(path: Path) -> str:
    return re.escape(os.fspath(path))


def _assert_same_state(module: torch.nn.Module, ref: torch.nn.Module) -> None:
    got, want = module.state_dict(), ref.state_dict()
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert torch.equal(got[name], tensor), name


# ----------------------------------------------------------------------------- round trip


def test_round_trip_weights_equal(ckpt: Path, reference: tuple) -> None:
    _, model, codec = reference
    loaded = load_checkpoint(ckpt)
    _assert_same_state(loaded.model, model)
    _assert_same_state(loaded.codec, codec)
    assert not loaded.model.training and not loaded.codec.training
    assert loaded.device == torch.device("cpu")


def test_round_trip_config_and_defaults(ckpt: Path) -> None:
    tiny = BreezeConfig.tiny()
    loaded = load_checkpoint(ckpt)
    assert loaded.config == tiny
    for section in ("text_encoder", "backbone", "depth", "codec"):
        assert getattr(loaded.config, section) == getattr(tiny, section), section
    assert loaded.config.codec_encoder_json == tiny.codec_encoder_json
    assert read_config(ckpt) == tiny
    assert loaded.generation == GenerationDefaults()
    assert loaded.tokenizer.encode("[S3]") == [2, 262149]


def test_full_config_json_round_trip() -> None:
    full = BreezeConfig.full()
    again = BreezeConfig.from_json(*full.to_json())
    assert again == full
    assert again.depth == full.depth and again.text_encoder == full.text_encoder


def test_generation_config_values_are_read(ckpt: Path) -> None:
    def edit(d: dict[str, Any]) -> None:
        d.update(do_sample=False, top_k=7, top_p=0.5, max_new_tokens=99,
                 depth_decoder_temperature=0.3, depth_decoder_top_k=3)

    _edit_json(ckpt / "generation_config.json", edit)
    gen = load_checkpoint(ckpt).generation
    assert gen == GenerationDefaults(
        sampling=SamplingParams(temperature=0.0, top_k=7, top_p=0.5, depth_temperature=0.3,
                                depth_top_k=3, depth_top_p=1.0, repetition_penalty=1.1),
        max_new_tokens=99,
    )


def test_missing_generation_config_uses_defaults(ckpt: Path) -> None:
    (ckpt / "generation_config.json").unlink()
    assert load_checkpoint(ckpt).generation == GenerationDefaults()


def test_dtype_override_keeps_codec_fp32(ckpt: Path) -> None:
    loaded = load_checkpoint(ckpt, dtype=torch.bfloat16)
    assert loaded.model.lm_head.weight.dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in loaded.codec.parameters())


def test_top_level_decoys_are_ignored(ckpt: Path) -> None:
    def decoys(d: dict[str, Any]) -> None:
        d.update(rope_theta=1.0, rms_norm_eps=0.5, max_position_embeddings=7,
                 rope_scaling={"rope_type": "linear", "factor": 99.0})

    _edit_json(ckpt / "config.json", decoys)
    assert read_config(ckpt) == BreezeConfig.tiny()
    assert load_checkpoint(ckpt).config == BreezeConfig.tiny()


def test_nested_sections_are_the_truth(ckpt: Path) -> None:
    _edit_json(ckpt / "config.json", lambda d: d["backbone_config"].update(rope_theta=123.0))
    config = read_config(ckpt)
    assert config.backbone.rope_theta == 123.0
    assert config.depth == BreezeConfig.tiny().depth


# ----------------------------------------------------------------------------- named errors


def test_missing_folder(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(CheckpointError, match=f"folder not found: {_re(missing)}"):
        load_checkpoint(missing)


def test_missing_config_json(ckpt: Path) -> None:
    (ckpt / "config.json").unlink()
    path = ckpt / "config.json"
    with pytest.raises(CheckpointError, match=f"missing checkpoint file: {_re(path)}$"):
        load_checkpoint(ckpt)


def test_missing_codec_config_json(ckpt: Path) -> None:
    (ckpt / CODEC_DIR / "config.json").unlink()
    path = ckpt / CODEC_DIR / "config.json"
    with pytest.raises(CheckpointError, match=f"missing checkpoint file: {_re(path)}$"):
        load_checkpoint(ckpt)


def test_missing_codec_weights(ckpt: Path) -> None:
    (ckpt / CODEC_DIR / SINGLE_FILE).unlink()
    path = ckpt / CODEC_DIR / SINGLE_FILE
    with pytest.raises(CheckpointError, match=f"missing checkpoint file: {_re(path)}$"):
        load_checkpoint(ckpt)


def test_missing_shard_listed_in_index(ckpt: Path) -> None:
    _edit_json(ckpt / INDEX_FILE,
               lambda d: d["weight_map"].update({NORM: "model-00002-of-00002.safetensors"}))
    with pytest.raises(CheckpointError, match=r"missing shard .*model-00002-of-00002\.safetensors"):
        load_checkpoint(ckpt)


def test_missing_weights_entirely(ckpt: Path) -> None:
    (ckpt / INDEX_FILE).unlink()
    (ckpt / SHARD).unlink()
    with pytest.raises(CheckpointError, match=rf"{INDEX_FILE}.*{SINGLE_FILE}"):
        load_checkpoint(ckpt)


def test_missing_tokenizer_json(ckpt: Path) -> None:
    (ckpt / "tokenizer.json").unlink()
    path = ckpt / "tokenizer.json"
    with pytest.raises(TokenizerError, match=f"missing tokenizer file: {_re(path)}$"):
        load_checkpoint(ckpt)


def test_wrong_shape_names_tensor_and_shapes(ckpt: Path) -> None:
    _rewrite(ckpt / SHARD, lambda t: t.update({GATE: t[GATE].reshape(64, 128).contiguous()}))
    with pytest.raises(
        CheckpointError, match=rf"'{GATE}' in {SHARD} has shape \(64, 128\), expected \(128, 64\)"
    ):
        load_checkpoint(ckpt)


def test_unexpected_tensor(ckpt: Path) -> None:
    _add_to_shard(ckpt, {"backbone_model.layers.0.extra.weight": torch.zeros(2)})
    extra = re.escape("'backbone_model.layers.0.extra.weight'")
    with pytest.raises(CheckpointError, match=f"unexpected tensor.*{extra}"):
        load_checkpoint(ckpt)


def test_missing_tensor(ckpt: Path) -> None:
    _rewrite(ckpt / SHARD, lambda t: t.pop(NORM))
    _edit_json(ckpt / INDEX_FILE, lambda d: d["weight_map"].pop(NORM))
    with pytest.raises(CheckpointError, match=rf"missing tensor.*'{NORM}'"):
        load_checkpoint(ckpt)


def test_tensor_in_index_but_not_in_shard(ckpt: Path) -> None:
    _rewrite(ckpt / SHARD, lambda t: t.pop(NORM))
    with pytest.raises(CheckpointError, match=rf"'{NORM}' is listed in {INDEX_FILE} .*{SHARD}"):
        load_checkpoint(ckpt)


def test_unexpected_codec_tensor(ckpt: Path) -> None:
    _rewrite(ckpt / CODEC_DIR / SINGLE_FILE, lambda t: t.update({"stray.weight": torch.zeros(1)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'stray\.weight'"):
        load_checkpoint(ckpt)


def _word_level_tokenizer(vocab: dict[str, int]) -> str:
    return Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>")).to_str()


def test_tokenizer_with_wrong_special_id(ckpt: Path) -> None:
    vocab = {**SPECIAL_TOKENS, "[S3]": 7}
    (ckpt / "tokenizer.json").write_text(_word_level_tokenizer(vocab))
    with pytest.raises(TokenizerError, match=r"'\[S3\]' has id 7, expected 262149"):
        load_checkpoint(ckpt)


def test_tokenizer_without_a_special_token(ckpt: Path) -> None:
    vocab = {k: v for k, v in SPECIAL_TOKENS.items() if k != "<ins_eos>"}
    (ckpt / "tokenizer.json").write_text(_word_level_tokenizer(vocab))
    with pytest.raises(TokenizerError, match=r"'<ins_eos>' has id None, expected 262157"):
        load_checkpoint(ckpt)


# ----------------------------------------------------------------------------- accepted layouts


def test_dead_tensors_are_skipped(ckpt: Path, reference: tuple) -> None:
    _add_to_shard(ckpt, {
        "embed_text_tokens.weight": torch.randn(8, 4),
        "codec_model.foo": torch.randn(3),
    })
    _assert_same_state(load_checkpoint(ckpt).model, reference[1])


def test_tied_audio_table_is_accepted(ckpt: Path, reference: tuple) -> None:
    model = reference[1]
    table = model.state_dict()["depth_decoder.model.embed_tokens.weight"].clone()
    _add_to_shard(ckpt, {TIED_AUDIO_TABLE: table})
    _assert_same_state(load_checkpoint(ckpt).model, model)


def test_single_file_without_index(ckpt: Path, reference: tuple) -> None:
    tensors = load_file(str(ckpt / SHARD))
    (ckpt / SHARD).unlink()
    (ckpt / INDEX_FILE).unlink()
    save_file(tensors, str(ckpt / SINGLE_FILE), metadata={"format": "pt"})
    _assert_same_state(load_checkpoint(ckpt).model, reference[1])


def test_sharded_across_two_files(ckpt: Path, reference: tuple) -> None:
    tensors = load_file(str(ckpt / SHARD))
    (ckpt / SHARD).unlink()
    names = sorted(tensors)
    half = len(names) // 2
    files = {"model-00001-of-00002.safetensors": names[:half],
             "model-00002-of-00002.safetensors": names[half:]}
    for file, keys in files.items():
        save_file({k: tensors[k] for k in keys}, str(ckpt / file))
    weight_map = {k: file for file, keys in files.items() for k in keys}
    _edit_json(ckpt / INDEX_FILE, lambda d: d.update(weight_map=weight_map))
    _assert_same_state(load_checkpoint(ckpt).model, reference[1])


# ----------------------------------------------------------------------------- random_init


def test_init_random_copies_a_given_tokenizer(tiny_ckpt: Path, tmp_path: Path) -> None:
    given = tmp_path / "tok" / "tokenizer.json"
    given.parent.mkdir()
    given.write_text((tiny_ckpt / "tokenizer.json").read_text())
    (given.parent / "tokenizer_config.json").write_text("{}")
    out = write_random_checkpoint(tmp_path / "m", seed=SEED, tokenizer=given)
    assert (out / "tokenizer.json").read_text() == given.read_text()
    assert (out / "tokenizer_config.json").is_file()


def test_init_random_rejects_a_bad_tokenizer_and_dtype(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(_word_level_tokenizer({**SPECIAL_TOKENS, "<ins_bos>": 9}))
    with pytest.raises(TokenizerError, match="<ins_bos>"):
        write_random_checkpoint(tmp_path / "a", tokenizer=bad)
    with pytest.raises(ValueError, match="dtype='int8'"):
        write_random_checkpoint(tmp_path / "b", dtype="int8")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
