"""SnakeBeta fused with the causal history in front of the conv it feeds: one Triton launch.

Owns: ``snake_cat`` (``cat([history, snake(x)], -1)`` in one pass: read ``x`` and the history
once, write the conv's input once) and its torch reference. The eager codec spends five
launches and five full passes over the activation on SnakeBeta (``exp``, ``mul``, ``sin``,
``pow``, ``mul``/``add``) and one more on the concatenation; at the decoder's 24 kHz end
(96 channels x 1920 samples a frame) those passes, not the convolutions, were half of a CODEC
step (``bench/results/h200-codec-conv-kernels-20261201.json``). Must not: change the formula
(``x + sin^2(x * e^alpha) / (e^beta + 1e-9)``, fp32 math, stored in ``x``'s dtype).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

_BLOCK = 1024


@triton.jit(do_not_specialize=["C", "T", "H", "total"])
def _snake_cat_kernel(x_ptr, hist_ptr, la_ptr, lb_ptr, out_ptr, C, T, H, total,
                      sx_b, sx_c, sh_b, sh_c, BLOCK: tl.constexpr):
    """Program ``j``: the flat elements ``j * BLOCK ...`` of ``out [B, C, H + T]``
    (contiguous), whatever rows they fall in.

    NOTE: one program per (row, 1024 columns), as before 5 Dec (sixth session), ran every lane
    of a 1024-wide block through the formula however short the row: at 256 streams x 1 frame
    the first block's rows are 7-86 samples wide, and ~3.0 G lane evaluations did 0.74 G
    elements' work (6.5 ms of a 36 ms CODEC step on the H100 at 27 % of its bandwidth).
    """
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # int32: total < 2**31 (the caller)
    width = H + T
    row = idx // width
    col = idx - row * width
    b = (row // C).to(tl.int64)  # the inputs' offsets may pass 2**31
    c = row % C
    inside = idx < total
    in_hist = inside & (col < H)
    in_new = inside & (col >= H)
    h = tl.load(hist_ptr + b * sh_b + c * sh_c + col, mask=in_hist, other=0.0)
    x = tl.load(x_ptr + b * sx_b + c * sx_c + (col - H), mask=in_new, other=0.0).to(tl.float32)
    alpha = tl.exp(tl.load(la_ptr + c, mask=inside, other=0.0).to(tl.float32))
    inv_beta = 1.0 / (tl.exp(tl.load(lb_ptr + c, mask=inside, other=0.0).to(tl.float32)) + 1e-9)
    s = tl.sin(x * alpha)
    y = x + inv_beta * (s * s)
    val = tl.where(in_hist, h.to(tl.float32), y)
    tl.store(out_ptr + idx, val.to(out_ptr.dtype.element_ty), mask=inside)


def snake_cat_reference(x: Tensor, log_alpha: Tensor, log_beta: Tensor,
                        history: Tensor | None) -> Tensor:
    """The eager arithmetic (``SnakeBeta`` then ``torch.cat``): ``[B, C, H + T]``."""
    alpha = log_alpha.exp()[None, :, None]
    beta = log_beta.exp()[None, :, None]
    y = x + (1.0 / (beta + 1e-9)) * torch.sin(x * alpha).pow(2)
    return y if history is None else torch.cat([history, y], dim=-1)


def snake_cat(x: Tensor, log_alpha: Tensor, log_beta: Tensor, history: Tensor | None) -> Tensor:
    """``cat([history, SnakeBeta(x)], -1)`` for ``x [B, C, T]``, ``history [B, C, H]`` (or
    ``None``: H = 0); one launch on CUDA, the torch arithmetic elsewhere."""
    if not x.is_cuda:
        return snake_cat_reference(x, log_alpha, log_beta, history)
    return snake_cat_triton(x, log_alpha, log_beta, history)


def snake_cat_triton(x: Tensor, log_alpha: Tensor, log_beta: Tensor,
                     history: Tensor | None) -> Tensor:
    """The kernel itself (CUDA, or CPU tensors under ``TRITON_INTERPRET=1``)."""
    bsz, channels, t = x.shape
    if x.stride(2) != 1:
        x = x.contiguous()
    if history is None:
        hist, h = x, 0  # never read (every column is a new one)
    else:
        hist, h = history, history.shape[-1]
        if hist.stride(2) != 1:
            hist = hist.contiguous()
    out = torch.empty(bsz, channels, h + t, device=x.device, dtype=x.dtype)
    total = out.numel()
    if total >= 2**31:
        raise ValueError(f"snake_cat: {total} output elements, the kernel indexes < 2**31")
    _snake_cat_kernel[(triton.cdiv(total, _BLOCK),)](
        x, hist, log_alpha, log_beta, out, channels, t, h, total,
        x.stride(0), x.stride(1), hist.stride(0), hist.stride(1), BLOCK=_BLOCK)
    return out
