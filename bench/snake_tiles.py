"""Candidate (issue 31): the codec's SnakeBeta + history kernel on 2-D row tiles, waiting for its
first GPU run before it replaces ``breezert.kernels.snake.snake_cat_triton``.

The runtime's kernel takes 1024 flat elements of the output a program, across rows: on the H100
(5 Dec, ``results/h100-codec-snake-ab-20261205.json``) it beat a program per (row, 1024 columns)
on short rows (256 streams x 1 frame: 21.66 -> 18.89 ms a CODEC step) but lost on long ones
(16 x 16: 16.60 -> 17.92; 32 x 16: 29.72 -> 32.28): per element it pays two integer divisions,
two scale gathers and two ``exp``. Here a program takes ``1024 / BLOCK_T`` rows x ``BLOCK_T``
columns, ``BLOCK_T`` from the row width (``block_cols``), each row's indices and scales taken
once. ``bench/codec_ab.py --change snake-tile`` times it against the runtime's inside the serving
codec; ``tests/unit/test_snake_kernel.py`` checks it under Triton's interpreter at every tile
shape. Its A/B ran on the H100 (6 Dec, ``results/h100-codec-snake-tile-ab-20261206.json``):
faster than the flat kernel at every shape but one stream x one frame, a tie (1.62 / 1.63 ms),
with identical waveforms. It stays out of the serving path until the codec's GPU tests have run
with it served, on the H200: then it moves into ``kernels/snake.py`` in place of the flat kernel
(with its interpreter test, and ``codec_ab.py`` keeping the flat kernel as the ``before``), and
this file goes.

Owns the candidate only. Must not: be imported by the runtime.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from breezert.kernels.snake import snake_cat_operands

_TILE = 1024  # elements a program: ROWS x BLOCK_T
_MAX_ELEMENTS = 2**31  # a launch's output elements (int32 indices)
_MAX_WASTE = 1.15  # padded / real columns a row may take in its column blocks


@triton.jit(do_not_specialize=["C", "T", "H", "num_rows"])
def _snake_cat_kernel(x_ptr, hist_ptr, rows_ptr, la_ptr, lb_ptr, out_ptr, C, T, H, num_rows,
                      sx_b, sx_c, sh_b, sh_c, ROWS: tl.constexpr, BLOCK_T: tl.constexpr,
                      APPLY: tl.constexpr, HAS_HIST: tl.constexpr, HAS_ROWS: tl.constexpr):
    """Program ``i * cdiv(H + T, BLOCK_T) + j``: a tile of ``ROWS`` rows (``i * ROWS ...`` of the
    ``B * C`` rows of ``out [B, C, H + T]``, contiguous) by ``BLOCK_T`` columns (``j * BLOCK_T
    ...``; a 1-D grid: a launch's column blocks may pass the grid's 65535 in y); row ``b``'s
    history (``HAS_HIST``, else H = 0) is ``hist[rows[b]]`` with ``HAS_ROWS``, else ``hist[b]``;
    ``APPLY``: SnakeBeta on ``x``, else ``x`` as it is. A row's batch, channel, history row and
    scales are taken once for the row and broadcast along its columns.

    NOTE: the host picks ``BLOCK_T`` from the row width (``block_cols``); the module docstring
    says what the runtime's two earlier layouts cost.
    """
    width = H + T
    col_blocks = tl.cdiv(width, BLOCK_T)
    tile = tl.program_id(0) // col_blocks
    row = tile * ROWS + tl.arange(0, ROWS)  # [ROWS] int32: rows * width < 2**31 (the caller)
    col = ((tl.program_id(0) - tile * col_blocks) * BLOCK_T + tl.arange(0, BLOCK_T))[None, :]
    b = (row // C).to(tl.int64)  # the inputs' offsets may pass 2**31
    c = row % C  # in range on the tile's padding rows too
    inside = (row < num_rows)[:, None] & (col < width)  # [ROWS, BLOCK_T]
    x = tl.load(x_ptr + (b * sx_b + c * sx_c - H)[:, None] + col, mask=inside & (col >= H),
                other=0.0).to(tl.float32)
    if APPLY:
        alpha = tl.exp(tl.load(la_ptr + c).to(tl.float32))[:, None]  # [ROWS, 1]
        inv_beta = (1.0 / (tl.exp(tl.load(lb_ptr + c).to(tl.float32)) + 1e-9))[:, None]
        s = tl.sin(x * alpha)
        x = x + inv_beta * (s * s)
    if HAS_HIST:
        in_hist = inside & (col < H)
        if HAS_ROWS:
            hb = tl.load(rows_ptr + b, mask=row < num_rows, other=0)
        else:
            hb = b
        h = tl.load(hist_ptr + (hb * sh_b + c * sh_c)[:, None] + col, mask=in_hist, other=0.0)
        x = tl.where(in_hist, h.to(tl.float32), x)
    out = out_ptr + (row * width)[:, None] + col
    tl.store(out, x.to(out_ptr.dtype.element_ty), mask=inside)


def block_cols(width: int) -> int:
    """A ``_snake_cat_kernel`` tile's columns for rows ``width`` wide: the largest power of two
    in [16, 1024] whose column blocks pad a row by less than ``_MAX_WASTE``, else the one that
    pads it least (the larger on a tie). Short rows share a program (1024 / ``BLOCK_T`` rows),
    long rows take full-width blocks."""
    best, best_waste = _TILE, float("inf")
    for block_t in (1024, 512, 256, 128, 64, 32, 16):
        waste = triton.cdiv(width, block_t) * block_t / width
        if waste < _MAX_WASTE:
            return block_t
        if waste < best_waste:
            best, best_waste = block_t, waste
    return best


def tiled_snake_cat(x: Tensor, log_alpha: Tensor | None, log_beta: Tensor | None,
                     history: Tensor | None, rows: Tensor | None = None) -> Tensor:
    """``cat([history, SnakeBeta(x)], -1)`` for ``x [B, C, T]``, ``history [B, C, H]`` (or
    ``None``: H = 0; with ``rows [B]``, ``history [S, C, H]`` is an arena and row ``b``'s
    history is ``history[rows[b]]``); ``log_alpha`` ``None``: no SnakeBeta: the runtime's
    ``snake_cat_triton`` on row tiles (CUDA, or CPU tensors under ``TRITON_INTERPRET=1``);
    ``snake.snake_cat_reference`` is its arithmetic."""
    x, hist, h, out = snake_cat_operands(x, history, rows)
    bsz, channels, t = x.shape
    apply = log_alpha is not None
    if out.numel() == 0:
        return out
    block_t = block_cols(h + t)
    rows_a_program = _TILE // block_t
    # the kernel indexes its output in int32: a batch past 2**31 elements (an ungraphed step of
    # > ~11k frames at the decoder's end) runs as several launches over slices of its rows
    per_launch = max(1, (_MAX_ELEMENTS - 1) // (channels * (h + t)))
    for b0 in range(0, bsz, per_launch):
        b1 = min(bsz, b0 + per_launch)
        part = out[b0:b1]
        own_hist = hist if rows is not None or history is None else hist[b0:b1]
        num_rows = (b1 - b0) * channels
        grid = (triton.cdiv(num_rows, rows_a_program) * triton.cdiv(h + t, block_t),)
        _snake_cat_kernel[grid](
            x[b0:b1], own_hist, x if rows is None else rows[b0:b1],
            log_alpha if apply else x, log_beta if apply else x, part, channels, t, h,
            num_rows, x.stride(0), x.stride(1), hist.stride(0), hist.stride(1),
            ROWS=rows_a_program, BLOCK_T=block_t, APPLY=apply, HAS_HIST=history is not None,
            HAS_ROWS=rows is not None)
    return out
