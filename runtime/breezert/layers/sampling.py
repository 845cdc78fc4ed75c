"""Sampling of first codes and depth codes: pure tensor functions.

Owns: the official processing order penalty -> suppress reserved ids -> temperature -> top-k ->
top-p -> one draw per row from a counter-based RNG keyed by (request seed, draw counter). Must
not: know about requests, KV or the models; parameters are ``breezert.options.SamplingParams``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from breezert.constants import CODEBOOK_SIZE, FRAME_EOS_ID

RESERVED_START = CODEBOOK_SIZE  # 2048..2050 are reserved in both vocabularies
RESERVED_END = FRAME_EOS_ID  # 2051 (EOS) is kept for the backbone; depth logits stop before it

Scalar = float | int
PerRow = Scalar | torch.Tensor


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


def filter_top_k_top_p(
    logits: torch.Tensor, top_k: PerRow, top_p: PerRow, max_k: int | None = None
) -> torch.Tensor:
    """Top-k (ids tied with the k-th value kept; k = 0 keeps the row), then top-p (the most
    likely ids up to and including the first to reach p; p = 1 removes nothing), with one sort
    and no host sync.

    With ``max_k`` (every row's k in 1..max_k) only the ``max_k`` largest logits are sorted, by
    ``topk``: far cheaper than sorting the vocabulary. Ids tied with the k-th value are kept
    either way; with ``max_k`` their mass is left out of the top-p sum only when such ties fall
    beyond the ``max_k`` largest.
    """
    num_rows, vocab = logits.shape
    return RowSampling.of(1.0, top_k, top_p, num_rows, vocab, logits.device, max_k).filter(logits)


class RowSampling(NamedTuple):
    """A batch's temperature, top-k and top-p as the per-row tensors a draw reads, made once
    for many draws (a depth frame draws 16 times with the same settings): ``draw`` is
    ``sample`` without rebuilding them (half its operators, which is what a draw costs on the
    CPU). Sync-free, so it runs inside CUDA graphs."""

    divisor: torch.Tensor  # [R, 1] float32: the temperature, 1 where it is 0 (greedy rows)
    sampled: torch.Tensor  # [R] bool: temperature > 0 (else the row takes the argmax)
    kth_index: torch.Tensor  # [R, 1] int64: position of the k-th largest among the sorted
    has_k: torch.Tensor  # [R, 1] bool: top-k on (k > 0)
    top_p: torch.Tensor  # [R, 1] float32
    has_p: torch.Tensor  # [R, 1] bool: top-p on (p < 1)
    max_k: int | None  # every row's k is in 1..max_k (see ``filter_top_k_top_p``), or None

    @classmethod
    def of(cls, temperature: PerRow, top_k: PerRow, top_p: PerRow, num_rows: int, vocab: int,
           device: torch.device, max_k: int | None = None) -> RowSampling:
        t = _per_row(temperature, num_rows, torch.float32, device)
        k = _per_row(top_k, num_rows, torch.long, device)
        p = _per_row(top_p, num_rows, torch.float32, device)
        width = vocab if max_k is None else min(max_k, vocab)  # the sorted logits' width
        return cls(torch.where(t > 0, t, torch.ones_like(t))[:, None], t > 0,
                   (k.clamp(1, width) - 1)[:, None], (k > 0)[:, None], p[:, None],
                   (p < 1)[:, None], max_k)

    def filter(self, logits: torch.Tensor) -> torch.Tensor:
        """Top-k, then top-p, of ``logits [R, V]`` (already tempered): the rest -> -inf."""
        if self.max_k is not None:
            sorted_desc, order = logits.topk(min(self.max_k, logits.shape[-1]), dim=-1)
        else:
            sorted_desc, order = logits.sort(dim=-1, descending=True)  # [R, V]
        kth = sorted_desc.gather(-1, self.kth_index)  # [R, 1]
        drop_k_sorted = (sorted_desc < kth) & self.has_k  # ties with the k-th value are kept
        probs = sorted_desc.masked_fill(drop_k_sorted, float("-inf")).float().softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # exclusive cumulative mass
        drop_p_sorted = (mass_before >= self.top_p) & self.has_p
        drop_p = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
        drop_p = drop_p.scatter(-1, order, drop_p_sorted)
        drop_k = (logits < kth) & self.has_k
        return logits.masked_fill(drop_k | drop_p, float("-inf"))

    def draw(self, logits: torch.Tensor, gumbel: torch.Tensor) -> torch.Tensor:
        """One code per row of ``logits [R, V]`` (after penalty and suppression) with the
        Gumbel noise ``gumbel [R, >= V]`` of the draw: ``sample``'s result."""
        filtered = self.filter(logits.float() / self.divisor)
        drawn = (filtered + gumbel[:, : logits.shape[-1]]).argmax(dim=-1)
        return torch.where(self.sampled, drawn, logits.argmax(dim=-1))


# Counter-based RNG: a draw is a pure function of (request seed, draw counter, column), so codes
# do not depend on batching, scheduling, device or graph replay, and there is no generator state
# to carry: the request's stream continues across segments by its frame counter alone.
_MASK32 = 0xFFFFFFFF
_MIX1, _MIX2 = 0x7FEB352D, 0x846CA68B  # lowbias32's multipliers
_COLUMN_STEP = 0x9E3779B1  # column c enters the hash as c * this (mod 2**32)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2**32`` exactly in int64 (x < 2**32), without overflowing 63 bits."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _MASK32


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 (C. Wellons): a strong 32-bit integer mix, on int64 tensors holding 32 bits."""
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = _mul32(x, _MIX1)
    x = x ^ (x >> 15)
    x = _mul32(x, _MIX2)
    return x ^ (x >> 16)


def counter_uniform(seeds: torch.Tensor, counters: torch.Tensor, width: int) -> torch.Tensor:
    """``[R, width]`` float32 uniforms in (0, 1) from ``seeds [R]`` and ``counters [R]`` (int64)."""
    if seeds.device.type == "cpu" and not torch.compiler.is_compiling():
        return _cpu_counter_uniform(seeds, counters, width)
    return _torch_counter_uniform(seeds, counters, width)


def _torch_counter_uniform(seeds: torch.Tensor, counters: torch.Tensor,
                           width: int) -> torch.Tensor:
    """``counter_uniform`` in int64 torch operators holding 32 bits (any device, graph-safe)."""
    seeds = seeds.to(torch.long)
    row = _hash32(_hash32(seeds & _MASK32) ^ (seeds >> 32) & _MASK32)
    row = _hash32(row ^ (counters.to(torch.long) & _MASK32))  # [R]
    cols = torch.arange(width, device=seeds.device, dtype=torch.long)
    bits = _hash32(_hash32(row[:, None] + _mul32(cols, _COLUMN_STEP)[None, :]) ^ row[:, None])
    return ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def _np_hash32(x: np.ndarray) -> np.ndarray:
    """``_hash32`` on uint32 arrays, whose products wrap mod 2**32 by themselves."""
    x = x ^ (x >> 16)
    x *= np.uint32(_MIX1)
    x ^= x >> 15
    x *= np.uint32(_MIX2)
    return x ^ (x >> 16)


_COLUMN_KEYS: dict[int, np.ndarray] = {}


def _cpu_counter_uniform(seeds: torch.Tensor, counters: torch.Tensor, width: int) -> torch.Tensor:
    """``counter_uniform`` on the CPU in 32-bit numpy: the same bits as the int64 torch path
    (exact integer arithmetic: uint32 products wrap mod 2**32) in a third of the operators on
    half the bytes (4x faster at 32 x 2052). A depth frame's noise is most of a tiny model's
    step on the CPU."""
    keys = _COLUMN_KEYS.get(width)
    if keys is None:  # _mul32(cols, _COLUMN_STEP): the same for every call of this width
        keys = _COLUMN_KEYS[width] = np.arange(width, dtype=np.uint32) * np.uint32(_COLUMN_STEP)
    s = seeds.to(torch.long).numpy().view(np.uint64)
    lo, hi = s.astype(np.uint32), (s >> np.uint64(32)).astype(np.uint32)
    row = _np_hash32(_np_hash32(lo) ^ hi)
    row = _np_hash32(row ^ counters.to(torch.long).numpy().astype(np.uint32))[:, None]
    bits = _np_hash32(_np_hash32(row + keys) ^ row)
    out = (bits >> 8).astype(np.float32)
    out += np.float32(0.5)
    out *= np.float32(1.0 / (1 << 24))
    return torch.from_numpy(out)


def gumbel_noise(seeds: torch.Tensor, counters: torch.Tensor, width: int) -> torch.Tensor:
    """``[R, width]`` Gumbel(0, 1) noise of the draws ``counters [R]`` of ``seeds [R]``. Column
    ``c`` depends on (seed, counter, c) only, so a wider call's first columns are a narrower
    call's noise, bit for bit."""
    return -torch.log(-torch.log(counter_uniform(seeds, counters, width)))


def draw_counter(frame_index: torch.Tensor | int, codebook: int) -> torch.Tensor | int:
    """Counter of a request's draw for ``codebook`` (0 = first code) of its frame ``frame_index``
    (counted over the whole request, across segments)."""
    return frame_index * 16 + codebook


def sample(
    logits: torch.Tensor,
    temperature: PerRow,
    top_k: PerRow,
    top_p: PerRow,
    seeds: torch.Tensor,
    counters: torch.Tensor,
    max_k: int | None = None,
    gumbel: torch.Tensor | None = None,
) -> torch.Tensor:
    """Temperature -> top-k -> top-p -> one categorical draw per row ``[R]`` (T = 0: argmax).

    The draw is Gumbel-max over the filtered logits, which samples exactly from their softmax;
    its noise is ``gumbel_noise(seeds, counters)``. Branch-free and sync-free.

    Args:
        logits: ``[R, V]`` after penalty and suppression.
        seeds, counters: ``[R]`` int64 per-row request seed and draw counter.
        max_k: a bound on every row's top-k (see ``filter_top_k_top_p``), or None.
        gumbel: that noise already made (``[R, >= V]``, e.g. a frame's draws in one call);
            ``seeds`` and ``counters`` are then unused.
    """
    num_rows, vocab = logits.shape
    rows = RowSampling.of(temperature, top_k, top_p, num_rows, vocab, logits.device, max_k)
    return rows.draw(logits, gumbel_noise(seeds, counters, vocab) if gumbel is None else gumbel)
