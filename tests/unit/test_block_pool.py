"""BlockPool: allocation, freeing, exhaustion and misuse."""

from __future__ import annotations

import pytest
from breezert.errors import BreezeRTError
from breezert.sched.block_pool import BlockPool, NoFreeBlocks

pytestmark = pytest.mark.unit


def test_allocate_and_free_round_trip() -> None:
    pool = BlockPool(num_blocks=8, block_size=16)
    assert (pool.num_free, pool.num_used) == (8, 0)
    first = pool.allocate(3)
    assert first == [0, 1, 2]
    second = pool.allocate(5)
    assert sorted(first + second) == list(range(8))
    assert pool.num_free == 0 and not pool.can_allocate(1) and pool.can_allocate(0)
    pool.free(first)
    assert pool.num_free == 3 and pool.can_allocate(3)
    assert sorted(pool.allocate(3)) == first  # freed blocks are reused
    pool.free(second)
    pool.free(first)
    assert pool.num_free == 8


def test_exhaustion_raises_typed_error_and_takes_nothing() -> None:
    pool = BlockPool(num_blocks=4, block_size=16)
    pool.allocate(3)
    with pytest.raises(NoFreeBlocks) as excinfo:
        pool.allocate(2)
    assert isinstance(excinfo.value, BreezeRTError)
    assert pool.num_free == 1


def test_misuse_raises_value_error() -> None:
    pool = BlockPool(num_blocks=4, block_size=16)
    blocks = pool.allocate(2)
    pool.free(blocks[:1])
    with pytest.raises(ValueError, match="double free"):
        pool.free(blocks[:1])
    with pytest.raises(ValueError, match="not in"):
        pool.free([4])
    with pytest.raises(ValueError, match="duplicate"):
        pool.free([blocks[1], blocks[1]])
    assert pool.num_free == 3  # failed frees changed nothing
    with pytest.raises(ValueError):
        pool.allocate(-1)
    with pytest.raises(ValueError):
        BlockPool(num_blocks=0, block_size=16)
    with pytest.raises(ValueError):
        BlockPool(num_blocks=4, block_size=0)


def test_blocks_for_tokens_rounds_up() -> None:
    pool = BlockPool(num_blocks=4, block_size=16)
    assert [pool.blocks_for_tokens(n) for n in (0, 1, 16, 17, 32)] == [0, 1, 1, 2, 2]
