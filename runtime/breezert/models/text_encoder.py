"""T5Gemma2 text encoder of Breeze-TTS-2: bidirectional, sliding/full layers, dual RoPE.

Owns: the encoder module (names = checkpoint ``text_encoder.*`` minus the prefix) and its packed
forward over independent segments. Must not: project to the backbone width or place segments in
a prompt (``BreezeModel`` does).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from breezert.host_copy import upload
from breezert.layers.attention import sdpa_gqa
from breezert.layers.fused import GatedMLP, PackedQKV
from breezert.layers.norms import GemmaRMSNorm
from breezert.layers.rope import Rope, apply_rope, default_inv_freq, linear_inv_freq
from breezert.models.config import TextEncoderConfig

FULL = "full_attention"
SLIDING = "sliding_attention"


class ScaledEmbedding(nn.Embedding):
    """Token embedding times ``sqrt(hidden)``; the EOI id takes ``eoi_embedding`` unscaled."""

    def __init__(self, cfg: TextEncoderConfig) -> None:
        super().__init__(cfg.vocab_size, cfg.hidden_size)
        self.eoi_embedding = nn.Parameter(torch.zeros(cfg.hidden_size))
        self.eoi_token_id = cfg.eoi_token_id
        self.scale = math.sqrt(cfg.hidden_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = F.embedding(input_ids, self.weight) * torch.tensor(self.scale, dtype=self.weight.dtype)
        is_eoi = (input_ids == self.eoi_token_id)[..., None]
        return torch.where(is_eoi, self.eoi_embedding.to(x.dtype), x)  # [N, d]


class EncoderAttention(nn.Module, PackedQKV):
    def __init__(self, cfg: TextEncoderConfig) -> None:
        super().__init__()
        self.init_projections(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        self.scale = cfg.query_pre_attn_scalar**-0.5
        self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.project(x)
        q = self.q_norm(q.reshape(n, self.num_heads, self.head_dim))  # [N, H, D]
        k = self.k_norm(k.reshape(n, self.num_kv_heads, self.head_dim))  # [N, KVH, D]
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = sdpa_gqa(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), mask, self.scale)
        return self.o_proj(out.transpose(0, 1).reshape(n, -1))  # [N, d]


class GeluMLP(GatedMLP):
    """Gemma MLP: ``down(gelu_tanh(gate(x)) * up(x))``."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__(hidden_size, intermediate_size, partial(F.gelu, approximate="tanh"))


class EncoderLayer(nn.Module):
    def __init__(self, cfg: TextEncoderConfig, layer_type: str) -> None:
        super().__init__()
        self.layer_type = layer_type
        eps = cfg.rms_norm_eps
        self.pre_self_attn_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.self_attn = EncoderAttention(cfg)
        self.post_self_attn_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.mlp = GeluMLP(cfg.hidden_size, cfg.intermediate_size)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        attn = self.self_attn(self.pre_self_attn_layernorm(x), cos, sin, mask)
        x = x + self.post_self_attn_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(mlp)


class T5Gemma2TextEncoder(nn.Module):
    """Encodes a packed batch of independent text segments (each at positions 0..n-1)."""

    def __init__(self, cfg: TextEncoderConfig) -> None:
        super().__init__()
        for layer_type in cfg.layer_types:
            if layer_type not in (FULL, SLIDING):
                raise ValueError(f"text_encoder layer_types: unknown type {layer_type!r}")
        self.cfg = cfg
        self.embed_tokens = ScaledEmbedding(cfg)
        self.layers = nn.ModuleList(EncoderLayer(cfg, t) for t in cfg.layer_types)
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self._ropes = {
            SLIDING: Rope(default_inv_freq(cfg.head_dim, cfg.sliding_rope_theta)),
            FULL: Rope(linear_inv_freq(cfg.head_dim, cfg.full_rope_theta, cfg.full_rope_factor)),
        }

    def forward(
        self, input_ids: torch.Tensor, seg_lens: Sequence[int] | torch.Tensor
    ) -> torch.Tensor:
        """Encodes ``input_ids [N]`` split into segments of ``seg_lens`` tokens -> ``[N, d]``.

        ``seg_lens`` is a list of lengths or a ``cu_seqlens`` LongTensor ``[S + 1]`` (0, ..., N).
        """
        seg_ids, positions = segment_layout(seg_lens, input_ids.shape[0], input_ids.device)
        return self.encode(input_ids, seg_ids, positions)

    def encode(
        self, input_ids: torch.Tensor, seg_ids: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """Like ``forward`` from per-token segment ids and positions ``[N]`` (fixed shapes, no
        host sync: graph-capturable; padding tokens get a segment id of their own)."""
        masks = {
            FULL: seg_ids[:, None] == seg_ids[None, :],  # [N, N] block diagonal
            SLIDING: sliding_block_mask(seg_ids, positions, self.cfg.sliding_window),
        }
        tables = self.rope_tables(positions)
        x = self.embed_tokens(input_ids)  # [N, d]
        for layer in self.layers:
            cos, sin = tables[layer.layer_type]
            x = layer(x, cos, sin, masks[layer.layer_type])
        return self.norm(x)

    def rope_tables(self, positions: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Per layer type, ``(cos, sin)`` ``[N, head_dim]`` of ``positions`` in the weights'
        dtype."""
        dtype = self.embed_tokens.weight.dtype
        return {t: rope.cos_sin(positions, dtype) for t, rope in self._ropes.items()}


def segment_layout(
    seg_lens: Sequence[int] | torch.Tensor, num_tokens: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns per-token ``(segment index [N], position within segment [N])``."""
    if isinstance(seg_lens, torch.Tensor):
        lens = (seg_lens[1:] - seg_lens[:-1]).tolist()
    else:
        lens = [int(n) for n in seg_lens]
    if sum(lens) != num_tokens or any(n <= 0 for n in lens):
        raise ValueError(f"seg_lens {lens} do not split {num_tokens} tokens into segments")
    seg_ids = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    positions = torch.cat([torch.arange(n) for n in lens])
    return upload(seg_ids, device), upload(positions, device)


def sliding_block_mask(seg_ids: torch.Tensor, positions: torch.Tensor, window: int) -> torch.Tensor:
    """Block-diagonal mask with the symmetric window ``q - k in [-(w // 2), (w + 1) // 2 - 1]``.

    HF T5Gemma2 bidirectional window: left size ``(w + 1) // 2``, right size ``w // 2 + 1``; for
    w = 512 that is q - k in [-256, 255].
    """
    dist = positions[:, None] - positions[None, :]  # [N, N] = q - k
    left, right = (window + 1) // 2, window // 2 + 1
    in_window = ((dist >= 0) & (dist < left)) | ((dist < 0) & (-dist < right))
    return in_window & (seg_ids[:, None] == seg_ids[None, :])
