"""TEXT_ENCODE: every text piece of the batch's segments through T5Gemma2, packed.

Owns: packing the pieces of all items (each piece attends only to itself), padding to a token
bucket for the graphed encoder (several replays past the largest bucket), and assembling
per-branch prefill rows (text rows, reference frames, audio-EOS row), handed to the slot table
until PREFILL has read them. Must not: run the backbone.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from breezert.models.breeze import BreezeModel
from breezert.models.prompt import Prompt
from breezert.outputs import StageOutput
from breezert.sched.plan import TextEncodeItem
from breezert.stages.interface import Graphs, StageWorker, bucket_for


def encode_text(
    model: BreezeModel, input_ids: torch.Tensor, seg_ids: torch.Tensor, positions: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Packed pieces ``[N]`` → projected encoder rows ``[N, D]``."""
    rows = model.text_encoder.encode(input_ids, seg_ids, positions)
    return {"rows": model.text_encoder_proj(rows)}


def split_into_buckets(lengths: Sequence[int], largest: int) -> list[tuple[int, int]]:
    """Consecutive ``[start, end)`` runs of pieces, each run as long as fits in ``largest``
    tokens (a piece longer than that is a run of its own)."""
    groups: list[tuple[int, int]] = []
    start, total = 0, 0
    for index, n in enumerate(lengths):
        if index > start and total + n > largest:
            groups.append((start, index))
            start, total = index, 0
        total += n
    if lengths:
        groups.append((start, len(lengths)))
    return groups


class TextEncodeStage:
    def __init__(self, model: BreezeModel, worker: StageWorker, graphs: Graphs,
                 buckets: Sequence[int]) -> None:
        self.model, self.slots, self.graphs = model, worker.slots, graphs
        self.buckets, self.device = tuple(buckets), worker.device

    def run(self, items: Sequence[TextEncodeItem]) -> StageOutput:
        prompts: list[Prompt] = []
        for item in items:
            self.slots.params(item.slot, item.request_id)  # the slot is the request's
            prompts.extend(item.prompt)
        pieces = [piece for p in prompts for piece in p.text_segments()]
        encoded = self._encode(pieces) if pieces else None
        embeds = self.model.assemble_prompt_embeds(prompts, encoded)
        offset = 0
        for item in items:
            num = len(item.prompt)
            self.slots.add_segment(item.slot, item.request_id, item.segment_index,
                                   embeds[offset : offset + num])
            offset += num
        return StageOutput()

    def _encode(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        """Encoder rows of every piece, in order. With graphs, pieces beyond the largest bucket
        go in several replays (pieces attend only to themselves, so the split changes nothing);
        only a single piece longer than every bucket runs eagerly."""
        lengths = [int(p.shape[0]) for p in pieces]
        if not self.graphs.enabled or not self.buckets:
            return self._encode_group(pieces, sum(lengths))
        groups = split_into_buckets(lengths, max(self.buckets))
        rows = [self._encode_group(pieces[i:j], sum(lengths[i:j])) for i, j in groups]
        return rows[0] if len(rows) == 1 else torch.cat(rows)

    def _encode_group(self, pieces: list[torch.Tensor], num: int) -> torch.Tensor:
        size = (bucket_for(num, self.buckets) if self.graphs.enabled else None) or num
        inputs = self.pack(pieces, size)
        return self.graphs(size, inputs)["rows"][:num].clone()  # the next replay overwrites it

    def pack(self, pieces: list[torch.Tensor], size: int) -> dict[str, torch.Tensor]:
        """Token ids, segment ids and positions ``[size]``; padding is one extra segment."""
        ids = torch.zeros(size, dtype=torch.long)
        seg_ids = torch.full((size,), len(pieces), dtype=torch.long)
        positions = torch.zeros(size, dtype=torch.long)
        offset = 0
        for index, piece in enumerate(pieces):
            n = int(piece.shape[0])
            ids[offset : offset + n] = piece
            seg_ids[offset : offset + n] = index
            positions[offset : offset + n] = torch.arange(n)
            offset += n
        positions[offset:] = torch.arange(size - offset)
        dev = self.device
        return {"input_ids": ids.to(dev), "seg_ids": seg_ids.to(dev),
                "positions": positions.to(dev)}

    def example_inputs(self, size: int) -> dict[str, torch.Tensor]:
        return self.pack([torch.full((size,), 2, dtype=torch.long)], size)
