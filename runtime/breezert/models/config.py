"""Breeze-TTS-2 model dimensions, parsed from the released ``config.json`` layout.

Owns: the frozen dimension dataclasses for each sub-model, the ``tiny`` and ``full`` presets and
their round trip to the released JSON files. Must not: touch tensors, files or defaults of the
runtime (those live in ``breezert.config``), or define the checkpoint's fixed ids and audio
geometry (those live in ``breezert.constants``).
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from breezert.constants import (
    AUDIO_EOS_TOKEN_ID,
    AUDIO_TOKEN_ID,
    AUDIO_VOCAB_SIZE,
    CODEBOOK_EOS_ID,
    CODEBOOK_PAD_ID,
    CODEBOOK_SIZE,
    EOI_TOKEN_ID,
    FRAME_RATE_HZ,
    NUM_CODEBOOKS,
    SAMPLE_RATE,
    SAMPLES_PER_FRAME,
    TEXT_BOS_ID,
    TEXT_EOS_ID,
    TEXT_PAD_ID,
)


class ConfigError(ValueError):
    """A checkpoint config file is missing a key or holds an impossible value."""


@dataclass(frozen=True)
class TextEncoderConfig:
    """T5Gemma2 text encoder (bidirectional, sliding/full layer mix, dual RoPE)."""

    vocab_size: int = 262158
    hidden_size: int = 1152
    intermediate_size: int = 6912
    num_layers: int = 26
    num_heads: int = 4
    num_kv_heads: int = 1
    head_dim: int = 256
    query_pre_attn_scalar: float = 256.0
    rms_norm_eps: float = 1e-6
    sliding_window: int = 512
    layer_types: tuple[str, ...] = tuple(
        "full_attention" if i in (5, 11, 17, 23) else "sliding_attention" for i in range(26)
    )
    sliding_rope_theta: float = 1e4
    full_rope_theta: float = 1e6
    full_rope_factor: float = 8.0  # linear scaling: inv_freq / factor
    eoi_token_id: int = EOI_TOKEN_ID
    pad_token_id: int = TEXT_PAD_ID


@dataclass(frozen=True)
class BackboneConfig:
    """Qwen3 backbone that predicts the first code of each frame."""

    hidden_size: int = 2048
    intermediate_size: int = 6144
    num_layers: int = 28
    num_heads: int = 16
    num_kv_heads: int = 8
    head_dim: int = 128
    rope_theta: float = 1e6
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 40960
    vocab_size: int = AUDIO_VOCAB_SIZE + 1  # 2052: the audio vocab plus EOS


@dataclass(frozen=True)
class DepthConfig:
    """Llama depth decoder that fills codebooks 1..15 of a frame."""

    hidden_size: int = 1024
    intermediate_size: int = 8192
    num_layers: int = 12
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 128
    rope_theta: float = 5e5
    rope_factor: float = 32.0
    rope_low_freq_factor: float = 0.001953125
    rope_high_freq_factor: float = 0.0078125
    rope_original_max_position: int = 16
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 33
    num_codebooks: int = NUM_CODEBOOKS
    vocab_size: int = AUDIO_VOCAB_SIZE
    backbone_hidden_size: int = 2048
    audio_embed_size: int = 2048


@dataclass(frozen=True)
class CodecConfig:
    """Qwen3-TTS-Tokenizer-12Hz decoder (codes -> 24 kHz waveform)."""

    codebook_size: int = CODEBOOK_SIZE
    codebook_dim: int = 512
    latent_dim: int = 1024
    decoder_dim: int = 1536
    hidden_size: int = 512
    intermediate_size: int = 1024
    num_layers: int = 8
    num_heads: int = 16
    num_kv_heads: int = 16
    head_dim: int = 64
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    layer_scale_initial_scale: float = 0.01
    max_position_embeddings: int = 8000
    sliding_window: int = 72
    num_quantizers: int = NUM_CODEBOOKS
    num_semantic_quantizers: int = 1
    semantic_codebook_size: int = 4096
    vq_hidden_dim: int = 512
    upsample_rates: tuple[int, ...] = (8, 5, 4, 3)
    upsampling_ratios: tuple[int, ...] = (2, 2)
    sample_rate: int = SAMPLE_RATE

    @property
    def samples_per_frame(self) -> int:
        return math.prod(self.upsample_rates) * math.prod(self.upsampling_ratios)


@dataclass(frozen=True)
class BreezeConfig:
    """Everything the model code needs to build Breeze-TTS-2 at some size."""

    text_encoder: TextEncoderConfig = field(default_factory=TextEncoderConfig)
    backbone: BackboneConfig = field(default_factory=BackboneConfig)
    depth: DepthConfig = field(default_factory=DepthConfig)
    codec: CodecConfig = field(default_factory=CodecConfig)
    num_codebooks: int = NUM_CODEBOOKS
    audio_vocab_size: int = AUDIO_VOCAB_SIZE
    text_vocab_size: int = 262158
    hidden_size: int = 2048
    audio_embed_size: int = 2048
    max_seq_len: int = 2048  # prompt + generated frames (OFF infer.py MAX_SEQ_LEN)
    dtype: str = "bfloat16"
    # Raw JSON of the audio tokenizer's encoder (Mimi), kept to write it back unchanged.
    codec_encoder_json: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.audio_embed_size != self.hidden_size:
            raise ConfigError(
                f"audio_embed_size={self.audio_embed_size} != hidden_size={self.hidden_size}: "
                "Breeze-TTS-2 feeds summed audio embeddings to the backbone without a projector"
            )
        if self.backbone.hidden_size != self.hidden_size:
            raise ConfigError(
                f"backbone_config.hidden_size={self.backbone.hidden_size} != "
                f"hidden_size={self.hidden_size}"
            )
        if self.codec.samples_per_frame != SAMPLES_PER_FRAME:
            raise ConfigError(
                f"codec upsampling gives {self.codec.samples_per_frame} samples per frame, "
                f"expected {SAMPLES_PER_FRAME}"
            )
        if len(self.text_encoder.layer_types) != self.text_encoder.num_layers:
            raise ConfigError(
                f"text_encoder_config.layer_types has {len(self.text_encoder.layer_types)} "
                f"entries for {self.text_encoder.num_layers} layers"
            )

    # ---------------------------------------------------------------- presets
    @staticmethod
    def full() -> BreezeConfig:
        """The released Breeze-TTS-2 dimensions (2,850,155,520 live LM parameters)."""
        return BreezeConfig(codec_encoder_json=_default_codec_encoder_json(full=True))

    @staticmethod
    def tiny() -> BreezeConfig:
        """The golden fixture's tiny dimensions with the real structure and special ids."""
        return BreezeConfig(
            text_encoder=TextEncoderConfig(
                hidden_size=32, intermediate_size=64, num_layers=3, num_heads=2,
                num_kv_heads=1, head_dim=16, query_pre_attn_scalar=16.0, sliding_window=4,
                layer_types=("sliding_attention", "full_attention", "sliding_attention"),
            ),
            backbone=BackboneConfig(
                hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                num_kv_heads=2, head_dim=16,
            ),
            depth=DepthConfig(
                hidden_size=32, intermediate_size=96, num_layers=2, num_heads=4,
                num_kv_heads=2, head_dim=8, backbone_hidden_size=64, audio_embed_size=64,
            ),
            codec=CodecConfig(
                codebook_dim=16, latent_dim=16, decoder_dim=32, hidden_size=16,
                intermediate_size=32, num_layers=2, num_heads=2, num_kv_heads=2, head_dim=8,
                vq_hidden_dim=16,
            ),
            hidden_size=64,
            audio_embed_size=64,
            dtype="float32",
            codec_encoder_json=_default_codec_encoder_json(full=False),
        )

    @staticmethod
    def preset(name: str) -> BreezeConfig:
        presets = {"tiny": BreezeConfig.tiny, "full": BreezeConfig.full}
        if name not in presets:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(presets)}")
        return presets[name]()

    # ------------------------------------------------------------- JSON I/O
    @staticmethod
    def from_json(config: dict[str, Any], codec: dict[str, Any]) -> BreezeConfig:
        """Builds the config from ``config.json`` and ``audio_tokenizer/config.json``.

        The top-level ``rope_theta``/``rope_scaling``/``rms_norm_eps``/``max_position_embeddings``
        are decoys (SPEC §1.2): the nested ``*_config`` objects are the truth.
        """
        bb = _section(config, "backbone_config", "config.json")
        dd = _section(config, "depth_decoder_config", "config.json")
        te = _section(config, "text_encoder_config", "config.json")
        cd = _section(codec, "decoder_config", "audio_tokenizer/config.json")
        rope = _get(te, "rope_parameters", "text_encoder_config")
        scaling = _get(dd, "rope_scaling", "depth_decoder_config") or {}
        if scaling and scaling.get("rope_type", "llama3") != "llama3":
            raise ConfigError(
                f"depth_decoder_config.rope_scaling.rope_type={scaling.get('rope_type')!r} "
                "is not llama3"
            )
        full_rope = _get(rope, "full_attention", "text_encoder_config.rope_parameters")
        slide_rope = _get(rope, "sliding_attention", "text_encoder_config.rope_parameters")
        codec_vocab = int(config.get("codec_config", {}).get("codebook_size", CODEBOOK_SIZE))
        if codec_vocab != CODEBOOK_SIZE or int(_get(cd, "codebook_size", "decoder_config")) != (
            CODEBOOK_SIZE
        ):
            raise ConfigError(f"codec codebook_size must be {CODEBOOK_SIZE}")
        return BreezeConfig(
            text_encoder=TextEncoderConfig(
                vocab_size=int(_get(te, "vocab_size", "text_encoder_config")),
                hidden_size=int(_get(te, "hidden_size", "text_encoder_config")),
                intermediate_size=int(_get(te, "intermediate_size", "text_encoder_config")),
                num_layers=int(_get(te, "num_hidden_layers", "text_encoder_config")),
                num_heads=int(_get(te, "num_attention_heads", "text_encoder_config")),
                num_kv_heads=int(_get(te, "num_key_value_heads", "text_encoder_config")),
                head_dim=int(_get(te, "head_dim", "text_encoder_config")),
                query_pre_attn_scalar=float(
                    _get(te, "query_pre_attn_scalar", "text_encoder_config")
                ),
                rms_norm_eps=float(_get(te, "rms_norm_eps", "text_encoder_config")),
                sliding_window=int(_get(te, "sliding_window", "text_encoder_config")),
                layer_types=tuple(_get(te, "layer_types", "text_encoder_config")),
                sliding_rope_theta=float(slide_rope["rope_theta"]),
                full_rope_theta=float(full_rope["rope_theta"]),
                full_rope_factor=float(full_rope.get("factor", 1.0)),
                eoi_token_id=int(te.get("eoi_token_index", EOI_TOKEN_ID)),
                pad_token_id=int(te.get("pad_token_id", TEXT_PAD_ID)),
            ),
            backbone=BackboneConfig(
                hidden_size=int(_get(bb, "hidden_size", "backbone_config")),
                intermediate_size=int(_get(bb, "intermediate_size", "backbone_config")),
                num_layers=int(_get(bb, "num_hidden_layers", "backbone_config")),
                num_heads=int(_get(bb, "num_attention_heads", "backbone_config")),
                num_kv_heads=int(_get(bb, "num_key_value_heads", "backbone_config")),
                head_dim=int(_get(bb, "head_dim", "backbone_config")),
                rope_theta=float(_get(bb, "rope_theta", "backbone_config")),
                rms_norm_eps=float(_get(bb, "rms_norm_eps", "backbone_config")),
                max_position_embeddings=int(bb.get("max_position_embeddings", 40960)),
                # VO configuration_breeze.py overrides the backbone vocab to 2052.
                vocab_size=int(config.get("vocab_size", AUDIO_VOCAB_SIZE)) + 1,
            ),
            depth=DepthConfig(
                hidden_size=int(_get(dd, "hidden_size", "depth_decoder_config")),
                intermediate_size=int(_get(dd, "intermediate_size", "depth_decoder_config")),
                num_layers=int(_get(dd, "num_hidden_layers", "depth_decoder_config")),
                num_heads=int(_get(dd, "num_attention_heads", "depth_decoder_config")),
                num_kv_heads=int(_get(dd, "num_key_value_heads", "depth_decoder_config")),
                head_dim=int(_get(dd, "head_dim", "depth_decoder_config")),
                rope_theta=float(_get(dd, "rope_theta", "depth_decoder_config")),
                rope_factor=float(scaling.get("factor", 1.0)),
                rope_low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
                rope_high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
                rope_original_max_position=int(
                    scaling.get("original_max_position_embeddings", 16)
                ),
                rms_norm_eps=float(_get(dd, "rms_norm_eps", "depth_decoder_config")),
                max_position_embeddings=int(dd.get("max_position_embeddings", 33)),
                num_codebooks=int(_get(dd, "num_codebooks", "depth_decoder_config")),
                vocab_size=int(_get(dd, "vocab_size", "depth_decoder_config")),
                backbone_hidden_size=int(_get(dd, "backbone_hidden_size", "depth_decoder_config")),
                audio_embed_size=int(_get(dd, "audio_embed_size", "depth_decoder_config")),
            ),
            codec=CodecConfig(
                codebook_dim=int(_get(cd, "codebook_dim", "decoder_config")),
                latent_dim=int(_get(cd, "latent_dim", "decoder_config")),
                decoder_dim=int(_get(cd, "decoder_dim", "decoder_config")),
                hidden_size=int(_get(cd, "hidden_size", "decoder_config")),
                intermediate_size=int(_get(cd, "intermediate_size", "decoder_config")),
                num_layers=int(_get(cd, "num_hidden_layers", "decoder_config")),
                num_heads=int(_get(cd, "num_attention_heads", "decoder_config")),
                num_kv_heads=int(_get(cd, "num_key_value_heads", "decoder_config")),
                head_dim=int(_get(cd, "head_dim", "decoder_config")),
                rope_theta=float(_get(cd, "rope_theta", "decoder_config")),
                rms_norm_eps=float(_get(cd, "rms_norm_eps", "decoder_config")),
                layer_scale_initial_scale=float(cd.get("layer_scale_initial_scale", 0.01)),
                max_position_embeddings=int(cd.get("max_position_embeddings", 8000)),
                sliding_window=int(_get(cd, "sliding_window", "decoder_config")),
                num_quantizers=int(_get(cd, "num_quantizers", "decoder_config")),
                num_semantic_quantizers=int(cd.get("num_semantic_quantizers", 1)),
                semantic_codebook_size=int(cd.get("semantic_codebook_size", 4096)),
                vq_hidden_dim=int(cd.get("vector_quantization_hidden_dimension", 512)),
                upsample_rates=tuple(int(r) for r in _get(cd, "upsample_rates", "decoder_config")),
                upsampling_ratios=tuple(
                    int(r) for r in _get(cd, "upsampling_ratios", "decoder_config")
                ),
                sample_rate=int(codec.get("output_sample_rate", SAMPLE_RATE)),
            ),
            num_codebooks=int(_get(config, "num_codebooks", "config.json")),
            audio_vocab_size=int(_get(config, "vocab_size", "config.json")),
            text_vocab_size=int(_get(config, "text_vocab_size", "config.json")),
            hidden_size=int(_get(config, "hidden_size", "config.json")),
            audio_embed_size=int(config.get("audio_embed_size", config["hidden_size"])),
            dtype=str(config.get("dtype", config.get("torch_dtype", "bfloat16"))),
            codec_encoder_json=copy.deepcopy(codec.get("encoder_config", {})),
        )

    def to_json(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """Returns ``(config.json, audio_tokenizer/config.json)`` in the released layout."""
        te, bb, dd, cd = self.text_encoder, self.backbone, self.depth, self.codec
        config: dict[str, Any] = {
            "architectures": ["BreezeForConditionalGeneration"],
            "model_type": "breeze",
            "backbone_model_type": "qwen3",
            "text_encoder_proj_type": "linear",
            "tie_codebooks_embeddings": True,
            "tie_word_embeddings": False,
            "num_codebooks": self.num_codebooks,
            "vocab_size": self.audio_vocab_size,
            "text_vocab_size": self.text_vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": bb.intermediate_size,
            "num_hidden_layers": bb.num_layers,
            "num_attention_heads": bb.num_heads,
            "num_key_value_heads": bb.num_kv_heads,
            "head_dim": bb.head_dim,
            # Decoys kept as the release has them (SPEC §1.2); no reader uses them.
            "max_position_embeddings": 2048,
            "rope_theta": 500000.0,
            "rope_scaling": {"rope_type": "llama3", "factor": 32.0,
                             "original_max_position_embeddings": 1024},
            "rms_norm_eps": 1e-05,
            "audio_embed_size": self.audio_embed_size,
            "audio_token_id": AUDIO_TOKEN_ID,
            "audio_eos_token_id": AUDIO_EOS_TOKEN_ID,
            "codebook_pad_token_id": CODEBOOK_PAD_ID,
            "codebook_eos_token_id": CODEBOOK_EOS_ID,
            "bos_token_id": TEXT_BOS_ID,
            "eos_token_id": TEXT_EOS_ID,
            "pad_token_id": TEXT_PAD_ID,
            "dtype": self.dtype,
            "text_encoder_bucket_max_length_ratio": 4.0,
            "backbone_config": {
                "model_type": "qwen3", "hidden_size": bb.hidden_size,
                "intermediate_size": bb.intermediate_size, "num_hidden_layers": bb.num_layers,
                "num_attention_heads": bb.num_heads, "num_key_value_heads": bb.num_kv_heads,
                "head_dim": bb.head_dim, "hidden_act": "silu", "rms_norm_eps": bb.rms_norm_eps,
                "rope_theta": bb.rope_theta, "rope_scaling": None,
                "max_position_embeddings": bb.max_position_embeddings, "attention_bias": False,
                "use_sliding_window": False, "vocab_size": bb.vocab_size,
                "tie_word_embeddings": False,
            },
            "depth_decoder_config": {
                "model_type": "breeze_depth_decoder_model",
                "num_codebooks": dd.num_codebooks,
                "backbone_hidden_size": dd.backbone_hidden_size,
                "audio_embed_size": dd.audio_embed_size, "vocab_size": dd.vocab_size,
                "hidden_size": dd.hidden_size, "intermediate_size": dd.intermediate_size,
                "num_hidden_layers": dd.num_layers, "num_attention_heads": dd.num_heads,
                "num_key_value_heads": dd.num_kv_heads, "head_dim": dd.head_dim,
                "max_position_embeddings": dd.max_position_embeddings,
                "rms_norm_eps": dd.rms_norm_eps, "rope_theta": dd.rope_theta,
                "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
                "rope_scaling": {
                    "rope_type": "llama3", "factor": dd.rope_factor,
                    "low_freq_factor": dd.rope_low_freq_factor,
                    "high_freq_factor": dd.rope_high_freq_factor,
                    "original_max_position_embeddings": dd.rope_original_max_position,
                },
            },
            "text_encoder_config": {
                "model_type": "t5gemma2_text", "vocab_size": te.vocab_size,
                "hidden_size": te.hidden_size, "intermediate_size": te.intermediate_size,
                "num_hidden_layers": te.num_layers, "num_attention_heads": te.num_heads,
                "num_key_value_heads": te.num_kv_heads, "head_dim": te.head_dim,
                "query_pre_attn_scalar": te.query_pre_attn_scalar,
                "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": te.rms_norm_eps,
                "sliding_window": te.sliding_window, "layer_types": list(te.layer_types),
                "rope_parameters": {
                    "sliding_attention": {"rope_type": "default",
                                          "rope_theta": te.sliding_rope_theta},
                    "full_attention": {"rope_type": "linear", "rope_theta": te.full_rope_theta,
                                       "factor": te.full_rope_factor},
                },
                "eoi_token_index": te.eoi_token_id, "pad_token_id": te.pad_token_id,
                "use_bidirectional_attention": False, "dropout_rate": 0.0,
            },
            "codec_config": {"model_type": "mimi", "codebook_size": CODEBOOK_SIZE,
                             "sampling_rate": SAMPLE_RATE, "frame_rate": FRAME_RATE_HZ},
        }
        codec: dict[str, Any] = {
            "architectures": ["Qwen3TTSTokenizerV2Model"],
            "model_type": "qwen3_tts_tokenizer_12hz",
            "decode_upsample_rate": cd.samples_per_frame,
            "encode_downsample_rate": cd.samples_per_frame,
            "encoder_valid_num_quantizers": cd.num_quantizers,
            "input_sample_rate": cd.sample_rate,
            "output_sample_rate": cd.sample_rate,
            "decoder_config": {
                "codebook_size": cd.codebook_size, "codebook_dim": cd.codebook_dim,
                "latent_dim": cd.latent_dim, "decoder_dim": cd.decoder_dim,
                "hidden_size": cd.hidden_size, "intermediate_size": cd.intermediate_size,
                "num_hidden_layers": cd.num_layers, "num_attention_heads": cd.num_heads,
                "num_key_value_heads": cd.num_kv_heads, "head_dim": cd.head_dim,
                "rope_theta": cd.rope_theta, "rms_norm_eps": cd.rms_norm_eps,
                "layer_scale_initial_scale": cd.layer_scale_initial_scale,
                "max_position_embeddings": cd.max_position_embeddings,
                "sliding_window": cd.sliding_window, "num_quantizers": cd.num_quantizers,
                "num_semantic_quantizers": cd.num_semantic_quantizers,
                "semantic_codebook_size": cd.semantic_codebook_size,
                "vector_quantization_hidden_dimension": cd.vq_hidden_dim,
                "upsample_rates": list(cd.upsample_rates),
                "upsampling_ratios": list(cd.upsampling_ratios),
                "hidden_act": "silu", "attention_bias": False,
            },
            "encoder_config": copy.deepcopy(self.codec_encoder_json),
        }
        return config, codec

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _section(config: dict[str, Any], key: str, where: str) -> dict[str, Any]:
    value = config.get(key)
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: missing or invalid nested object {key!r}")
    return value


def _get(config: dict[str, Any], key: str, where: str) -> Any:
    if key not in config:
        raise ConfigError(f"{where}: missing key {key!r}")
    return config[key]


def _default_codec_encoder_json(full: bool) -> dict[str, Any]:
    """A Mimi encoder config for the audio tokenizer (reference-audio encoding)."""
    hidden = 512 if full else 16
    return {
        "_frame_rate": FRAME_RATE_HZ, "model_type": "mimi", "audio_channels": 1,
        "codebook_dim": 256 if full else 16, "codebook_size": CODEBOOK_SIZE, "compress": 2,
        "dilation_growth_rate": 2, "head_dim": 64 if full else 8, "hidden_act": "gelu",
        "hidden_size": hidden, "intermediate_size": 2048 if full else 32, "kernel_size": 7,
        "last_kernel_size": 3, "layer_scale_initial_scale": 0.01,
        "max_position_embeddings": 8000, "norm_eps": 1e-5,
        "num_attention_heads": 8 if full else 2, "num_filters": 64 if full else 4,
        "num_hidden_layers": 8 if full else 1, "num_key_value_heads": 8 if full else 2,
        "num_quantizers": NUM_CODEBOOKS, "num_residual_layers": 1,
        "num_semantic_quantizers": 1, "pad_mode": "constant", "residual_kernel_size": 3,
        "rope_theta": 10000.0, "sampling_rate": SAMPLE_RATE, "sliding_window": 250,
        "trim_right_ratio": 1.0, "upsample_groups": 512 if full else 16,
        "upsampling_ratios": [8, 6, 5, 4], "use_causal_conv": True, "use_conv_shortcut": False,
        "use_streaming": False, "vector_quantization_hidden_dimension": 256 if full else 16,
    }
