"""The depth decoder's whole frame in one persistent Triton launch.

Owns: ``_frame_kernel`` and ``PersistentDepthFrame``, a drop-in for the 15-step loop of
``stages/depth.depth_frames`` on CUDA: for positions 0..15 of every request of the batch, the
input projector (position 0 reads the backbone's hidden state, position p the audio table's row
of code c_{p-1}), the 12 layers (RMSNorm + q/k/v + RoPE into a frame-local cache, attention
over <= 16 keys, o_proj + residual, RMSNorm + gate/up + SiLU * up, down + residual), the final
norm, the codebook head (bf16 weights, fp32 sums: the products are the fp32 head's, exactly),
CFG and the draw (``fused_sampling.sample_row``: temperature, top-k, top-p, counter-based
Gumbel noise), in ONE launch instead of ~1,200.

How: a grid of ``programs`` (one or two per SM, launched cooperatively so that all are resident)
walks a fixed list of phases (per position: projector, 5 per layer, head, draw); inside a phase
each program takes work items ``pid, pid + P, ...`` (a tile of output columns x a K split x a
block of rows), and between phases every program meets at a grid barrier (a monotonic int64
counter in global memory: release on arrival, acquire when the count reaches the next multiple
of P). GEMMs split along K leave fp32 partials; the last program to finish a tile (an atomic
tile counter) sums them in split order and runs the epilogue, as ``gemm.linear_residual_kernel``
does, so a row's bits depend neither on its batch nor on which program finishes last. Data made
inside the launch is read with ``.cg`` loads (L2, never a stale L1 line). Under Triton's
interpreter (CPU tests), which runs programs one after another, the same kernel runs one phase
per launch without barriers: the tile math is tested there, the barriers on the GPU.

Numerics: the bf16 rounding points of the eager modules (``DepthDecoder.run_layers``), with
other summation orders than cuBLAS (within bf16 tolerance; tests/gpu compare with fp32 math).
Must not: sample the first code (the backbone's, with its penalty: ``depth_frames`` does), know
about requests beyond per-row parameters, or sync with the host.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from breezert.kernels.fused_sampling import sample_row
from breezert.kernels.gemm import DOT_F32, INTERPRETED, bf16, check_bf16, mm, rope

CODEBOOK_CODES = 2048  # codes 0..2047; 2048..2050 reserved, drawn never (suppress_reserved)
MAX_K = 64  # every row's depth top-k must be in 1..MAX_K (stages.depth.TOP_K_BOUND)
PHASES_PER_LAYER = 5


@dataclass(frozen=True)
class FrameTiles:
    """Work-item shapes of each phase: output columns per tile (``*_bn``), K splits
    (``*_split``; they set the sum order, so they never change with the rows), K chunk
    (``*_bk``), and rows per item (``bm``, chosen per call from the row count)."""

    proj_bn: int = 32
    proj_split: int = 4
    proj_bk: int = 128
    qkv_sub: int = 4  # programs per head: column slices of both RoPE halves
    qkv_split: int = 2
    qkv_bk: int = 128
    o_bn: int = 32
    o_split: int = 4
    o_bk: int = 128
    gate_bn: int = 64
    gate_bk: int = 64
    down_bn: int = 32
    down_split: int = 4
    down_bk: int = 128
    head_bn: int = 16
    head_bk: int = 128
    num_warps: int = 8
    num_stages: int = 4
    programs_per_sm: int = 1
    max_bm: int = 64
    """Rows per work item grow with the rows (16 .. ``max_bm``), so that many rows read each
    weight tile fewer times."""


# ---------------------------------------------------------------------------------------------
# Device helpers


@triton.jit
def _acquire_load(ptr):
    """``ld.acquire.gpu`` of an int64: a read that later reads cannot pass (no atomic)."""
    return tl.inline_asm_elementwise("ld.global.acquire.gpu.b64 $0, [$1];", "=l,l", [ptr],
                                     dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _grid_sync(bar_ptr, num_programs):
    """Every program of the grid meets here: release this program's writes, wait until all
    ``num_programs`` arrived at this barrier, acquire theirs. The counter only grows (a launch
    adds the same multiple of the grid size), so no reset is needed between launches. One
    atomic per program; the wait spins on acquire loads, which do not queue behind the
    arrivals as atomics on the same word would."""
    tl.debug_barrier()  # every thread's stores are issued before the arrival
    old = tl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")
    target = (old // num_programs + 1) * num_programs
    seen = _acquire_load(bar_ptr)
    while seen < target:
        seen = _acquire_load(bar_ptr)
    tl.debug_barrier()  # no thread reads before the acquire


@triton.jit
def _rstd(x_ptr, stride, rows, rmask, eps, K: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    """``1 / sqrt(mean(x^2) + eps)`` per row (fp32), ``x`` made inside this launch."""
    sq = tl.zeros([BM], dtype=tl.float32)
    for k0 in tl.static_range(0, K, BK):  # unrolled: every load in flight at once
        cols = k0 + tl.arange(0, BK)
        x = tl.load(x_ptr + rows[:, None] * stride + cols[None, :], mask=rmask[:, None],
                    other=0.0, cache_modifier=".cg").to(tl.float32)
        sq += tl.sum(x * x, axis=1)
    return 1.0 / tl.sqrt(sq / K + eps)


@triton.jit
def _normed(x_ptr, stride, nw_ptr, rows, rmask, rstd, cols):
    """RMSNorm of an input tile at ``RMSNorm.forward``'s rounding: ``bf16(w * bf16(x * rstd))``."""
    x = tl.load(x_ptr + rows[:, None] * stride + cols[None, :], mask=rmask[:, None], other=0.0,
                cache_modifier=".cg").to(tl.float32)
    w = tl.load(nw_ptr + cols).to(tl.float32)
    return bf16(w[None, :] * bf16(x * rstd[:, None])).to(tl.bfloat16)


@triton.jit
def _finish(acc, tile_id, split, rows, rmask, n, N, out_ptr, stride_out, ws_ptr, ws_split,
            cnt_ptr, HAS_RES: tl.constexpr, S: tl.constexpr, BM: tl.constexpr,
            BN: tl.constexpr):
    """A split-K tile's end: ``out = bf16(out + bf16(sum))`` (``HAS_RES``: the residual is the
    output buffer itself) or ``bf16(sum)``, summed by the last of its ``S`` programs."""
    mask = rmask[:, None]
    dst = out_ptr + rows[:, None] * stride_out + n[None, :]
    if S == 1:
        total = acc
        last = True
    else:
        part = ws_ptr + rows[:, None] * N + n[None, :]  # [S, R, N] partials
        tl.store(part + split * ws_split, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is written before the counter says so
        arrived = tl.atomic_add(cnt_ptr + tile_id, 1, sem="acq_rel", scope="gpu")
        last = arrived == S - 1
        total = tl.zeros([BM, BN], dtype=tl.float32)
        if last:
            for s in range(S):
                total += tl.load(part + s * ws_split, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(cnt_ptr + tile_id, 0)
    if last:
        if HAS_RES:
            res = tl.load(dst, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
            out = bf16(res + bf16(total))
        else:
            out = bf16(total)
        tl.store(dst, out.to(tl.bfloat16), mask=mask)


@triton.jit
def _split_item(item, R, n_tiles: tl.constexpr, S: tl.constexpr, BM: tl.constexpr,
                BN: tl.constexpr):
    """Work item ``item`` of a GEMM phase (``S`` = 1: not split): (tile, K split, row block, its
    rows, which of them exist, its output columns)."""
    tile = item % n_tiles
    split = (item // n_tiles) % S
    rb = item // (n_tiles * S)
    rows = rb * BM + tl.arange(0, BM)
    return tile, split, rb, rows, rows < R, tile * BN + tl.arange(0, BN)


# ---------------------------------------------------------------------------------------------
# Phases


@triton.jit
def _proj_phase(pid, P, pos, R, B, hidden_ptr, codes_ptr, embed_ptr, w_ptr, h_ptr, ws_ptr,
                ws_split, cnt_ptr, D: tl.constexpr, DB: tl.constexpr, V: tl.constexpr,
                NCB: tl.constexpr, S: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                BK: tl.constexpr, F32: tl.constexpr):
    """``h = x @ W_proj.T``: x is the backbone state (position 0) or the audio table's row of
    the code drawn at position ``pos - 1`` in codebook ``pos - 1`` (both CFG rows of a request
    take its code; an EOS first code is clamped into the table, as ``depth_frames`` does)."""
    n_tiles: tl.constexpr = D // BN
    KS: tl.constexpr = DB // S
    n_items = n_tiles * S * tl.cdiv(R, BM)
    for item in range(pid, n_items, P):
        tile, split, rb, rows, rmask, n = _split_item(item, R, n_tiles, S, BM, BN)
        if pos == 0:
            src = hidden_ptr + rows.to(tl.int64) * DB
        else:
            code = tl.load(codes_ptr + (rows % B) * NCB + pos - 1, mask=rmask, other=0,
                           cache_modifier=".cg")
            code = tl.minimum(code, V - 1)
            src = embed_ptr + (code + V * (pos - 1)).to(tl.int64) * DB
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, KS, BK):
            cols = split * KS + k0 + tl.arange(0, BK)
            a = tl.load(src[:, None] + cols[None, :], mask=rmask[:, None], other=0.0,
                        cache_modifier=".cg")
            w = tl.load(w_ptr + n[:, None] * DB + cols[None, :])
            acc += mm(a, tl.trans(w), F32)
        _finish(acc, rb * n_tiles + tile, split, rows, rmask, n, D, h_ptr, D, ws_ptr, ws_split,
                cnt_ptr, False, S, BM, BN)


@triton.jit
def _qkv_phase(pid, P, pos, R, h_ptr, nw_ptr, w_ptr, cos_ptr, sin_ptr, q_ptr, cache_ptr,
               ws_ptr, ws_split, cnt_ptr, eps, c_kv, c_row, c_head, c_pos,
               D: tl.constexpr, H: tl.constexpr, KVH: tl.constexpr, HD: tl.constexpr,
               SUB: tl.constexpr, S: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
               F32: tl.constexpr, RK: tl.constexpr):
    """RMSNorm + packed q/k/v GEMM + RoPE: q heads to ``q``, k and v heads into the frame cache
    at ``pos``. An item is (head t, slice of SUB, K split, rows); a slice holds matching columns
    of both RoPE halves, so the rotation stays inside the item."""
    HALF: tl.constexpr = HD // 2
    C: tl.constexpr = HALF // SUB
    N: tl.constexpr = (H + 2 * KVH) * HD
    n_tiles: tl.constexpr = (H + 2 * KVH) * SUB
    KS: tl.constexpr = D // S
    n_items = n_tiles * S * tl.cdiv(R, BM)
    for item in range(pid, n_items, P):
        tile = item % n_tiles
        split = (item // n_tiles) % S
        rb = item // (n_tiles * S)
        t = tile // SUB
        j0 = (tile % SUB) * C
        d = j0 + tl.arange(0, C)
        rows = rb * BM + tl.arange(0, BM)
        rmask = rows < R
        rstd = _rstd(h_ptr, D, rows, rmask, eps, D, BM, RK)
        a0 = t * HD + j0
        acc_lo = tl.zeros([BM, C], dtype=tl.float32)
        acc_hi = tl.zeros([BM, C], dtype=tl.float32)
        for k0 in range(0, KS, BK):
            cols = split * KS + k0 + tl.arange(0, BK)
            xn = _normed(h_ptr, D, nw_ptr, rows, rmask, rstd, cols)
            w_lo = tl.load(w_ptr + (a0 + tl.arange(0, C))[:, None] * D + cols[None, :])
            w_hi = tl.load(w_ptr + (a0 + HALF + tl.arange(0, C))[:, None] * D + cols[None, :])
            acc_lo += mm(xn, tl.trans(w_lo), F32)
            acc_hi += mm(xn, tl.trans(w_hi), F32)
        mask = rmask[:, None]
        if S == 1:
            last = True
        else:
            part = ws_ptr + rows[:, None] * N + (t * HD + d)[None, :]
            tl.store(part + split * ws_split, acc_lo, mask=mask)
            tl.store(part + split * ws_split + HALF, acc_hi, mask=mask)
            tl.debug_barrier()
            arrived = tl.atomic_add(cnt_ptr + rb * n_tiles + tile, 1, sem="acq_rel", scope="gpu")
            last = arrived == S - 1
            if last:
                acc_lo = tl.zeros([BM, C], dtype=tl.float32)
                acc_hi = tl.zeros([BM, C], dtype=tl.float32)
                for s in range(S):
                    acc_lo += tl.load(part + s * ws_split, mask=mask, other=0.0,
                                      cache_modifier=".cg")
                    acc_hi += tl.load(part + s * ws_split + HALF, mask=mask, other=0.0,
                                      cache_modifier=".cg")
                tl.store(cnt_ptr + rb * n_tiles + tile, 0)
        if last:
            lo, hi = bf16(acc_lo), bf16(acc_hi)
            if t < H + KVH:  # q and k heads get RoPE
                lo, hi = rope(
                    lo, hi, tl.load(cos_ptr + pos * HD + d).to(tl.float32)[None, :],
                    tl.load(cos_ptr + pos * HD + HALF + d).to(tl.float32)[None, :],
                    tl.load(sin_ptr + pos * HD + d).to(tl.float32)[None, :],
                    tl.load(sin_ptr + pos * HD + HALF + d).to(tl.float32)[None, :])
            if t < H:
                dst = q_ptr + rows[:, None] * (H * HD) + t * HD + d[None, :]
            else:
                is_v = (t >= H + KVH).to(tl.int32)
                head = t - H - is_v * KVH
                dst = (cache_ptr + is_v * c_kv + rows[:, None] * c_row + head * c_head
                       + pos * c_pos + d[None, :])
            tl.store(dst, lo.to(tl.bfloat16), mask=mask)
            tl.store(dst + HALF, hi.to(tl.bfloat16), mask=mask)


@triton.jit
def _attend(q_row, kv, out_row, heads, d, slots, live, scale, c_kv, c_pos, HD: tl.constexpr):
    """One row's query ``heads`` (a KV head's group, ``[G]``) against cache slots 0..pos
    (``live``; ``kv``: the row's K cache of that KV head), rounded as flash attention rounds
    (unnormalised probabilities to bf16 for P @ V, fp32 row sums), to ``out_row``'s columns of
    those heads in bf16."""
    q = tl.load(q_row + heads[:, None] * HD + d[None, :], cache_modifier=".cg").to(tl.float32)
    base = kv + slots[:, None] * c_pos + d[None, :]
    k = tl.load(base, mask=live[:, None], other=0.0, cache_modifier=".cg").to(tl.float32)
    v = tl.load(base + c_kv, mask=live[:, None], other=0.0, cache_modifier=".cg").to(tl.float32)
    scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [G, NP]
    scores = tl.where(live[None, :], scores, float("-inf"))
    p = tl.exp(scores - tl.max(scores, axis=1)[:, None])
    out = tl.sum(bf16(p)[:, :, None] * v[None, :, :], axis=1)  # [G, HD]
    out = out / tl.sum(p, axis=1)[:, None]
    tl.store(out_row + heads[:, None] * HD + d[None, :], bf16(out).to(tl.bfloat16))


@triton.jit
def _attention_phase(pid, P, pos, R, q_ptr, cache_ptr, out_ptr, scale, c_kv, c_row, c_head,
                     c_pos, H: tl.constexpr, KVH: tl.constexpr, HD: tl.constexpr,
                     NP: tl.constexpr):
    """Item (row, KV head): ``_attend`` of its query heads."""
    G: tl.constexpr = H // KVH
    d = tl.arange(0, HD)
    slots = tl.arange(0, NP)
    live = slots <= pos
    for item in range(pid, R * KVH, P):
        r = item // KVH
        g = item % KVH
        _attend(q_ptr + r * (H * HD), cache_ptr + r * c_row + g * c_head,
                out_ptr + r * (H * HD), g * G + tl.arange(0, G), d, slots, live, scale, c_kv,
                c_pos, HD)


@triton.jit
def _linear_residual_phase(pid, P, R, a_ptr, w_ptr, h_ptr, ws_ptr, ws_split, cnt_ptr,
                           N: tl.constexpr, K: tl.constexpr, S: tl.constexpr, BM: tl.constexpr,
                           BN: tl.constexpr, BK: tl.constexpr, F32: tl.constexpr):
    """``h = bf16(h + bf16(a @ W.T))`` (o_proj, down_proj), split along K."""
    n_tiles: tl.constexpr = N // BN
    KS: tl.constexpr = K // S
    n_items = n_tiles * S * tl.cdiv(R, BM)
    for item in range(pid, n_items, P):
        tile, split, rb, rows, rmask, n = _split_item(item, R, n_tiles, S, BM, BN)
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, KS, BK):
            cols = split * KS + k0 + tl.arange(0, BK)
            a = tl.load(a_ptr + rows[:, None] * K + cols[None, :], mask=rmask[:, None],
                        other=0.0, cache_modifier=".cg")
            w = tl.load(w_ptr + n[:, None] * K + cols[None, :])
            acc += mm(a, tl.trans(w), F32)
        _finish(acc, rb * n_tiles + tile, split, rows, rmask, n, N, h_ptr, N, ws_ptr, ws_split,
                cnt_ptr, True, S, BM, BN)


@triton.jit
def _gate_up_phase(pid, P, R, h_ptr, nw_ptr, w_ptr, act_ptr, eps, D: tl.constexpr,
                   I: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                   F32: tl.constexpr, RK: tl.constexpr):
    """``act = bf16(silu(gate) * up)`` of the normed ``h``; gate rows 0..I-1 and up rows
    I..2I-1 of the packed weight."""
    n_tiles: tl.constexpr = I // BN
    n_items = n_tiles * tl.cdiv(R, BM)
    for item in range(pid, n_items, P):
        _, _, _, rows, rmask, n = _split_item(item, R, n_tiles, 1, BM, BN)
        rstd = _rstd(h_ptr, D, rows, rmask, eps, D, BM, RK)
        acc_g = tl.zeros([BM, BN], dtype=tl.float32)
        acc_u = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, D, BK):
            cols = k0 + tl.arange(0, BK)
            xn = _normed(h_ptr, D, nw_ptr, rows, rmask, rstd, cols)
            w_g = tl.load(w_ptr + n[:, None] * D + cols[None, :])
            w_u = tl.load(w_ptr + (I + n)[:, None] * D + cols[None, :])
            acc_g += mm(xn, tl.trans(w_g), F32)
            acc_u += mm(xn, tl.trans(w_u), F32)
        gate, up = bf16(acc_g), bf16(acc_u)
        act = bf16(gate / (1.0 + tl.exp(-gate)))  # F.silu on a bf16 tensor
        tl.store(act_ptr + rows[:, None] * I + n[None, :], bf16(act * up).to(tl.bfloat16),
                 mask=rmask[:, None])


@triton.jit
def _head_phase(pid, P, pos, R, h_ptr, nw_ptr, w_ptr, logits_ptr, eps, D: tl.constexpr,
                V: tl.constexpr, VP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                BK: tl.constexpr, F32: tl.constexpr, RK: tl.constexpr):
    """fp32 logits of codebook ``pos``: final RMSNorm (bf16), then ``@ head[pos - 1]`` (bf16
    weights transposed to ``[VP, D]``, fp32 sums)."""
    n_tiles: tl.constexpr = VP // BN
    n_items = n_tiles * tl.cdiv(R, BM)
    w_cb = w_ptr + (pos - 1).to(tl.int64) * (VP * D)
    out = logits_ptr + pos.to(tl.int64) * R * V
    for item in range(pid, n_items, P):
        _, _, _, rows, rmask, n = _split_item(item, R, n_tiles, 1, BM, BN)
        rstd = _rstd(h_ptr, D, rows, rmask, eps, D, BM, RK)
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, D, BK):
            cols = k0 + tl.arange(0, BK)
            xn = _normed(h_ptr, D, nw_ptr, rows, rmask, rstd, cols)
            w = tl.load(w_cb + n[:, None] * D + cols[None, :])
            acc += mm(xn, tl.trans(w), F32)
        tl.store(out + rows[:, None] * V + n[None, :], acc,
                 mask=rmask[:, None] & (n < V)[None, :])


@triton.jit
def _draw_phase(pid, P, pos, R, B, logits_ptr, has_cfg_ptr, scale_ptr, params_ptr, seeds_ptr,
                frames_ptr, codes_ptr, V: tl.constexpr, NCB: tl.constexpr, CODES: tl.constexpr,
                BLOCK: tl.constexpr, MAX_K: tl.constexpr, EXACT_LOG: tl.constexpr):
    """Item = request b: CFG ``u + s (c - u)`` where it has CFG (rows b and B + b), reserved ids
    and padding to -inf, then the depth draw (counter ``frame * 16 + pos``) into
    ``codes[b, pos]``."""
    cols = tl.arange(0, BLOCK)
    inside = cols < CODES
    base = logits_ptr + pos.to(tl.int64) * R * V
    for b in range(pid, B, P):
        cond = tl.load(base + b * V + cols, mask=cols < V, other=0.0, cache_modifier=".cg")
        x = cond
        if R > B:
            uncond = tl.load(base + (B + b) * V + cols, mask=cols < V, other=0.0,
                             cache_modifier=".cg")
            s = tl.load(scale_ptr + b)
            mixed = uncond + s * (cond - uncond)
            x = tl.where(tl.load(has_cfg_ptr + b) != 0, mixed, cond)
        x = tl.where(inside, x, float("-inf"))
        code = sample_row(x, tl.load(params_ptr + b * 3),
                          tl.load(params_ptr + b * 3 + 1).to(tl.int32),
                          tl.load(params_ptr + b * 3 + 2), tl.load(seeds_ptr + b),
                          tl.load(frames_ptr + b) * NCB + pos, cols, inside, MAX_K, EXACT_LOG)
        tl.store(codes_ptr + b * NCB + pos, code.to(tl.int64))


# ---------------------------------------------------------------------------------------------
# The kernel


@triton.jit(do_not_specialize=["R", "B", "s_begin", "s_end"])
def _frame_kernel(
    hidden_ptr, codes_ptr, has_cfg_ptr, scale_ptr, params_ptr, seeds_ptr, frames_ptr,
    embed_ptr, proj_ptr, ln1_ptr, qkv_ptr, o_ptr, ln2_ptr, gu_ptr, down_ptr, norm_ptr, head_ptr,
    cos_ptr, sin_ptr,
    h_ptr, q_ptr, attn_ptr, act_ptr, cache_ptr, logits_ptr, ws_ptr, cnt_ptr, bar_ptr,
    R, B, s_begin, s_end, eps, scale, ws_split, c_layer, c_kv, c_row, c_head, c_pos,
    D: tl.constexpr, DB: tl.constexpr, I: tl.constexpr, H: tl.constexpr, KVH: tl.constexpr,
    HD: tl.constexpr, L: tl.constexpr, NCB: tl.constexpr, V: tl.constexpr, VP: tl.constexpr,
    PROJ_BN: tl.constexpr, PROJ_S: tl.constexpr, PROJ_BK: tl.constexpr,
    QKV_SUB: tl.constexpr, QKV_S: tl.constexpr, QKV_BK: tl.constexpr,
    O_BN: tl.constexpr, O_S: tl.constexpr, O_BK: tl.constexpr,
    GATE_BN: tl.constexpr, GATE_BK: tl.constexpr,
    DOWN_BN: tl.constexpr, DOWN_S: tl.constexpr, DOWN_BK: tl.constexpr,
    HEAD_BN: tl.constexpr, HEAD_BK: tl.constexpr,
    BM: tl.constexpr, BLOCK: tl.constexpr, MAX_K: tl.constexpr, CODES: tl.constexpr,
    F32: tl.constexpr, EXACT_LOG: tl.constexpr, BARRIER: tl.constexpr, RK: tl.constexpr,
):
    """Phases ``s_begin .. s_end - 1`` of a frame (all of them in one launch on the GPU, with a
    grid barrier after each; one per launch under the interpreter). Phase s is position
    ``s // PER``; within it 0 = projector, 1 + 5 l + (0..4) = layer l's q/k/v, attention,
    o_proj, gate/up, down, then head and draw (positions >= 1)."""
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    PER: tl.constexpr = 1 + 5 * L + 2
    for s in range(s_begin, s_end):
        pos = s // PER
        r = s % PER
        layer = (r - 1) // 5
        kind = (r - 1) % 5
        if r == 0:
            _proj_phase(pid, P, pos, R, B, hidden_ptr, codes_ptr, embed_ptr, proj_ptr, h_ptr,
                        ws_ptr, ws_split, cnt_ptr, D, DB, V, NCB, PROJ_S, BM, PROJ_BN, PROJ_BK,
                        F32)
        elif r == PER - 2:
            if pos > 0:
                _head_phase(pid, P, pos, R, h_ptr, norm_ptr, head_ptr, logits_ptr, eps, D, V,
                            VP, BM, HEAD_BN, HEAD_BK, F32, RK)
        elif r == PER - 1:
            if pos > 0:
                _draw_phase(pid, P, pos, R, B, logits_ptr, has_cfg_ptr, scale_ptr, params_ptr,
                            seeds_ptr, frames_ptr, codes_ptr, V, NCB, CODES, BLOCK, MAX_K,
                            EXACT_LOG)
        elif kind == 0:
            _qkv_phase(pid, P, pos, R, h_ptr, ln1_ptr + layer * D,
                       qkv_ptr + layer.to(tl.int64) * ((H + 2 * KVH) * HD * D), cos_ptr, sin_ptr,
                       q_ptr, cache_ptr + layer.to(tl.int64) * c_layer, ws_ptr, ws_split,
                       cnt_ptr, eps, c_kv, c_row, c_head, c_pos, D, H, KVH, HD, QKV_SUB, QKV_S,
                       BM, QKV_BK, F32, RK)
        elif kind == 1:
            _attention_phase(pid, P, pos, R, q_ptr, cache_ptr + layer.to(tl.int64) * c_layer,
                             attn_ptr, scale, c_kv, c_row, c_head, c_pos, H, KVH, HD, NCB)
        elif kind == 2:
            _linear_residual_phase(pid, P, R, attn_ptr, o_ptr + layer.to(tl.int64) * (D * H * HD),
                                   h_ptr, ws_ptr, ws_split, cnt_ptr, D, H * HD, O_S, BM, O_BN,
                                   O_BK, F32)
        elif kind == 3:
            _gate_up_phase(pid, P, R, h_ptr, ln2_ptr + layer * D,
                           gu_ptr + layer.to(tl.int64) * (2 * I * D), act_ptr, eps, D, I, BM,
                           GATE_BN, GATE_BK, F32, RK)
        else:
            _linear_residual_phase(pid, P, R, act_ptr, down_ptr + layer.to(tl.int64) * (D * I),
                                   h_ptr, ws_ptr, ws_split, cnt_ptr, D, I, DOWN_S, BM, DOWN_BN,
                                   DOWN_BK, F32)
        if BARRIER:
            _grid_sync(bar_ptr, P)


# ---------------------------------------------------------------------------------------------
# Host side


def frame_row_block(rows: int, most: int) -> int:
    """Rows per work item: a power of two from 16 to ``most``."""
    return max(16, min(most, triton.next_power_of_2(rows)))


class PersistentDepthFrame:
    """``codes[:, 1:]`` of a frame in one launch (see the module docstring).

    Holds the depth weights stacked per layer (``[L, ...]``, a copy: the modules keep theirs),
    the head transposed and padded to ``[15, VP, d]``, the RoPE tables of positions 0..15 and the
    workspaces of ``max_rows`` rows, all made once, so CUDA graphs capture the launch. Needs
    ``BreezeModel.fuse_projections_()`` first (packed q/k/v and gate/up).
    """

    def __init__(self, depth: torch.nn.Module, max_rows: int, tiles: FrameTiles | None = None,
                 programs: int | None = None, max_k: int = MAX_K) -> None:
        """Workspaces for ``max_rows`` rows: ``depth_frames`` hands it batches of up to that
        many rows (larger ones run its step loop). ``max_k``: every request's depth top-k is
        in 1..max_k (a power of two; the CPU tests take a small one: Triton's interpreter
        sorts slowly)."""
        cfg = depth.cfg
        model = depth.model
        check_bf16(model.norm.weight, "depth")
        layers = model.layers
        if any(layer.self_attn.qkv_weight is None or layer.mlp.gate_up_weight is None
               for layer in layers):
            raise ValueError("the persistent depth frame needs BreezeModel.fuse_projections_()")
        self.cfg, self.max_rows, self.max_k = cfg, max_rows, max_k
        self.tiles = tiles or FrameTiles()
        self._check(cfg, self.tiles)
        self.qkv_sub = self._qkv_sub(cfg, self.tiles)
        device = model.norm.weight.device
        self.device = device
        with torch.no_grad():
            self.embed = model.embed_tokens.weight
            self.proj = model.inputs_embeds_projector.weight.contiguous()
            self.ln1 = torch.stack([layer.input_layernorm.weight for layer in layers])
            self.qkv = torch.stack([layer.self_attn.qkv_weight for layer in layers])
            self.o = torch.stack([layer.self_attn.o_proj.weight for layer in layers])
            self.ln2 = torch.stack([layer.post_attention_layernorm.weight for layer in layers])
            self.gate_up = torch.stack([layer.mlp.gate_up_weight for layer in layers])
            self.down = torch.stack([layer.mlp.down_proj.weight for layer in layers])
            self.norm = model.norm.weight
            heads = depth.codebooks_head.weight.to(torch.bfloat16)  # [15, d, V]
            self.vocab = heads.shape[-1]
            self.vocab_padded = triton.cdiv(self.vocab, self.tiles.head_bn) * self.tiles.head_bn
            self.head = torch.zeros(heads.shape[0], self.vocab_padded, heads.shape[1],
                                    dtype=torch.bfloat16, device=device)
            self.head[:, : self.vocab] = heads.transpose(1, 2)
            steps = torch.arange(cfg.num_codebooks, device=device)
            cos, sin = depth.rope.cos_sin(steps, torch.bfloat16)
            self.cos, self.sin = cos.contiguous(), sin.contiguous()
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        if programs is None:
            sms = (torch.cuda.get_device_properties(device).multi_processor_count
                   if device.type == "cuda" else 4)
            programs = sms * self.tiles.programs_per_sm
        self.programs = programs
        self._alloc(max_rows)

    @staticmethod
    def _qkv_sub(cfg, t: FrameTiles) -> int:
        """Programs per q/k/v head: ``t.qkv_sub``, fewer where a slice of a RoPE half would be
        under 16 columns (a tensor-core tile's least)."""
        return min(t.qkv_sub, max(1, cfg.head_dim // 2 // 16))

    @classmethod
    def _check(cls, cfg, t: FrameTiles) -> None:
        half = cfg.head_dim // 2
        qkv_sub = cls._qkv_sub(cfg, t)
        problems = []
        if half // qkv_sub < 16 or half % qkv_sub:
            problems.append(f"head_dim {cfg.head_dim}")
        for name, n, bn, k, split in (
            ("projector", cfg.hidden_size, t.proj_bn, cfg.backbone_hidden_size, t.proj_split),
            ("o_proj", cfg.hidden_size, t.o_bn, cfg.num_heads * cfg.head_dim, t.o_split),
            ("down_proj", cfg.hidden_size, t.down_bn, cfg.intermediate_size, t.down_split),
            ("gate/up", cfg.intermediate_size, t.gate_bn, cfg.hidden_size, 1),
        ):
            if n % bn or k % (split * 16) or (k // split) & (k // split - 1):
                problems.append(f"{name} ({n} x {k})")
        if cfg.hidden_size & (cfg.hidden_size - 1) or cfg.num_heads % cfg.num_kv_heads:
            problems.append(f"hidden_size {cfg.hidden_size}")
        if problems:
            raise ValueError("the persistent depth frame does not fit " + ", ".join(problems))

    def _alloc(self, rows: int) -> None:
        cfg, dev, bf = self.cfg, self.device, torch.bfloat16
        t = self.tiles
        d, heads_width = cfg.hidden_size, cfg.num_heads * cfg.head_dim
        qkv_width = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        self.h = torch.empty(rows, d, dtype=bf, device=dev)
        self.q = torch.empty(rows, heads_width, dtype=bf, device=dev)
        self.attn = torch.empty(rows, heads_width, dtype=bf, device=dev)
        self.act = torch.empty(rows, cfg.intermediate_size, dtype=bf, device=dev)
        self.cache = torch.zeros(cfg.num_layers, 2, rows, cfg.num_kv_heads, cfg.num_codebooks,
                                 cfg.head_dim, dtype=bf, device=dev)
        self.logits = torch.empty(cfg.num_codebooks, rows, self.vocab, dtype=torch.float32,
                                  device=dev)
        splits = max(t.proj_split, t.qkv_split, t.o_split, t.down_split)
        self.workspace = torch.empty(splits, rows, max(d, qkv_width), dtype=torch.float32,
                                     device=dev)
        most_tiles = triton.cdiv(rows, 16) * max(d // min(t.proj_bn, t.o_bn, t.down_bn),
                                                 (qkv_width // cfg.head_dim) * t.qkv_sub)
        self.counters = torch.zeros(most_tiles, dtype=torch.int32, device=dev)
        self.barrier = torch.zeros(1, dtype=torch.int64, device=dev)
        self.rows = rows

    def frame_logits(self, rows: int) -> torch.Tensor:
        """The last call's fp32 logits ``[16, rows, V]`` (position 0's are never written),
        ``rows`` as in that call: what the draws read, before CFG."""
        size = self.cfg.num_codebooks * rows * self.vocab
        return self.logits.view(-1)[:size].view(self.cfg.num_codebooks, rows, self.vocab)

    @property
    def phases(self) -> int:
        """Phases of one frame: per position the projector, 5 per layer, the head, the draw."""
        return self.cfg.num_codebooks * (1 + PHASES_PER_LAYER * self.cfg.num_layers + 2)

    def __call__(self, hidden: torch.Tensor, code0: torch.Tensor, has_cfg: torch.Tensor,
                 cfg_scale: torch.Tensor, depth_sampling: torch.Tensor, seeds: torch.Tensor,
                 frames_at: torch.Tensor) -> torch.Tensor:
        """``hidden [R, backbone_hidden]`` (R = B, or 2B: cond rows then uncond rows), the
        first codes ``code0 [B]``, per request ``has_cfg``, ``cfg_scale``, ``depth_sampling
        [B, 3]`` (temperature, top-k in 1..64, top-p), ``seeds`` and ``frames_at`` -> codes
        ``[B, 16]`` int64 (column 0 is ``code0``)."""
        rows, num = hidden.shape[0], code0.shape[0]
        if rows not in (num, 2 * num):
            raise ValueError(f"hidden has {rows} rows for {num} requests (want B or 2B)")
        if rows > self.rows:
            raise ValueError(f"{rows} rows past the persistent depth frame's {self.rows}")
        cfg, t = self.cfg, self.tiles
        codes = torch.empty(num, cfg.num_codebooks, dtype=torch.long, device=hidden.device)
        codes[:, 0] = code0
        params = depth_sampling.to(torch.float32).contiguous()
        c = self.cache.stride()  # [L, 2, R, KVH, P, D]
        args = (
            hidden.contiguous(), codes, has_cfg.to(torch.int8).contiguous(),
            cfg_scale.to(torch.float32).contiguous(), params, seeds.to(torch.long).contiguous(),
            frames_at.to(torch.long).contiguous(),
            self.embed, self.proj, self.ln1, self.qkv, self.o, self.ln2, self.gate_up, self.down,
            self.norm, self.head, self.cos, self.sin,
            self.h, self.q, self.attn, self.act, self.cache, self.logits, self.workspace,
            self.counters, self.barrier,
        )
        consts = dict(
            D=cfg.hidden_size, DB=cfg.backbone_hidden_size, I=cfg.intermediate_size,
            H=cfg.num_heads, KVH=cfg.num_kv_heads, HD=cfg.head_dim, L=cfg.num_layers,
            NCB=cfg.num_codebooks, V=self.vocab, VP=self.vocab_padded,
            PROJ_BN=t.proj_bn, PROJ_S=t.proj_split,
            PROJ_BK=min(t.proj_bk, cfg.backbone_hidden_size // t.proj_split),
            QKV_SUB=self.qkv_sub, QKV_S=t.qkv_split,
            QKV_BK=min(t.qkv_bk, cfg.hidden_size // t.qkv_split),
            O_BN=t.o_bn, O_S=t.o_split,
            O_BK=min(t.o_bk, cfg.num_heads * cfg.head_dim // t.o_split),
            GATE_BN=t.gate_bn, GATE_BK=min(t.gate_bk, cfg.hidden_size),
            DOWN_BN=t.down_bn, DOWN_S=t.down_split,
            DOWN_BK=min(t.down_bk, cfg.intermediate_size // t.down_split),
            HEAD_BN=t.head_bn, HEAD_BK=min(t.head_bk, cfg.hidden_size),
            BM=frame_row_block(rows, t.max_bm), BLOCK=triton.next_power_of_2(self.vocab),
            MAX_K=self.max_k, CODES=CODEBOOK_CODES, F32=DOT_F32, EXACT_LOG=hidden.is_cuda,
            RK=min(cfg.hidden_size, 128),
            num_warps=t.num_warps, num_stages=t.num_stages,
        )
        scalars = (cfg.rms_norm_eps, self.scale, self.workspace.stride(0), c[0], c[1], c[2],
                   c[3], c[4])
        grid = (self.programs,)
        if INTERPRETED:  # programs run one by one: one phase per launch, no barrier
            for s in range(self.phases):
                _frame_kernel[grid](*args, rows, num, s, s + 1, *scalars, BARRIER=False,
                                    **consts)
        else:
            _frame_kernel[grid](*args, rows, num, 0, self.phases, *scalars, BARRIER=True,
                                launch_cooperative_grid=True, **consts)
        return codes
