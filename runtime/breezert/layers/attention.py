"""Attention helpers and the pluggable KV-cache contract of the backbone, with a dense reference.

Owns: ``sdpa_gqa`` (grouped-query SDPA on one sequence), the ``KVCache`` protocol, ``GatherKV``
(the paged cache's per-forward view, over the index tensors ``worker/kv_cache.py`` builds, or
``decode_meta_on_device`` inside a graph; the fused DECODE kernel reads the same view), the
metadata's value types ``KVRun`` and ``StepMeta``, and ``DenseKVCache``. Must not: pick
sequences or blocks (the caller does) or know about requests.

The ``KVCache`` contract (what a paged implementation must honour too):

* The owner calls its own per-step setup (``DenseKVCache.begin_step(seq_ids, num_new_tokens)``)
  before a forward; the model never sees that metadata. The N tokens of the step are laid out as
  contiguous runs, one run per sequence, in the order given to the setup call.
* During the forward, every layer calls ``attend(layer_idx, q, k, v)`` exactly once, in layer
  order, with ``q [N, H, D]`` and ``k, v [N, KVH, D]`` after q/k-norm and RoPE.
* ``attend`` writes the new k/v at the sequence's next positions, then returns causal attention
  ``[N, H, D]`` (dtype of ``q``) of each new token over that sequence's cached plus new keys,
  with softmax scale ``D ** -0.5`` and GQA (query head ``h`` reads kv head ``h // (H // KVH)``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class KVRun:
    """New tokens of one sequence in this step: positions ``start .. start + num_new - 1``."""

    block_ids: Sequence[int]
    start: int
    num_new: int


@dataclass(frozen=True)
class StepMeta:
    """Host-built metadata of one backbone step (CPU tensors, padded to a bucket)."""

    positions: torch.Tensor  # [N] long
    write_rows: torch.Tensor  # [N] long
    read_rows: torch.Tensor  # [R, T] (decode) or [Tk] (packed)
    mask: torch.Tensor  # [R, 1, 1, T] or [N, Tk] bool
    num_tokens: int  # real (unpadded) tokens
    last_index: list[int]  # index of each run's last token in the step


class KVCache(Protocol):
    """What the backbone needs from a KV cache: one ``attend`` call per layer per step."""

    def attend(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor: ...


def sdpa_gqa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Grouped-query SDPA: ``q [..., H, Nq, D]``, ``k, v [..., KVH, Nk, D]`` -> ``[..., H, Nq, D]``.

    ``mask`` is boolean (True = attend), broadcastable to ``[..., H, Nq, Nk]``.
    """
    if q.shape[-3] != k.shape[-3]:  # GQA: SDPA reads each K/V head for its query group
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, enable_gqa=True
        )
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def causal_mask(start: int, num_new: int, device: torch.device) -> torch.Tensor | None:
    """Mask ``[num_new, start + num_new]`` for new tokens at ``start..``; None when one token."""
    if num_new == 1:
        return None
    q_pos = torch.arange(start, start + num_new, device=device)
    return torch.arange(start + num_new, device=device)[None, :] <= q_pos[:, None]


class GatherKV:
    """One forward's attention over the paged cache, from fixed-shape index tensors.

    Decode form (every sequence adds one token): ``read_rows [R, T]`` and ``mask [R, 1, 1, T]``.
    Packed form (prefill): ``read_rows [Tk]`` and ``mask [N, Tk]``; query ``i`` may read key ``j``
    iff they belong to the same sequence and key position <= query position.
    """

    def __init__(
        self, kv: torch.Tensor, write_rows: torch.Tensor, read_rows: torch.Tensor,
        mask: torch.Tensor,
    ) -> None:
        self.kv, self.write_rows, self.read_rows, self.mask = kv, write_rows, read_rows, mask

    @torch.compiler.disable  # in-place writes into the shared cache stay out of compiled code
    def attend(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        store = self.kv[layer_idx]  # [2, rows, KVH, D]
        store[0].index_copy_(0, self.write_rows, k.to(store.dtype))
        store[1].index_copy_(0, self.write_rows, v.to(store.dtype))
        keys = store[0][self.read_rows].to(q.dtype)
        values = store[1][self.read_rows].to(q.dtype)
        if self.read_rows.dim() == 2:  # decode: [R, T, KVH, D]
            out = sdpa_gqa(q[:, :, None, :], keys.transpose(1, 2), values.transpose(1, 2), self.mask)
            return out[:, :, 0, :]  # [R, H, D]
        out = sdpa_gqa(q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), self.mask)
        return out.transpose(0, 1)  # [N, H, D]


class DenseKVCache:
    """Reference KV cache: one growable ``[layers, 2, capacity, KVH, D]`` tensor per sequence.

    Used by the sequential reference generator and by tests; the engine's paged cache honours the
    same ``attend`` contract (see the module docstring).
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        initial_capacity: int = 64,
    ) -> None:
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.initial_capacity = initial_capacity
        self._store: dict[int, torch.Tensor] = {}  # seq_id -> [layers, 2, cap, KVH, D]
        self._lens: dict[int, int] = {}
        self._next_id = 0
        self._step: list[tuple[int, int, int]] = []  # (seq_id, start, num_new) per run

    def add_sequence(self) -> int:
        """Registers an empty sequence and returns its id."""
        seq_id = self._next_id
        self._next_id += 1
        self._store[seq_id] = self._alloc(self.initial_capacity)
        self._lens[seq_id] = 0
        return seq_id

    def seq_len(self, seq_id: int) -> int:
        """Number of tokens cached for ``seq_id`` (including those of the current step)."""
        return self._lens[seq_id]

    def begin_step(self, seq_ids: Sequence[int], num_new_tokens: Sequence[int]) -> torch.Tensor:
        """Sets the step metadata and returns the new tokens' absolute positions ``[N]``.

        The lengths advance immediately: the step's tokens count as cached once it begins.
        """
        if len(seq_ids) != len(num_new_tokens) or len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"bad step: seq_ids={list(seq_ids)} num_new={list(num_new_tokens)}")
        self._step = []
        positions = []
        for seq_id, num_new in zip(seq_ids, num_new_tokens, strict=True):
            start = self._lens[seq_id]
            self._reserve(seq_id, start + num_new)
            self._lens[seq_id] = start + num_new
            self._step.append((seq_id, start, num_new))
            positions.append(torch.arange(start, start + num_new))
        return torch.cat(positions).to(self.device)

    def attend(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        out = torch.empty_like(q)  # [N, H, D]
        offset = 0
        for seq_id, start, num_new in self._step:
            end = start + num_new
            store = self._store[seq_id][layer_idx]  # [2, cap, KVH, D]
            store[0, start:end] = k[offset : offset + num_new]
            store[1, start:end] = v[offset : offset + num_new]
            keys = store[0, :end].transpose(0, 1).to(q.dtype)  # [KVH, T, D]
            values = store[1, :end].transpose(0, 1).to(q.dtype)
            q_seq = q[offset : offset + num_new].transpose(0, 1)  # [H, n, D]
            mask = causal_mask(start, num_new, q.device)
            attn = sdpa_gqa(q_seq, keys, values, mask)  # [H, n, D]
            out[offset : offset + num_new] = attn.transpose(0, 1)
            offset += num_new
        if offset != q.shape[0]:
            raise ValueError(f"attend got {q.shape[0]} tokens, step metadata covers {offset}")
        return out

    def _alloc(self, capacity: int) -> torch.Tensor:
        shape = (self.num_layers, 2, capacity, self.num_kv_heads, self.head_dim)
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    def _reserve(self, seq_id: int, length: int) -> None:
        store = self._store[seq_id]
        capacity = store.shape[2]
        if length <= capacity:
            return
        while capacity < length:
            capacity *= 2
        grown = self._alloc(capacity)
        grown[:, :, : store.shape[2]] = store
        self._store[seq_id] = grown


def decode_meta_on_device(
    tables: torch.Tensor,  # [R, max_blocks] int64: each row's block table (scratch block past it)
    positions: torch.Tensor,  # [R] int64: the new token's position (padding rows: 0)
    key_slots: torch.Tensor,  # [T] int64: 0..T-1, the padded context
    block_size: int, scratch_row: int,
) -> dict[str, torch.Tensor]:
    """A DECODE step's ``GatherKV`` tensors from device block tables, sync-free, for a graph:
    each row reads keys ``0..position`` through its table and writes the new token's row; a
    padding row (its table all scratch block, position 0) reads and writes the scratch row."""
    rows = tables[:, key_slots // block_size] * block_size + key_slots % block_size  # [R, T]
    valid = key_slots[None, :] <= positions[:, None]
    mask = valid | (key_slots == 0)[None, :]  # padding rows read the scratch row: finite
    return {"positions": positions, "write_rows": rows.gather(1, positions[:, None])[:, 0],
            "read_rows": torch.where(valid, rows, scratch_row), "mask": mask[:, None, None, :]}
