"""PREFILL and DECODE: the Qwen3 backbone over the paged KV cache.

Owns: gathering each item's input rows (prompt-embedding chunks, or the last frame's summed
audio embedding), the KV runs of the step, and storing each branch's last hidden state.
Must not: sample (DEPTH does) or pick blocks (the scheduler does).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from breezert.models.breeze import BreezeModel
from breezert.sched.plan import DecodeItem, PrefillItem
from breezert.stages import StageOutput
from breezert.worker.batch_state import BatchState
from breezert.worker.kv_cache import KVRun, PagedKVCache


class PrefillStage:
    def __init__(self, model: BreezeModel, kv: PagedKVCache) -> None:
        self.model = model
        self.kv = kv

    def run(self, items: Sequence[PrefillItem], batch: BatchState) -> StageOutput:
        rows, runs = [], []
        for item in items:
            segment = batch.get(item.slot, item.request_id).segments[item.segment_index]
            assert segment.embeds is not None, "PREFILL before TEXT_ENCODE"
            rows.append(segment.embeds[item.branch][item.start_pos : item.start_pos + item.num_tokens])
            runs.append(KVRun(item.block_ids, item.start_pos, item.num_tokens))
        positions = self.kv.begin_step(runs)
        hidden = self.model.backbone_model(torch.cat(rows), positions, self.kv)  # [N, D]
        ends = torch.tensor([r.num_new for r in runs]).cumsum(0) - 1
        for item, end in zip(items, ends.tolist()):
            if item.is_last_chunk:
                segment = batch.get(item.slot, item.request_id).segments[item.segment_index]
                segment.hidden[item.branch] = hidden[end]
                if all(h is not None for h in segment.hidden):
                    segment.embeds = None  # prompt rows are no longer needed
        return StageOutput()


class DecodeStage:
    def __init__(self, model: BreezeModel, kv: PagedKVCache) -> None:
        self.model = model
        self.kv = kv

    def run(self, items: Sequence[DecodeItem], batch: BatchState) -> StageOutput:
        frames, runs = [], []
        for item in items:
            segment = batch.get(item.slot, item.request_id).segments[item.segment_index]
            assert segment.last_frame is not None, "DECODE before the segment's first DEPTH"
            for branch in item.branches:
                frames.append(segment.last_frame)
                runs.append(KVRun(branch.block_ids, branch.position, 1))
        positions = self.kv.begin_step(runs)
        device = self.model.lm_head.weight.device
        embeds = self.model.audio_frame_embeds(torch.stack(frames).to(device))  # [R, D]
        hidden = self.model.backbone_model(embeds, positions, self.kv)  # [R, D]
        row = 0
        for item in items:
            segment = batch.get(item.slot, item.request_id).segments[item.segment_index]
            for b in range(len(item.branches)):
                segment.hidden[b] = hidden[row]
                row += 1
        return StageOutput()
