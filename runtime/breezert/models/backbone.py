"""Qwen3 backbone of Breeze-TTS-2: a causal decoder over prompt and frame embeddings.

Owns: the layer stack and final norm (names = checkpoint ``backbone_model.*`` minus the prefix).
Must not: embed tokens, own ``lm_head`` (the composite does) or store KV itself: attention goes
through the ``KVCache.attend`` contract of ``breezert.layers.attention``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from breezert.layers.attention import KVCache
from breezert.layers.norms import RMSNorm
from breezert.layers.fused import GatedMLP, PackedQKV
from breezert.layers.rope import Rope, apply_rope, default_inv_freq
from breezert.models.config import BackboneConfig


class Qwen3Attention(nn.Module, PackedQKV):
    def __init__(self, cfg: BackboneConfig) -> None:
        super().__init__()
        self.init_projections(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: KVCache,
        layer_idx: int,
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.project(x)
        q = self.q_norm(q.reshape(n, self.num_heads, self.head_dim))  # [N, H, D]
        k = self.k_norm(k.reshape(n, self.num_kv_heads, self.head_dim))  # [N, KVH, D]
        v = v.reshape(n, self.num_kv_heads, self.head_dim)  # [N, KVH, D]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = kv.attend(layer_idx, q, k, v)  # [N, H, D]
        return self.o_proj(out.reshape(n, -1))


class SiluMLP(GatedMLP):
    """SwiGLU MLP: ``down(silu(gate(x)) * up(x))`` (Qwen3 and Llama)."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__(hidden_size, intermediate_size, F.silu)


class Qwen3Layer(nn.Module):
    def __init__(self, cfg: BackboneConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Qwen3Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SiluMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVCache
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv, self.layer_idx)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3Backbone(nn.Module):
    """Qwen3 decoder stack: ``forward(embeds [N, D], positions [N], kv) -> hidden [N, D]``."""

    def __init__(self, cfg: BackboneConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(Qwen3Layer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rope = Rope(default_inv_freq(cfg.head_dim, cfg.rope_theta))

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, kv: KVCache) -> torch.Tensor:
        """Runs all layers over the step's tokens and returns the final-normed hidden states.

        Args:
            embeds: ``[N, D]`` input rows of the step (contiguous runs per sequence).
            positions: ``[N]`` absolute positions, used for RoPE only.
            kv: a ``KVCache`` whose step metadata already describes these N tokens.
        """
        cos, sin = self.rope.cos_sin(positions, embeds.dtype)  # [N, head_dim] each
        x = embeds
        for layer in self.layers:
            x = layer(x, cos, sin, kv)
        return self.norm(x)
