"""Paged-KV block allocator: a free list of block ids.

Owns which backbone KV blocks are free. Integers only: it never sees the KV tensor and does not
choose which request gets blocks (the scheduler does).
"""

from __future__ import annotations

from breezert.errors import BreezeRTError


class NoFreeBlocks(BreezeRTError):
    """``allocate(n)`` asked for more blocks than are free."""


class BlockPool:
    """A fixed pool of ``num_blocks`` KV blocks of ``block_size`` tokens each.

    Block ids are ``0..num_blocks-1``. Freed blocks are reused first (LIFO), which keeps the ids
    of a busy pool compact. Double frees and foreign ids raise ``ValueError``.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks={num_blocks} must be > 0")
        if block_size <= 0:
            raise ValueError(f"block_size={block_size} must be > 0")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # NOTE: reversed so that a fresh pool hands out 0, 1, 2, ... (readable in tests and logs).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._is_free = [True] * num_blocks

    @property
    def num_free(self) -> int:
        """Blocks available right now."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Blocks currently allocated."""
        return self.num_blocks - len(self._free)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens (ceil division)."""
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        """Whether ``allocate(num_blocks)`` would succeed now."""
        return 0 <= num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        """Takes ``num_blocks`` blocks off the free list.

        Raises:
            NoFreeBlocks: fewer than ``num_blocks`` blocks are free (nothing is taken).
            ValueError: ``num_blocks`` is negative.
        """
        if num_blocks < 0:
            raise ValueError(f"num_blocks={num_blocks} must be >= 0")
        if num_blocks > len(self._free):
            raise NoFreeBlocks(f"asked for {num_blocks} blocks, {len(self._free)} free")
        block_ids = [self._free.pop() for _ in range(num_blocks)]
        for block_id in block_ids:
            self._is_free[block_id] = False
        return block_ids

    def free(self, block_ids: list[int] | tuple[int, ...]) -> None:
        """Returns blocks to the pool.

        Raises:
            ValueError: an id is out of range or already free (nothing is freed then).
        """
        for block_id in block_ids:
            if not 0 <= block_id < self.num_blocks:
                raise ValueError(f"block id {block_id} is not in 0..{self.num_blocks - 1}")
            if self._is_free[block_id]:
                raise ValueError(f"block {block_id} is already free (double free)")
        if len(set(block_ids)) != len(block_ids):
            raise ValueError(f"duplicate block ids in free({list(block_ids)})")
        for block_id in reversed(block_ids):
            self._is_free[block_id] = True
            self._free.append(block_id)
