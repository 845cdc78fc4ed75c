"""Qwen3-TTS-Tokenizer-12Hz encoder (Mimi): 24 kHz waveform -> reference codes [B, K, 16].

Owns: the Mimi encoder modules under the released ``encoder.*`` names (SEANet conv encoder,
causal transformer, stride-2 downsample, split RVQ), built from the raw ``encoder_config`` dict,
and a random init. Must not: read files, resample audio or know requests (see
``breezert.reference_audio``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from breezert.layers.rope import rotate_half
from breezert.models.codec import LayerScale

NUM_KEPT_QUANTIZERS = 16  # ``encoder_valid_num_quantizers`` (SPEC §1.6, §2.7)
_PAD_MODES = ("constant", "replicate")
_ACTIVATIONS = {"gelu": F.gelu, "silu": F.silu, "relu": F.relu}  # transformers ACT2FN names


@dataclass(frozen=True)
class MimiEncoderConfig:
    """The fields of a transformers ``MimiConfig`` that the encode path reads."""

    audio_channels: int
    num_filters: int
    kernel_size: int
    last_kernel_size: int
    residual_kernel_size: int
    dilation_growth_rate: int
    compress: int
    num_residual_layers: int
    upsampling_ratios: tuple[int, ...]
    use_conv_shortcut: bool
    pad_mode: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    attention_bias: bool
    norm_eps: float
    rope_theta: float
    layer_scale_initial_scale: float
    hidden_act: str
    sampling_rate: int
    frame_rate: float
    codebook_size: int
    codebook_dim: int
    vq_hidden_dim: int
    num_quantizers: int
    num_semantic_quantizers: int

    @staticmethod
    def from_json(d: dict[str, Any]) -> MimiEncoderConfig:
        """Reads a Mimi ``encoder_config``; absent optional keys take the MimiConfig defaults."""
        if not d:
            raise ValueError("encoder_config is empty: the audio tokenizer has no Mimi encoder")
        if not d.get("use_causal_conv", True):
            raise ValueError("encoder_config.use_causal_conv=False is not supported")
        hidden, heads = int(d["hidden_size"]), int(d["num_attention_heads"])
        cfg = MimiEncoderConfig(
            audio_channels=int(d.get("audio_channels", 1)),
            num_filters=int(d["num_filters"]),
            kernel_size=int(d.get("kernel_size", 7)),
            last_kernel_size=int(d.get("last_kernel_size", 3)),
            residual_kernel_size=int(d.get("residual_kernel_size", 3)),
            dilation_growth_rate=int(d.get("dilation_growth_rate", 2)),
            compress=int(d.get("compress", 2)),
            num_residual_layers=int(d.get("num_residual_layers", 1)),
            upsampling_ratios=tuple(int(r) for r in d["upsampling_ratios"]),
            use_conv_shortcut=bool(d.get("use_conv_shortcut", False)),
            pad_mode=str(d.get("pad_mode", "constant")),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            attention_bias=bool(d.get("attention_bias", False)),
            norm_eps=float(d.get("norm_eps", 1e-5)),
            rope_theta=float(d.get("rope_theta", 10000.0)),
            layer_scale_initial_scale=float(d.get("layer_scale_initial_scale", 0.01)),
            hidden_act=str(d.get("hidden_act", "gelu")),
            sampling_rate=int(d.get("sampling_rate", 24000)),
            frame_rate=float(d.get("_frame_rate") or d.get("frame_rate") or 12.5),
            codebook_size=int(d["codebook_size"]),
            codebook_dim=int(d.get("codebook_dim") or hidden),
            vq_hidden_dim=int(d.get("vector_quantization_hidden_dimension") or hidden),
            num_quantizers=int(d["num_quantizers"]),
            num_semantic_quantizers=int(d.get("num_semantic_quantizers", 1)),
        )
        cfg._validate()
        return cfg

    def _validate(self) -> None:
        if self.pad_mode not in _PAD_MODES:
            raise ValueError(f"encoder_config.pad_mode={self.pad_mode!r}: use one of {_PAD_MODES}")
        if self.hidden_act not in _ACTIVATIONS:
            raise ValueError(
                f"encoder_config.hidden_act={self.hidden_act!r}: use one of {sorted(_ACTIVATIONS)}"
            )
        if self.codebook_dim != self.vq_hidden_dim:
            raise ValueError(
                f"encoder_config.codebook_dim={self.codebook_dim} != "
                f"vector_quantization_hidden_dimension={self.vq_hidden_dim}"
            )
        if not 0 < self.num_semantic_quantizers < self.num_quantizers:
            raise ValueError(
                f"encoder_config.num_semantic_quantizers={self.num_semantic_quantizers} must be in "
                f"1..num_quantizers-1={self.num_quantizers - 1}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"encoder_config.num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}"
            )
        if self.downsample_kernel < 2:
            raise ValueError(
                f"encoder_config._frame_rate={self.frame_rate} needs a downsample: the SEANet "
                f"frame rate is {self.encodec_frame_rate}"
            )

    @property
    def encodec_frame_rate(self) -> int:
        """SEANet frames per second, before the stride-2 downsample."""
        return math.ceil(self.sampling_rate / math.prod(self.upsampling_ratios))

    @property
    def downsample_kernel(self) -> int:
        return 2 * int(self.encodec_frame_rate / self.frame_rate)

    @property
    def samples_per_frame(self) -> int:
        """Waveform samples per code frame (1920 for the 12.5 Hz tokenizer)."""
        return math.prod(self.upsampling_ratios) * 2



# ------------------------------------------------------------------------------- SEANet encoder
class _CausalConv(nn.Module):
    """MimiConv1d with causal padding: all of ``k_eff - stride`` on the left, and on the right
    the "extra padding" that rounds the length up to a multiple of the stride (so the output has
    ``ceil(T / stride)`` steps)."""

    def __init__(
        self, cin: int, cout: int, kernel: int, stride: int = 1, dilation: int = 1,
        bias: bool = True, pad_mode: str = "constant",
    ) -> None:
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, kernel, stride, dilation=dilation, bias=bias)
        self.stride = stride
        self.padding_total = (kernel - 1) * dilation + 1 - stride
        self.pad_mode = pad_mode

    def forward(self, x: Tensor) -> Tensor:  # [B, C, T] -> [B, C', ceil(T / stride)]
        length = x.shape[-1]
        # transformers' ceil((T - k_eff + padding_total) / s + 1) - 1 frames simplifies to this.
        extra = -(-length // self.stride) * self.stride - length
        x = F.pad(x, (self.padding_total, extra), mode=self.pad_mode)
        return self.conv(x)


class _ResnetBlock(nn.Module):
    """SEANet residual block: ELU, conv k (dilated), ELU, conv 1, plus the (identity) shortcut."""

    def __init__(self, cfg: MimiEncoderConfig, dim: int, dilation: int) -> None:
        super().__init__()
        hidden = dim // cfg.compress
        mode = cfg.pad_mode
        # indices 0 and 2 are the parameter-free ELUs, so the convs keep the names block.1 / .3
        self.block = nn.ModuleList([
            nn.ELU(), _CausalConv(dim, hidden, cfg.residual_kernel_size, dilation=dilation,
                                  pad_mode=mode),
            nn.ELU(), _CausalConv(hidden, dim, 1, pad_mode=mode),
        ])
        self.shortcut = _CausalConv(dim, dim, 1, pad_mode=mode) if cfg.use_conv_shortcut else None

    def forward(self, x: Tensor) -> Tensor:
        residual = x if self.shortcut is None else self.shortcut(x)
        for layer in self.block:
            x = layer(x)
        return residual + x


class _SeanetEncoder(nn.Module):
    def __init__(self, cfg: MimiEncoderConfig) -> None:
        super().__init__()
        mode = cfg.pad_mode
        layers: list[nn.Module] = [
            _CausalConv(cfg.audio_channels, cfg.num_filters, cfg.kernel_size, pad_mode=mode)
        ]
        scale = 1
        for ratio in reversed(cfg.upsampling_ratios):
            dim = scale * cfg.num_filters
            for j in range(cfg.num_residual_layers):
                layers.append(_ResnetBlock(cfg, dim, cfg.dilation_growth_rate**j))
            layers += [nn.ELU(), _CausalConv(dim, dim * 2, ratio * 2, stride=ratio, pad_mode=mode)]
            scale *= 2
        layers += [
            nn.ELU(),
            _CausalConv(scale * cfg.num_filters, cfg.hidden_size, cfg.last_kernel_size,
                        pad_mode=mode),
        ]
        self.layers = nn.ModuleList(layers)

    def forward(self, x: Tensor) -> Tensor:  # [B, 1, T] -> [B, hidden, ceil(T / 960)]
        for layer in self.layers:
            x = layer(x)
        return x


# ------------------------------------------------------------------------------- transformer
def _rope(num_pos: int, head_dim: int, theta: float, device: torch.device) -> tuple[Tensor, Tensor]:
    # Same float path as transformers' default RoPE: int64 arange -> fp32, fp32 outer product.
    inv_freq = 1.0 / theta ** (
        torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    )
    pos = torch.arange(num_pos, device=device).float()
    freqs = (inv_freq[:, None] @ pos[None, :]).T  # [T, head_dim / 2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [T, head_dim]
    return emb.cos(), emb.sin()


class _Attention(nn.Module):
    def __init__(self, cfg: MimiEncoderConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=bias)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:  # x [B, T, hidden]
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin  # [B, H, T, head_dim]
        k = k * cos + rotate_half(k) * sin
        if self.num_kv_heads != self.num_heads:
            rep = self.num_heads // self.num_kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        # NOTE(codec_encoder): full causal attention over the whole reference, not the config's
        # 250-frame sliding window: the released runtime encodes references this way (SPEC §1.6).
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class _Mlp(nn.Module):
    def __init__(self, cfg: MimiEncoderConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act = _ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


class _TransformerLayer(nn.Module):
    def __init__(self, cfg: MimiEncoderConfig) -> None:
        super().__init__()
        self.self_attn = _Attention(cfg)
        self.mlp = _Mlp(cfg)
        self.input_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.self_attn_layer_scale = LayerScale(cfg.hidden_size, cfg.layer_scale_initial_scale)
        self.mlp_layer_scale = LayerScale(cfg.hidden_size, cfg.layer_scale_initial_scale)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.self_attn_layer_scale(self.self_attn(self.input_layernorm(x), cos, sin))
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))


class _Transformer(nn.Module):
    def __init__(self, cfg: MimiEncoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(_TransformerLayer(cfg) for _ in range(cfg.num_layers))

    def forward(self, x: Tensor) -> Tensor:  # [B, T, hidden], positions 0..T-1
        cos, sin = _rope(x.shape[1], self.cfg.head_dim, self.cfg.rope_theta, x.device)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return x


# ------------------------------------------------------------------------------- split RVQ
class _Codebook(nn.Module):
    """EMA codebook: the code vectors are ``embed_sum / max(cluster_usage, eps)``."""

    def __init__(self, size: int, dim: int, epsilon: float = 1e-5) -> None:
        super().__init__()
        self.epsilon = epsilon
        self.register_buffer("initialized", torch.ones(1))
        self.register_buffer("cluster_usage", torch.ones(size))
        self.register_buffer("embed_sum", torch.zeros(size, dim))

    def embed(self) -> Tensor:  # [size, dim]
        return self.embed_sum / self.cluster_usage.clamp(min=self.epsilon)[:, None]

    def encode(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Nearest code of each row of ``x`` [N, dim] -> (indices [N], code vectors [N, dim])."""
        embed = self.embed()
        # NOTE(codec_encoder): torch.cdist, as transformers does: its matmul-based distance for
        # 2048 codes decides near ties the same way, so the argmin matches bit for bit.
        dists = torch.cdist(x[None].float(), embed[None].float(), p=2)[0]  # [N, size]
        indices = dists.argmin(dim=-1)
        return indices, F.embedding(indices, embed)


class _VectorQuantization(nn.Module):
    def __init__(self, cfg: MimiEncoderConfig) -> None:
        super().__init__()
        self.codebook = _Codebook(cfg.codebook_size, cfg.codebook_dim)


class _ResidualVectorQuantizer(nn.Module):
    def __init__(self, cfg: MimiEncoderConfig, num_quantizers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_VectorQuantization(cfg) for _ in range(num_quantizers))
        self.input_proj: nn.Conv1d | None = None
        self.output_proj: nn.Conv1d | None = None  # decode side only; kept for a strict load
        if cfg.vq_hidden_dim != cfg.hidden_size:
            self.input_proj = nn.Conv1d(cfg.hidden_size, cfg.vq_hidden_dim, 1, bias=False)
            self.output_proj = nn.Conv1d(cfg.vq_hidden_dim, cfg.hidden_size, 1, bias=False)

    def encode(self, x: Tensor, num_quantizers: int) -> Tensor:
        """``x`` [B, hidden, K] -> codes [B, K, num_quantizers]; each stage quantizes the residual
        the previous stages left."""
        if self.input_proj is not None:
            x = self.input_proj(x)
        b, d, k = x.shape
        residual = x.permute(0, 2, 1).reshape(b * k, d)  # [B*K, dim]
        codes = []
        for vq in self.layers[:num_quantizers]:
            indices, quantized = vq.codebook.encode(residual)
            residual = residual - quantized
            codes.append(indices.view(b, k))
        return torch.stack(codes, dim=-1)


class _SplitResidualVectorQuantizer(nn.Module):
    def __init__(self, cfg: MimiEncoderConfig) -> None:
        super().__init__()
        self.num_semantic = cfg.num_semantic_quantizers
        self.semantic_residual_vector_quantizer = _ResidualVectorQuantizer(cfg, self.num_semantic)
        self.acoustic_residual_vector_quantizer = _ResidualVectorQuantizer(
            cfg, cfg.num_quantizers - self.num_semantic
        )

    def encode(self, x: Tensor, num_quantizers: int) -> Tensor:  # [B, hidden, K] -> [B, K, n]
        # Both groups quantize the same embeddings (the acoustic one does not see the semantic
        # residual): that is Mimi's split RVQ.
        codes = self.semantic_residual_vector_quantizer.encode(x, self.num_semantic)
        if num_quantizers > self.num_semantic:
            acoustic = self.acoustic_residual_vector_quantizer.encode(
                x, num_quantizers - self.num_semantic
            )
            codes = torch.cat([codes, acoustic], dim=-1)
        return codes


# ------------------------------------------------------------------------------- the encoder
class CodecEncoder(nn.Module):
    """Mimi encoder of the audio tokenizer; state_dict keys are the file's ``encoder.*`` names
    without the ``encoder.`` prefix."""

    def __init__(
        self, encoder_config: dict[str, Any], num_kept_quantizers: int = NUM_KEPT_QUANTIZERS
    ) -> None:
        super().__init__()
        self.cfg = MimiEncoderConfig.from_json(encoder_config)
        if not self.cfg.num_semantic_quantizers <= num_kept_quantizers <= self.cfg.num_quantizers:
            raise ValueError(
                f"num_kept_quantizers={num_kept_quantizers} must be in "
                f"{self.cfg.num_semantic_quantizers}..{self.cfg.num_quantizers} "
                f"(encoder_config.num_quantizers)"
            )
        self.num_kept_quantizers = num_kept_quantizers
        self.encoder = _SeanetEncoder(self.cfg)
        self.encoder_transformer = _Transformer(self.cfg)
        self.downsample = _CausalConv(
            self.cfg.hidden_size, self.cfg.hidden_size, self.cfg.downsample_kernel, stride=2,
            bias=False, pad_mode="replicate",
        )
        self.quantizer = _SplitResidualVectorQuantizer(self.cfg)

    @property
    def samples_per_frame(self) -> int:
        return self.cfg.samples_per_frame

    @torch.no_grad()
    def encode(self, wav: Tensor) -> Tensor:
        """``wav`` [B, T] float 24 kHz -> codes [B, ceil(T / 1920), num_kept_quantizers] int64.

        Runs in the module's dtype (keep it float32: SPEC §2.7) with autocast off. Rows of a batch
        share one length; pad shorter ones yourself and trim their codes (Mimi has no mask).
        """
        if wav.dim() != 2 or wav.shape[-1] == 0:
            raise ValueError(f"wav: expected a non-empty [B, T] tensor, got {tuple(wav.shape)}")
        weight = self.downsample.conv.weight
        with torch.autocast(device_type=weight.device.type, enabled=False):
            x = self.embed(wav.to(device=weight.device, dtype=weight.dtype))  # [B, hidden, K]
            return self.quantizer.encode(x, self.num_kept_quantizers)  # [B, K, 16]

    def embed(self, wav: Tensor) -> Tensor:
        """``encode`` before the quantizer: ``wav [B, T]`` -> embeddings ``[B, hidden, K]``.
        Keeps autograd on (the codec trainer, ``breezert_train``, learns through it)."""
        x = self.encoder(wav[:, None, :])  # [B, hidden, ceil(T / 960)]
        x = self.encoder_transformer(x.transpose(1, 2)).transpose(1, 2)
        return self.downsample(x)  # [B, hidden, K]


# ------------------------------------------------------------------------------- random init
def _normal_(t: Tensor, std: float, generator: torch.Generator | None) -> None:
    # Draw on CPU in fp32 so a seed gives the same weights on every device.
    t.copy_(torch.randn(t.shape, generator=generator) * std)


@torch.no_grad()
def init_codec_encoder_random_(
    encoder: CodecEncoder, generator: torch.Generator | None = None
) -> CodecEncoder:
    """Finite random weights: convs and linears ``N(0, 1 / fan_in)``, biases 0, norms 1, layer
    scales ``layer_scale_initial_scale``, code vectors ``N(0, 1)`` with usages in [0.5, 1.5).
    Returns ``encoder`` (modified in place)."""
    for module in encoder.modules():
        if isinstance(module, (nn.Conv1d, nn.Linear)):
            _normal_(module.weight, module.weight[0].numel() ** -0.5, generator)
            if module.bias is not None:
                module.bias.zero_()
        elif isinstance(module, nn.LayerNorm):
            module.weight.fill_(1.0)
            module.bias.zero_()
        elif isinstance(module, LayerScale):
            module.scale.fill_(encoder.cfg.layer_scale_initial_scale)
        elif isinstance(module, _Codebook):
            usage = 0.5 + torch.rand(module.cluster_usage.shape, generator=generator)
            module.cluster_usage.copy_(usage)
            module.embed_sum.copy_(torch.randn(module.embed_sum.shape, generator=generator)
                                   * usage[:, None])
            module.initialized.fill_(1.0)
    return encoder
