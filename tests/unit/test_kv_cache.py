"""Paged KV metadata and attention: gather indices, masks and padding against a dense cache."""

from __future__ import annotations

import random

import pytest
import torch

from breezert.layers.attention import DenseKVCache, GatherKV
from breezert.layers.attention import KVRun
from breezert.worker.kv_cache import PagedKVCache
from tests.kernel_helpers import decode_meta

pytestmark = pytest.mark.unit

BLOCK = 4


def _cache() -> PagedKVCache:
    return PagedKVCache(1, 64, BLOCK, 2, 8, dtype=torch.float32, device="cpu")


def test_decode_meta_rows_mask_and_padding() -> None:
    """The DECODE graph's metadata (``decode_meta_on_device``): each row reads its sequence's
    rows up to and including the new token, writes the new token's row, and padding rows (an
    all-scratch block table) read and write the scratch row only."""
    kv = _cache()
    rng = random.Random(0)
    runs = [KVRun(rng.sample(range(64), 6), rng.randint(0, 20), 1) for _ in range(5)]
    meta = decode_meta(kv, runs, num_rows=8, context=24)
    for i, run in enumerate(runs):
        rows = kv._rows(run.block_ids, run.start + 1)
        n = len(rows)
        assert torch.equal(meta["read_rows"][i, :n], rows)
        assert (meta["read_rows"][i, n:] == kv.scratch_row).all()
        assert meta["mask"][i, 0, 0, :n].all() and not meta["mask"][i, 0, 0, n:].any()
        assert meta["write_rows"][i] == rows[-1] and meta["positions"][i] == run.start
    assert (meta["read_rows"][5:] == kv.scratch_row).all()
    assert (meta["write_rows"][5:] == kv.scratch_row).all() and meta["mask"][5:, 0, 0, 0].all()
    assert not meta["mask"][5:, 0, 0, 1:].any()


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
    meta = decode_meta(kv, [KVRun(t, n, 1) for t, n in zip(tables, lens)], 4, 16)
    padded = [torch.cat([x, torch.zeros(2, *x.shape[1:])]) for x in (q1, k1, v1)]
    got = GatherKV(kv.kv[:1], meta["write_rows"], meta["read_rows"], meta["mask"]).attend(
        0, *padded)
    dense.begin_step(seqs, [1, 1])
    want = dense.attend(0, q1, k1, v1)
    assert torch.allclose(got[:2], want, atol=1e-6)
