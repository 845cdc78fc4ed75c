"""The fused SnakeBeta + history kernels (kernels/snake.py) against the eager arithmetic, on CPU
through Triton's interpreter (tests/gpu checks them compiled, inside the whole codec)."""

from __future__ import annotations

import pytest
import torch

from tests.kernel_helpers import needs_triton, run_in_interpreter

pytestmark = pytest.mark.unit


def check(history: int, dtype: str, rows: int = 2, channels: int = 3, width: int = 1050) -> None:
    from breezert.kernels.snake import snake_cat_cl_triton, snake_cat_reference

    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    # strided rows (x is a slice of wider rows); 1050 columns: each row spans program blocks
    # (1024 samples of one channel a program at 3 or 5 channels), 7 x 5 rows of 9: one each
    x = (torch.randn(rows, channels, width + 50) * 2).to(dt)[:, :, 50:]
    hist = torch.randn(rows, channels, history).to(dt) if history else None
    log_alpha, log_beta = torch.randn(channels) * 0.1, torch.randn(channels) * 0.1
    got = snake_cat_cl_triton(x, log_alpha, log_beta, hist)
    want = snake_cat_reference(x.float(), log_alpha, log_beta,
                               None if hist is None else hist.float()).to(dt)
    assert got.shape == (rows, channels, history + width) and got.dtype == dt
    assert got.stride() == (channels * (history + width), 1, channels)  # channels-last
    tol = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}[dt]  # 16-bit: ~2 ulps
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    if hist is not None:
        assert torch.equal(got[..., :history], hist)  # the history is copied, not recomputed


@needs_triton
@pytest.mark.parametrize("history,dtype,shape", [
    (0, "float32", (2, 3, 1050)), (54, "float32", (2, 3, 1050)), (6, "bfloat16", (2, 3, 1050)),
    (6, "float16", (2, 3, 1050)), (6, "float32", (7, 5, 9)), (0, "float32", (7, 5, 9))])
def test_snake_cat_matches_eager(history: int, dtype: str, shape: tuple[int, int, int]) -> None:
    run_in_interpreter(__name__, f"check({history}, {dtype!r}, *{shape})")


def check_arena(dtype: str) -> None:
    """The history read from an arena by slot, and the new history written back there, with
    and without per-row frame counts, against the torch arithmetic."""
    from breezert.kernels.snake import keep_tail_triton, snake_cat_cl_triton
    from breezert.models.codec import real_tail

    torch.manual_seed(1)
    dt = getattr(torch, dtype)
    slots, rows, channels, length, frames, per_frame = 6, 3, 5, 18, 4, 8
    base = torch.randn(slots, channels * length + 7).to(dt)

    def piece(flat: torch.Tensor) -> torch.Tensor:  # a strided view, as the flat state's pieces
        return flat[:, 3:3 + channels * length].view(slots, channels, length)

    arena = piece(base)
    ids = torch.tensor([4, 0, 2])
    x = torch.randn(rows, channels, frames * per_frame).to(dt)
    log_alpha, log_beta = torch.randn(channels) * 0.1, torch.randn(channels) * 0.1
    for act in (True, False):
        la, lb = (log_alpha, log_beta) if act else (None, None)
        full = snake_cat_cl_triton(x, la, lb, arena, ids)
        want = snake_cat_cl_triton(x, la, lb, arena[ids].contiguous())
        assert torch.equal(full, want)  # the same kernel: rows only move where it reads
        for num_frames in (torch.tensor([4, 1, 3]), None):
            got_arena, want_arena = piece(base.clone()), piece(base.clone())
            keep_tail_triton(full, got_arena, ids, num_frames, frames)
            want_arena.index_copy_(0, ids, real_tail(full, length, num_frames, frames))
            assert torch.equal(got_arena, want_arena)
            untouched = [s for s in range(slots) if s not in ids.tolist()]
            assert torch.equal(got_arena[untouched], arena[untouched])


@needs_triton
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_histories_read_and_written_in_the_arena(dtype: str) -> None:
    run_in_interpreter(__name__, f"check_arena({dtype!r})")


def check_layouts(dtype: str) -> None:
    """The cat from a channels-first or a channels-last ``x`` against the eager arithmetic,
    laid out ``[B, H + T, C]``, with histories by batch row, from an arena by slot, or none, and
    with a conv's bias added first; ``keep_tail_triton`` writes the new histories ``real_tail``
    gives from it. Channels 6 (2 a program), 32 and 96 (32)."""
    from breezert.kernels.snake import (
        channel_block,
        keep_tail_triton,
        snake_cat_cl_triton,
        snake_cat_reference,
    )
    from breezert.models.codec import real_tail

    assert [channel_block(c) for c in (1, 6, 96, 192, 384, 768, 1024, 1536)] == \
        [1, 2, 32, 64, 128, 128, 128, 128]
    torch.manual_seed(3)
    dt = getattr(torch, dtype)
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2}[dt]  # bf16: ~2 ulps
    slots, frames, per_frame = 5, 3, 8
    ids = torch.tensor([4, 0])
    for channels in (6, 32, 96):
        log_alpha, log_beta = torch.randn(channels) * 0.1, torch.randn(channels) * 0.1
        plain = (torch.randn(2, channels, frames * per_frame) * 2).to(dt)
        for x in (plain, plain.transpose(1, 2).contiguous().transpose(1, 2)):
            for h in (0, 6):
                arena = torch.randn(slots, channels, h).to(dt)
                for act in (True, False):
                    la, lb = (log_alpha, log_beta) if act else (None, None)
                    for rows in (None, ids) if h else (None,):
                        hist = None if h == 0 else arena if rows is not None else arena[:2]
                        got = snake_cat_cl_triton(x, la, lb, hist, rows)
                        want = snake_cat_reference(x.float(), la, lb,
                                                   None if hist is None else hist.float(),
                                                   rows).to(dt)
                        assert got.shape == want.shape and got.dtype == dt
                        assert got.stride() == (channels * (h + x.shape[-1]), 1, channels)
                        if act:
                            torch.testing.assert_close(got.float(), want.float(), atol=tol,
                                                       rtol=tol)
                        else:  # the plain cat: every value copied
                            assert torch.equal(got, want)
                        assert torch.equal(got[..., :h], want[..., :h])  # histories copied
                        if act and h == 0:  # a conv's output whose bias it left out: the
                            # bias added in fp32 first, then (bf16) one rounding, the interpreter's
                            bias = torch.randn(channels)
                            got_b = snake_cat_cl_triton(x, la, lb, None, bias=bias).float()
                            want_b = snake_cat_reference(x.float() + bias[:, None], la, lb, None)
                            b_tol = tol if dt == torch.float32 else 2e-2
                            torch.testing.assert_close(got_b, want_b, atol=b_tol, rtol=b_tol)
                        if rows is None or not act:
                            continue
                        for num_frames in (torch.tensor([3, 1]), None):
                            got_arena, want_arena = arena.clone(), arena.clone()
                            keep_tail_triton(got, got_arena, rows, num_frames, frames)
                            want_arena.index_copy_(0, rows, real_tail(got, h, num_frames, frames))
                            assert torch.equal(got_arena, want_arena)
                            assert not torch.equal(got_arena, arena)


@needs_triton
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_either_layout_cat_matches_eager_and_keeps_the_histories(dtype: str) -> None:
    run_in_interpreter(__name__, f"check_layouts({dtype!r})")


def check_bias_residual(dtype: str) -> None:
    """A residual unit's skip plus its last conv's output and that conv's bias, in one pass:
    ``x + (y + bias)`` bit for bit, channels-last; 3 x 96 x 700 values (several programs, a
    ragged last one); ``x`` a slice of longer rows, as a transposed conv's trimmed output."""
    from breezert.kernels.snake import bias_residual_triton, rows_channels_last

    torch.manual_seed(4)
    dt = getattr(torch, dtype)
    x = torch.randn(3, 710, 96).to(dt).transpose(1, 2)[..., 5:705]
    y = torch.randn(3, 700, 96).to(dt).transpose(1, 2)
    bias = torch.randn(96)
    got = bias_residual_triton(x, y, bias)
    assert got.transpose(1, 2).is_contiguous() and got.dtype == dt
    want = x.float() + (y.float() + bias[:, None])
    if dt == torch.float32:  # the same fp32 sums in the same order
        assert torch.equal(got, want)
    else:  # then one rounding to bf16 (the interpreter's)
        torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    assert rows_channels_last(x) and not rows_channels_last(x.contiguous())


@needs_triton
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bias_residual_gives_the_skip_plus_the_biased_conv(dtype: str) -> None:
    run_in_interpreter(__name__, f"check_bias_residual({dtype!r})")
