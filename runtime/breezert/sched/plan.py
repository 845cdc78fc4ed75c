"""StepPlan and StepResult: the only contract between the scheduler and the worker.

Owns the torch-free plan types (ints, strings, tuples; prompts are opaque engine objects
passed through); their ``Stage`` comes from ``breezert.constants``. A plan and its items are
values: nobody changes them once the scheduler built them. The items are slotted dataclasses,
not frozen ones (several times cheaper to build; a DECODE step at 256 streams builds ~400 of
them with their branches). Must not carry behaviour beyond tiny
helpers, and never a ``Request``: the worker sees only what is written here.

How the worker applies a plan, in this order:
  1. ``finished_request_ids``: release those requests' slots (codec state, RNG, buffers).
  2. ``new_requests``: set up each new request's slot (the slot may have been released in 1).
  3. ``items``: run the one ``stage`` over all items as one batch.
Then it returns a ``StepResult`` with the same ``step_id``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from breezert.constants import Stage


@dataclass(frozen=True, slots=True)
class NewRequestData:
    """Everything the worker needs once per request, sent in the plan that admits it.

    Per-segment prompts are not here: they come with each segment's ``TextEncodeItem``.
    """

    request_id: str
    slot: int
    """Row of the persistent batch (and of the codec state arena), 0..max_running_requests-1."""
    num_branches: int
    """1, or 2 with CFG (branch 0 = conditional, branch 1 = unconditional)."""
    cfg_scale: float
    seed: int | None
    """Seed of the request's own generator; ``None`` = nondeterministic."""
    sampling: Any
    """Opaque sampling parameters (``breezert.options.SamplingParams`` or ``None``)."""
    ignore_eos: bool
    """The sampler must never produce ``FRAME_EOS_ID``; the segment stops at its frame limit."""


@dataclass(slots=True)
class TextEncodeItem:
    """Encode one segment's text pieces. The first item that names this segment."""

    request_id: str
    slot: int
    segment_index: int
    num_tokens: int
    """Text tokens the encoder processes for this segment (all branches); budget accounting."""
    prompt: Any
    """Opaque tokenized prompt the engine attached to the segment (ids per branch, text piece
    lengths, reference codes). Sent once; the worker keeps what it needs until PREFILL ends."""


@dataclass(slots=True)
class PrefillItem:
    """Run the backbone over prompt positions ``start_pos..start_pos+num_tokens-1`` of a branch."""

    request_id: str
    slot: int
    segment_index: int
    branch: int
    start_pos: int
    num_tokens: int
    block_ids: tuple[int, ...]
    """The branch's FULL block table. It is allocated once when the segment is admitted and does
    not change for the segment's lifetime (the same tuple object every step), so the worker may
    cache per ``(request_id, segment_index, branch)``."""
    is_last_chunk: bool
    """The prompt ends with this chunk: keep the last hidden state for DEPTH."""


@dataclass(slots=True)
class DecodeBranch:
    """One row of a DECODE item: feed the last frame of a branch at ``position``."""

    position: int
    """Backbone position of the fed frame: prompt length of the branch + frame_index."""
    block_ids: tuple[int, ...]
    """The branch's full block table (see ``PrefillItem.block_ids``)."""


@dataclass(slots=True)
class DecodeItem:
    """Run one backbone step over the segment's frame ``frame_index``; keep the new hidden."""

    request_id: str
    slot: int
    segment_index: int
    frame_index: int
    """Index within the segment of the frame being fed (the last one DEPTH produced)."""
    branches: tuple[DecodeBranch, ...]
    """One entry per CFG branch, in branch order; each counts as one row."""


@dataclass(slots=True)
class DepthItem:
    """Sample one frame from the segment's last hidden state: c0 (lm_head, CFG, repetition
    penalty, EOS) and, unless c0 is EOS, the 15 depth codes. All sampling happens here."""

    request_id: str
    slot: int
    segment_index: int
    frame_index: int
    """Index of the frame within its segment; 0 = sample from the PREFILL hidden state (and
    start the segment's repetition-penalty history)."""
    num_branches: int
    """Rows this item takes: 1, or 2 with CFG (each branch's hidden state)."""
    output_frame_index: int
    """Where the frame goes in the request's audio stream (counted over all segments), if it is
    not EOS. CODEC items refer to these indices."""


@dataclass(slots=True)
class CodecItem:
    """Decode frames ``start_frame .. start_frame+num_frames-1`` of a request into one chunk."""

    request_id: str
    slot: int
    start_frame: int
    num_frames: int
    """Exactly the frames of this chunk (1..max_codec_frames)."""
    is_first_chunk: bool
    """Reset the slot's streaming codec state before decoding."""
    is_final: bool
    """The request's last chunk: the codec state of the slot can be dropped afterwards."""


StageItem = TextEncodeItem | PrefillItem | DecodeItem | DepthItem | CodecItem


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One step: one stage over a batch of items, plus request set-up and release."""

    step_id: int
    stage: Stage
    items: tuple[StageItem, ...]
    new_requests: tuple[NewRequestData, ...] = ()
    finished_request_ids: tuple[str, ...] = ()
    """Requests that finished, aborted or failed since the last plan: release their slots."""

    @property
    def request_ids(self) -> tuple[str, ...]:
        """Ids of the requests with an item in this step, in item order (may repeat)."""
        return tuple(item.request_id for item in self.items)

    @property
    def num_rows(self) -> int:
        """Batch rows of this step: DECODE and DEPTH count each CFG branch, others each item."""
        if self.stage is Stage.DECODE:
            return sum([len(item.branches) for item in self.items])  # type: ignore[union-attr]
        if self.stage is Stage.DEPTH:
            return sum([item.num_branches for item in self.items])  # type: ignore[union-attr]
        return len(self.items)


@dataclass(frozen=True, slots=True)
class StepResult:
    """What the worker reports back for the plan with the same ``step_id``."""

    step_id: int
    first_codes: dict[str, int] = field(default_factory=dict)
    """DEPTH only: the sampled first code c0 per request (``FRAME_EOS_ID`` ends the segment)."""
    failed: dict[str, str] = field(default_factory=dict)
    """Requests whose part of the step raised: request_id -> short reason. Only those fail."""
