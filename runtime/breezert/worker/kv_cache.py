"""The backbone's paged KV cache: one preallocated tensor of blocks, read through block tables.

Owns: the ``[layers, 2, (num_blocks + 1) * block_size, KVH, D]`` tensor (the extra block is a
scratch area that padding tokens write to and read from) and host-side metadata builders that
turn block tables into the fixed-shape gather indices and masks that ``layers.attention.GatherKV``
(the per-forward view implementing the ``KVCache`` contract) reads (DECODE builds the same in
its graph from the slot table's block tables: ``layers.attention.decode_meta_on_device``). Must
not: choose blocks (the scheduler's ``BlockPool`` does) or know about requests.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from breezert.layers.attention import KVRun, StepMeta


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
        self.scratch_row = num_blocks * block_size  # first row of the scratch block
        self.kv = torch.zeros(
            (num_layers, 2, (num_blocks + 1) * block_size, num_kv_heads, head_dim),
            dtype=dtype, device=device,
        )

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
        blocks = torch.tensor(list(block_ids[:needed]), dtype=torch.long)
        offsets = torch.arange(self.block_size, dtype=torch.long)
        return (blocks[:, None] * self.block_size + offsets[None, :]).flatten()[:end]

    def decode_meta(self, runs: Sequence[KVRun], num_rows: int, context: int) -> StepMeta:
        """One new token per run, padded to ``num_rows`` rows and ``context`` keys.

        Vectorized over runs (numpy): at 128 rows a per-run loop cost ~5 ms of host time per
        step, as much as the step itself.
        """
        assert all(run.num_new == 1 for run in runs), "decode_meta takes single-token runs"
        num = len(runs)
        lengths = np.array([run.start + 1 for run in runs], dtype=np.int64)  # [B]
        if num and lengths.max() > context:
            raise ValueError(f"context {int(lengths.max())} exceeds the padded length {context}")
        blocks_needed = -(-context // self.block_size)
        table = np.zeros((num, blocks_needed), dtype=np.int64)
        for i, run in enumerate(runs):
            needed = -(-int(lengths[i]) // self.block_size)
            if needed > len(run.block_ids):
                raise ValueError(f"sequence of {int(lengths[i])} tokens needs {needed} blocks, "
                                 f"its table has {len(run.block_ids)}")
            table[i, :needed] = run.block_ids[:needed]
        pos = np.arange(context, dtype=np.int64)  # [T]
        rows = table[:, pos // self.block_size] * self.block_size + pos % self.block_size
        valid = pos[None, :] < lengths[:, None]  # [B, T]
        read = np.full((num_rows, context), self.scratch_row, dtype=np.int64)
        read[:num] = np.where(valid, rows, self.scratch_row)
        mask = np.zeros((num_rows, context), dtype=bool)
        mask[:num] = valid
        mask[:, 0] = True  # padding rows read the scratch row: finite, ignored
        write = np.full(num_rows, self.scratch_row, dtype=np.int64)
        write[:num] = rows[np.arange(num), lengths - 1]
        positions = np.zeros(num_rows, dtype=np.int64)
        positions[:num] = lengths - 1
        return StepMeta(torch.from_numpy(positions), torch.from_numpy(write),
                        torch.from_numpy(read), torch.from_numpy(mask)[:, None, None, :], num,
                        list(range(num)))

    def packed_meta(self, runs: Sequence[KVRun], num_tokens: int, num_keys: int) -> StepMeta:
        """Runs of new tokens packed into ``num_tokens`` queries over ``num_keys`` keys."""
        positions = torch.zeros(num_tokens, dtype=torch.long)
        write = torch.full((num_tokens,), self.scratch_row, dtype=torch.long)
        read = torch.full((num_keys,), self.scratch_row, dtype=torch.long)
        mask = torch.zeros(num_tokens, num_keys, dtype=torch.bool)
        q_off = k_off = 0
        last = []
        for run in runs:
            end = run.start + run.num_new
            rows = self._rows(run.block_ids, end)
            q_slice = slice(q_off, q_off + run.num_new)
            read[k_off : k_off + end] = rows
            write[q_slice] = rows[run.start :]
            positions[q_slice] = torch.arange(run.start, end)
            q_pos = torch.arange(run.start, end)[:, None]
            mask[q_slice, k_off : k_off + end] = torch.arange(end)[None, :] <= q_pos
            q_off += run.num_new
            k_off += end
            last.append(q_off - 1)
        if q_off > num_tokens or k_off > num_keys:
            raise ValueError(f"{q_off} tokens / {k_off} keys exceed the padding {num_tokens}/{num_keys}")
        pad_mask = torch.zeros(num_keys, dtype=torch.bool)
        pad_mask[k_off:] = True  # padding queries read the scratch keys only
        mask[q_off:] = pad_mask if k_off < num_keys else True
        return StepMeta(positions, write, read, mask, q_off, last)

