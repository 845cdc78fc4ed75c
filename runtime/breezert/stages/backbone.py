"""PREFILL and DECODE: the Qwen3 backbone over the paged KV cache.

Owns: PREFILL's packed prompt-embedding chunks and bucket-padded KV metadata, keeping each
branch's state after its prompt's last chunk; DECODE's row indices and positions, whose graph
(``backbone_decode_from_slots``) reads each row's last frame and block table from the slot table
and writes its new state back; the graphed forward functions. Must not: sample (DEPTH does) or
pick blocks (the scheduler does).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from breezert.layers.attention import GatherKV, KVRun, StepMeta, decode_meta_on_device
from breezert.models.breeze import BreezeModel
from breezert.outputs import StageOutput
from breezert.sched.plan import DecodeBatch, PrefillItem
from breezert.stages.interface import Graphs, Slots, StageWorker, bucket_for


def backbone_prefill(
    model: BreezeModel, kv: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor,
    write_rows: torch.Tensor, read_rows: torch.Tensor, mask: torch.Tensor,
    *, backbone: Callable[..., torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Packed prompt rows ``embeds [N, D]`` → final-normed hidden ``[N, D]``. ``backbone``
    replaces ``model.backbone_model`` (same contract; the fused Triton prefill step)."""
    view = GatherKV(kv, write_rows, read_rows, mask)
    return {"hidden": (backbone or model.backbone_model)(embeds, positions, view)}


def backbone_decode(
    model: BreezeModel, kv: torch.Tensor, codes: torch.Tensor, positions: torch.Tensor,
    write_rows: torch.Tensor, read_rows: torch.Tensor, mask: torch.Tensor,
    *, backbone: Callable[..., torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """One step for rows fed the frames ``codes [R, 16]`` → hidden ``[R, D]``. ``backbone``
    replaces ``model.backbone_model`` (same contract; the fused Triton decode step)."""
    view = GatherKV(kv, write_rows, read_rows, mask)
    embeds = model.audio_frame_embeds(codes)  # [R, D]
    return {"hidden": (backbone or model.backbone_model)(embeds, positions, view)}


def backbone_decode_from_slots(
    table: Slots, decode: Callable[..., dict[str, torch.Tensor]], block_size: int,
    scratch_row: int,
    row_ids: torch.Tensor,  # [R] int64: slot * 2 + branch of each row
    positions: torch.Tensor,  # [R] int64: the fed frame's position (padding: 0)
    key_slots: torch.Tensor,  # [T] int64: 0..T-1
) -> dict[str, torch.Tensor]:
    """``decode`` (``backbone_decode`` bound to a model and cache) fed each row's last frame
    from ``table``, its KV metadata built from the table's block tables; the new hidden states
    go back into the table. Sync-free, graph-safe."""
    meta = decode_meta_on_device(table.block_tables[row_ids], positions, key_slots, block_size,
                                 scratch_row)
    hidden = decode(codes=table.decode_codes(row_ids), **meta)["hidden"]
    table.store_hidden(row_ids, hidden)
    return {"hidden": hidden}


def _meta_inputs(meta: StepMeta, device: torch.device) -> dict[str, torch.Tensor]:
    return {
        "positions": meta.positions.to(device, non_blocking=True),
        "write_rows": meta.write_rows.to(device, non_blocking=True),
        "read_rows": meta.read_rows.to(device, non_blocking=True),
        "mask": meta.mask.to(device, non_blocking=True),
    }


class PrefillStage:
    def __init__(
        self, model: BreezeModel, worker: StageWorker, graphs: Graphs,
        token_buckets: Sequence[int], context_buckets: Sequence[int],
    ) -> None:
        self.model, self.slots, self.kv, self.graphs = model, worker.slots, worker.kv, graphs
        self.token_buckets, self.context_buckets = tuple(token_buckets), tuple(context_buckets)
        self.device = worker.device

    def shape_for(self, num_tokens: int, num_keys: int) -> tuple[int, int]:
        if self.graphs.enabled:
            n = bucket_for(num_tokens, self.token_buckets)
            k = bucket_for(max(num_keys, n or 0), self.context_buckets)
            if n is not None and k is not None:
                return n, k
        return num_tokens, num_keys

    def run(self, items: Sequence[PrefillItem]) -> StageOutput:
        rows, runs = [], []
        segments = [self.slots.segment(item.slot, item.request_id, item.segment_index)
                    for item in items]
        for item, segment in zip(items, segments):
            assert segment.embeds is not None, "PREFILL after the segment's last chunk"
            end = item.start_pos + item.num_tokens
            rows.append(segment.embeds[item.branch][item.start_pos : end])
            runs.append(KVRun(item.block_ids, item.start_pos, item.num_tokens))
        num_tokens = sum(r.num_new for r in runs)
        shape = self.shape_for(num_tokens, sum(r.start + r.num_new for r in runs))
        meta = self.kv.packed_meta(runs, *shape)
        embeds = torch.cat(rows)
        if shape[0] > num_tokens:
            embeds = torch.cat([embeds, embeds.new_zeros(shape[0] - num_tokens, embeds.shape[1])])
        inputs = {"embeds": embeds, **_meta_inputs(meta, self.device)}
        hidden = self.graphs(shape, inputs)["hidden"]
        for item, segment, last in zip(items, segments, meta.last_index):
            if item.is_last_chunk:
                segment.hidden[item.branch] = hidden[last].clone()
                if all(h is not None for h in segment.hidden):
                    segment.embeds = None  # prompt rows are no longer needed
        return StageOutput()

    def example_inputs(self, num_tokens: int, num_keys: int) -> dict[str, torch.Tensor]:
        meta = self.kv.packed_meta([], num_tokens, num_keys)
        d = self.model.cfg.hidden_size
        dtype = self.model.lm_head.weight.dtype
        embeds = torch.randn(num_tokens, d, device=self.device, dtype=dtype)
        return {"embeds": embeds, **_meta_inputs(meta, self.device)}


class DecodeStage:
    def __init__(
        self, worker: StageWorker, graphs: Graphs,
        row_buckets: Sequence[int], context_buckets: Sequence[int],
    ) -> None:
        """``graphs`` runs ``backbone_decode_from_slots`` bound to the slot table."""
        self.graphs, self.slots, self.kv = graphs, worker.slots, worker.kv
        self._key_slots: dict[int, torch.Tensor] = {}  # context -> arange on the device
        self.row_buckets, self.context_buckets = tuple(row_buckets), tuple(context_buckets)
        self.device = worker.device

    def shape_for(self, num_rows: int, context: int) -> tuple[int, int]:
        if self.graphs.enabled:
            r = bucket_for(num_rows, self.row_buckets)
            t = bucket_for(context, self.context_buckets)
            if r is not None and t is not None:
                return r, t
        return num_rows, context

    def run(self, batch: DecodeBatch) -> StageOutput:
        """One upload of row ids and positions, and the block tables of the segments that
        start (frame 0: a segment's tables never change, and its first DECODE feeds frame 0);
        the frames, KV metadata and new states stay on the device."""
        for i in np.flatnonzero(batch.frame_index == 0).tolist():
            slot = int(batch.slots[i])
            for b, block_ids in enumerate(batch.block_ids[i]):
                self.slots.set_block_table(2 * slot + b, block_ids)
        has_row = np.arange(2) < batch.num_branches[:, None]  # [n, 2]: request, branch
        rows = (2 * batch.slots[:, None] + np.arange(2))[has_row]  # request by request
        positions = batch.positions[has_row]
        shape = self.shape_for(len(rows), int(positions.max()) + 1)
        self.graphs(shape, self.slot_inputs(rows, positions, *shape))
        return StageOutput()

    def slot_inputs(self, rows: Sequence[int] | np.ndarray, positions: Sequence[int] | np.ndarray,
                    size: int, context: int) -> dict[str, torch.Tensor]:
        """Inputs of ``backbone_decode_from_slots``, padded to ``size`` rows (padding rows read
        and write the scratch slot at position 0) and ``context`` keys."""
        index = torch.zeros(2, size, dtype=torch.long)
        index[0] = 2 * self.slots.scratch_slot
        index[0, : len(rows)] = torch.as_tensor(rows, dtype=torch.long)
        index[1, : len(positions)] = torch.as_tensor(positions, dtype=torch.long)
        index = index.to(self.device, non_blocking=True)  # one upload
        key_slots = self._key_slots.get(context)
        if key_slots is None:
            key_slots = self._key_slots[context] = torch.arange(context, device=self.device)
        return {"row_ids": index[0], "positions": index[1], "key_slots": key_slots}

    def example_inputs(
        self, num_rows: int, context: int, cached: int = 0
    ) -> dict[str, torch.Tensor]:
        """Inputs of a bucket. ``cached=0``: every row is padding, reading and writing the
        scratch slot (graph capture at start-up); else row ``i`` (slot ``i // 2``, branch
        ``i % 2``) holds ``cached`` tokens in its own blocks, its block table written into the
        slot table (benchmarks on an idle engine: attention then reads a real context).

        Raises:
            ValueError: the pool has too few blocks, or the table too few slots.
        """
        if not cached:
            return self.slot_inputs([], [], num_rows, context)
        blocks = cached // self.kv.block_size + 1
        if num_rows * blocks > self.kv.num_blocks:
            raise ValueError(f"{num_rows} rows x {cached} cached tokens need {num_rows * blocks} "
                             f"blocks; the pool has {self.kv.num_blocks}")
        if num_rows > 2 * self.slots.scratch_slot:
            raise ValueError(f"{num_rows} rows need {-(-num_rows // 2)} slots; the table has "
                             f"{self.slots.scratch_slot}")
        for row in range(num_rows):
            self.slots.set_block_table(row, tuple(range(row * blocks, (row + 1) * blocks)))
        return self.slot_inputs(list(range(num_rows)), [cached] * num_rows, num_rows, context)
