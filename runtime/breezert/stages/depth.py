"""DEPTH: sample one frame per request: first code from the backbone state, then 15 depth codes.

Owns: ``depth_frames`` — one branch-free, sync-free tensor function for a whole frame (fp32
``lm_head``, per-request CFG, repetition penalty, reserved-id and EOS masking, counter-based
sampling, the 15-step depth loop) that runs eagerly on CPU and as ONE CUDA graph per
(request bucket, CFG layout) on GPU — and the host side that packs slot state into its inputs.
Must not: run the backbone or the codec.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from breezert.constants import FRAME_EOS_ID
from breezert.layers.sampling import (
    apply_repetition_penalty,
    draw_counter,
    gumbel_noise,
    sample,
    suppress_reserved,
)
from breezert.models.breeze import BreezeModel
from breezert.outputs import StageOutput
from breezert.sched.plan import DepthItem
from breezert.worker.batch_state import BatchState, SegmentState
from breezert.worker.cuda_graphs import GraphRunner, bucket_for


def _guide(logits: torch.Tensor, num: int, has_cfg: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Rows ``[B]`` (no CFG) or ``[2B]`` (cond rows then uncond rows) → ``[B, V]``.

    Requests without CFG keep their cond row exactly; the others get ``u + s (c - u)``.
    """
    cond = logits[:num]
    if logits.shape[0] == num:
        return cond
    uncond = logits[num:]
    mixed = uncond + scale[:, None] * (cond - uncond)
    return torch.where(has_cfg[:, None], mixed, cond)


def depth_frames(
    model: BreezeModel,
    hidden: torch.Tensor,  # [R, D], R = B or 2B (cond rows, then uncond rows)
    has_cfg: torch.Tensor,  # [B] bool
    cfg_scale: torch.Tensor,  # [B] float32
    seen: torch.Tensor,  # [B, 2052] bool: first codes generated before in this segment
    penalty: torch.Tensor,  # [B] float32
    no_eos: torch.Tensor,  # [B] bool
    sampling: torch.Tensor,  # [B, 6] float32: T, top-k, top-p, depth T, top-k, top-p
    seeds: torch.Tensor,  # [B] int64
    frames_at: torch.Tensor,  # [B] int64: index of this frame in the request's audio
    *,
    max_k: int | None = None,
    sampler: Callable[..., torch.Tensor] = sample,
    noise_per_frame: bool = False,
) -> dict[str, torch.Tensor]:
    """One frame per request → ``{"codes": [B, 16]}`` (``codes[:, 0] == 2051`` means EOS).

    ``max_k``: every row's top-k lies in 1..max_k, so sampling sorts only the top ``max_k``.
    ``sampler``: ``layers.sampling.sample`` or a compiled version of it.
    ``noise_per_frame``: make the 16 draws' Gumbel noise in one call up front instead of one per
    draw (the same bits: it depends on seed and counter only, never on the codes drawn). On the
    CPU that is ~18 % of a frame's time (tiny model: 34.5 -> 28.3 ms); a compiled sampler fuses
    the noise into its own kernel instead.
    """
    num = has_cfg.shape[0]
    logits = _guide(model.first_code_logits(hidden), num, has_cfg, cfg_scale)  # [B, 2052]
    logits = suppress_reserved(apply_repetition_penalty(logits, seen, penalty))
    eos_col = torch.zeros_like(logits, dtype=torch.bool)
    eos_col[:, FRAME_EOS_ID] = True
    logits = logits.masked_fill(eos_col & no_eos[:, None], float("-inf"))
    num_codebooks = model.cfg.num_codebooks
    noise: list[dict[str, torch.Tensor]] = [{}] * num_codebooks  # sampler keywords per draw
    if noise_per_frame:  # [16 * B, 2052]: draw j of request b is row j * B + b
        counters = torch.cat([draw_counter(frames_at, j) for j in range(num_codebooks)])
        gumbel = gumbel_noise(seeds.repeat(num_codebooks), counters, logits.shape[-1])
        noise = [{"gumbel": rows} for rows in gumbel.split(num)]
    top_k = sampling[:, 1].long()
    code = sampler(
        logits, sampling[:, 0], top_k, sampling[:, 2], seeds, draw_counter(frames_at, 0), max_k,
        **noise[0],
    )
    depth = model.depth_decoder
    owner = torch.arange(hidden.shape[0], device=hidden.device) % num  # row -> request
    cache = depth.new_cache(hidden.shape[0])
    depth.step(hidden, 0, cache)
    codes = [code]
    depth_k = sampling[:, 4].long()
    for j in range(1, num_codebooks):
        x = depth.embed_code(codes[-1].clamp(max=FRAME_EOS_ID - 1)[owner], j - 1)  # [R, D]
        logits = _guide(depth.logits(depth.step(x, j, cache), j), num, has_cfg, cfg_scale)
        counters = draw_counter(frames_at, j)
        codes.append(
            sampler(suppress_reserved(logits), sampling[:, 3], depth_k, sampling[:, 5], seeds,
                    counters, max_k, **noise[j])
        )
    return {"codes": torch.stack(codes, dim=1)}


TOP_K_BOUND = 64
"""Batches whose every top-k is in 1..TOP_K_BOUND (the default is 50) sample with a cheap
``topk``; others use the full-sort graphs."""


class DepthStage:
    def __init__(
        self, model: BreezeModel, graphs: GraphRunner, full_sort_graphs: GraphRunner,
        buckets: Sequence[int],
    ) -> None:
        self.model = model
        self.graphs = graphs  # depth_frames with max_k=TOP_K_BOUND
        self.full_sort_graphs = full_sort_graphs  # depth_frames with max_k=None
        self.buckets = tuple(sorted(buckets))
        self.device = model.lm_head.weight.device

    def run(self, items: Sequence[DepthItem], batch: BatchState) -> StageOutput:
        slots = [batch.get(item.slot, item.request_id) for item in items]
        segments = [slot.segments[item.segment_index] for item, slot in zip(items, slots)]
        for item, segment in zip(items, segments):
            if item.frame_index == 0:
                segment.seen = None
        num = len(items)
        size = bucket_for(num, self.buckets) if self.graphs.enabled else None
        size = size or num
        use_cfg = any(slot.num_branches == 2 for slot in slots)
        inputs = self._inputs(items, slots, segments, size, use_cfg)
        bounded = all(
            1 <= k <= TOP_K_BOUND for s in slots for k in (s.sampling.top_k, s.sampling.depth_top_k)
        )
        graphs = self.graphs if bounded else self.full_sort_graphs
        codes = graphs((size, use_cfg), inputs)["codes"][:num].cpu()  # [B, 16]
        out = StageOutput()
        for item, slot, segment, frame in zip(items, slots, segments, codes):
            code0 = int(frame[0])
            out.first_codes[item.request_id] = code0
            if code0 != FRAME_EOS_ID:
                if segment.seen is None:
                    segment.seen = np.zeros(self.model.cfg.backbone.vocab_size, dtype=bool)
                segment.seen[code0] = True
                segment.last_frame = frame
                slot.frames[item.output_frame_index] = frame
        return out

    def seen_rows(self, segments: Sequence[SegmentState], size: int) -> np.ndarray:
        """``[size, vocab]`` bool: each segment's first codes so far (padding rows empty); one
        row copy a segment (turning each segment's code list into a tensor every step cost
        2.8-13.5 ms at 64 streams on the dev VM, bench/depth_host_inputs.py)."""
        seen = np.zeros((size, self.model.cfg.backbone.vocab_size), dtype=bool)
        for i, seg in enumerate(segments):
            if seg.seen is not None:
                seen[i] = seg.seen
        return seen

    def _inputs(self, items, slots, segments, size: int, use_cfg: bool) -> dict[str, torch.Tensor]:
        """Host-built, bucket-padded inputs of ``depth_frames`` (padding rows copy row 0)."""
        num = len(items)
        pad = [0] * (size - num)
        cond = [seg.hidden[0] for seg in segments]
        rows = cond + [cond[i] for i in pad]
        if use_cfg:
            uncond = [seg.hidden[-1] for seg in segments]  # a 1-branch request repeats its row
            rows += uncond + [uncond[i] for i in pad]
        seen = self.seen_rows(segments, size)
        order = list(range(num)) + pad
        params = [slots[i].sampling for i in order]
        sampling = torch.tensor(
            [[p.temperature, p.top_k, p.top_p, p.depth_temperature, p.depth_top_k, p.depth_top_p]
             for p in params], dtype=torch.float32,
        )
        dev = self.device
        return {
            "hidden": torch.stack(rows),
            "has_cfg": torch.tensor([slots[i].num_branches == 2 for i in order], device=dev),
            "cfg_scale": torch.tensor([slots[i].cfg_scale for i in order], device=dev),
            "seen": torch.from_numpy(seen).to(dev),
            "penalty": torch.tensor([p.repetition_penalty for p in params], device=dev),
            "no_eos": torch.tensor([slots[i].ignore_eos for i in order], device=dev),
            "sampling": sampling.to(dev),
            "seeds": torch.tensor([slots[i].seed for i in order], dtype=torch.long, device=dev),
            "frames_at": torch.tensor(
                [items[i].output_frame_index for i in order], dtype=torch.long, device=dev
            ),
        }

    def example_inputs(self, size: int, use_cfg: bool) -> dict[str, torch.Tensor]:
        """Dummy inputs of a bucket, for capture at start-up."""
        dev, d = self.device, self.model.cfg.hidden_size
        rows = 2 * size if use_cfg else size
        dtype = self.model.lm_head.weight.dtype
        return {
            "hidden": torch.randn(rows, d, device=dev, dtype=dtype),
            "has_cfg": torch.full((size,), use_cfg, device=dev),
            "cfg_scale": torch.ones(size, device=dev),
            "seen": torch.zeros(size, self.model.cfg.backbone.vocab_size, dtype=torch.bool,
                                device=dev),
            "penalty": torch.ones(size, device=dev),
            "no_eos": torch.zeros(size, dtype=torch.bool, device=dev),
            "sampling": torch.tensor([[0.9, 50, 1.0, 0.9, 50, 1.0]], device=dev).expand(size, 6)
            .contiguous(),
            "seeds": torch.arange(size, device=dev),
            "frames_at": torch.zeros(size, dtype=torch.long, device=dev),
        }
