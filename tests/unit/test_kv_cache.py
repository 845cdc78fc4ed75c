"""Paged KV metadata and attention: gather indices, masks and padding against a dense cache."""

from __future__ import annotations

import random

import pytest
import torch

from breezert.layers.attention import DenseKVCache, GatherKV
from breezert.layers.attention import KVRun, decode_meta_on_device
from breezert.worker.kv_cache import PagedKVCache

pytestmark = pytest.mark.unit

BLOCK = 4


def _cache() -> PagedKVCache:
    return PagedKVCache(1, 64, BLOCK, 2, 8, dtype=torch.float32, device="cpu")


def test_decode_meta_rows_mask_and_padding() -> None:
    kv = _cache()
    rng = random.Random(0)
    runs = [KVRun(rng.sample(range(64), 6), rng.randint(0, 20), 1) for _ in range(5)]
    meta = kv.decode_meta(runs, num_rows=8, context=24)
    for i, run in enumerate(runs):
        rows = kv._rows(run.block_ids, run.start + 1)
        n = len(rows)
        assert torch.equal(meta.read_rows[i, :n], rows)
        assert meta.mask[i, 0, 0, :n].all() and not meta.mask[i, 0, 0, n:].any()
        assert meta.write_rows[i] == rows[-1] and meta.positions[i] == run.start
    assert (meta.read_rows[5:] == kv.scratch_row).all()
    assert (meta.write_rows[5:] == kv.scratch_row).all() and meta.mask[5:, 0, 0, 0].all()
    with pytest.raises(ValueError, match="exceeds the padded length"):
        kv.decode_meta([KVRun([0, 1, 2, 3, 4, 5, 6, 7], 30, 1)], 1, 24)
    with pytest.raises(ValueError, match="needs 3 blocks"):
        kv.decode_meta([KVRun([0, 1], 9, 1)], 1, 24)


def test_decode_meta_on_device_equals_the_host_meta() -> None:
    kv = _cache()
    rng = random.Random(1)
    runs = [KVRun(rng.sample(range(64), 6), rng.randint(0, 20), 1) for _ in range(5)]
    want = kv.decode_meta(runs, num_rows=8, context=24)
    tables = torch.full((8, 7), kv.num_blocks, dtype=torch.long)  # padding: the scratch block
    positions = torch.zeros(8, dtype=torch.long)
    for i, run in enumerate(runs):
        tables[i, :6] = torch.tensor(run.block_ids)
        positions[i] = run.start
    got = decode_meta_on_device(tables, positions, torch.arange(24), BLOCK, kv.scratch_row)
    for name in ("positions", "write_rows", "read_rows", "mask"):
        assert torch.equal(got[name], getattr(want, name)), name


def test_paged_attention_equals_dense_cache() -> None:
    """Prefill two sequences packed (with padding), then decode them batched (with padding):
    every output equals the dense reference cache's."""
    torch.manual_seed(0)
    kv, dense = _cache(), DenseKVCache(1, 2, 8)
    seqs = [dense.add_sequence(), dense.add_sequence()]
    tables = [[5, 9, 2, 11], [7, 3, 13, 1]]
    lens = [6, 3]
    q = torch.randn(sum(lens), 4, 8)
    k, v = torch.randn(sum(lens), 2, 8), torch.randn(sum(lens), 2, 8)
    meta = kv.packed_meta([KVRun(t, 0, n) for t, n in zip(tables, lens)], 12, 16)
    pad = 12 - sum(lens)
    padded = [torch.cat([x, torch.zeros(pad, *x.shape[1:])]) for x in (q, k, v)]
    got = GatherKV(kv.kv[:1], meta.write_rows, meta.read_rows, meta.mask).attend(0, *padded)
    dense.begin_step(seqs, lens)
    want = dense.attend(0, q, k, v)
    assert torch.allclose(got[: sum(lens)], want, atol=1e-6)
    q1, k1, v1 = torch.randn(2, 4, 8), torch.randn(2, 2, 8), torch.randn(2, 2, 8)
    meta = kv.decode_meta([KVRun(t, n, 1) for t, n in zip(tables, lens)], 4, 16)
    padded = [torch.cat([x, torch.zeros(2, *x.shape[1:])]) for x in (q1, k1, v1)]
    got = GatherKV(kv.kv[:1], meta.write_rows, meta.read_rows, meta.mask).attend(0, *padded)
    dense.begin_step(seqs, [1, 1])
    want = dense.attend(0, q1, k1, v1)
    assert torch.allclose(got[:2], want, atol=1e-6)
