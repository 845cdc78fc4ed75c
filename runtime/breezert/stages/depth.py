"""DEPTH: sample one frame per request: first code from the backbone state, then 15 depth codes.

Owns: the first-code logits (fp32 ``lm_head``), CFG mixing per request, the repetition penalty
over the segment's first codes, reserved-id and EOS masking, per-request sampling from each
request's counter-based RNG stream, and the 15-step depth loop batched over every row. Must not: run the
backbone or the codec.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from breezert.layers.sampling import (
    apply_repetition_penalty,
    cfg_mix,
    draw_counter,
    sample,
    seen_mask,
    suppress_reserved,
)
from breezert.models.breeze import BreezeModel
from breezert.models.config import FRAME_EOS_ID
from breezert.sched.plan import DepthItem
from breezert.stages import StageOutput
from breezert.worker.batch_state import BatchState, SegmentState, SlotState


def _mix_rows(logits: torch.Tensor, spans: Sequence[tuple[int, int, float]]) -> torch.Tensor:
    """``[R, V]`` branch rows → ``[B, V]``: the cond row alone, or ``u + s (c - u)`` with CFG."""
    mixed = [
        logits[start] if num == 1 else cfg_mix(logits[start], logits[start + 1], scale)
        for start, num, scale in spans
    ]
    return torch.stack(mixed)


class DepthStage:
    def __init__(self, model: BreezeModel) -> None:
        self.model = model

    def run(self, items: Sequence[DepthItem], batch: BatchState) -> StageOutput:
        slots = [batch.get(item.slot, item.request_id) for item in items]
        segments = [slot.segments[item.segment_index] for item, slot in zip(items, slots)]
        if any(item.frame_index == 0 for item in items):
            for item, segment in zip(items, segments):
                if item.frame_index == 0:
                    segment.history.clear()
        hidden = torch.stack([h for seg in segments for h in seg.hidden])  # [R, D]
        spans = _row_spans(slots)
        device = hidden.device
        seeds = torch.tensor([slot.seed for slot in slots], dtype=torch.long, device=device)
        frames_at = torch.tensor([item.output_frame_index for item in items], device=device)
        code0 = self._first_codes(hidden, spans, slots, segments, seeds, frames_at)  # [B]
        out = StageOutput(
            first_codes={item.request_id: int(c) for item, c in zip(items, code0.tolist())}
        )
        keep = [i for i, c in enumerate(code0.tolist()) if c != FRAME_EOS_ID]
        if not keep:
            return out
        kept_slots = [slots[i] for i in keep]
        rows = torch.tensor([r for i in keep for r in range(spans[i][0], spans[i][0] + spans[i][1])])
        kept = torch.tensor(keep, device=device)
        frames = self._depth_codes(
            hidden[rows.to(device)], code0[kept], _row_spans(kept_slots), kept_slots,
            seeds[kept], frames_at[kept],
        )  # [B', 16]
        for i, frame in zip(keep, frames.cpu()):
            segments[i].history.append(int(frame[0]))
            segments[i].last_frame = frame
            slots[i].frames[items[i].output_frame_index] = frame
        return out

    def _first_codes(
        self,
        hidden: torch.Tensor,
        spans: Sequence[tuple[int, int, float]],
        slots: Sequence[SlotState],
        segments: Sequence[SegmentState],
        seeds: torch.Tensor,
        frames_at: torch.Tensor,
    ) -> torch.Tensor:
        logits = _mix_rows(self.model.first_code_logits(hidden), spans)  # [B, 2052]
        penalty = torch.tensor([s.sampling.repetition_penalty for s in slots])
        if any(seg.history for seg in segments):
            seen = seen_mask([seg.history for seg in segments], logits.shape[-1], logits.device)
            logits = apply_repetition_penalty(logits, seen, penalty.to(logits.device))
        logits = suppress_reserved(logits)
        no_eos = torch.tensor([s.ignore_eos for s in slots], device=logits.device)
        logits[:, FRAME_EOS_ID] = logits[:, FRAME_EOS_ID].masked_fill(no_eos, float("-inf"))
        params = [s.sampling for s in slots]
        return sample(
            logits,
            torch.tensor([p.temperature for p in params]),
            torch.tensor([p.top_k for p in params]),
            torch.tensor([p.top_p for p in params]),
            seeds,
            draw_counter(frames_at, 0),
        )

    def _depth_codes(
        self,
        hidden: torch.Tensor,
        code0: torch.Tensor,
        spans: Sequence[tuple[int, int, float]],
        slots: Sequence[SlotState],
        seeds: torch.Tensor,
        frames_at: torch.Tensor,
    ) -> torch.Tensor:
        """The 15-codebook loop for ``R`` rows of ``B`` requests → frames ``[B, 16]``."""
        depth = self.model.depth_decoder
        num_rows = hidden.shape[0]
        # Each request's code is fed to all of its branch rows.
        row_owner = torch.tensor(
            [b for b, (_, num, _) in enumerate(spans) for _ in range(num)], device=hidden.device
        )
        params = [s.sampling for s in slots]
        temperature = torch.tensor([p.depth_temperature for p in params])
        top_k = torch.tensor([p.depth_top_k for p in params])
        top_p = torch.tensor([p.depth_top_p for p in params])
        cache = depth.new_cache(num_rows)
        depth.step(hidden, 0, cache)
        codes = [code0.to(hidden.device)]
        for j in range(1, self.model.cfg.num_codebooks):
            x = depth.embed_code(codes[-1][row_owner], j - 1)  # [R, D]
            logits = _mix_rows(depth.logits(depth.step(x, j, cache), j), spans)  # [B, 2051]
            counters = draw_counter(frames_at, j)
            codes.append(sample(suppress_reserved(logits), temperature, top_k, top_p, seeds, counters))
        return torch.stack(codes, dim=1)  # [B, 16]


def _row_spans(slots: Sequence[SlotState]) -> list[tuple[int, int, float]]:
    """(first row, number of rows, cfg scale) of each request in the stacked hidden rows."""
    spans, start = [], 0
    for slot in slots:
        spans.append((start, slot.num_branches, slot.cfg_scale))
        start += slot.num_branches
    return spans
