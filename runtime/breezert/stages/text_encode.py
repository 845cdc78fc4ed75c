"""TEXT_ENCODE: every text piece of the batch's segments through T5Gemma2 in one packed call.

Owns: turning ``TextEncodeItem`` prompts into per-branch prefill rows (text rows, reference
frames, audio-EOS row) held in the segment's state. Must not: run the backbone.
"""

from __future__ import annotations

from collections.abc import Sequence

from breezert.models.breeze import BreezeModel
from breezert.models.prompt import Prompt
from breezert.sched.plan import TextEncodeItem
from breezert.stages import StageOutput
from breezert.worker.batch_state import BatchState, SegmentState


class TextEncodeStage:
    def __init__(self, model: BreezeModel) -> None:
        self.model = model

    def run(self, items: Sequence[TextEncodeItem], batch: BatchState) -> StageOutput:
        prompts: list[Prompt] = []
        owners: list[tuple[SegmentState, int]] = []  # (segment, number of branches)
        for item in items:
            branch_prompts = list(item.prompt)
            segment = SegmentState(prompts=branch_prompts, hidden=[None] * len(branch_prompts))
            batch.get(item.slot, item.request_id).segments[item.segment_index] = segment
            prompts.extend(branch_prompts)
            owners.append((segment, len(branch_prompts)))
        embeds = self.model.prompt_embeds_many(prompts)  # one [L_b, D] per branch
        offset = 0
        for segment, num in owners:
            segment.embeds = embeds[offset : offset + num]
            offset += num
        return StageOutput()
