"""The codec decoder's residual units as two Triton launches on channels-last activations.

Owns: the implicit-GEMM causal conv (kernel 7, dilation d) that applies SnakeBeta to its input
tiles as it loads them, reads each stream's causal history (``6 * d`` samples, already
activated, as the incremental codec keeps it) through a pointer of its own, and adds the bias
and the second SnakeBeta in its epilogue; the kernel-1 conv (a GEMM) with the bias and the
residual add in its epilogue; the next history of a step (``next_history``); the weight layout
they read (``pack_residual_unit``) and their launch shapes (``ConvTiles``). TF32 tensor-core
math on fp32 storage (today's served precision) or bf16 storage with fp32 accumulation.
Must not: know the decoder's modules or its state arena (callers hand tensors and views), or
change SnakeBeta's formula (``kernels/snake.py``'s ``snake_apply``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from breezert.kernels.gemm import DOT_F32
from breezert.kernels.snake import snake_apply

TAPS = 7  # the residual units' conv1 kernel
OUT_PAD = 128
"""Packed weights have their output channels padded with zeros to a multiple of this (the
widest column block), so weight tiles load unmasked."""


@dataclass(frozen=True)
class ConvTiles:
    """Launch shape of one conv kernel: ``bm`` output rows (samples of the flattened
    ``[B * T]`` rows) x ``bn`` output channels per program, ``bk`` input channels per step of
    the reduction (must divide the input channels), warps and software-pipeline stages."""

    bm: int = 128
    bn: int = 128
    bk: int = 32
    num_warps: int = 8
    num_stages: int = 3

    def name(self) -> str:
        return f"bm{self.bm}bn{self.bn}bk{self.bk}w{self.num_warps}s{self.num_stages}"


CANDIDATE_TILES = (ConvTiles(), ConvTiles(128, 64, 32, 4, 4), ConvTiles(64, 128, 32, 4, 4),
                   ConvTiles(128, 32, 32, 4, 4))
"""The launch shapes ``bench/codec_conv_kernels.py`` times for each unit (none measured yet):
the default; narrower column blocks (more programs, each re-applying SnakeBeta to its input
tiles); and 32 columns, which cover 96 channels without the 25 % of masked columns that
128 (a power of two, as Triton's blocks must be) computes for nothing."""


@dataclass(frozen=True)
class PackedUnit:
    """One residual unit's weights as the kernels read them."""

    w1: Tensor  # [C', TAPS * C]  row co, column j * C + ci = conv1.weight[co, ci, j]; C' is C
    # padded to OUT_PAD (zero rows). K-contiguous: TF32 wgmma reads both operands K-major from
    # shared memory, and a tile stored [K, N] was copied in transposed, 4 bytes at a time
    b1: Tensor  # [C]
    w2: Tensor  # [C', C]  row co, column ci = conv2.weight[co, ci, 0]
    b2: Tensor  # [C]
    act1: tuple[Tensor, Tensor]  # fp32 [C] each: e^alpha, 1 / (e^beta + 1e-9) of SnakeBeta 1
    act2: tuple[Tensor, Tensor]  # ... of SnakeBeta 2
    dilation: int

    @property
    def history(self) -> int:
        """Input samples of causal history a stream carries for conv1: ``(TAPS - 1) * d``."""
        return (TAPS - 1) * self.dilation


def snake_scales(log_alpha: Tensor, log_beta: Tensor) -> tuple[Tensor, Tensor]:
    """``(e^alpha, 1 / (e^beta + 1e-9))`` in fp32, as ``SnakeBeta.scales`` makes them."""
    log_alpha, log_beta = log_alpha.detach().float(), log_beta.detach().float()
    return log_alpha.exp().contiguous(), (1.0 / (log_beta.exp() + 1e-9)).contiguous()


def pack_residual_unit(conv1_weight: Tensor, conv1_bias: Tensor, conv2_weight: Tensor,
                       conv2_bias: Tensor, act1: tuple[Tensor, Tensor],
                       act2: tuple[Tensor, Tensor], dilation: int,
                       dtype: torch.dtype = torch.float32) -> PackedUnit:
    """The kernels' layout of a unit: ``conv1_weight [C, C, 7]``, ``conv2_weight [C, C, 1]``
    (``nn.Conv1d``'s), ``act1``/``act2`` the SnakeBetas' ``(log_alpha, log_beta)``; weights
    and biases in ``dtype`` (the activations' storage), SnakeBeta scales in fp32."""
    w1 = conv1_weight.detach()
    assert w1.shape[2] == TAPS and conv2_weight.shape[2] == 1, "a residual unit: k=7 then k=1"
    c = w1.shape[1]
    return PackedUnit(
        w1=pad_rows(w1.permute(0, 2, 1).reshape(w1.shape[0], TAPS * c), dtype),
        b1=conv1_bias.detach().to(dtype).contiguous(),
        w2=pad_rows(conv2_weight.detach()[:, :, 0], dtype),
        b2=conv2_bias.detach().to(dtype).contiguous(),
        act1=snake_scales(*act1), act2=snake_scales(*act2), dilation=dilation)


def pad_rows(w: Tensor, dtype: torch.dtype) -> Tensor:
    """``w [N, K]`` in ``dtype`` with zero rows up to a multiple of ``OUT_PAD``."""
    rows = -(-w.shape[0] // OUT_PAD) * OUT_PAD
    out = torch.zeros(rows, w.shape[1], device=w.device, dtype=dtype)
    out[:w.shape[0]] = w
    return out


@triton.jit
def _mma(a, w, acc, PRECISION: tl.constexpr, F32: tl.constexpr):
    """``acc + a @ w`` in fp32: TF32 (or ``PRECISION``) tensor cores on fp32 operands, bf16
    ones on bf16; under the interpreter fp32 operands (its bf16 dot is wrong, ``gemm.py``)."""
    if F32:
        out = tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
    else:
        out = tl.dot(a.to(w.dtype), w, acc, input_precision=PRECISION)
    return out


@triton.jit(do_not_specialize=["M", "T"])
def _conv_kernel(x_ptr, hist_ptr, w_ptr, bias_ptr, in_alpha_ptr, in_beta_ptr,
                 out_alpha_ptr, out_beta_ptr, res_ptr, out_ptr,
                 M, T, H, dilation,
                 sx_b, sx_t, sh_b, sh_t, sr_b, sr_t, so_b, so_t,
                 CIN: tl.constexpr, COUT: tl.constexpr, NUM_TAPS: tl.constexpr,
                 HAS_HIST: tl.constexpr, SNAKE_IN: tl.constexpr, SNAKE_OUT: tl.constexpr,
                 RESIDUAL: tl.constexpr, PRECISION: tl.constexpr, F32: tl.constexpr,
                 APPROX_SIN: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Program (row block, column block) of ``out [B, T, COUT]``: output sample ``t`` of stream
    ``b`` sums, over taps ``j``, input sample ``t + j * dilation - H`` (below 0: history sample
    ``H + that`` of the stream, taken as it is; else ``x``, SnakeBeta'd first with
    ``SNAKE_IN``) times tap ``j`` of ``w [COUT', NUM_TAPS * CIN]`` (rows past ``COUT`` zero, so
    its tiles load unmasked); then the bias, SnakeBeta
    (``SNAKE_OUT``) and the residual ``res`` (``RESIDUAL``). Rows are the flattened ``B * T``
    samples, so a row block may span two streams: every row finds its own stream and history.
    """
    NUM_KB: tl.constexpr = CIN // BK
    num_n = tl.cdiv(COUT, BN)
    pid = tl.program_id(0)
    pid_m, pid_n = pid // num_n, pid % num_n  # neighbours share the row block (its A in L2)
    rows = pid_m * BM + tl.arange(0, BM)
    row_ok = rows < M
    b = rows // T
    t = rows - b * T
    cols = pid_n * BN + tl.arange(0, BN)
    col_ok = cols < COUT
    ks = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    # one flat loop over (tap, channel block), so the pipeliner sees NUM_TAPS * NUM_KB steps
    for i in range(NUM_TAPS * NUM_KB):
        j = i // NUM_KB
        ch = (i - j * NUM_KB) * BK + ks  # [BK] input channels
        p = t + j * dilation - H  # [BM] input sample among this step's new ones
        is_new = row_ok & (p >= 0)
        a = tl.load(x_ptr + (b * sx_b + p * sx_t)[:, None] + ch[None, :],
                    mask=is_new[:, None], other=0.0).to(tl.float32)  # [BM, BK]
        if SNAKE_IN:  # snake(0) = 0: masked rows stay 0
            a = snake_apply(a, tl.load(in_alpha_ptr + ch)[None, :],
                            tl.load(in_beta_ptr + ch)[None, :], APPROX_SIN)
        if HAS_HIST:  # without one, the history is zeros: the masked loads' 0
            is_old = row_ok & (p < 0)
            old = tl.load(hist_ptr + (b * sh_b + (p + H) * sh_t)[:, None] + ch[None, :],
                          mask=is_old[:, None], other=0.0).to(tl.float32)
            a = tl.where(is_old[:, None], old, a)
        w = tl.load(w_ptr + cols[:, None] * (NUM_TAPS * CIN) + (j * CIN + ch)[None, :])
        acc = _mma(a, tl.trans(w), acc, PRECISION, F32)  # w [BN, BK]: K-major
    acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if SNAKE_OUT:
        acc = snake_apply(acc, tl.load(out_alpha_ptr + cols, mask=col_ok, other=0.0)[None, :],
                          tl.load(out_beta_ptr + cols, mask=col_ok, other=0.0)[None, :],
                          APPROX_SIN)
    mask = row_ok[:, None] & col_ok[None, :]
    if RESIDUAL:
        acc += tl.load(res_ptr + (b * sr_b + t * sr_t)[:, None] + cols[None, :], mask=mask,
                       other=0.0).to(tl.float32)
    tl.store(out_ptr + (b * so_b + t * so_t)[:, None] + cols[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=mask)


def conv_launch(x: Tensor, hist: Tensor | None, history: int, dilation: int, w: Tensor,
                bias: Tensor, snake_in: tuple[Tensor, Tensor] | None,
                snake_out: tuple[Tensor, Tensor] | None, residual: Tensor | None,
                tiles: ConvTiles, precision: str = "tf32", approx_sin: bool = False) -> Tensor:
    """One launch of the kernel: ``x [B, T, Cin]`` with ``hist [B, history, Cin]`` (or None:
    zeros; copied channels-contiguous first if it is not, e.g. the state arena's ``[B, Cin,
    history]`` transposed: strided, every thread's copies of it would be 4-byte ones, issued
    for every tile whether or not it reaches back into the history) in front, ``w [Cout',
    taps * Cin]`` (tap-major columns, ``Cout = bias.numel()``, rows past it zero), ``history =
    (taps - 1) * dilation``; SnakeBeta scales ``(e^alpha, 1 / (e^beta + 1e-9))`` for the input
    and the output (None: none), ``residual [B, T, Cout]`` added last (None: none) -> ``[B, T,
    Cout]``. ``approx_sin``: SnakeBeta's sine on the SFU (``snake._sin_approx``), a candidate
    the bench times against libdevice's. The two wrappers below are the residual unit's
    launches."""
    bsz, t, cin = x.shape
    num_taps = w.shape[1] // cin
    cout = bias.shape[0]
    assert x.stride(2) == 1 and cin % tiles.bk == 0, (x.stride(), cin, tiles.bk)
    assert w.shape[1] == num_taps * cin and history == (num_taps - 1) * dilation
    assert w.is_contiguous() and w.shape[0] % tiles.bn == 0 and w.shape[0] >= cout, (
        w.shape, tiles.bn, cout)
    out = torch.empty(bsz, t, cout, device=x.device, dtype=x.dtype)
    h = hist if hist is not None else x  # never read without HAS_HIST
    if hist is not None:
        assert hist.shape == (bsz, history, cin), (hist.shape, bsz, history, cin)
        if hist.stride(2) != 1:
            h = hist.contiguous()
    r = residual if residual is not None else out  # never read without RESIDUAL
    assert r.stride(2) == 1
    a_in = snake_in if snake_in is not None else (bias, bias)
    a_out = snake_out if snake_out is not None else (bias, bias)
    grid = (triton.cdiv(bsz * t, tiles.bm) * triton.cdiv(cout, tiles.bn),)
    _conv_kernel[grid](
        x, h, w, bias, a_in[0], a_in[1], a_out[0], a_out[1], r, out,
        bsz * t, t, history, dilation,
        x.stride(0), x.stride(1), h.stride(0), h.stride(1),
        r.stride(0), r.stride(1), out.stride(0), out.stride(1),
        CIN=cin, COUT=cout, NUM_TAPS=num_taps, HAS_HIST=hist is not None and history > 0,
        SNAKE_IN=snake_in is not None, SNAKE_OUT=snake_out is not None,
        RESIDUAL=residual is not None, PRECISION=precision, F32=DOT_F32, APPROX_SIN=approx_sin,
        BM=tiles.bm, BN=tiles.bn, BK=tiles.bk, num_warps=tiles.num_warps,
        num_stages=tiles.num_stages)
    return out


def causal_conv_snake(x: Tensor, hist: Tensor | None, unit: PackedUnit,
                      tiles: ConvTiles = ConvTiles(), precision: str = "tf32",
                      approx_sin: bool = False) -> Tensor:
    """Launch 1: ``snake2(conv1(snake1(x)) + b1)`` for ``x [B, T, C]`` (channels contiguous)
    with ``hist [B, 6d, C]`` (any strides; activated; ``None``: zeros) in front of each
    stream -> ``[B, T, C]``."""
    return conv_launch(x, hist, unit.history, unit.dilation, unit.w1, unit.b1, unit.act1,
                       unit.act2, None, tiles, precision, approx_sin)


def pointwise_residual(g: Tensor, x: Tensor, unit: PackedUnit,
                       tiles: ConvTiles = ConvTiles(), precision: str = "tf32") -> Tensor:
    """Launch 2: ``x + conv2(g) + b2`` for ``g, x [B, T, C]`` -> ``[B, T, C]``."""
    return conv_launch(g, None, 0, 1, unit.w2, unit.b2, None, None, x, tiles, precision)


def residual_unit(x: Tensor, hist: Tensor | None, unit: PackedUnit,
                  conv_tiles: ConvTiles = ConvTiles(), pointwise_tiles: ConvTiles = ConvTiles(),
                  precision: str = "tf32", approx_sin: bool = False) -> Tensor:
    """``x + conv2(snake2(conv1(snake1(x))))`` with the causal history: two launches.

    Args:
        x: ``[B, T, C]`` the unit's input, channels contiguous (rows of one stream in order).
        hist: ``[B, 6 * d, C]`` (a view of any strides, e.g. the state arena's ``[B, C, 6d]``
            transposed) of SnakeBeta'd input samples before ``x``; ``None``: zeros.
        unit: ``pack_residual_unit``'s weights.
        precision: ``tl.dot``'s on fp32 storage: ``"tf32"`` (served) or ``"ieee"``.
        approx_sin: SnakeBeta's sine on the SFU (``conv_launch``).
    """
    g = causal_conv_snake(x, hist, unit, conv_tiles, precision, approx_sin)
    return pointwise_residual(g, x, unit, pointwise_tiles, precision)


def next_history(x: Tensor, hist: Tensor | None, unit: PackedUnit,
                 ends: Tensor | None = None) -> Tensor:
    """The ``6 * d`` activated input samples a stream carries past this step: those before
    sample ``ends[b]`` of ``x [B, T, C]`` (``ends``: ``[B]`` int64 samples really decoded,
    ``None``: all ``T``), reaching back into ``hist`` (``None``: zeros) -> ``[B, 6d, C]``.
    The incremental codec's ``_Carry.keep_last`` on the activated ``cat([hist, x])``."""
    bsz, t, c = x.shape
    length = unit.history
    end = (torch.full((bsz,), t, device=x.device, dtype=torch.long) if ends is None
           else ends.to(x.device, torch.long))
    index = end[:, None] - length + torch.arange(length, device=x.device)  # [B, 6d] in x
    new = x.gather(1, index.clamp(min=0)[..., None].expand(bsz, length, c)).float()
    alpha, inv_beta = unit.act1
    new = new + inv_beta * torch.sin(new * alpha).pow(2)  # SnakeBeta.forward's arithmetic
    if hist is None:
        old = torch.zeros_like(new)
    else:
        old = hist.gather(1, (index + length).clamp(max=length - 1)[..., None]
                          .expand(bsz, length, c)).float()
    return torch.where((index < 0)[..., None], old, new).to(x.dtype)  # [B, 6d, C]
