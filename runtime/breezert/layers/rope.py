"""Rotary position embeddings: default, linear-scaled and llama3-scaled inverse frequencies.

Owns: inv_freq formulas (HF semantics), cos/sin tables for explicit positions and the rotate-half
apply (and its sign-folded form for hot loops). Must not: hold state in module buffers (a
``.to(bf16)`` would round inv_freq); tables are computed in fp32 and cast to the activation dtype
only when applied.
"""

from __future__ import annotations

import math

import torch


def default_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """Returns ``1 / theta^(2i/d)`` for ``i < d/2``.  # [head_dim / 2] fp32"""
    # NOTE: explicit CPU device, so a model built under ``torch.device("meta")`` keeps real tables.
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    return 1.0 / (theta**exponent)


def linear_inv_freq(head_dim: int, theta: float, factor: float) -> torch.Tensor:
    """Linear ("position interpolation") scaling: the default inv_freq divided by ``factor``."""
    return default_inv_freq(head_dim, theta) / factor


def llama3_inv_freq(
    head_dim: int,
    theta: float,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_max_position: int,
) -> torch.Tensor:
    """Llama-3 scaling: long wavelengths divided by ``factor``, short ones kept, smooth between."""
    inv_freq = default_inv_freq(head_dim, theta)
    low_freq_wavelen = original_max_position / low_freq_factor
    high_freq_wavelen = original_max_position / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max_position / wavelen - low_freq_factor) / (
        high_freq_factor - low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class Rope:
    """Caches one inv_freq per device and builds cos/sin tables for explicit positions."""

    def __init__(self, inv_freq: torch.Tensor) -> None:
        self._inv_freq = inv_freq.float()  # [head_dim / 2]
        self._by_device: dict[torch.device, torch.Tensor] = {}

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        if device not in self._by_device:
            self._by_device[device] = self._inv_freq.to(device)
        return self._by_device[device]

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)``, each ``[N, head_dim]``, for ``positions [N]``: computed in fp32, then
        cast once to ``dtype`` (the activations' dtype) so no layer casts them again."""
        freqs = positions.float()[:, None] * self.inv_freq(positions.device)[None, :]  # [N, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [N, D]
        cos, sin = emb.cos(), emb.sin()
        if dtype is not None and dtype != torch.float32:
            cos, sin = cos.to(dtype), sin.to(dtype)
        return cos, sin


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates ``x [N, H, D]`` by per-token ``cos/sin [N, D]`` (HF rotate-half convention)."""
    cos = cos.to(x.dtype)[:, None, :]  # [N, 1, D]
    sin = sin.to(x.dtype)[:, None, :]
    return x * cos + rotate_half(x) * sin


def fold_rotation_sign(sin: torch.Tensor) -> torch.Tensor:
    """``sin [..., D]`` with its first half negated, for ``apply_rope_signed``."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def apply_rope_signed(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """``apply_rope`` with the sign of ``rotate_half`` folded into the table
    (``fold_rotation_sign``): ``x * cos + roll(x, D/2) * sin_signed``, the same bits with one
    ``roll`` where ``rotate_half`` takes two slices, a negation and a concatenation (negation
    is exact and commutes with the product). ``cos`` and ``sin_signed`` broadcast against
    ``x [..., D]`` as they are."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed
