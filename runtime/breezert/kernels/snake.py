"""The causal convs' histories on the device: SnakeBeta fused with the history in front of the conv
it feeds, and the new history written back into the stream's state, one Triton launch each.

Owns: ``snake_cat_cl_triton`` (``cat([history, snake(x)], -1)`` in one pass, written
channels-last, ``[B, H + T, C]`` in memory, for the fast codec's channels-last convolutions: read
``x`` and the history once, write the conv's input once; without SnakeBeta, the plain ``cat``;
with a conv's bias added first; its torch reference), ``bias_residual_triton`` (a residual unit's
skip and its last conv's bias in one pass), ``keep_tail_triton`` (each row's new history, the
samples of the conv's input that end at its last real frame, written into its slot of the state
arena; ``models.codec.real_tail`` is its arithmetic). The eager codec spends five launches and
five full passes over the activation on SnakeBeta (``exp``, ``mul``, ``sin``, ``pow``,
``mul``/``add``) and one more on the concatenation; at the decoder's 24 kHz end (96 channels x
1920 samples a frame) those passes, not the convolutions, were half of a CODEC step
(``bench/results/h200-codec-conv-kernels-20261201.json``). The cat and ``keep_tail`` read and
write the history in the arena by slot (``rows``), so a step gathers and scatters no conv state.
Must not: change the formula (``x + sin^2(x * e^alpha) / (e^beta + 1e-9)``, fp32 math, stored in
``x``'s dtype).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

_BLOCK = 1024  # keep_tail's and bias_residual's elements a program
_TILE = 1024  # snake_cat's elements a program: BLOCK_T x BLOCK_C


@triton.jit(do_not_specialize=["C", "W", "L", "scale", "total"])
def _keep_tail_kernel(full_ptr, hist_ptr, rows_ptr, frames_ptr, C, W, L, scale, total,
                      sf_b, sf_c, sf_t, sh_s, sh_c, BLOCK: tl.constexpr,
                      HAS_FRAMES: tl.constexpr):
    """Program ``j``: the flat elements ``j * BLOCK ...`` of the new histories ``[B, C, L]``:
    ``hist[rows[b], c, i] = full[b, c, start_b + i]`` with ``start_b = frames[b] * scale``
    (``HAS_FRAMES``) or ``W - L``; ``full [B, C, W]`` is read through its strides (the codec's:
    channels-last, from ``snake_cat_cl_triton``)."""
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    row = idx // L
    i = idx - row * L
    b = (row // C).to(tl.int64)
    c = row % C
    inside = idx < total
    if HAS_FRAMES:
        start = tl.load(frames_ptr + b, mask=inside, other=0) * scale
    else:
        start = W - L
    val = tl.load(full_ptr + b * sf_b + c * sf_c + (start + i) * sf_t, mask=inside, other=0.0)
    slot = tl.load(rows_ptr + b, mask=inside, other=0)
    tl.store(hist_ptr + slot * sh_s + c * sh_c + i, val, mask=inside)


@triton.jit(do_not_specialize=["C", "T", "H", "t_blocks", "c_blocks"])
def _snake_cat_cl_kernel(x_ptr, hist_ptr, rows_ptr, la_ptr, lb_ptr, bias_ptr, out_ptr, C, T, H,
                         t_blocks, c_blocks, sx_b, sx_c, sx_t, sh_b, sh_c,
                         BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, APPLY: tl.constexpr,
                         HAS_HIST: tl.constexpr, HAS_ROWS: tl.constexpr,
                         HAS_BIAS: tl.constexpr):
    """Program ``(b * t_blocks + j) * c_blocks + k`` fills ``out[b, j * BLOCK_T ..., k *
    BLOCK_C ...]`` of ``out [B, H + T, C]`` (contiguous; ``BLOCK_C`` divides ``C``), channels
    along the lanes, so its loads of a channels-last ``x`` (any strides ``sx_*``) and its stores
    are coalesced. Row ``b``'s history (``HAS_HIST``, else H = 0) is ``hist[rows[b]]`` with
    ``HAS_ROWS``, else ``hist[b]`` (``[C, H]``, samples dense), read across channels: at most 54
    samples a row. ``APPLY``: SnakeBeta on ``x``, else ``x`` as it is. ``HAS_BIAS``: ``x`` is a
    conv's output before its bias, added here first (fp32)."""
    pid = tl.program_id(0)
    k = pid % c_blocks
    bt = pid // c_blocks
    b = (bt // t_blocks).to(tl.int64)  # the offsets may pass 2**31
    t = ((bt % t_blocks) * BLOCK_T + tl.arange(0, BLOCK_T))[:, None]  # [BLOCK_T, 1]
    c = k * BLOCK_C + tl.arange(0, BLOCK_C)  # [BLOCK_C]
    width = H + T
    inside = t < width
    x = tl.load(x_ptr + b * sx_b + c[None, :] * sx_c + (t - H) * sx_t,
                mask=inside & (t >= H), other=0.0).to(tl.float32)
    if HAS_BIAS:
        x = x + tl.load(bias_ptr + c).to(tl.float32)[None, :]
    if APPLY:
        alpha = tl.exp(tl.load(la_ptr + c).to(tl.float32))[None, :]  # [1, BLOCK_C]
        inv_beta = (1.0 / (tl.exp(tl.load(lb_ptr + c).to(tl.float32)) + 1e-9))[None, :]
        s = tl.sin(x * alpha)
        x = x + inv_beta * (s * s)
    if HAS_HIST:
        in_hist = t < H
        if HAS_ROWS:
            hb = tl.load(rows_ptr + b)
        else:
            hb = b
        h = tl.load(hist_ptr + hb * sh_b + c[None, :] * sh_c + t, mask=in_hist, other=0.0)
        x = tl.where(in_hist, h.to(tl.float32), x)
    out = out_ptr + b * width * C + t * C + c[None, :]
    tl.store(out, x.to(out_ptr.dtype.element_ty), mask=inside)


def snake_cat_reference(x: Tensor, log_alpha: Tensor | None, log_beta: Tensor | None,
                        history: Tensor | None, rows: Tensor | None = None) -> Tensor:
    """The eager arithmetic (``SnakeBeta`` then ``torch.cat``): ``[B, C, H + T]``."""
    y = x
    if log_alpha is not None:
        alpha = log_alpha.exp()[None, :, None]
        beta = log_beta.exp()[None, :, None]
        y = x + (1.0 / (beta + 1e-9)) * torch.sin(x * alpha).pow(2)
    if history is None:
        return y
    return torch.cat([history if rows is None else history[rows], y], dim=-1)


def channel_block(channels: int) -> int:
    """``_snake_cat_cl_kernel``'s channels a program: the largest power of two <= 128 that
    divides ``channels`` (the served decoder's 96-1536: 32-128)."""
    return math.gcd(channels, 128)


def snake_cat_cl_triton(x: Tensor, log_alpha: Tensor | None, log_beta: Tensor | None,
                        history: Tensor | None, rows: Tensor | None = None,
                        bias: Tensor | None = None) -> Tensor:
    """``cat([history, SnakeBeta(x)], -1)`` for ``x [B, C, T]`` (any strides: channels-last
    from the conv before, or channels-first), ``history [B, C, H]`` (or ``None``: H = 0; with
    ``rows [B]``, ``history [S, C, H]`` is an arena and row ``b``'s history is
    ``history[rows[b]]``; samples dense); ``log_alpha`` ``None``: no SnakeBeta. The result
    ``[B, C, H + T]`` is the view of a contiguous ``[B, H + T, C]`` (what a channels-last
    convolution reads without a transpose). ``bias [C]``: the conv that made ``x`` left its
    bias out; it is added to ``x`` first, as the conv would have (one pass over its output
    fewer). The kernel (CUDA, or CPU tensors under ``TRITON_INTERPRET=1``);
    ``snake_cat_reference`` is its arithmetic (of ``x + bias[:, None]`` with ``bias``)."""
    bsz, channels, t = x.shape
    hist = x if history is None else history
    h = 0 if history is None else history.shape[-1]
    assert history is None or history.stride(2) == 1, "a history's samples are read dense"
    assert rows is None or rows.is_contiguous(), "rows are read by raw pointer: dense [B]"
    out = torch.empty(bsz, h + t, channels, device=x.device, dtype=x.dtype)
    if out.numel() == 0:
        return out.transpose(1, 2)
    apply = log_alpha is not None
    block_c = channel_block(channels)
    block_t = max(1, _TILE // block_c)
    t_blocks, c_blocks = triton.cdiv(h + t, block_t), channels // block_c
    _snake_cat_cl_kernel[(bsz * t_blocks * c_blocks,)](
        x, hist, x if rows is None else rows, log_alpha if apply else x,
        log_beta if apply else x, x if bias is None else bias, out, channels, t, h, t_blocks,
        c_blocks, *x.stride(), hist.stride(0), hist.stride(1), BLOCK_T=block_t, BLOCK_C=block_c,
        APPLY=apply, HAS_HIST=history is not None, HAS_ROWS=rows is not None,
        HAS_BIAS=bias is not None)
    return out.transpose(1, 2)


def keep_tail_triton(full: Tensor, history: Tensor, rows: Tensor, num_frames: Tensor | None,
                     total_frames: int) -> None:
    """Writes each row's new history into the arena: ``history [S, C, L]`` at ``rows [B]`` gets the
    ``L`` samples of ``full [B, C, L + T]`` (the conv's input: old history, then the step's ``T``
    samples; any strides) that end at the row's last real frame (``num_frames [B]`` of the step's
    ``total_frames``; ``None``: all). In place; padding rows may share a slot (any one of them
    wins). The kernel (CUDA, or CPU tensors under ``TRITON_INTERPRET=1``);
    ``breezert.models.codec.real_tail`` is its arithmetic."""
    bsz, channels, width = full.shape
    length = history.shape[-1]
    assert history.stride(2) == 1
    for ids in (rows, num_frames):  # read by raw pointer: element b at b
        assert ids is None or ids.is_contiguous(), "rows, frame counts: dense [B]"
    total = bsz * channels * length
    _keep_tail_kernel[(triton.cdiv(total, _BLOCK),)](
        full, history, rows, rows if num_frames is None else num_frames, channels, width, length,
        (width - length) // max(total_frames, 1), total, *full.stride(), history.stride(0),
        history.stride(1), BLOCK=_BLOCK, HAS_FRAMES=num_frames is not None)


@triton.jit(do_not_specialize=["C", "row", "total", "sx_b", "sy_b"])
def _bias_residual_kernel(x_ptr, y_ptr, bias_ptr, out_ptr, C, row, total, sx_b, sy_b,
                          BLOCK: tl.constexpr):
    """Program ``j``: flat elements ``j * BLOCK ...`` of the contiguous ``out [B, T, C]``
    (``row`` = T * C a batch row): ``out = x + (y + bias[c])`` in fp32; ``x`` and ``y`` are
    channels-last within a batch row (their batch strides ``sx_b``, ``sy_b`` any)."""
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = idx < total
    c = idx % C
    b = idx // row
    within = idx - b * row
    x = tl.load(x_ptr + b * sx_b + within, mask=inside, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + b * sy_b + within, mask=inside, other=0.0).to(tl.float32)
    bias = tl.load(bias_ptr + c, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + idx, (x + (y + bias)).to(out_ptr.dtype.element_ty), mask=inside)


def rows_channels_last(x: Tensor) -> bool:
    """Whether each batch row of ``x [B, C, T]`` is a contiguous ``[T, C]`` (channels-last; the
    rows themselves may lie apart, as in a slice of a longer output)."""
    return x[:1].transpose(1, 2).is_contiguous()


def bias_residual_triton(x: Tensor, y: Tensor, bias: Tensor) -> Tensor:
    """``x + (y + bias[:, None])`` for channels-last ``x``, ``y [B, C, T]`` (each batch row
    contiguous: see ``rows_channels_last``), in one pass: a residual unit's skip added to its last
    conv's output, whose bias the conv left out (cuDNN adds a conv's bias in a pass of its own).
    The same fp32 sums in the same order as the conv's bias, then the skip. Channels-last out."""
    assert rows_channels_last(x) and rows_channels_last(y) and x.shape == y.shape
    out = torch.empty(x.shape[0], x.shape[2], x.shape[1], device=x.device, dtype=x.dtype)
    total = out.numel()
    if total:
        _bias_residual_kernel[(triton.cdiv(total, _BLOCK),)](
            x, y, bias, out, x.shape[1], x.shape[1] * x.shape[2], total, x.stride(0),
            y.stride(0), BLOCK=_BLOCK)
    return out.transpose(1, 2)
