"""DEPTH: sample one frame per request: first code from the backbone state, then 15 depth codes.

Owns: ``depth_frames`` — one branch-free, sync-free tensor function for a whole frame (fp32
``lm_head``, per-request CFG, repetition penalty, reserved-id and EOS masking, counter-based
sampling, the 15-step depth loop) that runs eagerly on CPU and as ONE CUDA graph per
(request bucket, CFG layout) on GPU — and ``depth_frames_from_slots``, the same frame over rows
gathered by slot id from the slot table, its results written back into the table, only the
first codes read back. Must not: run the backbone or the codec.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from breezert.constants import FRAME_EOS_ID
from breezert.layers.sampling import (
    RowSampling,
    apply_repetition_penalty,
    draw_counter,
    gumbel_noise,
    suppress_reserved,
)
from breezert.models.breeze import BreezeModel
from breezert.outputs import StageOutput
from breezert.sched.plan import DepthBatch
from breezert.stages.interface import Graphs, Slots, StageWorker, bucket_for


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
    sampler: Callable[..., torch.Tensor] | None = None,
    noise_per_frame: bool = False,
    depth_draw: Callable[..., torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """One frame per request → ``{"codes": [B, 16]}`` (``codes[:, 0] == 2051`` means EOS).

    ``max_k``: every row's top-k lies in 1..max_k, so sampling sorts only the top ``max_k``.
    ``sampler``: a compiled stand-in for ``layers.sampling.sample``,
    called once per draw; ``None``: ``sample``'s draws with each kind's settings turned into
    tensors once per frame (``RowSampling``), not 16 times.
    ``noise_per_frame``: make the 16 draws' Gumbel noise in one call up front instead of one per
    draw (the same bits: it depends on seed and counter only, never on the codes drawn): faster
    on the CPU; a compiled sampler fuses the noise into its own kernel instead.
    ``depth_draw``: draws codebooks 1..15 from each head's logits in one call
    (``kernels/depth_draw.depth_draw_triton``'s arguments): guidance, the reserved ids and the
    depth settings' draw; the first code keeps ``sampler``.
    """
    num = has_cfg.shape[0]
    logits = _guide(model.first_code_logits(hidden), num, has_cfg, cfg_scale)  # [B, 2052]
    logits = suppress_reserved(apply_repetition_penalty(logits, seen, penalty))
    eos_col = torch.zeros_like(logits, dtype=torch.bool)
    eos_col[:, FRAME_EOS_ID] = True
    logits = logits.masked_fill(eos_col & no_eos[:, None], float("-inf"))
    num_codebooks = model.cfg.num_codebooks
    noise: list[torch.Tensor | None] = [None] * num_codebooks  # each draw's Gumbel noise
    if noise_per_frame:  # [16 * B, 2052]: draw j of request b is row j * B + b
        counters = torch.cat([draw_counter(frames_at, j) for j in range(num_codebooks)])
        gumbel = gumbel_noise(seeds.repeat(num_codebooks), counters, logits.shape[-1])
        noise = list(gumbel.split(num))
    params = (sampling[:, 0], sampling[:, 1].long(), sampling[:, 2])  # first code, then depth
    depth_params = (sampling[:, 3], sampling[:, 4].long(), sampling[:, 5])
    rows: RowSampling | None = None  # the draws' settings as tensors, made once per kind

    def draw(j: int, logits: torch.Tensor) -> torch.Tensor:
        nonlocal rows
        p = params if j == 0 else depth_params
        if sampler is not None:  # a compiled stand-in for ``sample``
            extra = {} if noise[j] is None else {"gumbel": noise[j]}
            return sampler(logits, *p, seeds, draw_counter(frames_at, j), max_k, **extra)
        if j <= 1:  # the first code's settings, then the depth codes'
            rows = RowSampling.of(*p, num, logits.shape[-1], logits.device, max_k)
        g = noise[j]
        if g is None:
            g = gumbel_noise(seeds, draw_counter(frames_at, j), logits.shape[-1])
        assert rows is not None
        return rows.draw(logits, g)

    code = draw(0, logits)
    depth = model.depth_decoder
    owner = None  # row -> request, for the uncond rows of CFG
    if hidden.shape[0] != num:
        owner = torch.arange(hidden.shape[0], device=hidden.device) % num
    cache = depth.new_cache(hidden.shape[0])
    depth.step(hidden, 0, cache)
    codes = [code]
    for j in range(1, num_codebooks):
        # an EOS first code (2051) is clamped into the table: that frame is dropped anyway
        last = codes[-1].clamp(max=FRAME_EOS_ID - 1) if j == 1 else codes[-1]
        x = depth.embed_code(last if owner is None else last[owner], j - 1)  # [R, D]
        logits = depth.logits(depth.step(x, j, cache), j)  # [R, V]
        if depth_draw is not None:
            codes.append(depth_draw(logits, num, has_cfg, cfg_scale, *depth_params, seeds,
                                    draw_counter(frames_at, j)))
            continue
        codes.append(draw(j, suppress_reserved(_guide(logits, num, has_cfg, cfg_scale))))
    return {"codes": torch.stack(codes, dim=1)}


def depth_frames_from_slots(
    table: Slots, frame_fn: Callable[..., dict[str, torch.Tensor]],
    row_ids: torch.Tensor,  # [C, B] int64: slot * 2 + branch (C = 2: cond rows, uncond rows)
) -> dict[str, torch.Tensor]:
    """``frame_fn`` (``depth_frames`` bound to a model) over the table's rows ``row_ids``; each
    frame goes back into the table (last frame, ring, repetition mask, frame counter) ->
    ``{"first_codes": [B]}``, the one thing the scheduler needs. Sync-free, graph-safe."""
    inputs = table.depth_inputs(row_ids)
    codes = frame_fn(**inputs)["codes"]  # [B, 16]
    table.commit_frames(row_ids[0] // 2, codes, inputs["frames_at"])
    return {"first_codes": codes[:, 0]}


TOP_K_BOUND = 64
"""Batches whose every top-k is in 1..TOP_K_BOUND (the default is 50) sample with a cheap
``topk``; others use the full-sort graphs."""


class DepthStage:
    def __init__(
        self, worker: StageWorker, graphs: Graphs, full_sort_graphs: Graphs,
        buckets: Sequence[int],
    ) -> None:
        """``graphs`` and ``full_sort_graphs`` run ``depth_frames_from_slots`` bound to the slot
        table, with ``max_k=TOP_K_BOUND`` and ``max_k=None``."""
        self.graphs = graphs
        self.full_sort_graphs = full_sort_graphs
        self.buckets = tuple(sorted(buckets))
        self.device = worker.device
        self.slots = worker.slots

    def _launch(self, slots: np.ndarray) -> tuple[int, bool, Graphs]:
        """(bucket rows, CFG layout, graphs) of a batch of the requests in ``slots``."""
        num = len(slots)
        size = bucket_for(num, self.buckets) if self.graphs.enabled else None
        use_cfg = bool(self.slots.host_has_cfg[slots].any())
        top_k = self.slots.host_top_k[slots]
        bounded = bool(((top_k >= 1) & (top_k <= TOP_K_BOUND)).all())
        return size or num, use_cfg, self.graphs if bounded else self.full_sort_graphs

    def run(self, batch: DepthBatch) -> StageOutput:
        """One upload of row ids, one read-back of the first codes."""
        out = StageOutput()
        table = self.slots
        full = table.ring_would_overflow(batch.slots, batch.output_frame_index)
        if full.any():
            for request_id in batch.select(full).request_ids:
                out.failed[request_id] = (
                    f"DEPTH: {table.ring_frames} frames already wait for the codec (the slot "
                    "table's ring is full)")
            batch = batch.select(~full)
        if not len(batch):
            return out
        table.check_holders(batch.slots, batch.request_ids)
        fresh = np.flatnonzero(batch.frame_index == 0).tolist()
        if fresh:
            table.start_segments([int(batch.slots[i]) for i in fresh], [
                table.take_prefill_states(int(batch.slots[i]), batch.request_ids[i],
                                          int(batch.segment_index[i])) for i in fresh])
        size, use_cfg, graphs = self._launch(batch.slots)
        row_ids = self.row_ids(batch.slots, batch.num_branches, size, use_cfg)
        first = graphs((size, use_cfg), {"row_ids": row_ids})["first_codes"]
        out.first_codes.update(zip(batch.request_ids, first[: len(batch)].tolist()))
        return out

    def row_ids(self, slots: np.ndarray, num_branches: np.ndarray, size: int,
                use_cfg: bool) -> torch.Tensor:
        """``[C, size]`` table rows (``slot * 2 + branch``) of requests in ``slots`` (``[n]``,
        ``num_branches`` each) on the device; a 1-branch request in a CFG batch repeats its cond
        row, padding rows read the scratch slot."""
        rows = np.full((2 if use_cfg else 1, size), 2 * self.slots.scratch_slot, np.int64)
        num = len(slots)
        rows[0, :num] = 2 * slots
        if use_cfg:
            rows[1, :num] = rows[0, :num] + (num_branches == 2)
        return torch.from_numpy(rows).to(self.device, non_blocking=True)

    def example_inputs(self, size: int, use_cfg: bool) -> dict[str, torch.Tensor]:
        """Inputs of a bucket, for capture at start-up: every row the scratch slot's, so
        capture writes nothing a request owns."""
        none = np.zeros(0, np.int64)
        return {"row_ids": self.row_ids(none, none, size, use_cfg)}
