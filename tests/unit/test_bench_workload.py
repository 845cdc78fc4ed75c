"""The benchmark workload: frames from text, texts files, seeds and Poisson arrivals.

Owns: the fixed-length rule that makes runs comparable. Must not: touch an engine.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from breezert_bench.workload import (
    BUILTIN_TEXTS, frames_for_text, load_texts, make_workload, poisson_offsets, request_seed,
    shard_items,
)

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("num_chars", "frames"),
    [(0, 1), (1, 1), (6, 5), (15, 12), (30, 25), (84, 70), (90, 75), (179, 149)],
)
def test_frames_from_text_length(num_chars: int, frames: int) -> None:
    # 12.5 frames per second of speech at 15 characters per second, at least one frame
    assert frames_for_text("x" * num_chars) == frames


def test_builtin_texts_are_four_to_ten_seconds() -> None:
    for text in BUILTIN_TEXTS:
        assert 50 <= frames_for_text(text) <= 125, text


def test_load_texts_skips_the_header_and_ids(tmp_path: Path) -> None:
    path = tmp_path / "t.tsv"
    path.write_text("id\ttext\n1-2-3\tHello there.\n\n4-5-6\tSecond\tline.\n", encoding="utf-8")
    assert load_texts(path) == ["Hello there.", "Second\tline."]


def test_load_texts_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_texts(tmp_path / "missing.tsv")
    empty = tmp_path / "empty.tsv"
    empty.write_text("id\ttext\n", encoding="utf-8")
    with pytest.raises(ValueError, match="holds no text"):
        load_texts(empty)


def test_workload_cycles_texts_in_order_with_fixed_lengths_and_seeds() -> None:
    texts = ["a" * 15, "b" * 30, "c" * 45]
    items = make_workload(texts, 7, seed=3)
    assert [item.text[0] for item in items] == list("abcabca")
    assert [item.num_frames for item in items] == [12, 25, 38, 12, 25, 38, 12]
    assert [item.index for item in items] == list(range(7))
    assert len({item.seed for item in items}) == 7
    assert items == make_workload(texts, 7, seed=3)  # same index, same seed, in every run
    assert items[0].seed == request_seed(3, 0) != make_workload(texts, 1, seed=4)[0].seed


def test_poisson_offsets_are_seeded_and_have_the_rate() -> None:
    offsets = poisson_offsets(8.0, 2000, seed=1)
    assert offsets[0] == 0.0
    assert offsets == sorted(offsets)
    assert offsets == poisson_offsets(8.0, 2000, seed=1)
    assert offsets != poisson_offsets(8.0, 2000, seed=2)
    assert 2000 / offsets[-1] == pytest.approx(8.0, rel=0.08)
    with pytest.raises(ValueError, match="rate"):
        poisson_offsets(0.0, 3, seed=1)


def test_shards_split_the_workload_into_contiguous_slices_that_keep_index_and_seed() -> None:
    items = make_workload(["a" * 30, "b" * 45], 7, seed=3)
    shards = [shard_items(items, (i, 3)) for i in (1, 2, 3)]
    assert [[it.index for it in s] for s in shards] == [[0, 1], [2, 3], [4, 5, 6]]
    assert [it for s in shards for it in s] == items
    assert shard_items(items, None) == items
    with pytest.raises(ValueError, match="shard 4/3"):
        shard_items(items, (4, 3))
