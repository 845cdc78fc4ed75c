"""The backbone's paged KV cache: one preallocated tensor of blocks, read through block tables.

Owns: the ``[layers, 2, (num_blocks + 1) * block_size, KVH, D]`` tensor (the extra block is a
scratch area that padding tokens write to and read from) and PREFILL's host-side metadata
builder, which turns block tables into the fixed-shape gather indices and masks that
``layers.attention.GatherKV`` (the per-forward view implementing the ``KVCache`` contract) reads
(DECODE builds its own in its graph from the slot table's block tables:
``layers.attention.decode_meta_on_device``);
``kv_blocks_for_memory`` sizes the pool from the device's free memory. Must not: choose blocks
(the scheduler's ``BlockPool`` does) or know about requests.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from breezert.errors import InvalidConfig
from breezert.layers.attention import KVRun, StepMeta


def kv_block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                   dtype_bytes: int) -> int:
    """Bytes one KV block takes in ``PagedKVCache`` (K and V of every layer)."""
    return num_layers * 2 * block_size * num_kv_heads * head_dim * dtype_bytes


def kv_blocks_for_memory(*, free_bytes: int, total_bytes: int, block_bytes: int,
                         memory_fraction: float, worst_case: int, min_blocks: int) -> int:
    """KV blocks to allocate on a device with ``free_bytes`` of ``total_bytes`` free (measured
    after the weights are loaded), as vLLM's ``gpu_memory_utilization``: this process may use
    ``memory_fraction`` of the device's memory in all, the weights and whatever else already
    holds memory count against it, and the rest of that budget goes to KV blocks (one of them
    the scratch block), capped at ``worst_case`` (every running request at full context). The
    ``1 - memory_fraction`` left over is the headroom for activations, the codec state arena,
    the slot table and captured graphs, which are allocated after the cache.

    Pure arithmetic (no device): the caller measures the memory.

    Raises:
        InvalidConfig: fewer than ``min_blocks`` fit (not even one request could be admitted);
            the message names ``cache.gpu_memory_fraction`` and the sizes.
    """
    if block_bytes <= 0 or worst_case <= 0:
        raise ValueError(f"block_bytes={block_bytes} and worst_case={worst_case} must be > 0")
    used = total_bytes - free_bytes
    budget = int(memory_fraction * total_bytes) - used
    fit = budget // block_bytes - 1  # the scratch block comes on top of the pool
    if fit < min_blocks:
        gib = 2.0 ** 30
        raise InvalidConfig(
            f"cache.gpu_memory_fraction={memory_fraction:g}: {used / gib:.1f} GiB of the "
            f"device's {total_bytes / gib:.1f} GiB are in use after loading the weights, which "
            f"leaves room for {max(fit, 0)} KV blocks of {block_bytes / 2**20:.2f} MiB; one "
            f"request needs up to {min_blocks} (raise cache.gpu_memory_fraction, free the "
            "device, or lower scheduler.max_model_len)")
    return min(worst_case, fit)


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

