"""CODEC: decode the frames of each chunk with the exact streaming codec, many streams at once.

Owns: grouping CODEC items by frame count, padding each group to a (streams, frames) bucket
(padding rows decode into a scratch slot), the graphed gather → step → scatter function,
resetting a slot's state at a request's first chunk, and turning waveforms into
``DecodedChunk``s. Must not: decide chunk sizes (the scheduler and the Predictor do).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch

from breezert.models.codec import StreamingCodec
from breezert.outputs import DecodedChunk, StageOutput
from breezert.sched.plan import CodecItem
from breezert.worker.batch_state import BatchState
from breezert.worker.cuda_graphs import GraphRunner, bucket_for


def codec_step(
    codec: StreamingCodec, slot_ids: torch.Tensor, codes: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Decodes ``codes [B, F, 16]`` for ``slot_ids [B]`` (state gathered and written back)."""
    return {"wav": codec.decode(slot_ids, codes)}


class CodecStage:
    def __init__(self, codec: StreamingCodec, graphs: GraphRunner, buckets: Sequence[int]) -> None:
        self.codec, self.graphs, self.buckets = codec, graphs, tuple(buckets)
        self.device = codec.positions.device
        self.scratch_slot = codec.max_slots - 1  # the arena has one slot more than the batch

    def run(self, items: Sequence[CodecItem], batch: BatchState) -> StageOutput:
        out = StageOutput()
        groups: dict[int, list[CodecItem]] = defaultdict(list)
        for item in items:
            groups[item.num_frames].append(item)
        for group in groups.values():
            out.chunks.extend(self._decode_group(group, batch))
        return out

    def frame_buckets(self, max_frames: int) -> list[int]:
        """Captured frame counts (powers of two); other chunk sizes are split into these."""
        sizes, f = [], 1
        while f <= max(1, min(max_frames, 16)):
            sizes.append(f)
            f *= 2
        return sorted(sizes, reverse=True)

    def _pieces(self, num_frames: int) -> list[int]:
        """``num_frames`` as a sum of captured frame counts, largest first (exact: the
        streaming codec gives the same audio for any split)."""
        if not self.graphs.enabled:
            return [num_frames]
        pieces, left = [], num_frames
        for size in self.frame_buckets(16):
            while left >= size:
                pieces.append(size)
                left -= size
        return pieces

    def _decode_group(self, items: list[CodecItem], batch: BatchState) -> list[DecodedChunk]:
        fresh = [item.slot for item in items if item.is_first_chunk]
        if fresh:
            self.codec.reset(torch.tensor(fresh, device=self.device))
        num, frames_per = len(items), items[0].num_frames
        size = (bucket_for(num, self.buckets) if self.graphs.enabled else None) or num
        slot_ids = torch.full((size,), self.scratch_slot, dtype=torch.long)
        codes = torch.zeros(size, frames_per, 16, dtype=torch.long)
        for i, item in enumerate(items):
            frames = batch.get(item.slot, item.request_id).frames
            span = range(item.start_frame, item.start_frame + frames_per)
            codes[i] = torch.stack([frames.pop(f) for f in span])  # [F, 16]
            slot_ids[i] = item.slot
        slot_ids, codes = slot_ids.to(self.device), codes.to(self.device)
        waves, start = [], 0
        for piece in self._pieces(frames_per):
            inputs = {"slot_ids": slot_ids, "codes": codes[:, start : start + piece]}
            waves.append(self.graphs((size, piece), inputs)["wav"][:num].float().cpu())
            start += piece
        pcm = torch.cat(waves, dim=1).numpy()  # [B, F * 1920]
        return [
            DecodedChunk(item.request_id, item.start_frame, item.num_frames, pcm[i], item.is_final)
            for i, item in enumerate(items)
        ]

    def example_inputs(self, size: int, frames: int) -> dict[str, torch.Tensor]:
        slot_ids = torch.full((size,), self.scratch_slot, dtype=torch.long, device=self.device)
        codes = torch.zeros(size, frames, 16, dtype=torch.long, device=self.device)
        return {"slot_ids": slot_ids, "codes": codes}
