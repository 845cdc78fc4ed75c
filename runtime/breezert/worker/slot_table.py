"""Per-slot state of the running requests, on the engine's device: the one slot-state path.

Owns: fixed-capacity tensors on the engine's device, one row per slot plus a scratch row (slot
``max_slots``) that bucket padding reads and writes: the sampling parameters, seed, frame counter,
CFG, repetition penalty and EOS switch of each request (written at admission), the repetition mask
and the backbone state of the active segment (reset at each segment start), the last frame and a
ring of frames waiting for the codec (written by DEPTH inside its graph), each branch's KV block
table (written when DECODE first sees it: a segment's table never changes), and the sync-free index
ops the graphed stage functions use to gather and scatter them. On the host it keeps only what
admission and the stages' launch choices need: each slot's ``SlotParams`` (and its holder, CFG and
top-k as arrays, for a batch), and each segment's prompt rows and PREFILL states from TEXT_ENCODE
to its first DEPTH step (a look-ahead segment gets them while the active one still runs). A freed
slot's rows are reset to the scratch defaults. Must not: decide anything (the scheduler does), run
models (the stages do) or copy device -> host.

The ring holds frame ``f`` of a request at ``f % ring_frames``: its head is the frame counter
(device, advanced by DEPTH on every non-EOS frame), its tail the next frame a CODEC item
decodes (host, from the plan). The host knows both from the plans, so a request about to
overwrite frames the codec has not read yet is refused before it does (``ring_would_overflow``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from breezert.constants import FRAME_EOS_ID, NUM_CODEBOOKS
from breezert.options import SamplingParams
from breezert.stages.interface import PendingSegment, SlotParams

_DEFAULT = SlotParams("", 1, 1.0, SamplingParams(), 0, False)
"""The scratch row's (and every freed row's) values: finite, ordinary sampling."""


def sampling_row(p: SamplingParams) -> list[float]:
    """``[6]``: T, top-k, top-p, depth T, depth top-k, depth top-p (the ``sampling`` column
    order of ``stages.depth.depth_frames``)."""
    return [p.temperature, p.top_k, p.top_p, p.depth_temperature, p.depth_top_k, p.depth_top_p]


def _upload(values: list, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


class SlotTable:
    """``max_slots + 1`` rows of per-request device state; the last row is scratch."""

    def __init__(self, max_slots: int, *, vocab_size: int, hidden_size: int,
                 hidden_dtype: torch.dtype, ring_frames: int, device: torch.device,
                 max_blocks: int = 1, scratch_block: int = 0) -> None:
        """``max_blocks``: KV blocks of the longest context a DECODE row reads;
        ``scratch_block``: the KV cache's scratch block (padding and unused entries)."""
        rows, dev = max_slots + 1, device
        self.scratch_slot = max_slots
        self.ring_frames = ring_frames
        self.device = device
        self.sampling = torch.zeros(rows, 6, dtype=torch.float32, device=dev)
        self.seeds = torch.zeros(rows, dtype=torch.long, device=dev)
        self.frame_count = torch.zeros(rows, dtype=torch.long, device=dev)
        """Frames generated so far per request (EOS is not a frame): the next frame's index."""
        self.cfg_scale = torch.zeros(rows, dtype=torch.float32, device=dev)
        self.has_cfg = torch.zeros(rows, dtype=torch.bool, device=dev)
        self.penalty = torch.zeros(rows, dtype=torch.float32, device=dev)
        self.no_eos = torch.zeros(rows, dtype=torch.bool, device=dev)
        self.seen = torch.zeros(rows, vocab_size, dtype=torch.bool, device=dev)
        """First codes generated so far in the active segment (repetition penalty)."""
        self.hidden = torch.zeros(rows, 2, hidden_size, dtype=hidden_dtype, device=dev)
        """``[slot, branch]`` final-normed backbone state feeding the next DEPTH step."""
        self.last_frame = torch.zeros(rows, NUM_CODEBOOKS, dtype=torch.long, device=dev)
        """The frame the next DECODE step feeds."""
        self.ring = torch.zeros(rows, ring_frames, NUM_CODEBOOKS, dtype=torch.long, device=dev)
        """Frames waiting for the codec: frame ``f`` of a request at ``[slot, f % ring_frames]``."""
        self.next_codec_frame = np.zeros(rows, dtype=np.int64)
        """Host: the first frame of each slot the codec has not decoded yet (the ring's tail)."""
        self.scratch_block = scratch_block
        self.block_tables = torch.full((2 * rows, max_blocks), scratch_block, dtype=torch.long,
                                       device=dev)
        """``[slot * 2 + branch]`` the branch's KV blocks, the scratch block past them."""
        self._tables: dict[int, tuple[int, ...]] = {}  # row -> the block ids written there
        self._params: list[SlotParams | None] = [None] * max_slots
        """Host: the request holding each slot (None: free)."""
        self.holders = np.full(max_slots, None, object)
        """Host: the id of the request holding each slot (None: free), for a batch's check."""
        self.host_has_cfg = np.zeros(max_slots, bool)
        """Host: each slot's request runs two CFG branches (a DEPTH batch's layout)."""
        self.host_top_k = np.zeros((max_slots, 2), np.int64)
        """Host: each slot's request's top-k of the first code and of the depth codes (which
        DEPTH graphs a batch can take)."""
        self._segments: dict[tuple[int, int], PendingSegment] = {}  # (slot, segment index)
        self._write(list(range(rows)), [_DEFAULT] * rows, reset=True)

    # ------------------------------------------------------------ host side (rare writes)
    def admit(self, slots: Sequence[int], params: Sequence[SlotParams]) -> dict[str, str]:
        """Writes the rows of newly admitted requests (one upload per tensor for all); a request
        whose slot is still held is refused and returned, ``{request_id: why}``."""
        refused, admitted = {}, []
        for slot, p in zip(slots, params):
            held = self._params[slot]
            if held is not None:
                refused[p.request_id] = f"slot {slot} is still held by {held.request_id}"
                continue
            self._params[slot] = p
            self.holders[slot], self.host_has_cfg[slot] = p.request_id, p.has_cfg
            self.host_top_k[slot] = p.sampling.top_k, p.sampling.depth_top_k
            admitted.append((slot, p))
        if admitted:  # a free row is at the defaults (init, release): only the settings
            self._write([slot for slot, _ in admitted], [p for _, p in admitted], reset=False)
        return refused

    def release_request(self, request_id: str) -> list[int]:
        """Frees the slots ``request_id`` holds (none if it holds none), their rows back to the
        scratch defaults so nothing of the request outlives it; returns them."""
        slots = [slot for slot, p in enumerate(self._params)
                 if p is not None and p.request_id == request_id]
        for slot in slots:
            self._params[slot] = None
            self.holders[slot] = None
        for key in [key for key in self._segments if key[0] in slots]:
            del self._segments[key]
        if slots:
            self._write(slots, [_DEFAULT] * len(slots), reset=True)
        return slots

    def params(self, slot: int, request_id: str) -> SlotParams:
        """The settings of the request holding ``slot``.

        Raises:
            RuntimeError: the slot is free or held by another request than ``request_id``.
        """
        held = self._params[slot]
        if held is None or held.request_id != request_id:
            raise RuntimeError(f"slot {slot} holds {held and held.request_id!r}, the plan says "
                               f"{request_id!r}")
        return held

    def check_holders(self, slots: np.ndarray, request_ids: Sequence[str]) -> None:
        """``params``' check for a batch: each of ``slots`` is held by its ``request_ids``.

        Raises:
            RuntimeError: naming the first slot that is free or another request's.
        """
        wrong = np.flatnonzero(self.holders[slots] != np.array(request_ids, object))
        if len(wrong):
            i = int(wrong[0])
            self.params(int(slots[i]), request_ids[i])

    @property
    def num_active(self) -> int:
        """Slots held by a request."""
        return sum(p is not None for p in self._params)

    def _write(self, slots: list[int], params: list[SlotParams], *, reset: bool) -> None:
        """The rows' settings, in three uploads (the slots with the seeds, the float settings,
        the switches); with ``reset``, their per-segment state back to the defaults too."""
        n, dev = len(slots), self.device
        ids = _upload([*slots, *(p.seed for p in params)], dev, torch.long)
        index, seeds = ids[:n], ids[n:]
        floats = _upload([[*sampling_row(p.sampling), p.cfg_scale, p.sampling.repetition_penalty]
                          for p in params], dev, torch.float32)
        switches = _upload([[p.has_cfg, p.ignore_eos] for p in params], dev, torch.bool)
        k = self.sampling.shape[1]  # sampling_row's width
        self.sampling.index_copy_(0, index, floats[:, :k])
        self.cfg_scale.index_copy_(0, index, floats[:, k])
        self.penalty.index_copy_(0, index, floats[:, k + 1])
        self.seeds.index_copy_(0, index, seeds)
        self.has_cfg.index_copy_(0, index, switches[:, 0])
        self.no_eos.index_copy_(0, index, switches[:, 1])
        if not reset:
            return
        for table in (self.frame_count, self.seen, self.hidden, self.last_frame, self.ring):
            table.index_fill_(0, index, 0)
        self.next_codec_frame[slots] = 0
        self.block_tables.index_fill_(0, torch.cat([2 * index, 2 * index + 1]),
                                      self.scratch_block)
        for row in (r for slot in slots for r in (2 * slot, 2 * slot + 1)):
            self._tables.pop(row, None)

    def add_segment(self, slot: int, request_id: str, segment_index: int,
                    embeds: list[torch.Tensor]) -> None:
        """TEXT_ENCODE: a segment's prompt rows, one ``[L, D]`` tensor per branch."""
        self.params(slot, request_id)
        self._segments[slot, segment_index] = PendingSegment(embeds, [None] * len(embeds))

    def segment(self, slot: int, request_id: str, segment_index: int) -> PendingSegment:
        """A segment between TEXT_ENCODE and its first DEPTH step.

        Raises:
            RuntimeError: the slot is not the request's, or the segment was not encoded.
        """
        self.params(slot, request_id)
        pending = self._segments.get((slot, segment_index))
        if pending is None:
            raise RuntimeError(f"segment {segment_index} of {request_id!r} has no prompt rows "
                               "(PREFILL or DEPTH before TEXT_ENCODE)")
        return pending

    def take_prefill_states(self, slot: int, request_id: str, segment_index: int) \
            -> list[torch.Tensor]:
        """A segment's first DEPTH step: its PREFILL state per branch (``[D]`` each), handed
        over to ``start_segments`` and no longer kept here.

        Raises:
            RuntimeError: as ``segment``, or a branch has not finished its PREFILL.
        """
        pending = self.segment(slot, request_id, segment_index)
        if any(h is None for h in pending.hidden):
            raise RuntimeError(f"DEPTH before the end of segment {segment_index}'s PREFILL")
        del self._segments[slot, segment_index]
        return [h for h in pending.hidden if h is not None]

    def start_segments(self, slots: Sequence[int], hidden: Sequence[Sequence[torch.Tensor]]) \
            -> None:
        """A segment's first DEPTH step: clears its slot's repetition mask and takes the
        PREFILL state of each branch (``hidden[i]``: one or two ``[D]`` rows)."""
        rows = [h[b] for h in hidden for b in (0, len(h) - 1)]  # 1 branch: its row twice
        index = _upload(list(slots), self.device, torch.long)
        self.seen.index_fill_(0, index, False)
        self.hidden.index_copy_(0, index, torch.stack(rows).view(len(slots), 2, -1))

    def set_block_table(self, row: int, block_ids: tuple[int, ...]) -> None:
        """Row ``slot * 2 + branch`` reads ``block_ids``; uploads only when the table changed
        (the plan hands the same tuple every step of a segment)."""
        if self._tables.get(row) is block_ids:
            return
        if len(block_ids) > self.block_tables.shape[1]:
            raise ValueError(f"a block table of {len(block_ids)} blocks exceeds the "
                             f"{self.block_tables.shape[1]} of the slot table")
        table = torch.full((self.block_tables.shape[1],), self.scratch_block, dtype=torch.long)
        table[: len(block_ids)] = torch.tensor(block_ids, dtype=torch.long)
        self.block_tables[row] = table.to(self.device, non_blocking=True)
        self._tables[row] = block_ids

    def ring_would_overflow(self, slots: np.ndarray, frame_index: np.ndarray) -> np.ndarray:
        """Whether writing frame ``frame_index[i]`` of ``slots[i]`` would overwrite a frame the
        codec has not read yet (``[n]`` bool)."""
        return frame_index - self.next_codec_frame[slots] >= self.ring_frames

    def mark_decoded(self, slot: int, end_frame: int) -> None:
        """The codec has read the slot's frames up to ``end_frame`` (exclusive)."""
        self.next_codec_frame[slot] = end_frame

    # ------------------------------------------------ device side (inside graphed functions)
    def depth_inputs(self, row_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """``row_ids [C, B]`` (C = 1, or 2 with CFG: ``slot * 2 + branch``) -> the keyword
        inputs of ``depth_frames`` for those B rows (``hidden`` is ``[C * B, D]``)."""
        slots = row_ids[0] // 2  # [B]
        return {
            "hidden": self.hidden.view(-1, self.hidden.shape[-1])[row_ids.flatten()],
            "has_cfg": self.has_cfg[slots],
            "cfg_scale": self.cfg_scale[slots],
            "seen": self.seen[slots],
            "penalty": self.penalty[slots],
            "no_eos": self.no_eos[slots],
            "sampling": self.sampling[slots],
            "seeds": self.seeds[slots],
            "frames_at": self.frame_count[slots],
        }

    def commit_frames(self, slots: torch.Tensor, codes: torch.Tensor,
                      frames_at: torch.Tensor) -> None:
        """Stores each row's sampled frame (``codes [B, 16]``): unless it is EOS, it becomes the
        slot's last frame, enters the ring at ``frames_at``, marks its first code seen and
        advances the frame counter. Distinct real slots; padding rows all write the scratch."""
        keep = codes[:, 0] != FRAME_EOS_ID  # [B]
        self.last_frame[slots] = torch.where(keep[:, None], codes, self.last_frame[slots])
        at = frames_at % self.ring_frames
        self.ring[slots, at] = torch.where(keep[:, None], codes, self.ring[slots, at])
        first = codes[:, 0].clamp(max=self.seen.shape[1] - 1)
        self.seen[slots, first] = self.seen[slots, first] | keep
        self.frame_count[slots] = frames_at + keep.long()

    def decode_codes(self, row_ids: torch.Tensor) -> torch.Tensor:
        """``row_ids [R]`` (``slot * 2 + branch``) -> the frames DECODE feeds, ``[R, 16]``."""
        return self.last_frame[row_ids // 2]

    def store_hidden(self, row_ids: torch.Tensor, hidden: torch.Tensor) -> None:
        """DECODE's new backbone state ``hidden [R, D]`` into its ``slot * 2 + branch`` rows."""
        self.hidden.view(-1, self.hidden.shape[-1]).index_copy_(0, row_ids, hidden)

    def codec_codes(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``rows [B, 1 + F]`` (the slot, then the index of each frame to decode in its
        request's audio, -1 for padding) -> ``(codes [B, F, 16], real frames per row [B])``;
        padding frames are zeros."""
        slots, frames = rows[:, 0], rows[:, 1:]
        valid = frames >= 0  # [B, F]
        codes = self.ring[slots[:, None], frames.clamp(min=0) % self.ring_frames]  # [B, F, 16]
        return codes.masked_fill(~valid[..., None], 0), valid.sum(dim=1)
