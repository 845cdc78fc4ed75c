"""Checkpoint folder (released Breeze-TTS-2 layout) ⇄ modules.

Owns: reading ``config.json``, ``generation_config.json``, sharded safetensors through
``model.safetensors.index.json``, ``audio_tokenizer/`` and ``tokenizer.json``; skipping dead
tensors; naming every missing, misshapen or unexpected tensor; writing the same layout for
random checkpoints. Must not: hold runtime defaults (``breezert.config``) or run models.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from breezert.models.breeze import BreezeModel
from breezert.models.codec import CodecDecoder
from breezert.models.codec_encoder import CodecEncoder
from breezert.models.config import BreezeConfig
from breezert.options import SamplingParams
from breezert.tokenizer import BreezeTokenizer

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
CODEC_DIR = "audio_tokenizer"
CODEC_PREFIX = "decoder."
# Tensors the released checkpoint carries but no live module reads (SPEC §1.3).
DEAD_PREFIXES = ("embed_text_tokens.", "codec_model.")
# Tied to ``depth_decoder.model.embed_tokens.weight``; absent from the release, allowed if present.
TIED_AUDIO_TABLE = "backbone_model.embed_tokens.embed_audio_tokens.weight"
# The audio tokenizer's reference-audio encoder (Mimi, SPEC §2.7): loaded into
# ``Checkpoint.codec_encoder`` when present, never used by the synthesis loop.
CODEC_ENCODER_PREFIX = "encoder."


class CheckpointError(ValueError):
    """The checkpoint folder is incomplete or does not match the expected layout."""


DEFAULT_MAX_NEW_TOKENS = 750
"""Frame limit of the released ``generation_config.json``."""


@dataclass(frozen=True)
class GenerationDefaults:
    """``generation_config.json`` values: the checkpoint's sampling defaults and frame limit.

    Fields the file leaves out keep ``SamplingParams``' defaults (the repetition penalty is
    never in the file: it comes from the recipe).
    """

    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS

    @staticmethod
    def from_json(d: dict[str, Any]) -> GenerationDefaults:
        base = SamplingParams()
        greedy = d.get("do_sample") is False
        depth_greedy = d.get("depth_decoder_do_sample") is False
        return GenerationDefaults(
            sampling=replace(
                base,
                temperature=0.0 if greedy else float(d.get("temperature", base.temperature)),
                top_k=int(d.get("top_k", base.top_k)),
                top_p=float(d.get("top_p", base.top_p)),
                depth_temperature=0.0 if depth_greedy else float(
                    d.get("depth_decoder_temperature", base.depth_temperature)),
                depth_top_k=int(d.get("depth_decoder_top_k", base.depth_top_k)),
                depth_top_p=float(d.get("depth_decoder_top_p", base.depth_top_p)),
            ),
            max_new_tokens=int(d.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)),
        )

    def to_json(self) -> dict[str, Any]:
        s = self.sampling
        return {
            "do_sample": True, "temperature": s.temperature, "top_k": s.top_k,
            "top_p": s.top_p, "max_new_tokens": self.max_new_tokens,
            "depth_decoder_do_sample": True, "depth_decoder_temperature": s.depth_temperature,
            "depth_decoder_top_k": s.depth_top_k, "depth_decoder_top_p": s.depth_top_p,
            "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0,
        }


@dataclass
class Checkpoint:
    """A loaded model: LM modules, codec decoder, tokenizer and generation defaults."""

    path: Path
    config: BreezeConfig
    model: BreezeModel
    codec: CodecDecoder
    tokenizer: BreezeTokenizer
    generation: GenerationDefaults = field(default_factory=GenerationDefaults)
    codec_encoder: CodecEncoder | None = None
    """Reference-audio encoder (fp32); ``None`` when the file has no ``encoder.*`` tensors."""

    @property
    def device(self) -> torch.device:
        return self.model.lm_head.weight.device

    @property
    def codec_device(self) -> torch.device:
        return next(self.codec.parameters()).device


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointError(f"missing checkpoint file: {path}")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: invalid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


def read_config(path: str | Path) -> BreezeConfig:
    """Dimensions from ``config.json`` and ``audio_tokenizer/config.json``."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"checkpoint folder not found: {root}")
    return BreezeConfig.from_json(
        _read_json(root / "config.json"), _read_json(root / CODEC_DIR / "config.json")
    )


def read_generation_defaults(path: str | Path) -> GenerationDefaults:
    file = Path(path) / "generation_config.json"
    return GenerationDefaults.from_json(_read_json(file)) if file.is_file() else (
        GenerationDefaults()
    )


def _shard_map(root: Path) -> dict[str, Path]:
    """tensor name → shard file, from the index (sharded) or the single file."""
    index = root / INDEX_FILE
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: missing or empty 'weight_map'")
        shards = {name: root / file for name, file in weight_map.items()}
        for file in sorted(set(shards.values())):
            if not file.is_file():
                raise CheckpointError(f"missing shard listed in {INDEX_FILE}: {file}")
        return shards
    single = root / SINGLE_FILE
    if not single.is_file():
        raise CheckpointError(f"missing weights: neither {index} nor {single} exists")
    with safe_open(str(single), "pt") as f:
        return {name: single for name in f.keys()}


def _load_into(
    module: torch.nn.Module,
    tensors: dict[str, tuple[Path, str]],
    where: str,
    device: torch.device,
    dtype: torch.dtype,
) -> None:
    """Copies ``tensors`` (module key → (file, file key)) into ``module``, checking everything."""
    expected = module.state_dict()
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise CheckpointError(f"{where}: unexpected tensor(s) {_names(unexpected)}")
    if missing:
        raise CheckpointError(f"{where}: missing tensor(s) {_names(missing)}")
    by_file: dict[Path, list[str]] = {}
    for key, (file, _) in tensors.items():
        by_file.setdefault(file, []).append(key)
    loaded: dict[str, torch.Tensor] = {}
    for file, keys in by_file.items():
        with safe_open(str(file), "pt", device="cpu") as f:
            present = set(f.keys())
            for key in keys:
                if tensors[key][1] not in present:  # listed in the index, absent from the shard
                    raise CheckpointError(
                        f"{where}: tensor {tensors[key][1]!r} is listed in {INDEX_FILE} but "
                        f"missing from {file.name}"
                    )
                tensor = f.get_tensor(tensors[key][1])
                want = expected[key]
                if tuple(tensor.shape) != tuple(want.shape):
                    raise CheckpointError(
                        f"{where}: tensor {tensors[key][1]!r} in {file.name} has shape "
                        f"{tuple(tensor.shape)}, expected {tuple(want.shape)}"
                    )
                target = want.dtype if not want.dtype.is_floating_point else dtype
                loaded[key] = tensor.to(device=device, dtype=target)
    module.load_state_dict(loaded, strict=True, assign=True)


def _names(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def load_checkpoint(
    path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    codec_dtype: torch.dtype = torch.float32,
) -> Checkpoint:
    """Loads a released-layout folder. ``dtype`` defaults to the config's ``dtype``."""
    root = Path(path)
    config = read_config(root)
    device = torch.device(device)
    dtype = dtype or _dtype(config.dtype)
    tokenizer = BreezeTokenizer.from_file(root / "tokenizer.json")

    with torch.device("meta"):
        model = BreezeModel(config)
        codec = CodecDecoder(config.codec)
    lm_tensors: dict[str, tuple[Path, str]] = {}
    for name, file in _shard_map(root).items():
        if name.startswith(DEAD_PREFIXES) or name == TIED_AUDIO_TABLE:
            continue
        lm_tensors[name] = (file, name)
    _load_into(model, lm_tensors, "model weights", device, dtype)

    codec_file = root / CODEC_DIR / SINGLE_FILE
    if not codec_file.is_file():
        raise CheckpointError(f"missing checkpoint file: {codec_file}")
    codec_tensors: dict[str, tuple[Path, str]] = {}
    encoder_tensors: dict[str, tuple[Path, str]] = {}
    with safe_open(str(codec_file), "pt") as f:
        for name in f.keys():
            if name.startswith(CODEC_ENCODER_PREFIX):
                encoder_tensors[name[len(CODEC_ENCODER_PREFIX):]] = (codec_file, name)
                continue
            if not name.startswith(CODEC_PREFIX):
                raise CheckpointError(f"{codec_file}: unexpected tensor {name!r}")
            codec_tensors[name[len(CODEC_PREFIX):]] = (codec_file, name)
    _load_into(codec, codec_tensors, f"{CODEC_DIR}/{SINGLE_FILE}", device, codec_dtype)

    return Checkpoint(
        path=root, config=config, model=model.eval(), codec=codec.eval(), tokenizer=tokenizer,
        generation=read_generation_defaults(root),
        codec_encoder=_load_codec_encoder(config, encoder_tensors, device),
    )


# ------------------------------------------------------------------------------- codec encoder
def _load_codec_encoder(
    config: BreezeConfig, tensors: dict[str, tuple[Path, str]], device: torch.device
) -> CodecEncoder | None:
    """The ``encoder.*`` tensors into a ``CodecEncoder``, always fp32 (SPEC §2.7)."""
    if not tensors:
        return None
    where = f"{CODEC_DIR}/{SINGLE_FILE} (encoder)"
    try:
        with torch.device("meta"):
            encoder = CodecEncoder(config.codec_encoder_json)
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(
            f"{CODEC_DIR}/config.json: encoder_config cannot build the encoder "
            f"({type(exc).__name__}: {exc})"
        ) from None
    _load_into(encoder, tensors, where, device, torch.float32)
    return encoder.eval()


def _dtype(name: str) -> torch.dtype:
    table = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    if name not in table:
        raise CheckpointError(f"config.json: unsupported dtype {name!r}; use one of {list(table)}")
    return table[name]


def save_checkpoint(
    out: str | Path,
    config: BreezeConfig,
    model: BreezeModel,
    codec: CodecDecoder,
    tokenizer_json: str,
    generation: GenerationDefaults | None = None,
    max_shard_bytes: int = 5_000_000_000,
    codec_encoder: CodecEncoder | None = None,
) -> Path:
    """Writes the released layout: config, index + shards, audio_tokenizer/, tokenizer.json."""
    root = Path(out)
    (root / CODEC_DIR).mkdir(parents=True, exist_ok=True)
    config_json, codec_json = config.to_json()
    (root / "config.json").write_text(json.dumps(config_json, indent=2))
    (root / CODEC_DIR / "config.json").write_text(json.dumps(codec_json, indent=2))
    (root / CODEC_DIR / "preprocessor_config.json").write_text(json.dumps({
        "feature_extractor_type": "MimiFeatureExtractor", "feature_size": 1,
        "sampling_rate": config.codec.sample_rate, "padding_side": "right",
        "padding_value": 0.0, "return_attention_mask": True,
    }, indent=2))
    (root / "generation_config.json").write_text(
        json.dumps((generation or GenerationDefaults()).to_json(), indent=2)
    )
    (root / "tokenizer.json").write_text(tokenizer_json)

    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(state):
        nbytes = state[name].numel() * state[name].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = state[name]
        size += nbytes
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards, start=1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(root / file), metadata={"format": "pt"})
        weight_map.update({name: file for name in shard})
    total = sum(t.numel() * t.element_size() for t in state.values())
    (root / INDEX_FILE).write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2
    ))
    codec_state = {
        CODEC_PREFIX + k: v.detach().contiguous() for k, v in codec.state_dict().items()
    }
    if codec_encoder is not None:
        codec_state.update({
            CODEC_ENCODER_PREFIX + k: v.detach().contiguous()
            for k, v in codec_encoder.state_dict().items()
        })
    save_file(codec_state, str(root / CODEC_DIR / SINGLE_FILE), metadata={"format": "pt"})
    return root
