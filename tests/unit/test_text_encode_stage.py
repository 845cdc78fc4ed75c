"""TEXT_ENCODE past the largest graph bucket: the pieces go in several bucket-sized replays and
their rows equal one packed eager call (each piece attends only to itself)."""

from __future__ import annotations

from collections.abc import Mapping

import pytest
import torch

from breezert.models.breeze import BreezeModel
from breezert.models.config import BreezeConfig
from breezert.stages.interface import StageWorker
from breezert.stages.text_encode import TextEncodeStage, encode_text, split_into_buckets

pytestmark = pytest.mark.unit


def test_split_into_buckets_packs_consecutive_pieces_up_to_the_largest_bucket() -> None:
    assert split_into_buckets([80, 80, 80, 80, 80], 256) == [(0, 3), (3, 5)]
    assert split_into_buckets([10, 300, 10, 10], 256) == [(0, 1), (1, 2), (2, 4)]
    assert split_into_buckets([256, 1], 256) == [(0, 1), (1, 2)]
    assert split_into_buckets([5], 256) == [(0, 1)]
    assert split_into_buckets([], 256) == []


class _RecordingGraphs:
    """A graph runner stand-in that is "enabled" on CPU: records each bucket it is asked for
    and runs the function (a replay computes exactly what the function computes)."""

    enabled = True

    def __init__(self, fn) -> None:  # type: ignore[no-untyped-def]
        self.fn, self.keys = fn, []

    def __call__(self, key: int, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        self.keys.append(key)
        return self.fn(**inputs)


def test_pieces_past_the_largest_bucket_encode_in_several_replays_with_equal_rows() -> None:
    model = BreezeModel(BreezeConfig.tiny()).init_random_(torch.Generator().manual_seed(1)).eval()
    graphs = _RecordingGraphs(lambda **kw: encode_text(model, **kw))
    worker = StageWorker(torch.device("cpu"), None, None)  # type: ignore[arg-type] # unused
    stage = TextEncodeStage(model, worker, graphs, buckets=(16, 32))  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(1)
    pieces = [torch.randint(3, 200, (n,), generator=gen) for n in (12, 9, 20, 7, 40, 3)]
    with torch.inference_mode():
        got = stage._encode(pieces)
        assert got.abs().max() > 0
        total = sum(int(p.shape[0]) for p in pieces)
        want = encode_text(model, **stage.pack(pieces, total))["rows"]
    # (12+9) (20+7) (40, longer than every bucket: its own eager-sized call) (3)
    assert graphs.keys == [32, 32, 40, 16]
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
