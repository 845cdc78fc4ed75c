"""The slot table (``worker/slot_table.py``) on its own: admission writes a request's rows and
refuses a held slot, DEPTH's commit keeps EOS out of every record, the ring wraps and refuses to
overrun the codec, the codec's gather pads with zeros, a segment's prompt rows and PREFILL states
wait on the host until its first DEPTH step, and a freed slot is back to the scratch defaults.

Owns: the table's index ops and host bookkeeping (tensors only, no model). Must not need a GPU;
the engine-level mix is tests/integration/test_engine_slot_state.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from breezert.constants import FRAME_EOS_ID
from breezert.options import SamplingParams
from breezert.stages.interface import SlotParams
from breezert.worker.slot_table import SlotTable, sampling_row

pytestmark = pytest.mark.unit

VOCAB, HIDDEN, RING = 2052, 8, 4


SCRATCH_BLOCK = 99


def _table(max_slots: int = 3) -> SlotTable:
    return SlotTable(max_slots, vocab_size=VOCAB, hidden_size=HIDDEN, hidden_dtype=torch.float32,
                     ring_frames=RING, device=torch.device("cpu"), max_blocks=4,
                     scratch_block=SCRATCH_BLOCK)


def _params(seed: int, *, cfg: bool = False) -> SlotParams:
    sampling = SamplingParams(temperature=0.7, top_k=20, repetition_penalty=1.3)
    return SlotParams(f"r{seed}", 2 if cfg else 1, 2.5 if cfg else 1.0, sampling, seed,
                      ignore_eos=seed % 2 == 1)


def _snapshot(table: SlotTable, slot: int) -> list[torch.Tensor]:
    return [t[slot].clone() for t in (table.sampling, table.seeds, table.frame_count,
                                      table.cfg_scale, table.has_cfg, table.penalty,
                                      table.no_eos, table.seen, table.hidden, table.last_frame,
                                      table.ring)]


def test_admit_writes_rows_and_release_restores_the_defaults() -> None:
    table = _table()
    fresh = _snapshot(table, 1)
    table.admit([1, 2], [_params(7, cfg=True), _params(8)])
    assert table.seeds[1].item() == 7 and table.seeds[2].item() == 8
    assert table.has_cfg.tolist() == [False, True, False, False]
    assert table.cfg_scale[1].item() == 2.5 and table.no_eos[1].item()
    assert table.sampling[1].tolist() == pytest.approx(sampling_row(_params(7).sampling))
    assert table.penalty[2].item() == pytest.approx(1.3)
    table.start_segments([1], [[torch.ones(HIDDEN), 2 * torch.ones(HIDDEN)]])
    frame = torch.arange(16)[None, :] + 5
    table.commit_frames(torch.tensor([1]), frame, torch.tensor([0]))
    table.mark_decoded(1, 1)
    assert table.release_request("r7") == [1] and table.num_active == 1
    for got, want in zip(_snapshot(table, 1), fresh):
        assert torch.equal(got, want)
    assert table.next_codec_frame[1] == 0
    assert table.seeds[2].item() == 8  # the other slot is untouched


def test_commit_records_frames_but_not_eos() -> None:
    table = _table()
    table.admit([0, 1], [_params(1), _params(2)])
    codes = torch.stack([torch.full((16,), 11), torch.full((16,), 3)])
    codes[1, 0] = FRAME_EOS_ID
    table.commit_frames(torch.tensor([0, 1]), codes, torch.tensor([0, 5]))
    assert table.frame_count.tolist()[:2] == [1, 5]  # EOS is not a frame
    assert torch.equal(table.last_frame[0], codes[0]) and not table.last_frame[1].any()
    assert torch.equal(table.ring[0, 0], codes[0]) and not table.ring[1].any()
    assert table.seen[0].nonzero().flatten().tolist() == [11] and not table.seen[1].any()


def test_depth_inputs_gather_rows_and_repeat_a_single_branch() -> None:
    table = _table()
    table.admit([0, 2], [_params(4, cfg=True), _params(5)])
    table.start_segments([0, 2], [[torch.ones(HIDDEN), 2 * torch.ones(HIDDEN)],
                                  [3 * torch.ones(HIDDEN)]])
    rows = torch.tensor([[0, 4, 6], [1, 4, 6]])  # slot 0 with CFG, slot 2 without, scratch
    inputs = table.depth_inputs(rows)
    assert inputs["hidden"][:, 0].tolist() == [1, 3, 0, 2, 3, 0]
    assert inputs["seeds"].tolist() == [4, 5, 0] and inputs["has_cfg"].tolist() == [True, False,
                                                                                     False]
    assert inputs["frames_at"].tolist() == [0, 0, 0]


def test_ring_wraps_and_the_host_refuses_to_overrun_the_codec() -> None:
    table = _table()
    table.admit([0], [_params(1)])
    for f in range(RING + 2):
        table.commit_frames(torch.tensor([0]), torch.full((1, 16), 100 + f), torch.tensor([f]))
    assert table.ring[0, :, 0].tolist() == [104, 105, 102, 103]
    rows = torch.tensor([[0, 2, 3, 4, 5], [3, 4, -1, -1, -1]])  # frames 2..5; a padding row
    codes, counts = table.codec_codes(rows)
    assert codes[0, :, 0].tolist() == [102, 103, 104, 105]
    assert counts.tolist() == [4, 1] and not codes[1, 1:].any()
    table.mark_decoded(0, 2)
    assert table.ring_would_overflow(np.array([0, 0]), np.array([5, 6])).tolist() == [False, True]


def test_decode_reads_last_frames_and_stores_hidden_per_branch() -> None:
    table = _table()
    table.last_frame[1] = 9
    assert table.decode_codes(torch.tensor([2, 3, 6]))[:, 0].tolist() == [9, 9, 0]
    table.store_hidden(torch.tensor([2, 3]), torch.stack([torch.ones(HIDDEN), -torch.ones(HIDDEN)]))
    assert table.hidden[1, :, 0].tolist() == [1, -1]


def test_block_tables_upload_on_change_and_reset_at_release(
        monkeypatch: pytest.MonkeyPatch) -> None:
    table = _table()
    blocks = (5, 6)
    table.set_block_table(3, blocks)  # slot 1, branch 1
    assert table.block_tables[3].tolist() == [5, 6, SCRATCH_BLOCK, SCRATCH_BLOCK]
    writes = []
    monkeypatch.setattr(table, "block_tables", _Spy(table.block_tables, writes))
    table.set_block_table(3, blocks)  # the same tuple: nothing to upload
    assert writes == []
    table.set_block_table(3, (7, 8, 9))  # a new segment's table
    assert writes == [3]
    monkeypatch.undo()
    table.admit([1], [_params(3)])
    table.release_request("r3")
    assert (table.block_tables == SCRATCH_BLOCK).all()
    table.set_block_table(3, blocks)  # written again after reuse
    assert table.block_tables[3, 0].item() == 5
    with pytest.raises(ValueError, match="exceeds"):
        table.set_block_table(0, tuple(range(5)))


def test_admission_refuses_a_held_slot_and_params_check_the_request() -> None:
    table = _table()
    assert table.admit([0, 1], [_params(1), _params(2)]) == {}
    refused = table.admit([1, 2], [_params(3), _params(4, cfg=True)])
    assert refused == {"r3": "slot 1 is still held by r2"}
    assert table.seeds[:3].tolist() == [1, 2, 4] and table.num_active == 3
    assert table.params(2, "r4").has_cfg
    with pytest.raises(RuntimeError, match="slot 1 holds 'r2', the plan says 'r3'"):
        table.params(1, "r3")
    assert table.host_has_cfg[:3].tolist() == [False, False, True]
    assert table.host_top_k[2].tolist() == [_params(4).sampling.top_k,
                                            _params(4).sampling.depth_top_k]
    table.check_holders(np.array([2, 0]), ["r4", "r1"])  # a batch's check: all held
    with pytest.raises(RuntimeError, match="slot 1 holds 'r2', the plan says 'r3'"):
        table.check_holders(np.array([0, 1]), ["r1", "r3"])
    table.release_request("r2")
    with pytest.raises(RuntimeError, match="slot 1 holds None"):
        table.params(1, "r2")
    with pytest.raises(RuntimeError, match="slot 1 holds None"):
        table.check_holders(np.array([1]), ["r2"])
    assert table.release_request("r2") == []  # released twice: nothing held


def test_a_segment_waits_on_the_host_until_its_first_depth_step() -> None:
    table = _table()
    table.admit([0], [_params(4, cfg=True)])
    with pytest.raises(RuntimeError, match="no prompt rows"):
        table.segment(0, "r4", 0)
    table.add_segment(0, "r4", 0, [torch.zeros(3, HIDDEN), torch.zeros(2, HIDDEN)])
    table.add_segment(0, "r4", 1, [torch.zeros(4, HIDDEN), torch.zeros(4, HIDDEN)])  # look-ahead
    pending = table.segment(0, "r4", 0)
    pending.hidden[0] = torch.ones(HIDDEN)
    with pytest.raises(RuntimeError, match="before the end of segment 0's PREFILL"):
        table.take_prefill_states(0, "r4", 0)
    pending.hidden[1] = 2 * torch.ones(HIDDEN)
    hidden = table.take_prefill_states(0, "r4", 0)
    assert [h[0].item() for h in hidden] == [1, 2]
    with pytest.raises(RuntimeError, match="no prompt rows"):
        table.segment(0, "r4", 0)  # handed over once
    table.start_segments([0], [hidden])
    assert table.hidden[0, :, 0].tolist() == [1, 2]
    assert table.segment(0, "r4", 1).embeds is not None
    table.release_request("r4")
    table.admit([0], [_params(4, cfg=True)])  # the same request id in the slot again
    with pytest.raises(RuntimeError, match="no prompt rows"):
        table.segment(0, "r4", 1)  # the look-ahead segment went with the release


class _Spy:
    """A tensor stand-in that records the rows written to it."""

    def __init__(self, tensor: torch.Tensor, writes: list[int]) -> None:
        self.tensor, self.writes, self.shape = tensor, writes, tensor.shape

    def __setitem__(self, row: int, value: torch.Tensor) -> None:
        self.writes.append(row)
        self.tensor[row] = value
