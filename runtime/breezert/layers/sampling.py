"""Sampling of first codes and depth codes: pure tensor functions plus validated parameters.

Owns: ``SamplingParams`` (validation, generation_config defaults) and the official processing
order penalty -> suppress reserved ids -> temperature -> top-k -> top-p -> softmax -> one draw per
row with that row's ``torch.Generator``. Must not: know about requests, KV or the models.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

from breezert.models.config import CODEBOOK_SIZE, FRAME_EOS_ID

RESERVED_START = CODEBOOK_SIZE  # 2048..2050 are reserved in both vocabularies
RESERVED_END = FRAME_EOS_ID  # 2051 (EOS) is kept for the backbone; depth logits stop before it

Scalar = float | int
PerRow = Scalar | torch.Tensor


@dataclass(frozen=True)
class SamplingParams:
    """Backbone (first code) and depth-decoder sampling parameters of one request.

    Defaults are the released ``generation_config.json`` plus the recipe's repetition penalty 1.1.
    A temperature of 0 means greedy (argmax); ``top_k`` 0 turns top-k off.
    """

    temperature: float = 0.9
    """Backbone softmax temperature (>= 0; 0 = argmax)."""
    top_k: int = 50
    """Backbone top-k (>= 0; 0 = off; ties with the k-th value are kept)."""
    top_p: float = 1.0
    """Backbone nucleus mass in (0, 1]; 1 = off."""
    repetition_penalty: float = 1.1
    """HF repetition penalty over previously generated first codes (> 0; 1 = off)."""
    depth_temperature: float = 0.9
    """Depth-decoder temperature (>= 0; 0 = argmax)."""
    depth_top_k: int = 50
    """Depth-decoder top-k (>= 0; 0 = off)."""
    depth_top_p: float = 1.0
    """Depth-decoder nucleus mass in (0, 1]."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{f.name}={value!r} must be a number")
            if not math.isfinite(value):
                raise ValueError(f"{f.name}={value!r} must be finite")
        for name in ("temperature", "depth_temperature"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be >= 0")
        for name in ("top_k", "depth_top_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}={value!r} must be an integer >= 0 (0 = off)")
        for name in ("top_p", "depth_top_p"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name}={getattr(self, name)!r} must be in (0, 1]")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty={self.repetition_penalty!r} must be > 0")

    @staticmethod
    def greedy(repetition_penalty: float = 1.0) -> SamplingParams:
        """Argmax for both the backbone and the depth decoder."""
        return SamplingParams(
            temperature=0.0, repetition_penalty=repetition_penalty, depth_temperature=0.0
        )


def _per_row(
    value: PerRow, num_rows: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=dtype).expand(num_rows)
    return torch.full((num_rows,), value, dtype=dtype, device=device)


def cfg_mix(cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """Classifier-free guidance ``u + s * (c - u)``."""
    return uncond + scale * (cond - uncond)


def suppress_reserved(logits: torch.Tensor) -> torch.Tensor:
    """Sets the reserved ids 2048..2050 to -inf (EOS 2051, if present, is kept)."""
    out = logits.clone()
    out[..., RESERVED_START:RESERVED_END] = float("-inf")
    return out


def seen_mask(
    history: Sequence[Sequence[int]], vocab_size: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Boolean ``[R, V]`` mask of the ids each row generated before (each id counts once)."""
    mask = torch.zeros(len(history), vocab_size, dtype=torch.bool, device=device)
    for row, ids in enumerate(history):
        if len(ids):
            mask[row, torch.as_tensor(list(ids), dtype=torch.long, device=device)] = True
    return mask


def apply_repetition_penalty(
    logits: torch.Tensor, seen: torch.Tensor, penalty: PerRow
) -> torch.Tensor:
    """HF repetition penalty on ``seen`` ids: positive logits / penalty, negative * penalty."""
    p = _per_row(penalty, logits.shape[0], logits.dtype, logits.device)[:, None]  # [R, 1]
    penalized = torch.where(logits > 0, logits / p, logits * p)
    return torch.where(seen, penalized, logits)


def apply_temperature(logits: torch.Tensor, temperature: PerRow) -> torch.Tensor:
    """Divides each row by its temperature; rows at temperature 0 are left unchanged."""
    t = _per_row(temperature, logits.shape[0], logits.dtype, logits.device)[:, None]
    return logits / torch.where(t > 0, t, torch.ones_like(t))


def apply_top_k(logits: torch.Tensor, top_k: PerRow) -> torch.Tensor:
    """Keeps every logit >= the row's k-th largest (ties kept); k = 0 keeps the row."""
    k = _per_row(top_k, logits.shape[0], torch.long, logits.device)  # [R]
    sorted_desc = logits.sort(dim=-1, descending=True).values  # [R, V]
    kth = sorted_desc.gather(-1, (k.clamp(1, logits.shape[-1]) - 1)[:, None])  # [R, 1]
    kth = torch.where(k[:, None] > 0, kth, torch.full_like(kth, float("-inf")))
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: PerRow) -> torch.Tensor:
    """Nucleus filter: keeps the most likely ids up to and including the first to reach top_p."""
    p = _per_row(top_p, logits.shape[0], torch.float32, logits.device)[:, None]  # [R, 1]
    if bool((p >= 1).all()):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [R, V]
    probs = sorted_logits.float().softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # exclusive cumulative mass
    remove_sorted = (mass_before >= p) & (p < 1)
    remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)
    return logits.masked_fill(remove, float("-inf"))


def sample(
    logits: torch.Tensor,
    temperature: PerRow,
    top_k: PerRow,
    top_p: PerRow,
    generators: Sequence[torch.Generator | None] | None = None,
) -> torch.Tensor:
    """Temperature -> top-k -> top-p -> softmax -> one draw per row ``[R]`` (T = 0: argmax).

    Args:
        logits: ``[R, V]`` after penalty and suppression.
        generators: one ``torch.Generator`` per row (None = the global RNG).
    """
    num_rows = logits.shape[0]
    t = _per_row(temperature, num_rows, torch.float32, logits.device)
    greedy = logits.argmax(dim=-1)  # [R]
    if bool((t == 0).all()):
        return greedy
    filtered = apply_top_p(apply_top_k(apply_temperature(logits.float(), t), top_k), top_p)
    probs = filtered.softmax(dim=-1)  # [R, V]
    out = greedy.clone()
    for row in range(num_rows):
        if t[row] > 0:
            gen = generators[row] if generators is not None else None
            out[row] = torch.multinomial(probs[row], 1, generator=gen)[0]
    return out
