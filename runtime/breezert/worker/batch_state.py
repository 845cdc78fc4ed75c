"""Per-slot worker state: what each running request needs between its stage steps.

Owns: the slot table (``slot -> SlotState``), each request's RNG seed, sampling settings, the
per-segment prompt embeddings, last hidden states, repetition masks and the frames waiting for
the codec. With ``graph.device_slot_state`` the stages keep the per-step tensors (repetition
mask, last frame, hidden state after the first, frames for the codec) in the device table
(``worker/slot_table.py``) instead and these fields stay empty. Must not: make decisions (the
scheduler does) or run models (the stages do).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from breezert.options import SamplingParams
from breezert.models.prompt import Prompt


@dataclass
class SegmentState:
    """One text segment of a request, from TEXT_ENCODE to its last DEPTH step."""

    prompts: list[Prompt]
    """One prompt per CFG branch (cond first)."""
    embeds: list[torch.Tensor] | None = None
    """Per branch ``[L, D]`` prefill rows, set by TEXT_ENCODE, dropped when prefill ends."""
    hidden: list[torch.Tensor | None] = field(default_factory=list)
    """Per branch ``[D]`` final-normed backbone state feeding the next DEPTH step."""
    seen: np.ndarray | None = None
    """First codes generated so far in this segment (repetition penalty): a bool mask over the
    backbone vocabulary, one element set per frame (None: none yet)."""
    last_frame: torch.Tensor | None = None
    """``[16]`` the frame the next DECODE step feeds."""


@dataclass
class SlotState:
    """Everything the worker keeps for one running request."""

    request_id: str
    num_branches: int
    cfg_scale: float
    sampling: SamplingParams
    seed: int
    """The request's RNG seed (draws are keyed by seed and frame counter)."""
    ignore_eos: bool
    segments: dict[int, SegmentState] = field(default_factory=dict)
    frames: dict[int, torch.Tensor] = field(default_factory=dict)
    """Output frame index → ``[16]`` codes generated and not yet decoded by the codec."""


class BatchState:
    """The slot table: ``max_slots`` rows, each empty or holding one request."""

    def __init__(self, max_slots: int) -> None:
        self._slots: list[SlotState | None] = [None] * max_slots

    def add(self, slot: int, state: SlotState) -> None:
        if self._slots[slot] is not None:
            raise RuntimeError(f"slot {slot} is still held by {self._slots[slot].request_id}")
        self._slots[slot] = state

    def release_request(self, request_id: str) -> list[int]:
        """Empties the slots ``request_id`` holds; returns them (none if it holds none)."""
        freed = [slot for slot, state in enumerate(self._slots)
                 if state is not None and state.request_id == request_id]
        for slot in freed:
            self._slots[slot] = None
        return freed

    def get(self, slot: int, request_id: str) -> SlotState:
        state = self._slots[slot]
        if state is None or state.request_id != request_id:
            held = None if state is None else state.request_id
            raise RuntimeError(f"slot {slot} holds {held!r}, the plan says {request_id!r}")
        return state

    @property
    def num_active(self) -> int:
        return sum(state is not None for state in self._slots)
