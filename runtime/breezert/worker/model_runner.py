"""Runs one ``StepPlan`` on the device: release slots, set up new requests, run the stage.

Owns: the device, the paged KV cache, the codec state arena, the slot table
(``worker/slot_table.py``), and the five stage runners, each built with the same ``StageWorker``
(``stages/interface.py``). Stage-agnostic: it dispatches a plan to its stage and isolates
per-request failures. Must not: decide what runs next (the scheduler does) or touch ``Request``
objects.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from breezert.config import GraphConfig
from breezert.constants import Stage
from breezert.loader import Checkpoint
from breezert.models.codec import StreamingCodec
from breezert.outputs import StageOutput
from breezert.sched.plan import BATCHES, NewRequestData, StageItems, StepPlan
from breezert.stages.backbone import (
    DecodeStage,
    PrefillStage,
    backbone_decode_from_slots,
)
from breezert.stages.codec import CodecStage, codec_from_ring, codec_step
from breezert.stages.depth import TOP_K_BOUND, DepthStage, depth_frames_from_slots
from breezert.stages.interface import SlotParams, StageWorker
from breezert.stages.text_encode import TextEncodeStage
from breezert.worker.compile import (
    check_pdl_supported,
    decode_fn,
    depth_fn,
    prefill_fn,
    text_encode_fn,
)
from breezert.worker.cuda_graphs import GraphFn, GraphRunner
from breezert.worker.kv_cache import PagedKVCache
from breezert.worker.slot_table import SlotTable
from breezert.worker.warmup import Progress, capture_all

logger = logging.getLogger("breezert.worker")

FaultHook = Callable[[Stage, str], None]
"""Called with (stage, request_id) before each item runs; raising fails that request only.
Tests use it to inject failures."""


@dataclass(frozen=True)
class ResolvedLayout:
    """Sizes measured or derived at start-up (never written back into the config)."""

    num_blocks: int
    block_size: int
    max_slots: int
    kv_cache_bytes: int


class ModelRunner:
    def __init__(
        self,
        checkpoint: Checkpoint,
        *,
        max_slots: int,
        num_blocks: int,
        block_size: int,
        graph: GraphConfig | None = None,
        codec_precision: str = "tf32",
        max_model_len: int = 2048,
    ) -> None:
        """``max_model_len``: tokens per branch, and the frames per slot that may wait for
        the codec (a whole segment's)."""
        self.ckpt = checkpoint
        model = checkpoint.model
        bb = checkpoint.config.backbone
        self.device = checkpoint.device
        self.graph_config = graph = graph or GraphConfig()
        if graph.pdl:
            check_pdl_supported(self.device)
        use_graphs = graph.enable_cuda_graphs and self.device.type == "cuda"
        self.kv = PagedKVCache(
            bb.num_layers, num_blocks, block_size, bb.num_kv_heads, bb.head_dim,
            dtype=model.lm_head.weight.dtype, device=self.device,
        )
        # One arena slot more than the batch: bucket padding decodes into it.
        self.codec = StreamingCodec.for_serving(
            checkpoint.codec, max_slots + 1, codec_precision, fast=graph.fused_codec)
        longest = max(max_model_len, *graph.decode_context_buckets)  # keys a DECODE row reads
        self.slots = SlotTable(
            max_slots, vocab_size=bb.vocab_size, hidden_size=checkpoint.config.hidden_size,
            hidden_dtype=model.lm_head.weight.dtype, ring_frames=max_model_len,
            device=self.device, max_blocks=-(-longest // block_size), scratch_block=num_blocks)
        worker = StageWorker(self.device, self.slots, self.kv)
        model.fuse_projections_()

        # CFG runs two rows per request: the fused depth workspace covers the largest bucket.
        depth_kernels = (graph.compile_depth, graph.fused_depth,
                         2 * max(graph.depth_batch_buckets), graph.pdl)

        def runner(name: str, fn: GraphFn) -> GraphRunner:
            return GraphRunner(name, fn, enabled=use_graphs, device=self.device)

        # Each graphed function reads and writes the slot table by slot id.
        decode = partial(backbone_decode_from_slots, self.slots,
                         decode_fn(model, self.kv.kv, graph.fused_decode,
                                   max(graph.decode_batch_buckets)),
                         block_size, self.kv.scratch_row)
        depth = {max_k: partial(depth_frames_from_slots, self.slots,
                                depth_fn(model, max_k, *depth_kernels,
                                         fused_draw=graph.fused_depth_draw))
                 for max_k in (TOP_K_BOUND, None)}
        codec = partial(codec_from_ring, self.slots, partial(codec_step, self.codec))
        self.stages = {
            Stage.TEXT_ENCODE: TextEncodeStage(
                model, worker,
                runner("text_encode", text_encode_fn(
                    model, graph.fused_text_encoder, graph.pdl,
                    fused_max_tokens=graph.fused_text_encoder_max_tokens)),
                graph.text_encode_buckets,
            ),
            Stage.PREFILL: PrefillStage(
                model, worker, runner("prefill", prefill_fn(
                    model, self.kv.kv, graph.fused_prefill, graph.fused_prefill_max_tokens)),
                graph.prefill_token_buckets, graph.decode_context_buckets,
            ),
            Stage.DECODE: DecodeStage(
                worker, runner("decode", decode),
                graph.decode_batch_buckets, graph.decode_context_buckets,
            ),
            Stage.DEPTH: DepthStage(
                worker, runner("depth", depth[TOP_K_BOUND]),
                runner("depth_full_sort", depth[None]), graph.depth_batch_buckets,
            ),
            Stage.CODEC: CodecStage(
                self.codec, worker, runner("codec", codec), graph.codec_buckets,
                replay_cost_frames=graph.codec_replay_cost_frames,
            ),
        }
        self.layout = ResolvedLayout(num_blocks, block_size, max_slots, self.kv.nbytes)
        self.fault_hook: FaultHook | None = None
        self.uses_graphs = use_graphs
        self.warmup_s: float | None = None
        """Seconds spent capturing graphs at start-up (None: graphs off)."""
        self.warmup_stage_s: dict[str, float] = {}

    @torch.inference_mode()
    def warmup(self, max_codec_frames: int = 16, progress: Progress | None = None,
               max_codec_step_frames: int | None = None) -> dict[str, float]:
        """Captures every configured bucket a step can reach (largest first) and returns
        seconds per stage; ``progress`` hears each capture (``worker/warmup.py``)."""
        return capture_all(self.graph_config, self.stages, max_codec_frames, progress,
                           max_codec_step_frames)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StageOutput:
        for request_id in plan.finished_request_ids:
            self.release(request_id)
        failed: dict[str, str] = {}
        admitted = []
        for new in plan.new_requests:
            try:
                admitted.append(self._slot_params(new))
            except Exception as exc:  # a bad request must not take the engine down
                failed[new.request_id] = f"set-up failed: {exc}"
        slots = {new.request_id: new.slot for new in plan.new_requests}
        refused = self.slots.admit([slots[p.request_id] for p in admitted], admitted)
        failed.update({rid: f"set-up failed: {why}" for rid, why in refused.items()})
        items = self._runnable(plan.stage, plan.items, failed)
        out = StageOutput()
        if len(items):
            try:
                out = self.stages[plan.stage].run(items)
            except Exception as exc:
                logger.exception("stage %s failed for %d request(s)", plan.stage.value, len(items))
                reason = f"{plan.stage.value} step failed: {type(exc).__name__}: {exc}"
                failed.update(dict.fromkeys(StepPlan.request_ids_of(items), reason))
                out = StageOutput()
        out.failed.update(failed)
        return out

    def release(self, request_id: str) -> None:
        """Frees the request's slot: its rows reset for reuse, its pending segments dropped."""
        self.slots.release_request(request_id)

    def _runnable(self, stage: Stage, items: StageItems, failed: dict[str, str]) -> StageItems:
        """Items (or batch requests) whose request is healthy; the fault hook may fail
        individual requests."""
        if self.fault_hook is None and not failed:
            return items
        keep = []
        for request_id in StepPlan.request_ids_of(items):
            if request_id in failed:
                keep.append(False)
                continue
            if self.fault_hook is not None:
                try:
                    self.fault_hook(stage, request_id)
                except Exception as exc:
                    failed[request_id] = f"{stage.value}: {type(exc).__name__}: {exc}"
                    keep.append(False)
                    continue
            keep.append(True)
        if isinstance(items, BATCHES):
            return items.select(np.array(keep, bool))
        return tuple([item for item, kept in zip(items, keep, strict=True) if kept])

    def _slot_params(self, new: NewRequestData) -> SlotParams:
        seed = new.seed if new.seed is not None else secrets.randbits(63)
        return SlotParams(new.request_id, new.num_branches, new.cfg_scale,
                          new.sampling or self.ckpt.generation.sampling, seed, new.ignore_eos)
