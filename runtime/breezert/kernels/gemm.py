"""Shared Triton building blocks of the fused layers: GEMMs with RMSNorm prologues and epilogues.

Owns: the bf16 rounding helpers (and their interpreter workarounds), RMSNorm + GEMM prologues,
RoPE at ``apply_rope``'s rounding points (and after a per-head QK-norm, ``head_norm_rope``),
``norm_linear`` (RMSNorm + GEMM), ``norm_gate_up`` (RMSNorm + packed gate/up GEMM + SiLU * up),
``linear_residual`` (split-K GEMM + residual, the last program of a tile summing the partials in
a fixed order), ``rms_norm_rows`` (the norm apart, for ``Tiles.prenorm``: the GEMMs then read
normed rows through TMA), their launch shapes (``Tiles``), the split-K workspace, and programmatic
dependent launch (``pdl_launch`` / ``pdl_wait``) for every fused kernel. Every kernel keeps
the eager modules' bf16 rounding points (``RMSNorm``, ``F.linear``, ``F.silu``, residual add).
Must not: know which model calls it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.tools.tensor_descriptor import TensorDescriptor

# Triton 3.6's interpreter (CPU tests) mis-multiplies bf16 ``tl.dot`` operands and truncates
# fp32 -> bf16 instead of rounding to nearest even. Under it the kernels upcast dot operands to
# fp32 (the same exact products) and round to bf16 by hand, so the CPU tests check the real
# rounding points.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DOT_F32 = INTERPRETED
_RNE_BY_HAND = tl.constexpr(INTERPRETED)

BM_MAX = 64  # rows per program by default; more rows run as more row blocks


@dataclass(frozen=True)
class Tiles:
    """Launch shapes. The defaults won bench/tune_fused_depth.py on the H200 at 32 rows
    (bench/README.md). They serve the fused DECODE step and one-shape depth layers; the depth
    layers' own per-row-bucket shapes are ``fused_depth.TILES_BY_ROWS``.

    ``qkv_split``: programs per head (each takes matching slices of both RoPE halves), so
    12 heads give 48 programs; ``split_k``: K splits of o_proj/down (32 column tiles x 8 splits
    against the H200's 132 SMs)."""

    qkv_split: int = 4
    qkv_bk: int = 256
    gate_bn: int = 64
    gate_bk: int = 64
    split_k: int = 8
    split_bn: int = 32
    split_bk: int = 256
    linear_bn: int = 64
    linear_bk: int = 64
    num_warps: int = 4
    num_stages: int = 4
    gate_warps: int | None = None
    gate_stages: int | None = None
    split_warps: int | None = None
    split_stages: int | None = None
    """Warps / pipeline stages of the gate/up and split-K GEMMs (None: ``num_warps`` /
    ``num_stages``, which the other kernels use)."""
    qkv_bm: int = 64
    gate_bm: int = 64
    """Most rows per program of the q/k/v and gate/up GEMMs: with many rows, smaller row blocks
    give more programs (each streams its weight slice again, mostly from L2)."""
    split_bm: int = BM_MAX
    """Most rows per program of ``linear_residual`` (up to 128: wide tiles for hundreds of
    rows, where each smaller block would read the weight and its input rows again)."""
    tma: bool = False
    """Weight tiles through the tensor-memory accelerator (host ``TensorDescriptor``s, one per
    weight and tile shape, cached) instead of per-thread loads; same tiles, same bits."""
    pdl: bool = False
    """Programmatic dependent launch (``pdl_launch``) for every kernel these tiles launch."""
    skip_pdl: bool = False
    """Launch this bucket's kernels plainly even where the frame asks for PDL
    (``FusedDepthLayers(pdl=True)``): on the H100 the 512-row frame took 24.6 ms with PDL
    against 23.0 without (bench/results/h100-tune-fused-depth-20261207-12.json; 24.5 against
    23.1 in -14.json), so ``TILES_BY_ROWS``' 512-row bucket sets it. PDL changes no bit, so
    neither does this."""
    qkv_split_k: int = 1
    """K splits of the depth layers' q/k/v GEMM (1: one program reduces all of K). More
    programs for a small GEMM (12 heads x ``qkv_split`` programs at up to 16 rows); like
    ``split_k`` it sets the sum order, so every row bucket must use the same."""
    prenorm: bool = False
    """Large-row buckets: each RMSNorm runs once, apart (``rms_norm_rows``, one launch), and
    every GEMM reads its input rows through TMA (``[BM, BK]`` blocks) instead of each program
    re-reading and normalising its row block in a prologue. The same values at the same
    rounding points in the same K order, so the same bits as without it; one more launch per
    norm."""

    o_inline: bool = False
    """Large-row buckets: o_proj's ``split_k`` partials made and summed in split order inside
    each program (``linear_residual(inline=True)``) rather than by the tile's last program from a
    workspace. o_proj's weight is small (1,024 x 1,024), so at hundreds of rows its split-K
    partials (512 rows: 8 MB written, 8 MB read) move several times its weight; the same
    partials in the same order, so the same bits."""

    down_inline: bool = False
    """Large-row buckets: down_proj's ``split_k`` partials summed in split order inside each
    program, as ``o_inline`` does for o_proj. At 512 rows its split-K partials are 8 MB written
    and read beside 16.8 MB of weight, and the split GEMM took 35.6 us against cuBLAS's 17.2
    (H200, 6 Dec); one program a tile reads K whole (8,192). The same bits."""

    def launch(self, kernel: str) -> dict[str, int]:
        """``num_warps`` / ``num_stages`` of ``kernel`` ("gate" or "split"; others share the
        defaults), so the GEMMs with the most bytes can take deeper pipelines; and
        ``pdl_launch(self.pdl)``."""
        warps = getattr(self, f"{kernel}_warps", None) or self.num_warps
        stages = getattr(self, f"{kernel}_stages", None) or self.num_stages
        return {"num_warps": warps, "num_stages": stages, **pdl_launch(self.pdl)}


def pdl_launch(pdl: bool) -> dict[str, bool]:
    """Launch keywords for programmatic dependent launch (Hopper): the kernel may start while
    the one before it in the stream finishes, and waits for it in ``pdl_wait`` before touching
    memory. The launch flag and the in-kernel wait travel together here: a kernel launched early
    without its wait would race the one before it."""
    return {"launch_pdl": pdl, "PDL": pdl}


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """A fused kernel's first statement. With ``PDL``: wait until the kernel before has ended
    and its writes are visible (so every load and store of this one comes after it, reads and
    overwrites of shared buffers alike), then let the next kernel launch, so that its blocks are
    placed while this one runs. Without: nothing (the interpreter never sees the instructions).
    """
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def mm(a, b, F32: tl.constexpr):
    """``a [M, K] @ b [K, N]`` -> fp32."""
    if F32:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def weight_tile(w, n0, k0, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                TMA: tl.constexpr):
    """Rows ``n0..n0+BN-1``, columns ``k0..k0+BK-1`` of a row-major ``[N, K]`` weight: ``w`` is
    a TMA descriptor of ``[BN, BK]`` blocks (``TMA``) or a pointer."""
    if TMA:
        tile = w.load([n0, k0])
    else:
        n = n0 + tl.arange(0, BN)
        tile = tl.load(w + n[:, None] * K + (k0 + tl.arange(0, BK))[None, :])
    return tile


@triton.jit
def bf16(x):
    """Rounds fp32 to bf16 (nearest even) and back: an eager module's bf16 output."""
    if _RNE_BY_HAND:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        out = bits.to(tl.float32, bitcast=True)
    else:
        out = x.to(tl.bfloat16).to(tl.float32)
    return out


@triton.jit
def row_rstd(x_ptr, stride_x, rows, rmask, eps, K: tl.constexpr, BM: tl.constexpr,
              BK: tl.constexpr):
    """``1 / sqrt(mean(x^2) + eps)`` per row, in fp32 (``F.rms_norm`` of ``x.float()``)."""
    sq = tl.zeros([BM], dtype=tl.float32)
    for k0 in tl.static_range(0, K, BK):  # unrolled: every load is in flight at once
        cols = k0 + tl.arange(0, BK)
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=rmask[:, None],
                    other=0.0).to(tl.float32)
        sq += tl.sum(x * x, axis=1)
    return 1.0 / tl.sqrt(sq / K + eps)


@triton.jit
def normed_tile(x_ptr, nw_ptr, stride_x, rows, rmask, rstd, cols):
    """RMSNorm of an input tile as ``RMSNorm.forward`` rounds it: ``bf16(w * bf16(x * rstd))``."""
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=rmask[:, None],
                other=0.0).to(tl.float32)
    w = tl.load(nw_ptr + cols).to(tl.float32)
    return bf16(w[None, :] * bf16(x * rstd[:, None])).to(tl.bfloat16)


@triton.jit
def input_tile(a, stride_a, rows, rmask, r0, k0, BK: tl.constexpr, TMA_A: tl.constexpr):
    """Rows ``rows`` (from ``r0``), columns ``k0..k0+BK-1`` of a row-major bf16 input: ``a`` is
    a TMA descriptor of ``[BM, BK]`` blocks (``TMA_A``; rows past the tensor read as zeros) or
    a pointer (masked rows read as zeros)."""
    if TMA_A:
        tile = a.load([r0, k0])
    else:
        cols = k0 + tl.arange(0, BK)
        tile = tl.load(a + rows[:, None] * stride_a + cols[None, :], mask=rmask[:, None],
                       other=0.0)
    return tile


@triton.jit(do_not_specialize=["R"])  # one build serves every row count
def rms_norm_rows_kernel(x_ptr, nw_ptr, out_ptr, R, eps, stride_x, stride_out,
                         K: tl.constexpr, BM: tl.constexpr, NK: tl.constexpr,
                         PDL: tl.constexpr = False):
    """Program (row block): ``RMSNorm(x)`` of BM rows as the GEMM prologues round it
    (``normed_tile``), for GEMMs that read normed rows (``Tiles.prenorm``)."""
    pdl_wait(PDL)
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    rmask = rows < R
    rstd = row_rstd(x_ptr, stride_x, rows, rmask, eps, K, BM, NK)
    for k0 in tl.static_range(0, K, NK):
        cols = k0 + tl.arange(0, NK)
        xn = normed_tile(x_ptr, nw_ptr, stride_x, rows, rmask, rstd, cols)
        tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], xn, mask=rmask[:, None])


@triton.jit
def norm_dot2(x_ptr, nw_ptr, w, stride_x, rows, rmask, eps, r0, a0, b0, k_start,
              K: tl.constexpr, KLEN: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
              BK: tl.constexpr, NK: tl.constexpr, F32: tl.constexpr, TMA: tl.constexpr,
              PRENORM: tl.constexpr):
    """``RMSNorm(x) @ w[a0:a0+BN].T`` and ``@ w[b0:b0+BN].T`` over columns ``k_start ..
    k_start + KLEN - 1`` of K in one pass (fp32 ``[BM, BN]`` each; all of K, or one split of
    it): gate and up, or the two RoPE halves of a head, with the input tile loaded once. The
    rows' rstd reads all of K in ``NK`` steps first.
    ``PRENORM`` (``Tiles.prenorm``): ``x_ptr`` is a TMA descriptor of rows already normed
    (``rms_norm_rows``; the row block's first row ``r0``), ``nw_ptr`` and ``eps`` unread, no
    rstd taken; the same tiles in the same K order."""
    if not PRENORM:
        rstd = row_rstd(x_ptr, stride_x, rows, rmask, eps, K, BM, NK)
    acc_a = tl.zeros([BM, BN], dtype=tl.float32)
    acc_b = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, KLEN, BK):  # constant trip count: the loop pipelines
        if PRENORM:
            xn = input_tile(x_ptr, stride_x, rows, rmask, r0, k_start + k0, BK, True)
        else:
            cols = k_start + k0 + tl.arange(0, BK)
            xn = normed_tile(x_ptr, nw_ptr, stride_x, rows, rmask, rstd, cols)
        w_a = weight_tile(w, a0, k_start + k0, K, BN, BK, TMA)
        w_b = weight_tile(w, b0, k_start + k0, K, BN, BK, TMA)
        acc_a += mm(xn, tl.trans(w_a), F32)
        acc_b += mm(xn, tl.trans(w_b), F32)
    return acc_a, acc_b


@triton.jit
def rope(lo, hi, cos_lo, cos_hi, sin_lo, sin_hi):
    """``apply_rope`` on the two halves of heads (fp32 of bf16 values): ``x * cos +
    rotate_half(x) * sin``, each product and the sum rounded to bf16 as the eager op does."""
    out_lo = bf16(bf16(lo * cos_lo) + bf16(-hi * sin_lo))
    out_hi = bf16(bf16(hi * cos_hi) + bf16(lo * sin_hi))
    return out_lo, out_hi


@triton.jit
def head_norm_rope(lo, hi, w_ptr, cos_lo, cos_hi, sin_lo, sin_hi, eps, D: tl.constexpr):
    """QK-norm then RoPE: RMSNorm over each row of ``lo``/``hi`` (the halves of one head per row,
    ``[rows, D/2]``, fp32 of bf16 values), then RoPE, at ``RMSNorm``'s and ``apply_rope``'s bf16
    rounding points (the backbone's DECODE and PREFILL steps)."""
    HALF: tl.constexpr = D // 2
    d = tl.arange(0, HALF)
    rstd = 1.0 / tl.sqrt((tl.sum(lo * lo, axis=1) + tl.sum(hi * hi, axis=1)) / D + eps)
    w_lo = tl.load(w_ptr + d).to(tl.float32)[None, :]
    w_hi = tl.load(w_ptr + HALF + d).to(tl.float32)[None, :]
    n_lo = bf16(w_lo * bf16(lo * rstd[:, None]))
    n_hi = bf16(w_hi * bf16(hi * rstd[:, None]))
    return rope(n_lo, n_hi, cos_lo, cos_hi, sin_lo, sin_hi)


@triton.jit
def softmax_step(s, m, total):
    """One key block of an online softmax over scores ``s [rows, keys]`` (-inf where masked):
    the new running max, the block's unnormalised probabilities, the factor that rescales the
    sums so far, and the new running sum; a row with no key yet keeps its max at -inf and its
    sums at 0."""
    m_new = tl.maximum(m, tl.max(s, axis=1))
    base = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet
    p = tl.exp(s - base[:, None])
    alpha = tl.exp(m - base)
    return m_new, p, alpha, total * alpha + tl.sum(p, axis=1)


@triton.jit(do_not_specialize=["R"])  # one build serves every row count
def norm_linear_kernel(
    x_ptr, nw_ptr, w_ptr, out_ptr, R, eps, stride_x, stride_out,
    K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NK: tl.constexpr,
    F32: tl.constexpr, TMA: tl.constexpr = False, PDL: tl.constexpr = False,
):
    """Program (column block, row block): ``bf16(RMSNorm(x) @ w.T)``."""
    pdl_wait(PDL)
    rows = tl.program_id(1) * BM + tl.arange(0, BM)
    rmask = rows < R
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    rstd = row_rstd(x_ptr, stride_x, rows, rmask, eps, K, BM, NK)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        cols = k0 + tl.arange(0, BK)
        xn = normed_tile(x_ptr, nw_ptr, stride_x, rows, rmask, rstd, cols)
        w = weight_tile(w_ptr, tl.program_id(0) * BN, k0, K, BN, BK, TMA)
        acc += mm(xn, tl.trans(w), F32)
    tl.store(out_ptr + rows[:, None] * stride_out + n[None, :], bf16(acc).to(tl.bfloat16),
             mask=rmask[:, None])


@triton.jit(do_not_specialize=["R"])  # one build serves every row count
def norm_gate_up_kernel(
    x_ptr, nw_ptr, w_ptr, out_ptr, R, eps, stride_x, stride_out,
    I: tl.constexpr, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    NK: tl.constexpr, F32: tl.constexpr, TMA: tl.constexpr = False, PDL: tl.constexpr = False,
    PRENORM: tl.constexpr = False,
):
    """Program (column block, row block): ``bf16(silu(gate) * up)`` of the normed input; gate
    rows 0..I-1 and up rows I..2I-1 of the packed weight. ``PRENORM``: ``x_ptr`` is a TMA
    descriptor of rows already normed (``rms_norm_rows``), ``nw_ptr`` and ``eps`` unread."""
    pdl_wait(PDL)
    rows = tl.program_id(1) * BM + tl.arange(0, BM)
    rmask = rows < R
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    n0 = tl.program_id(0) * BN
    acc_g, acc_u = norm_dot2(x_ptr, nw_ptr, w_ptr, stride_x, rows, rmask, eps,
                             tl.program_id(1) * BM, n0, n0 + I, 0, K, K, BM, BN, BK, NK, F32,
                             TMA, PRENORM)
    gate, up = bf16(acc_g), bf16(acc_u)
    act = bf16(gate / (1.0 + tl.exp(-gate)))  # F.silu on a bf16 tensor
    tl.store(out_ptr + rows[:, None] * stride_out + n[None, :], bf16(act * up).to(tl.bfloat16),
             mask=rmask[:, None])


@triton.jit
def split_partial(a_ptr, w_ptr, stride_a, rows, rmask, r0, n0, k_start, KS: tl.constexpr,
                  K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                  F32: tl.constexpr, TMA: tl.constexpr, TMA_A: tl.constexpr):
    """One K split's fp32 partial of ``a @ w.T`` for a ``[rows, n0..n0+BN)`` tile: columns
    ``k_start..k_start+KS`` in ``BK`` steps, in K order."""
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, KS, BK):  # constant trip count: the loop pipelines
        a = input_tile(a_ptr, stride_a, rows, rmask, r0, k_start + k0, BK, TMA_A)
        w = weight_tile(w_ptr, n0, k_start + k0, K, BN, BK, TMA)
        acc += mm(a, tl.trans(w), F32)
    return acc


@triton.jit
def residual_out(total, res_ptr, out_ptr, rows, rmask, n, stride_res, stride_out,
                 HAS_RES: tl.constexpr):
    """``bf16(res + bf16(total))`` (``HAS_RES`` off: ``bf16(total)``) into the output tile."""
    if HAS_RES:
        res = tl.load(res_ptr + rows[:, None] * stride_res + n[None, :],
                      mask=rmask[:, None], other=0.0).to(tl.float32)
        out = bf16(res + bf16(total)).to(tl.bfloat16)
    else:
        out = bf16(total).to(tl.bfloat16)
    tl.store(out_ptr + rows[:, None] * stride_out + n[None, :], out, mask=rmask[:, None])


@triton.jit(do_not_specialize=["R"])  # one build serves every row count
def linear_residual_kernel(
    a_ptr, w_ptr, res_ptr, out_ptr, ws_ptr, count_ptr, R, stride_a, stride_res, stride_out,
    ws_split, N: tl.constexpr, K: tl.constexpr, SPLIT: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, F32: tl.constexpr,
    TMA: tl.constexpr = False, HAS_RES: tl.constexpr = True, PDL: tl.constexpr = False,
    TMA_A: tl.constexpr = False, INLINE: tl.constexpr = False,
):
    """Program (column block, K split, row block): ``out = bf16(res + bf16(a @ w.T))``
    (``HAS_RES`` off: ``bf16(a @ w.T)``, ``res_ptr`` unread; ``TMA_A``: ``a_ptr`` is a TMA
    descriptor of ``[BM, BK]`` blocks of ``a``).

    Each program stores its fp32 partial; the last of the SPLIT programs of a tile (atomic
    counter) sums all partials in split order, writes the tile and resets the counter.
    ``INLINE`` (grid of one split): one program makes the SPLIT partials in turn and sums them in
    the same order, no workspace: the same bits."""
    pdl_wait(PDL)  # before the workspace: the previous split-K launch may still be summing
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    row_block = tl.program_id(2)
    rows = row_block * BM + tl.arange(0, BM)
    rmask = rows < R
    n = pid_n * BN + tl.arange(0, BN)
    KS: tl.constexpr = K // SPLIT
    if INLINE:
        total = tl.zeros([BM, BN], dtype=tl.float32)
        for s in tl.static_range(SPLIT):
            partial = split_partial(a_ptr, w_ptr, stride_a, rows, rmask, row_block * BM,
                                    pid_n * BN, s * KS, KS, K, BM, BN, BK, F32, TMA, TMA_A)
            # through a select, so the compiler cannot fold the sum into the last MMA's
            # accumulator (add(dot(a, b, 0), t) -> dot(a, b, t) would change the rounding)
            total += tl.where(rmask[:, None], partial, 0.0)
        residual_out(total, res_ptr, out_ptr, rows, rmask, n, stride_res, stride_out, HAS_RES)
    else:
        acc = split_partial(a_ptr, w_ptr, stride_a, rows, rmask, row_block * BM, pid_n * BN,
                            split * KS, KS, K, BM, BN, BK, F32, TMA, TMA_A)
        tile = ws_ptr + rows[:, None] * N + n[None, :]  # partials of this call: [SPLIT, R, N]
        tl.store(tile + split * ws_split, acc, mask=rmask[:, None])
        tl.debug_barrier()  # every thread's partial is written before the counter says so
        counter = count_ptr + row_block * (N // BN) + pid_n
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT - 1:
            total = tl.zeros([BM, BN], dtype=tl.float32)
            for s in range(SPLIT):
                total += tl.load(tile + s * ws_split, mask=rmask[:, None], other=0.0,
                                 cache_modifier=".cg")
            residual_out(total, res_ptr, out_ptr, rows, rmask, n, stride_res, stride_out,
                         HAS_RES)
            tl.store(counter, 0)


def check_bf16(weight: torch.Tensor, model: str) -> None:
    """The kernels store bf16 and round at bf16 points: other dtypes must not run them."""
    if weight.dtype != torch.bfloat16:
        raise ValueError(f"fused kernels need the {model} in bfloat16, not {weight.dtype} "
                         "(model.dtype)")


def warm_row_counts(max_rows: int) -> list[int]:
    """One row count per row-block size (16, 32, 64 rows) up to ``max_rows``: running each once
    at start builds every kernel variant a layer with the default row blocks can need (a caller
    that asks for 128-row blocks, ``row_block(rows, 128)``, adds a count past 64 itself)."""
    return sorted({min(rows, max_rows) for rows in (1, 17, 33)})


def row_block(rows: int, most: int = BM_MAX) -> int:
    """Rows per program for ``rows`` rows: a power of two from 16 up to ``most`` (<= 128)."""
    return min(most, 128, max(16, triton.next_power_of_2(rows)))


class FusedGemms:
    """Launches the shared kernels with one set of ``Tiles`` and one split-K workspace.

    The workspace (fp32 partials for ``max_rows`` rows of ``max_n`` columns) and the tile
    counters are allocated once, so CUDA graphs capture them; a call with more rows (an
    uncaptured eager fallback) gets its own for that call.
    """

    def __init__(self, tiles: Tiles, max_rows: int, max_n: int, device: torch.device) -> None:
        self.tiles, self.max_rows, self.max_n = tiles, max_rows, max_n
        self.workspace, self.counters = self._workspace(max_rows, device)
        self._descriptors: dict[tuple[int, int, int], TensorDescriptor] = {}

    def weight(self, weight: torch.Tensor, block_n: int, block_k: int) -> object:
        """What a kernel reads ``weight`` through: the tensor, or with ``Tiles.tma`` its TMA
        descriptor of ``[block_n, block_k]`` tiles (built once per weight: weights never move)."""
        if not self.tiles.tma:
            return weight
        key = (weight.data_ptr(), block_n, block_k)
        if key not in self._descriptors:
            self._descriptors[key] = TensorDescriptor.from_tensor(weight, [block_n, block_k])
        return self._descriptors[key]

    def _workspace(self, rows: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        t = self.tiles
        workspace = torch.empty(t.split_k, rows, self.max_n, dtype=torch.float32, device=device)
        counters = torch.zeros(triton.cdiv(rows, 16) * triton.cdiv(self.max_n, t.split_bn),
                               dtype=torch.int32, device=device)  # row blocks hold >= 16 rows
        return workspace, counters

    def check(
        self, name: str, *, norm_k: int = 0, linear: tuple[int, int] | None = None,
        gate_up: tuple[int, int] | None = None, split: tuple[int, int] | None = None,
    ) -> None:
        """Raises ``ValueError`` naming ``name`` unless every GEMM given as ``(n, k)`` (output
        columns, reduction length) runs whole power-of-two tiles: ``norm_k``, the length an
        RMSNorm prologue reads; ``linear`` (``norm_linear``), ``gate_up`` (``n`` = intermediate
        size) and ``split`` (``linear_residual``, whose ``n`` must fit the workspace)."""
        t = self.tiles

        def whole(length: int, block: int) -> bool:  # whole tiles of a power-of-two size
            size = min(block, length)
            return length > 0 and size & (size - 1) == 0 and length % size == 0

        ok = norm_k == 0 or whole(norm_k, 256)
        if linear is not None:
            ok &= linear[0] % t.linear_bn == 0 and whole(linear[1], t.linear_bk)
        if gate_up is not None:
            ok &= gate_up[0] % t.gate_bn == 0 and whole(gate_up[1], t.gate_bk)
        if split is not None:
            n, k = split
            ok &= (n % t.split_bn == 0 and n <= self.max_n and k % (t.split_k * 16) == 0
                   and whole(k // t.split_k, t.split_bk))
        if not ok:
            raise ValueError(f"fused kernels: {name} does not fit {t}")

    def norm_linear(self, x: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor,
                    eps: float) -> torch.Tensor:
        t = self.tiles
        rows, (n, k) = x.shape[0], weight.shape
        out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
        bm = row_block(rows)
        bk = min(t.linear_bk, k)
        norm_linear_kernel[(n // t.linear_bn, triton.cdiv(rows, bm))](
            x, norm_weight, self.weight(weight, t.linear_bn, bk), out, rows, eps, x.stride(0),
            out.stride(0), K=k, BM=bm, BN=t.linear_bn, BK=bk, NK=min(256, k), F32=DOT_F32,
            TMA=t.tma, **t.launch("linear"),
        )
        return out

    def rms_norm_rows(self, x: torch.Tensor, norm_weight: torch.Tensor,
                      eps: float) -> torch.Tensor:
        """``RMSNorm(x)`` as the GEMM prologues round it, one launch (``Tiles.prenorm``)."""
        rows, k = x.shape
        out = torch.empty_like(x)
        bm = row_block(rows, 16)  # small blocks: many programs for a short read
        rms_norm_rows_kernel[(triton.cdiv(rows, bm),)](
            x, norm_weight, out, rows, eps, x.stride(0), out.stride(0), K=k, BM=bm,
            NK=min(256, k), num_warps=4, **pdl_launch(self.tiles.pdl))
        return out

    @staticmethod
    def rows_input(a: torch.Tensor, block_m: int, block_k: int) -> TensorDescriptor:
        """A TMA descriptor of ``[block_m, block_k]`` blocks of a row-major input (cheap: made
        per call, since activations move between calls)."""
        return TensorDescriptor.from_tensor(a, [block_m, block_k])

    def normed_input(self, x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                     block_m: int, block_k: int) -> object:
        """What a norm-prologue GEMM reads: ``x`` itself, or with ``Tiles.prenorm`` a TMA
        descriptor of ``rms_norm_rows(x)`` (one launch, here)."""
        if not self.tiles.prenorm:
            return x
        return self.rows_input(self.rms_norm_rows(x, norm_weight, eps), block_m, block_k)

    def norm_gate_up(self, x: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        t = self.tiles
        rows, k = x.shape
        inter = weight.shape[0] // 2
        out = torch.empty(rows, inter, dtype=x.dtype, device=x.device)
        bm = row_block(rows, t.gate_bm)
        bk = min(t.gate_bk, k)
        norm_gate_up_kernel[(inter // t.gate_bn, triton.cdiv(rows, bm))](
            self.normed_input(x, norm_weight, eps, bm, bk), norm_weight,
            self.weight(weight, t.gate_bn, bk), out, rows, eps, x.stride(0), out.stride(0),
            I=inter, K=k, BM=bm, BN=t.gate_bn, BK=bk, NK=min(256, k),
            F32=DOT_F32, TMA=t.tma, PRENORM=t.prenorm, **t.launch("gate"),
        )
        return out

    def linear_residual(self, a: torch.Tensor, weight: torch.Tensor,
                        residual: torch.Tensor | None, inline: bool = False) -> torch.Tensor:
        """``residual + a @ weight.T`` (bf16 rounding points of ``x + linear(a)``), split-K;
        ``residual=None``: ``linear(a)``; ``inline``: each program sums its tile's K splits
        itself (``Tiles.o_inline``), the same bits."""
        t = self.tiles
        rows, (n, k) = a.shape[0], weight.shape
        workspace, counters = (
            (self.workspace, self.counters) if rows <= self.max_rows or inline
            else self._workspace(rows, a.device)  # inline: neither is touched
        )
        out = torch.empty(rows, n, dtype=a.dtype, device=a.device)
        has_res = residual is not None
        residual = residual if has_res else out  # never read
        bm = row_block(rows, t.split_bm)
        bk = min(t.split_bk, k // t.split_k)
        grid = (n // t.split_bn, 1 if inline else t.split_k, triton.cdiv(rows, bm))
        linear_residual_kernel[grid](
            self.rows_input(a, bm, bk) if t.prenorm else a, self.weight(weight, t.split_bn, bk),
            residual, out, workspace, counters, rows, a.stride(0), residual.stride(0),
            out.stride(0), workspace.stride(0), N=n, K=k, SPLIT=t.split_k, BM=bm,
            BN=t.split_bn, BK=bk, F32=DOT_F32, TMA=t.tma, HAS_RES=has_res, TMA_A=t.prenorm,
            INLINE=inline, **t.launch("split"),
        )
        return out
