"""The codec's in-place ring attention (kernels/codec_attention.py) against the torch ring math of
``models/codec.py``, on CPU through Triton's interpreter; and a StreamingCodec that runs it equal
to the offline decode (tests/gpu runs the same compiled, inside the codec's graphs)."""

from __future__ import annotations

import pytest
import torch

from tests.kernel_helpers import needs_triton, run_in_interpreter

pytestmark = pytest.mark.unit


def check_kernel(heads: int, kv_heads: int, head_dim: int, dtype: str, window: int) -> None:
    from breezert.kernels.codec_attention import ring_attention
    from breezert.models.codec import _rope, _RowsRing

    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    slots, ring = 6, window - 1  # steps below wrap the ring and pass it
    # rows at 0 (fresh), inside the first ring, at its wrap, far past it; padding frames in two
    cases = [(0, 4, 4), (ring // 2, 4, 2), (ring - 2, 4, 4), (3 * ring + 5, 4, 3),
             (5 * ring, 4, 1)]  # (pos, T, real frames)
    arena = torch.randn(slots, 2, kv_heads, ring, head_dim).to(dt)
    for t in (1, 4, 12):  # window 9: 12 > ring, a step's own frames overwrite each other
        got_arena, want_arena = arena.clone(), arena.clone()
        slot_ids = torch.tensor([4, 0, 2, 5, 1])
        pos = torch.tensor([c[0] for c in cases])
        frames = torch.tensor([min(c[2], t) for c in cases])
        q = torch.randn(5, t, heads, head_dim).to(dt).transpose(1, 2)  # strided, as q_proj's
        k = torch.randn(5, t, kv_heads, head_dim).to(dt).transpose(1, 2)
        v = torch.randn(5, kv_heads, t, head_dim).to(dt)
        for num_frames in (frames, None):
            cos, sin = _rope(pos[:, None] + torch.arange(t), head_dim, 10000.0, dt)
            got = ring_attention(q, k, v, cos, sin, got_arena, slot_ids, pos, num_frames, window)
            rows = _RowsRing(want_arena[slot_ids][:, None].float(), pos, num_frames, window)
            want = rows.attend(0, q.float(), k.float(), v.float(), cos.float(), sin.float())
            want_arena[slot_ids] = rows.new()[:, 0].to(dt)
            tol = {torch.float32: 2e-5, torch.bfloat16: 2e-2}[dt]
            torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
            # the ring: the real frames' values written bit for bit and their keys as rotated
            # (in fp32, rounded once: within a unit of the last place), every other entry kept
            assert torch.equal(got_arena[:, 1], want_arena[:, 1])
            key_tol = {torch.float32: 1e-6, torch.bfloat16: 8e-3}[dt]
            torch.testing.assert_close(got_arena[:, 0], want_arena[:, 0], atol=key_tol,
                                       rtol=key_tol)
            kept = (want_arena == arena).all(-1)  # entries no step has written yet
            assert torch.equal(got_arena[kept], arena[kept])
            pos = pos + (t if num_frames is None else num_frames)


def stream_two_rows(run, schedule, full: torch.Tensor) -> list[int]:  # noqa: ANN001
    """Rows 0 and 1 decoded ``schedule``'s frames a step (``run(sizes, cursor) -> wav``), each
    equal to its offline decode ``full``; returns the frames each decoded."""
    cursor, parts = [0, 0], [[], []]
    for sizes in schedule:
        wav = run(sizes, cursor)
        for i, n in enumerate(sizes):
            parts[i].append(wav[i, : n * 1920])
            cursor[i] += n
    for i in range(2):
        torch.testing.assert_close(torch.cat(parts[i]), full[i, : cursor[i] * 1920],
                                   atol=1e-5, rtol=0)
    return cursor


def check_streaming(kv_heads: int) -> None:
    import dataclasses

    from breezert.models.codec import CodecDecoder, StreamingCodec, init_codec_random_
    from breezert.models.config import BreezeConfig

    cfg = dataclasses.replace(BreezeConfig.tiny().codec, num_kv_heads=kv_heads, sliding_window=9)
    dec = init_codec_random_(CodecDecoder(cfg), torch.Generator().manual_seed(2)).eval()
    codes = torch.randint(0, 2048, (2, 30, 16), generator=torch.Generator().manual_seed(1))
    full = dec.decode(codes)
    from breezert.kernels import codec_attention

    from breezert.kernels import snake

    calls, kernel = [], codec_attention.ring_attention
    codec_attention.ring_attention = lambda *a: calls.append(1) or kernel(*a)
    cl_cats, cl_kernel = [], snake.snake_cat_cl_triton
    snake.snake_cat_cl_triton = lambda *a, **k: cl_cats.append(a[0].shape) or cl_kernel(*a, **k)
    residuals, residual_kernel = [], snake.bias_residual_triton
    snake.bias_residual_triton = lambda *a: residuals.append(1) or residual_kernel(*a)
    # the kernels (the interpreter's): the conv inputs built channels-last by the snake
    # kernels, the convs as 2-D channels-last convolutions
    sc = StreamingCodec(dec, max_slots=3, fast=True)
    slots = torch.tensor([2, 0])

    def run(sizes: list[int], cursor: list[int]) -> torch.Tensor:
        batch = torch.zeros(2, max(sizes), 16, dtype=torch.long)
        for i, (c, n) in enumerate(zip(cursor, sizes, strict=True)):
            batch[i, :n] = codes[i, c:c + n]
        return sc.decode(slots, batch, torch.tensor(sizes))

    cursor = stream_two_rows(run, ([1, 3], [4, 4], [2, 1], [16, 16], [1, 5], [6, 1]), full)
    assert sc.positions[slots].tolist() == cursor
    assert len(calls) == 6 * cfg.num_layers  # every step's every layer ran the kernel
    # every conv input built by the channels-last kernel (33 a step), and each residual
    # unit's skip added with its last conv's bias in one pass (12 a step)
    assert len(cl_cats) == 6 * 33
    assert len(residuals) == 6 * 12


def check_stage_rows() -> None:
    """The codec stage's replays through both kernels: ``codec_from_ring`` hands ``decode`` its
    slot ids as a column of ``rows [B, 1 + F]`` (stride 1 + F, not 1), padding rows all on the
    scratch slot with 0 frames, and a real row that has finished decodes 0 frames. Each real
    row equals its offline decode, its position advances by its own frames only."""
    import dataclasses
    from functools import partial

    from breezert.models.codec import CodecDecoder, StreamingCodec, init_codec_random_
    from breezert.models.config import BreezeConfig
    from breezert.stages.codec import codec_from_ring, codec_step

    cfg = dataclasses.replace(BreezeConfig.tiny().codec, sliding_window=9)
    dec = init_codec_random_(CodecDecoder(cfg), torch.Generator().manual_seed(2)).eval()
    codes = torch.randint(0, 2048, (2, 12, 16), generator=torch.Generator().manual_seed(1))
    full = dec.decode(codes)
    sc = StreamingCodec(dec, max_slots=4, fast=True)  # slot 3: the stage's scratch slot

    class Table:  # a slot table's ``codec_codes``: frame f of slot s's request
        ring = torch.zeros(4, 12, 16, dtype=torch.long)
        ring[2], ring[0] = codes[0], codes[1]

        def codec_codes(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            valid = rows[:, 1:] >= 0
            got = self.ring[rows[:, :1], rows[:, 1:].clamp(min=0)]
            return got.masked_fill(~valid[..., None], 0), valid.sum(dim=1)

    step = partial(codec_from_ring, Table(), partial(codec_step, sc))

    def run(sizes: list[int], cursor: list[int]) -> torch.Tensor:
        rows = torch.full((4, 1 + max(sizes)), -1)  # the stage's replay rows
        rows[:, 0] = 3
        for i, (slot, c, n) in enumerate(zip((2, 0), cursor, sizes, strict=True)):
            rows[i, 0] = slot
            rows[i, 1:1 + n] = torch.arange(c, c + n)
        return step(rows)["wav"]

    cursor = stream_two_rows(run, ([3, 3], [4, 1], [5, 0]), full)
    assert sc.positions.tolist() == [cursor[1], 0, cursor[0], 0]


@needs_triton
@pytest.mark.parametrize("heads,kv_heads,head_dim,dtype,window", [
    (2, 2, 8, "float32", 9), (4, 2, 64, "float32", 72), (2, 1, 64, "bfloat16", 72)])
def test_ring_attention_matches_the_torch_ring(heads: int, kv_heads: int, head_dim: int,
                                               dtype: str, window: int) -> None:
    # window 72: the served ring of 71 entries, three blocks of the online softmax
    run_in_interpreter(__name__,
                       f"check_kernel({heads}, {kv_heads}, {head_dim}, {dtype!r}, {window})")


@needs_triton
@pytest.mark.parametrize("kv_heads", [2, 1])
def test_a_streaming_codec_on_the_kernels_equals_the_offline_decode(kv_heads: int) -> None:
    # 2 K/V heads for 2 query heads, as the served codec has; 1: grouped, as the kernel tests'
    # (4, 2) and (2, 1) cases
    run_in_interpreter(__name__, f"check_streaming({kv_heads})")


@needs_triton
def test_the_codec_stages_rows_decode_in_their_slots() -> None:
    run_in_interpreter(__name__, "check_stage_rows()")
