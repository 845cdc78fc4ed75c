"""CODEC: decode the frames of each chunk with the exact streaming codec, many streams at once.

Owns: grouping a step's CODEC chunks (one ``CodecBatch`` of arrays) into replays, padding each
replay to a (streams, frames) bucket (padding rows decode into a scratch slot), the graphed step
function (``StreamingCodec.decode``: conv histories gathered and written back, K/V rings read and
written in place), resetting a slot's state at a request's first chunk, and turning
waveforms into ``DecodedChunk``s. Chunks of different sizes share a replay (each row decodes its
own count, ``StreamingCodec.decode(num_frames=)``): a step's chunks are split into the groups of
sizes that minimise padded frames plus a fixed cost per replay. The graphs read each chunk's frames
from the slot table's ring (``codec_from_ring``): the host uploads only slot and frame indices.
Must not: decide chunk sizes (the scheduler and the Predictor do).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from breezert.models.codec import StreamingCodec
from breezert.outputs import DecodedChunk, StageOutput
from breezert.sched.plan import CodecBatch
from breezert.stages.interface import Graphs, Slots, StageWorker, bucket_for


def codec_step(
    codec: StreamingCodec, slot_ids: torch.Tensor, codes: torch.Tensor,
    num_frames: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Decodes ``codes [B, F, 16]`` for ``slot_ids [B]`` (their state updated in the arena);
    ``num_frames [B]``: the real frames of each row (the rest is padding)."""
    return {"wav": codec.decode(slot_ids, codes, num_frames)}


def codec_from_ring(
    table: Slots, step_fn: Callable[..., dict[str, torch.Tensor]],
    rows: torch.Tensor,  # [B, 1 + F] int64: the slot, then each frame's index (-1: padding)
) -> dict[str, torch.Tensor]:
    """``step_fn`` (``codec_step`` bound to a codec) over frames gathered from the table's ring;
    each row decodes only its real frames."""
    codes, counts = table.codec_codes(rows)
    return step_fn(slot_ids=rows[:, 0], codes=codes, num_frames=counts)


INF = float("inf")


class CodecStage:
    def __init__(self, codec: StreamingCodec, worker: StageWorker, graphs: Graphs,
                 buckets: Sequence[int], replay_cost_frames: float = 24.0) -> None:
        """``graphs`` runs ``codec_from_ring`` bound to the slot table."""
        self.codec, self.graphs, self.buckets = codec, graphs, tuple(buckets)
        self.slots = worker.slots
        self.device = codec.positions.device
        self.scratch_slot = codec.max_slots - 1  # the arena has one slot more than the batch
        self.replay_cost_frames = replay_cost_frames
        self.num_replays = 0  # graph replays or eager calls, all steps

    def run(self, batch: CodecBatch) -> StageOutput:
        out = StageOutput()
        for group in self.plan_groups(batch.num_frames):
            out.chunks.extend(self._decode(batch, group))
        return out

    def replay_cost(self, num_items: int, max_frames: int) -> float:
        """Predicted cost of decoding ``num_items`` rows of up to ``max_frames`` frames, in
        frame-equivalents: the bucketed rows times the padded frames of each piece, plus
        ``replay_cost_frames`` per replay (the launch-bound floor of a small step)."""
        return self._price(self._rows_for(num_items), self._pieces(max_frames),
                           set(self.graphs.keys))

    def _price(self, rows: int, pieces: list[int], captured: set) -> float:
        """``replay_cost`` of ``rows`` bucketed rows in ``pieces``; infinite where a piece's
        key was never captured (after warm-up, ``graph_keys``): such a replay would run
        eagerly."""
        if captured and any((rows, piece) not in captured for piece in pieces):
            return float("inf")
        return sum(self.replay_cost_frames + rows * piece for piece in pieces)

    def plan_groups(self, num_frames: np.ndarray) -> list[np.ndarray]:
        """Chunks (``num_frames [n]``: each one's frames) split into replays, as index arrays
        into them: contiguous runs of the chunks stably sorted by size, chosen by dynamic
        programming over ``replay_cost`` (exact for that cost: the same split as trying every
        run ``ordered[i:j]``, the first cheapest ``i`` on ties).

        NOTE(host): a run's cost depends only on its bucketed row count and its largest chunk,
        so for each end ``j`` the starts ``i`` fall into one window per bucket (the counts that
        pad to it), priced once, whose cheapest ``best[i]`` is one ``min`` over a slice: O(n x
        buckets) interpreter steps, not O(n^2) (256 chunks: ~33k). The pairwise definition is
        kept in tests/integration/test_engine_codec_modes.py."""
        order = np.argsort(num_frames, kind="stable")
        sizes = num_frames[order].tolist()
        n = len(sizes)
        windows = []  # [bucket rows, fewest count, most count] padding to it, counts 1..n
        for count in range(1, n + 1):
            rows = self._rows_for(count)
            if windows and windows[-1][0] == rows:
                windows[-1][2] = count
            else:
                windows.append([rows, count, count])
        windows.reverse()  # largest runs first: their starts i are the smallest
        captured = set(self.graphs.keys)  # after warm-up a replay takes a captured key only
        priced: dict[int, list[tuple[int, int, float]]] = {}  # largest chunk -> its windows
        best = [0.0] + [INF] * n  # best[j]: cheapest split of ordered[:j]
        cut = [0] * (n + 1)
        for j in range(1, n + 1):
            frames = sizes[j - 1]
            if frames not in priced:  # == replay_cost(count, frames); uncaptured runs dropped
                pieces = self._pieces(frames)
                priced[frames] = [(fewest, most, price) for rows, fewest, most in windows
                                  if (price := self._price(rows, pieces, captured)) < INF]
            for fewest, most, price in priced[frames]:
                if fewest > j:
                    continue
                lo = j - min(most, j)  # runs ordered[i:j] of these counts start at lo..j-fewest
                window = best[lo : j - fewest + 1]
                low = min(window)
                if low + price < best[j]:
                    best[j], cut[j] = low + price, lo + window.index(low)
        groups, j = [], n
        while j > 0:
            groups.append(order[cut[j]:j])
            j = cut[j]
        return groups[::-1]

    def _decode(self, batch: CodecBatch, group: np.ndarray) -> list[DecodedChunk]:
        """The chunks ``group`` (indices into ``batch``) decoded in one replay per piece."""
        slots, starts = batch.slots[group], batch.start_frame[group]
        counts = batch.num_frames[group]
        num = len(group)
        pieces = self._pieces(int(counts.max()))
        fresh = slots[batch.is_first_chunk[group]]
        if len(fresh):
            self.codec.reset(torch.from_numpy(fresh).to(self.device))
        size, replays = self._replays(slots, starts, counts, pieces)
        waves = []
        for piece, inputs in zip(pieces, replays):
            wav = self.graphs((size, piece), inputs)["wav"][:num]
            waves.append(wav.to(torch.float32, copy=True))  # the replay's buffer is reused
            self.num_replays += 1
        pcm = torch.cat(waves, dim=1).cpu().numpy()  # [num, sum(pieces) * 1920]
        spf = pcm.shape[1] // sum(pieces)
        ids = batch.request_ids
        return [
            DecodedChunk(ids[i], start, count, pcm[k, : count * spf], final)
            for k, (i, start, count, final) in enumerate(zip(
                group.tolist(), starts.tolist(), counts.tolist(),
                batch.is_final[group].tolist(), strict=True))
        ]

    def graph_keys(self, max_frames: int, max_step_frames: int) -> list[tuple[int, int]]:
        """The (bucket rows, frames) replays a step can need, largest first: a bucket whose
        fewest rows (one more than the bucket below it) times the frames fit in
        ``max_step_frames``, and every frame count for the smallest bucket. Larger keys never
        pay (``plan_groups`` splits instead) and their padded activations do not fit beside
        a large KV pool."""
        buckets = sorted(self.buckets)
        keys = []
        for i, b in enumerate(buckets):
            fewest = buckets[i - 1] + 1 if i else 1
            keys += [(b, f) for f in self.frame_buckets(max_frames)
                     if i == 0 or fewest * f <= max_step_frames]
        return sorted(keys, reverse=True)

    def frame_buckets(self, max_frames: int) -> list[int]:
        """Captured frame counts (powers of two); other chunk sizes are split into these."""
        sizes, f = [], 1
        while f <= max(1, min(max_frames, 16)):
            sizes.append(f)
            f *= 2
        return sorted(sizes, reverse=True)

    def _pieces(self, num_frames: int) -> list[int]:
        """``num_frames`` as 16-frame pieces and one last piece of the next captured count up
        (exact: the streaming codec gives the same audio for any split; rows are padded)."""
        if not self.graphs.enabled:
            return [num_frames]
        pieces, left = [], num_frames
        while left > 16:
            pieces.append(16)
            left -= 16
        return pieces + [bucket_for(left, self.frame_buckets(16)) or 16]

    def _replays(self, slots: np.ndarray, starts: np.ndarray, counts: np.ndarray,
                 pieces: list[int]) -> tuple[int, list[dict[str, torch.Tensor]]]:
        """``(bucket rows, inputs of each piece's replay)`` for the chunks of ``counts`` frames
        from ``starts`` of ``slots`` (``[num]`` each) decoded in ``pieces`` frames at a time:
        ``rows [bucket, 1 + piece]`` per replay (slot, frame indices; padding rows decode the
        scratch slot's zeros). Marks the frames read."""
        num = len(slots)
        size = self._rows_for(num)
        offsets = np.arange(sum(pieces), dtype=np.int64)
        rows = np.full((size, 1 + len(offsets)), -1, dtype=np.int64)
        rows[:, 0] = self.scratch_slot
        rows[:num, 0] = slots
        rows[:num, 1:] = np.where(offsets < counts[:, None], starts[:, None] + offsets, -1)
        for slot, end in zip(slots.tolist(), (starts + counts).tolist()):
            self.slots.mark_decoded(slot, end)
        replays, start = [], 1
        for piece in pieces:
            piece_rows = np.concatenate([rows[:, :1], rows[:, start : start + piece]], axis=1)
            replays.append({"rows": torch.from_numpy(piece_rows).to(self.device,
                                                                     non_blocking=True)})
            start += piece
        return size, replays

    def _rows_for(self, num: int) -> int:
        return (bucket_for(num, self.buckets) if self.graphs.enabled else None) or num

    def example_inputs(self, size: int, frames: int) -> dict[str, torch.Tensor]:
        """Inputs of a bucket: every row decodes padding into the scratch slot."""
        rows = torch.full((size, 1 + frames), -1, dtype=torch.long, device=self.device)
        rows[:, 0] = self.scratch_slot
        return {"rows": rows}
