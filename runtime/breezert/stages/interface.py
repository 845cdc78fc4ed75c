"""The worker as the stages see it: what the model runner hands each stage when it builds it.

Owns: ``StageWorker`` (the device, the slot table, the paged KV cache), the protocols those and
the graph runners honour (``worker/slot_table.py``, ``worker/kv_cache.py`` and
``worker/cuda_graphs.py`` implement them), the slot table's host-side value types and
``bucket_for``. Must not: import ``breezert.worker`` (the runner imports the stages, never the
reverse) or hold state of its own.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from breezert.layers.attention import KVRun, StepMeta
from breezert.options import SamplingParams


class Graphs(Protocol):
    """Runs ``fn(**inputs) -> dict`` eagerly or by replaying the graph captured for ``key``
    (``worker.cuda_graphs.GraphRunner``): read or copy outputs before the key's next replay."""

    enabled: bool
    """Graphs are captured and replayed (CUDA with graphs on): pad batches to a bucket."""

    def __call__(self, key: Hashable,
                 inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...


class PagedKV(Protocol):
    """The paged KV cache (``worker.kv_cache.PagedKVCache``) as PREFILL and DECODE use it."""

    block_size: int
    num_blocks: int
    scratch_row: int
    """First token row of the scratch block (padding writes and reads it)."""

    def packed_meta(self, runs: Sequence[KVRun], num_tokens: int, num_keys: int) -> StepMeta: ...


@dataclass(frozen=True)
class SlotParams:
    """What the slot table keeps of one request, written once when it is admitted."""

    request_id: str
    num_branches: int
    """1, or 2 with CFG (branch 0 conditional, branch 1 unconditional)."""
    cfg_scale: float
    sampling: SamplingParams
    seed: int
    """The request's RNG seed (draws are keyed by seed and frame counter)."""
    ignore_eos: bool

    @property
    def has_cfg(self) -> bool:
        return self.num_branches == 2


@dataclass
class PendingSegment:
    """A segment from TEXT_ENCODE to its first DEPTH step, which moves it into the slot's rows
    (a look-ahead segment waits here while the active one runs)."""

    embeds: list[torch.Tensor] | None
    """Per branch ``[L, D]`` prefill rows (TEXT_ENCODE); dropped once every branch prefilled."""
    hidden: list[torch.Tensor | None] = field(default_factory=list)
    """Per branch ``[D]`` final-normed backbone state after the prompt's last PREFILL chunk."""


class Slots(Protocol):
    """The device slot table (``worker.slot_table.SlotTable``): host calls between steps, and
    the sync-free gathers and scatters the graphed stage functions make by slot id."""

    scratch_slot: int
    """The row bucket padding reads and writes."""
    host_has_cfg: np.ndarray
    """``[slot]`` bool: the slot's request runs two CFG branches."""
    host_top_k: np.ndarray
    """``[slot, 2]``: the slot's request's top-k of the first code and of the depth codes."""
    ring_frames: int
    block_tables: torch.Tensor
    """``[2 * rows, max_blocks]`` each branch's KV blocks (row ``slot * 2 + branch``)."""

    def params(self, slot: int, request_id: str) -> SlotParams: ...
    def check_holders(self, slots: np.ndarray, request_ids: Sequence[str]) -> None: ...
    def add_segment(self, slot: int, request_id: str, segment_index: int,
                    embeds: list[torch.Tensor]) -> None: ...
    def segment(self, slot: int, request_id: str, segment_index: int) -> PendingSegment: ...
    def take_prefill_states(self, slot: int, request_id: str,
                            segment_index: int) -> list[torch.Tensor]: ...
    def start_segments(self, slots: Sequence[int],
                       hidden: Sequence[Sequence[torch.Tensor]]) -> None: ...
    def set_block_table(self, row: int, block_ids: tuple[int, ...]) -> None: ...
    def ring_would_overflow(self, slots: np.ndarray, frame_index: np.ndarray) -> np.ndarray: ...
    def mark_decoded(self, slot: int, end_frame: int) -> None: ...
    # device side, inside graphed functions
    def depth_inputs(self, row_ids: torch.Tensor) -> dict[str, torch.Tensor]: ...
    def commit_frames(self, slots: torch.Tensor, codes: torch.Tensor,
                      frames_at: torch.Tensor) -> None: ...
    def decode_codes(self, row_ids: torch.Tensor) -> torch.Tensor: ...
    def store_hidden(self, row_ids: torch.Tensor, hidden: torch.Tensor) -> None: ...
    def codec_codes(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass(frozen=True)
class StageWorker:
    """What every stage gets from the model runner (each also gets its own graph runners)."""

    device: torch.device
    slots: Slots
    kv: PagedKV


def bucket_for(n: int, buckets: tuple[int, ...] | list[int]) -> int | None:
    """Smallest bucket >= n, or None when n exceeds them all (split or run eagerly)."""
    for b in sorted(buckets):
        if b >= n:
            return b
    return None
