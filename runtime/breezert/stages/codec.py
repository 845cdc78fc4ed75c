"""CODEC: decode the frames of each chunk with the exact streaming codec, many streams at once.

Owns: grouping CODEC items by frame count (one batched decode per group), resetting a slot's
codec state at a request's first chunk, and turning the waveform into ``DecodedChunk``s.
Must not: decide chunk sizes (the scheduler and the Predictor do).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import numpy as np
import torch

from breezert.models.codec import StreamingCodec
from breezert.sched.plan import CodecItem
from breezert.stages import DecodedChunk, StageOutput
from breezert.worker.batch_state import BatchState


class CodecStage:
    def __init__(self, codec: StreamingCodec) -> None:
        self.codec = codec
        self.device = codec.positions.device

    def run(self, items: Sequence[CodecItem], batch: BatchState) -> StageOutput:
        out = StageOutput()
        groups: dict[int, list[CodecItem]] = defaultdict(list)
        for item in items:
            groups[item.num_frames].append(item)
        for group in groups.values():
            out.chunks.extend(self._decode_group(group, batch))
        return out

    def _decode_group(self, items: list[CodecItem], batch: BatchState) -> list[DecodedChunk]:
        slot_ids = torch.tensor([item.slot for item in items], device=self.device)
        fresh = [item.slot for item in items if item.is_first_chunk]
        if fresh:
            self.codec.reset(torch.tensor(fresh, device=self.device))
        codes = []
        for item in items:
            frames = batch.get(item.slot, item.request_id).frames
            span = range(item.start_frame, item.start_frame + item.num_frames)
            codes.append(torch.stack([frames.pop(i) for i in span]))  # [F, 16]
        wav = self.codec.decode(slot_ids, torch.stack(codes).to(self.device))  # [B, F * 1920]
        pcm = wav.float().cpu().numpy().astype(np.float32, copy=False)
        return [
            DecodedChunk(item.request_id, item.start_frame, item.num_frames, pcm[i], item.is_final)
            for i, item in enumerate(items)
        ]
