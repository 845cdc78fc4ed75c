"""The backbone's paged KV cache: one preallocated tensor of blocks, read through block tables.

Owns: the ``[layers, 2, num_blocks, block_size, KVH, D]`` tensor and the per-step attention
metadata (one run of new tokens per sequence, with its block table and start position).
Implements the ``KVCache`` contract of ``layers/attention.py``. Must not: choose blocks (the
scheduler's ``BlockPool`` does) or know about requests.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from breezert.layers.attention import causal_mask, sdpa_gqa


@dataclass(frozen=True)
class KVRun:
    """New tokens of one sequence in this step: positions ``start .. start + num_new - 1``."""

    block_ids: Sequence[int]
    start: int
    num_new: int


class PagedKVCache:
    """Paged K/V storage shared by every sequence (request branch) of the backbone."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        # [layers, 2, blocks * block_size, KVH, D]: blocks flattened so a token is one row.
        self.kv = torch.zeros(
            (num_layers, 2, num_blocks * block_size, num_kv_heads, head_dim),
            dtype=dtype, device=device,
        )
        self._runs: list[KVRun] = []
        self._write_rows = torch.empty(0, dtype=torch.long)
        self._read_rows: torch.Tensor | None = None  # [R, T_max] for an all-decode step
        self._read_mask: torch.Tensor | None = None  # [R, 1, 1, T_max]
        self._run_rows: list[torch.Tensor] = []

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def _rows(self, block_ids: Sequence[int], end: int) -> torch.Tensor:
        """Flat token rows of positions ``0 .. end - 1`` of a sequence."""
        needed = -(-end // self.block_size)
        if needed > len(block_ids):
            raise ValueError(
                f"sequence of {end} tokens needs {needed} blocks, its table has {len(block_ids)}"
            )
        blocks = torch.tensor(block_ids[:needed], dtype=torch.long)
        offsets = torch.arange(self.block_size, dtype=torch.long)
        return (blocks[:, None] * self.block_size + offsets[None, :]).flatten()[:end]

    def begin_step(self, runs: Sequence[KVRun]) -> torch.Tensor:
        """Sets this step's metadata; returns the new tokens' positions ``[N]``."""
        device = self.kv.device
        self._runs = list(runs)
        self._run_rows = [self._rows(r.block_ids, r.start + r.num_new) for r in runs]
        self._write_rows = torch.cat(
            [rows[r.start :] for rows, r in zip(self._run_rows, runs)]
        ).to(device)
        self._read_rows = self._read_mask = None
        if runs and all(r.num_new == 1 for r in runs):
            # All-decode step: one padded gather and one SDPA call for every sequence.
            lengths = [len(rows) for rows in self._run_rows]
            t_max = max(lengths)
            read = torch.zeros(len(runs), t_max, dtype=torch.long)
            mask = torch.zeros(len(runs), t_max, dtype=torch.bool)
            for i, rows in enumerate(self._run_rows):
                read[i, : len(rows)] = rows
                mask[i, : len(rows)] = True
            self._read_rows = read.to(device)
            self._read_mask = mask[:, None, None, :].to(device)
        self._run_rows = [rows.to(device) for rows in self._run_rows]
        positions = [torch.arange(r.start, r.start + r.num_new) for r in runs]
        return torch.cat(positions).to(device) if positions else torch.empty(0, dtype=torch.long)

    def attend(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """Writes ``k, v [N, KVH, D]`` and returns causal attention ``[N, H, D]``."""
        store = self.kv[layer_idx]  # [2, rows, KVH, D]
        store[0].index_copy_(0, self._write_rows, k.to(store.dtype))
        store[1].index_copy_(0, self._write_rows, v.to(store.dtype))
        if self._read_rows is not None:
            keys = store[0][self._read_rows].transpose(1, 2).to(q.dtype)  # [R, KVH, T, D]
            values = store[1][self._read_rows].transpose(1, 2).to(q.dtype)
            out = sdpa_gqa(q[:, :, None, :], keys, values, self._read_mask)  # [R, H, 1, D]
            return out[:, :, 0, :]
        out = torch.empty_like(q)
        offset = 0
        for run, rows in zip(self._runs, self._run_rows):
            keys = store[0][rows].transpose(0, 1).to(q.dtype)  # [KVH, T, D]
            values = store[1][rows].transpose(0, 1).to(q.dtype)
            q_run = q[offset : offset + run.num_new].transpose(0, 1)  # [H, n, D]
            mask = causal_mask(run.start, run.num_new, q.device)
            out[offset : offset + run.num_new] = sdpa_gqa(q_run, keys, values, mask).transpose(0, 1)
            offset += run.num_new
        return out
