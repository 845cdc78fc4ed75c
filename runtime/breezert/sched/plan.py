"""StepPlan and StepResult: the only contract between the scheduler and the worker.

Owns the torch-free plan types (ints, strings, tuples, numpy arrays; prompts are opaque engine
objects passed through); their ``Stage`` comes from ``breezert.constants``. A plan and its items
are values: nobody changes them once the scheduler built them. The few items of TEXT_ENCODE and
PREFILL are one object each; DECODE, DEPTH and CODEC, which take up to every running request
each step (~250 at 256 streams), are one batch of arrays each, so that building one costs the
same few array operations whatever the number of streams. All are slotted dataclasses, not
frozen ones (several times cheaper to build). Must not carry behaviour beyond tiny helpers, and
never a ``Request``: the worker sees only what is written here.

How the worker applies a plan, in this order:
  1. ``finished_request_ids``: release those requests' slots (codec state, RNG, buffers).
  2. ``new_requests``: set up each new request's slot (the slot may have been released in 1).
  3. ``items``: run the one ``stage`` over all items (or the DECODE/DEPTH/CODEC batch) at once.
Then it returns a ``StepResult`` with the same ``step_id``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple, Self

import numpy as np

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


class DecodeRow(NamedTuple):
    """One request of a ``DecodeBatch``, as a value (tests and logs; the worker reads arrays)."""

    request_id: str
    slot: int
    segment_index: int
    frame_index: int
    branches: tuple[tuple[int, tuple[int, ...]], ...]
    """``(position, block_ids)`` per CFG branch (see ``DecodeBatch``)."""


class DepthRow(NamedTuple):
    """One request of a ``DepthBatch``, as a value (tests and logs; the worker reads arrays)."""

    request_id: str
    slot: int
    segment_index: int
    frame_index: int
    num_branches: int
    output_frame_index: int


class CodecRow(NamedTuple):
    """One chunk of a ``CodecBatch``, as a value (tests and logs; the worker reads arrays)."""

    request_id: str
    slot: int
    start_frame: int
    num_frames: int
    is_first_chunk: bool
    is_final: bool


@dataclass(slots=True)
class _Batch:
    """What a DECODE, DEPTH and CODEC batch share: one entry per request, in batch order, as
    arrays (``[n]``), built with a few array operations whatever the number of requests.
    Iterating gives row values (for tests, not the hot path)."""

    request_ids: tuple[str, ...]
    slots: np.ndarray

    def __len__(self) -> int:
        return len(self.request_ids)

    @property
    def num_rows(self) -> int:
        return len(self.request_ids)

    def select(self, keep: np.ndarray) -> Self:
        """The requests where ``keep`` (``[n]`` bool) holds, in order."""
        values = [getattr(self, f.name) for f in fields(self)]
        return type(self)(*[_pick(value, keep) if isinstance(value, tuple) else value[keep]
                            for value in values])


@dataclass(slots=True)
class _FrameBatch(_Batch):
    """What a DECODE and a DEPTH batch share beyond ``_Batch``: each request's active segment
    (``[n]`` int64 columns)."""

    segment_index: np.ndarray
    frame_index: np.ndarray
    num_branches: np.ndarray
    """1, or 2 with CFG: the rows each request takes (one per branch)."""

    @property
    def num_rows(self) -> int:
        return sum(self.num_branches.tolist())  # numpy's sum costs more up to ~100 requests


@dataclass(slots=True)
class DecodeBatch(_FrameBatch):
    """Run one backbone step over each request's active segment, feeding its frame
    ``frame_index`` (the one DEPTH just produced), and keep the new hidden state. Iterating
    gives ``DecodeRow`` values."""

    positions: np.ndarray
    """``[n, 2]`` backbone position of the fed frame per branch: the branch's prompt length +
    ``frame_index`` (without CFG column 1 repeats column 0)."""
    block_ids: tuple[tuple[tuple[int, ...], ...], ...]
    """Per request, each branch's FULL block table (see ``PrefillItem.block_ids``: the same
    tuple objects every step of a segment)."""

    def __iter__(self) -> Iterator[DecodeRow]:
        positions = self.positions.tolist()
        for i, (request_id, slot, index, frame, branches, tables) in enumerate(zip(
                self.request_ids, self.slots.tolist(), self.segment_index.tolist(),
                self.frame_index.tolist(), self.num_branches.tolist(), self.block_ids,
                strict=True)):
            yield DecodeRow(request_id, slot, index, frame,
                            tuple(zip(positions[i][:branches], tables, strict=True)))


@dataclass(slots=True)
class DepthBatch(_FrameBatch):
    """Sample each request's frame ``frame_index`` of its active segment from the segment's
    last hidden state: c0 (lm_head, CFG, repetition penalty, EOS) and, unless c0 is EOS, the 15
    depth codes; all sampling happens here. ``frame_index`` 0 samples from the PREFILL hidden
    state (and starts the segment's repetition-penalty history). Iterating gives ``DepthRow``
    values."""

    output_frame_index: np.ndarray
    """Where the frame goes in the request's audio stream (counted over all segments), if it is
    not EOS. CODEC items refer to these indices."""

    def __iter__(self) -> Iterator[DepthRow]:
        for row in zip(self.request_ids, self.slots.tolist(), self.segment_index.tolist(),
                       self.frame_index.tolist(), self.num_branches.tolist(),
                       self.output_frame_index.tolist(), strict=True):
            yield DepthRow(*row)


def _pick(values: tuple, keep: np.ndarray) -> tuple:
    return tuple([value for value, kept in zip(values, keep.tolist(), strict=True) if kept])


@dataclass(slots=True)
class CodecBatch(_Batch):
    """Decode frames ``start_frame .. start_frame+num_frames-1`` of each request into one chunk
    (``[n]`` columns). Iterating gives ``CodecRow`` values."""

    start_frame: np.ndarray
    num_frames: np.ndarray
    """Exactly the frames of each chunk (1..max_codec_frames)."""
    is_first_chunk: np.ndarray
    """``[n]`` bool: reset the slot's streaming codec state before decoding."""
    is_final: np.ndarray
    """``[n]`` bool: the request's last chunk: the codec state of the slot can be dropped
    afterwards."""

    @classmethod
    def of(cls, rows: Sequence[CodecRow]) -> CodecBatch:
        """The batch of ``rows`` (tests and simulations)."""
        columns = list(zip(*rows)) or [()] * 6
        return cls(tuple(columns[0]), *[np.array(c, np.int64) for c in columns[1:4]],
                   *[np.array(c, bool) for c in columns[4:]])

    def __iter__(self) -> Iterator[CodecRow]:
        for row in zip(self.request_ids, self.slots.tolist(), self.start_frame.tolist(),
                       self.num_frames.tolist(), self.is_first_chunk.tolist(),
                       self.is_final.tolist(), strict=True):
            yield CodecRow(*row)


BATCHES = (DecodeBatch, DepthBatch, CodecBatch)
"""The stages' items that are one batch of arrays (``isinstance(plan.items, BATCHES)``)."""
StageItem = TextEncodeItem | PrefillItem
StageItems = tuple[StageItem, ...] | DecodeBatch | DepthBatch | CodecBatch
"""A step's work: one item per unit of TEXT_ENCODE and PREFILL (few a step), a batch of arrays
for DECODE, DEPTH and CODEC (up to every running request, each step)."""


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One step: one stage over a batch of items, plus request set-up and release."""

    step_id: int
    stage: Stage
    items: StageItems
    new_requests: tuple[NewRequestData, ...] = ()
    finished_request_ids: tuple[str, ...] = ()
    """Requests that finished, aborted or failed since the last plan: release their slots."""

    @property
    def request_ids(self) -> tuple[str, ...]:
        """Ids of the requests with an item in this step, in item order (may repeat)."""
        return self.request_ids_of(self.items)

    @staticmethod
    def request_ids_of(items: StageItems) -> tuple[str, ...]:
        """``request_ids`` of a plan's ``items`` (or of a part of them)."""
        if isinstance(items, BATCHES):
            return items.request_ids
        return tuple([item.request_id for item in items])

    @property
    def num_rows(self) -> int:
        """Batch rows of this step: DECODE and DEPTH count each CFG branch, others each item."""
        items = self.items
        return items.num_rows if isinstance(items, BATCHES) else len(items)


@dataclass(frozen=True, slots=True)
class StepResult:
    """What the worker reports back for the plan with the same ``step_id``."""

    step_id: int
    first_codes: dict[str, int] = field(default_factory=dict)
    """DEPTH only: the sampled first code c0 per request (``FRAME_EOS_ID`` ends the segment)."""
    failed: dict[str, str] = field(default_factory=dict)
    """Requests whose part of the step raised: request_id -> short reason. Only those fail."""
