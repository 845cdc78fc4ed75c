"""Experiment (issue 30): the depth decoder's 12 layers for one position in ONE persistent Gluon
launch with THREE grid-wide dependencies a layer instead of eight, because no GEMM is split
along K across programs except the last one. Built for triton 3.6.0 / 3.7.1 (sm_90a).

    PYTHONPATH=runtime:bench:. python3 bench/depth_layers_3phase.py --out depth-layers-3phase.json
    PYTHONPATH=runtime:bench:. python bench/depth_layers_3phase.py --compile-only  # no GPU
    PYTHONPATH=runtime:bench:. python bench/depth_layers_3phase.py --emulate --rows 2  # no GPU

Why it was built (a hypothesis the H100 run refuted; see below): the 8-phase body
(``depth_layers_wgmma.py``) streams the weights at the GEMMs' pace and still
takes 0.49 ms a position at 2 rows against 0.30 for its GEMMs alone: each of its 8 phases a layer
is a chain of dependent global round trips (split-K partial sums added with atomics, a grid wait,
the activation re-read through TMA, the CUDA-core work, a store and a release), ~3-4 us each,
and a layer's weights (55.6 MB) need only ~17 us of HBM time on an H100. So this body cuts the
chain: every GEMM but ``down`` reduces its whole K inside one program, and the MLP's two GEMMs
meet inside a program (the program that makes intermediate features j..j+63 also multiplies them
by ``down``'s columns j..j+63, a partial sum over all 1024 outputs), so a layer is 3 phases:

    A  q/k/v   unit = 64 of the 1536 output features (24 units): RMSNorm of h (every row,
               recomputed by each unit into shared memory as the B operand), the GEMM over all of
               K, bf16 into QKV (before RoPE, eager's rounding point)
    B  attn+o  unit = 64 of o's 1024 output features (16 units): attention of every row and head
               (RoPE, k/v into the cache at pos by every unit alike, fp32 softmax over slots
               <= pos), the output into shared memory, o's GEMM over all of K, then
               M = bf16(h + bf16(o)) for the unit's columns (h = M + bf16(acc of the layer
               before), read and that accumulator zeroed by the same thread)
    C  MLP     unit = 64 of the 8192 intermediate features (128 units): RMSNorm of M, gate and
               up over all of K, Y = bf16(bf16(silu(bf16(gate))) * bf16(up)) in registers, into
               shared memory, then ``down``'s 16 tiles of [64 outputs, these 64 features]: each
               partial sum added into the layer's fp32 accumulator with relaxed atomics

The residual after layer l is M + bf16(acc[l % 2]) (two accumulators: the one layer l adds into
was zeroed by layer l-1's B units). After the last layer, row owners write h = bf16(M +
bf16(acc)) and zero the accumulator, so a launch leaves both accumulators zero.

Past 64 rows a unit runs blocks of 64 rows, the loader bringing its tiles again for each block.

Units go to programs so that the CUDA-core-heavy A and B units sit on programs with fewer C
units: C unit c on program c, A unit a on program P-1-a, B unit b on program P-25-b (P = 132:
programs 128-131 hold one A unit each, 92-127 one C unit and one A or B unit, 0-91 one C unit).

Per program, ``gl.warp_specialize`` forks a weight loader (1 warp: TMA of every 64x64 tile of
the program's units, 12 layers, in the consumers' order, never waiting for a phase: the ring
fills ahead across phases and layers) and the consumers (one warpgroup, 4 warps). The weights
are packed in that order: a layer's A units' tiles (16 each, K-blocks in order), B units' (16
each), C units' (48 each: gate k0, up k0, gate k1, ... up k15, then down's 16 output blocks).
Activations never go through TMA: the consumers write every B operand into shared memory
themselves (each thread's ``fence_async_shared``, then a partition barrier, before the wgmma
reads it), so no global proxy fence is needed. Cross-program reads bypass L1 (``.cg``).

The attention (``--attention``): ``items`` runs it inside every B unit, 4 (row, KV head) items
at once (one a warp); ``rows`` the same, one item at a time (``depth_layers_wgmma``'s loop);
``phase`` in a phase of its own (T) between A and B, 4 items a program over all programs, into
one shared buffer that B's units copy (4 phases a layer: one more wait, but the attention's work
no longer repeats in 16 units nor grows with the rows inside each).

``--timeline`` stamps each program's phases with ``%globaltimer`` (``EVENTS``) and prints, from
the last timed launch, each phase's span on the critical path and the median wait and work
pieces of the programs holding it (``timeline_summary``): where a layer's time goes.

Measured on an H100 (6 Dec, bench/README.md): correct, and slower than the 8-phase body at 2
rows (0.507 ms a position with the attention as a phase, 0.703 inside B, against 0.479) and far
slower with more rows (every unit normalises every row itself). So a layer's ~40 us are not
its waits, whatever their count; ``--timeline`` is there to say where they go.

Checked, timed and reported like ``depth_layers_wgmma.py`` (its ``check``: torch fp32 math of the
same layers, beside the eager bf16 module's own error), beside the served ``FusedDepthLayers`` and
the 8-phase body (``--with-8phase``). ``--emulate`` runs the check on the body's data flow in
torch on the CPU: the same packed tiles gathered by the loader's indices, the units' math in the
phases' order at the same rounding points (it checks the packing, the unit and tile indexing and
the accumulator schedule; it runs no kernel code).

Owns: this experiment only. Must not: be imported by the runtime (its unit test imports the
packing helpers, ``pack_layer`` and ``unit_tiles``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback
from pathlib import Path

import torch
import triton
from depth_layers_wgmma import (
    EPS,
    FFN,
    HEAD_DIM,
    HEADS,
    KV_HEADS,
    LAYERS,
    SLOTS,
    EmulatedFrame,
    _attention,
    _publish,
    _stamp,
    after_launches,
    baselines,
    build_depth,
    check,
    check_and_time,
    emulated_attention,
    event_ms,
    phase_timeline,
)
from depth_stream_gluon import HIDDEN, _partition_barrier, _wait_count, describe_build
from depth_stream_wgmma import LOADER_REGS, _pow2_at_least, _sass_hgmma
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

TILE = 64  # weight tiles are 64 x 64 bf16 (8 KB): wgmma's M and one 128-byte swizzle row of K
Q_OUT = (HEADS + 2 * KV_HEADS) * HEAD_DIM
A_UNITS, B_UNITS, C_UNITS = Q_OUT // TILE, HIDDEN // TILE, FFN // TILE  # 24, 16, 128
KT = HIDDEN // TILE  # 16 K-tiles of a 1024-wide input
A_TILES, B_TILES, C_TILES = KT, KT, 2 * KT + HIDDEN // TILE  # 16, 16, 48 a unit
B_BASE = A_UNITS * A_TILES
C_BASE = B_BASE + B_UNITS * B_TILES
LAYER_TILES = C_BASE + C_UNITS * C_TILES  # 6784 tiles = 27.8 M weights a layer
RB = 8  # rows a norm pass holds at once
MAX_RP = 64  # rows a block: a unit's X chunks (16 x RP x 64 bf16) sit in shared memory
MAX_ROWS = 512
SMEM_BUDGET = 227 * 1024 - 4096
MAX_STAGES = 24
ROWS = "2,16,64,128,256"
# the attention: in each B unit one (row, KV head) item at a time, in each B unit 4 at once (one
# a warp), or in a phase of its own (T) between A and B, 4 items a program over all programs
ATTENTION = ("rows", "items", "phase")
# ``--timeline``: %globaltimer stamps per program and layer (the last row block's where a unit
# has several); a program without the phase's work leaves its stamps 0
EVENTS = ("layer", "a_waited", "a_done", "t_waited", "t_done", "b_waited", "b_operand",
          "b_done", "c_waited", "c_normed", "c_gate_up", "c_done")

# ----------------------------------------------------------------------------- device code


@gluon.jit
def _norm_into(xs, src_ptr, acc_ptr, g_ptr, rows, eps, ADD: gl.constexpr, RP: gl.constexpr,
               full_l: gl.constexpr, chunk_l: gl.constexpr):
    """X = bf16(g * bf16(h * rsqrt(mean(h^2) + eps))) of every row into the 16 K-chunks
    ``xs[kb] = X[:, kb*64:(kb+1)*64]`` (rows >= ``rows`` zero), h = src (bf16) or, with ADD,
    bf16(src + bf16(acc)) (the residual after a layer's MLP; read, not zeroed). A pass over 8
    full rows gives their RMS; the chunks are re-read (L2 hits) and written as wgmma's B
    operand."""
    rf = gl.arange(0, RB_C, layout=gl.SliceLayout(1, full_l))
    cf = gl.arange(0, HIDDEN_C, layout=gl.SliceLayout(0, full_l))
    rc = gl.arange(0, RB_C, layout=gl.SliceLayout(1, chunk_l))
    cc = gl.arange(0, TILE_C, layout=gl.SliceLayout(0, chunk_l))
    for rb in gl.static_range(RP // RB_C):
        r = rb * RB_C + rf
        mask = (r[:, None] < rows) & (cf[None, :] < HIDDEN_C)
        offs = r[:, None] * HIDDEN_C + cf[None, :]
        h = gl.load(src_ptr + offs, mask=mask, other=0.0, cache_modifier=".cg").to(gl.float32)
        if ADD:
            a = gl.load(acc_ptr + offs, mask=mask, other=0.0, cache_modifier=".cg")
            h = h + a.to(gl.bfloat16).to(gl.float32)
        h = h.to(gl.bfloat16).to(gl.float32)
        inv = gl.rsqrt(gl.sum(h * h, axis=1) / HIDDEN_C + eps)
        inv = gl.convert_layout(inv, gl.SliceLayout(1, chunk_l))
        r2 = rb * RB_C + rc
        for kb in gl.static_range(KT_C):
            c = kb * TILE_C + cc
            m2 = (r2[:, None] < rows) & (c[None, :] < HIDDEN_C)
            o2 = r2[:, None] * HIDDEN_C + c[None, :]
            x = gl.load(src_ptr + o2, mask=m2, other=0.0, cache_modifier=".cg").to(gl.float32)
            if ADD:
                a2 = gl.load(acc_ptr + o2, mask=m2, other=0.0, cache_modifier=".cg")
                x = x + a2.to(gl.bfloat16).to(gl.float32)
            x = x.to(gl.bfloat16).to(gl.float32)
            normed = (x * inv[:, None]).to(gl.bfloat16).to(gl.float32)
            g = gl.load(g_ptr + c).to(gl.float32)
            out = gl.where(m2, g[None, :] * normed, 0.0).to(gl.bfloat16)
            xs.index(kb).slice(rb * RB_C, RB_C).store(out)


@gluon.jit
def _copy_into(xs, src_ptr, rows, RP: gl.constexpr, chunk_l: gl.constexpr):
    """Rows of a bf16 [rows, 1024] buffer (this program's own attention output) into the 16
    K-chunks of ``xs`` (rows >= ``rows`` zero)."""
    rc = gl.arange(0, RB_C, layout=gl.SliceLayout(1, chunk_l))
    cc = gl.arange(0, TILE_C, layout=gl.SliceLayout(0, chunk_l))
    for rb in gl.static_range(RP // RB_C):
        r = rb * RB_C + rc
        for kb in gl.static_range(KT_C):
            c = kb * TILE_C + cc
            m = (r[:, None] < rows) & (c[None, :] < HIDDEN_C)
            x = gl.load(src_ptr + r[:, None] * HIDDEN_C + c[None, :], mask=m, other=0.0,
                        cache_modifier=".cg")
            xs.index(kb).slice(rb * RB_C, RB_C).store(x)


@gluon.jit
def _attention_items(qkv_ptr, cache_ptr, rope_ptr, x_out_ptr, rows, cache_rows, pos, scale,
                     first_item, item_step, l3: gl.constexpr):
    """``_attention``'s items (row, KV head) 4 at a time, one a warp (``l3``: warps along
    the items), so that 4 items' loads are in flight at once instead of one item's: same
    arithmetic, same rounding points; k and v into the cache at pos."""
    l_id: gl.constexpr = gl.SliceLayout(1, l3)  # [items, 128]
    l_it: gl.constexpr = gl.SliceLayout(2, l3)  # [items, 16]
    d = gl.arange(0, HEAD_DIM_C, layout=gl.SliceLayout(0, l_id))
    t = gl.arange(0, SLOTS_C, layout=gl.SliceLayout(0, l_it))
    i_d = gl.arange(0, 4, layout=gl.SliceLayout(1, l_id))
    i_t = gl.arange(0, 4, layout=gl.SliceLayout(1, l_it))
    cos = gl.load(rope_ptr + d).to(gl.float32)[None, :]
    sin = gl.load(rope_ptr + HEAD_DIM_C + d).to(gl.float32)[None, :]
    t3 = t[None, :, None]
    d3 = d[None, None, :]
    earlier = (t3 < pos) & (d3 < HEAD_DIM_C)
    here = (t3 == pos) & (d3 < HEAD_DIM_C)
    live = (t < pos + 1)[None, :]
    group: gl.constexpr = HEADS_C // KV_HEADS_C
    for i0 in range(first_item, rows * KV_HEADS_C, item_step):
        item = i0 + i_d
        ok = (item < rows * KV_HEADS_C)[:, None] & (d[None, :] < HEAD_DIM_C)
        r = item // KV_HEADS_C
        j = item % KV_HEADS_C
        base = qkv_ptr + (r * Q_OUT_C)[:, None] + d[None, :]
        kx = gl.load(base + ((HEADS_C + j) * HEAD_DIM_C)[:, None], mask=ok, other=0.0,
                     cache_modifier=".cg").to(gl.float32)
        kr = gl.load(base + ((HEADS_C + j) * HEAD_DIM_C)[:, None] + ((d ^ 64) - d)[None, :],
                     mask=ok, other=0.0, cache_modifier=".cg").to(gl.float32)
        k = ((kx * cos).to(gl.bfloat16).to(gl.float32)
             + (kr * sin).to(gl.bfloat16).to(gl.float32)).to(gl.bfloat16).to(gl.float32)
        v = gl.load(base + ((HEADS_C + KV_HEADS_C + j) * HEAD_DIM_C)[:, None], mask=ok,
                    other=0.0, cache_modifier=".cg").to(gl.bfloat16)
        kv = (r * KV_HEADS_C + j) * SLOTS_C * HEAD_DIM_C  # [items]
        k_at = cache_ptr + kv[:, None] + pos * HEAD_DIM_C + d[None, :]
        v_off = cache_rows * KV_HEADS_C * SLOTS_C * HEAD_DIM_C  # values after all rows' keys
        gl.store(k_at, k.to(gl.bfloat16), mask=ok)
        gl.store(k_at + v_off, v, mask=ok)
        item3 = i0 + i_t
        ok3 = (item3 < rows * KV_HEADS_C)[:, None, None] & earlier
        kv3 = ((item3 // KV_HEADS_C) * KV_HEADS_C + item3 % KV_HEADS_C) * SLOTS_C * HEAD_DIM_C
        tile = cache_ptr + kv3[:, None, None] + t3 * HEAD_DIM_C + d3
        keys = gl.load(tile, mask=ok3, other=0.0).to(gl.float32)
        keys = gl.where(here, k[:, None, :], keys)
        values = gl.load(tile + v_off, mask=ok3, other=0.0).to(gl.float32)
        values = gl.where(here, v.to(gl.float32)[:, None, :], values)
        for hh in gl.static_range(group):
            head = j * group + hh
            qp = base + (head * HEAD_DIM_C)[:, None]
            qx = gl.load(qp, mask=ok, other=0.0, cache_modifier=".cg").to(gl.float32)
            qr = gl.load(qp + ((d ^ 64) - d)[None, :], mask=ok, other=0.0,
                         cache_modifier=".cg").to(gl.float32)
            q = ((qx * cos).to(gl.bfloat16).to(gl.float32)
                 + (qr * sin).to(gl.bfloat16).to(gl.float32)).to(gl.bfloat16).to(gl.float32)
            sc = gl.sum(keys * q[:, None, :], axis=2) * scale
            sc = gl.where(live, sc, float("-inf"))
            p = gl.exp(sc - gl.max(sc, axis=1)[:, None])
            p = gl.where(live, p, 0.0)
            den = gl.convert_layout(gl.sum(p, axis=1), gl.SliceLayout(1, l_id))
            o = gl.sum(values * p[:, :, None], axis=1) / den[:, None]
            gl.store(x_out_ptr + (r * HIDDEN_C + head * HEAD_DIM_C)[:, None] + d[None, :],
                     o.to(gl.bfloat16), mask=ok)


@gluon.jit
def _mark(TL: gl.constexpr, tl_ptr, layer, event: gl.constexpr):
    """With TL: this program's ``%globaltimer`` as ``event`` of ``layer`` (``EVENTS``)."""
    _stamp(TL, tl_ptr + (gl.program_id(0) * LAYERS_C + layer) * EVENTS_C + event)


@gluon.jit
def _operand_ready():
    """Every consumer warp's ordinary stores into a wgmma operand (X chunks, Y) are visible to
    the tensor cores: each thread's shared-proxy fence, then a partition barrier (a warp's
    wgmma reads what all four warps wrote)."""
    fence_async_shared()
    _partition_barrier()


@gluon.jit
def _take(ready, it, S: gl.constexpr):
    """Waits until ring tile ``it`` has landed; returns its slot."""
    slot = it % S
    mbarrier.wait(ready.index(slot), (it // S) & 1)
    return slot


@gluon.jit
def _give(empty, it, S: gl.constexpr):
    """Ring tile ``it``'s slot goes back to the loader (every warp's wgmma on it retired)."""
    _partition_barrier()
    mbarrier.arrive(empty.index(it % S), count=1)


@gluon.jit
def _gemm_full_k(ring, ready, empty, xs, it, acc, S: gl.constexpr):
    """acc[64, RP] = W_unit[64, 1024] @ X^T over the unit's 16 ring tiles, one wgmma in flight
    while the tile before it is given back."""
    for kb in gl.static_range(KT_C):
        slot = _take(ready, it + kb, S)
        acc = warpgroup_mma(ring.index(slot), xs.index(kb).permute((1, 0)), acc,
                            use_acc=kb > 0, is_async=True)
        acc = warpgroup_mma_wait(1, deps=[acc])
        if kb > 0:
            _give(empty, it + kb - 1, S)
    acc = warpgroup_mma_wait(0, deps=[acc])
    _give(empty, it + KT_C - 1, S)
    return it + KT_C, acc


@gluon.jit
def _three_phase_consumer(ring, ready, empty, xs, ys, counters, err_ptr, x_in_ptr, h_out_ptr,
                          m_ptr, qkv_ptr, att_ptr, acc_ptr, norm_ptr, rope_ptr, cache_ptr,
                          rows, pos, target, budget, eps, scale, S: gl.constexpr,
                          RP: gl.constexpr, acc_layout: gl.constexpr, full_l: gl.constexpr,
                          chunk_l: gl.constexpr, att_l: gl.constexpr, row_l: gl.constexpr,
                          att3_l: gl.constexpr, ATT: gl.constexpr, NPH: gl.constexpr,
                          tl_ptr, TL: gl.constexpr):
    pid = gl.program_id(0)
    P = gl.num_programs(0)
    a0 = P - 1 - pid  # A unit a on program P-1-a, B unit b on P-1-A_UNITS-b, C unit c on c
    b0 = (2 * P - 1 - A_UNITS_C - pid) % P
    offs_n = gl.arange(0, TILE_C, layout=gl.SliceLayout(1, acc_layout))
    offs_r = gl.arange(0, RP, layout=gl.SliceLayout(0, acc_layout))
    my_att = att_ptr + pid * RP * HIDDEN_C
    kv_row: gl.constexpr = KV_HEADS_C * SLOTS_C * HEAD_DIM_C
    it = 0
    for layer in range(LAYERS_C):
        g = layer * NPH  # A at g, (T at g + 1), B at g_b = g + NPH - 2, C at g_b + 1
        g_b = g + NPH - 2
        first = layer == 0
        acc_prev = acc_ptr + ((layer + 1) % 2) * rows * HIDDEN_C  # layer-1's sums
        acc_cur = acc_ptr + (layer % 2) * rows * HIDDEN_C
        norms = norm_ptr + layer * 2 * HIDDEN_C
        _mark(TL, tl_ptr, layer, 0)
        # ---- A: q/k/v, whole K a unit
        if a0 < A_UNITS_C:
            if layer > 0:
                budget = _wait_count(counters + g - 1, target, budget)
        _mark(TL, tl_ptr, layer, 1)
        for a in range(a0, A_UNITS_C, P):
            for r0 in range(0, rows, RP):  # row blocks (the loader brings the tiles again)
                n = rows - r0
                if first:
                    _norm_into(xs, x_in_ptr + r0 * HIDDEN_C, acc_prev, norms, n, eps, False,
                               RP, full_l, chunk_l)
                else:
                    _norm_into(xs, m_ptr + r0 * HIDDEN_C, acc_prev + r0 * HIDDEN_C, norms, n,
                               eps, True, RP, full_l, chunk_l)
                _operand_ready()
                acc = gl.zeros([TILE_C, RP], gl.float32, acc_layout)
                it, acc = _gemm_full_k(ring, ready, empty, xs, it, acc, S)
                cols = a * TILE_C + offs_n
                gl.store(qkv_ptr + (r0 + offs_r)[None, :] * Q_OUT_C + cols[:, None],
                         acc.to(gl.bfloat16), mask=offs_r[None, :] < n)
        _mark(TL, tl_ptr, layer, 2)
        budget = _publish(counters, g, budget, False)
        if ATT == 2:  # ---- T: attention, 4 items a program (one a warp), into the shared ATT
            if pid * 4 < rows * KV_HEADS_C:
                budget = _wait_count(counters + g, target, budget)
                _mark(TL, tl_ptr, layer, 3)
                _attention_items(qkv_ptr, cache_ptr + layer * 2 * rows * kv_row, rope_ptr,
                                 att_ptr, rows, rows, pos, scale, pid * 4, P * 4, att3_l)
                _mark(TL, tl_ptr, layer, 4)
            budget = _publish(counters, g + 1, budget, False)
        # ---- B: attention + o, whole K a unit, + residual into M
        if b0 < B_UNITS_C:
            budget = _wait_count(counters + g_b - 1, target, budget)
        _mark(TL, tl_ptr, layer, 5)
        for b in range(b0, B_UNITS_C, P):
            for r0 in range(0, rows, RP):
                n = rows - r0
                bmask = offs_r[None, :] < n
                # the residual h of the unit's columns first: its loads overlap the attention
                cols = b * TILE_C + offs_n
                offs = (r0 + offs_r)[None, :] * HIDDEN_C + cols[:, None]
                if first:
                    h = gl.load(x_in_ptr + offs, mask=bmask, other=0.0).to(gl.float32)
                else:
                    h = gl.load(m_ptr + offs, mask=bmask, other=0.0,
                                cache_modifier=".cg").to(gl.float32)
                    d = gl.load(acc_prev + offs, mask=bmask, other=0.0, cache_modifier=".cg")
                    gl.store(acc_prev + offs, gl.zeros_like(d), mask=bmask)
                    h = (h + d.to(gl.bfloat16).to(gl.float32)).to(gl.bfloat16).to(gl.float32)
                cache_l = cache_ptr + layer * 2 * rows * kv_row
                if ATT == 1:  # the block's items; my_att holds the block's rows
                    _attention_items(qkv_ptr + r0 * Q_OUT_C, cache_l + r0 * kv_row, rope_ptr,
                                     my_att, gl.minimum(n, RP), rows, pos, scale, 0, 4, att3_l)
                elif ATT == 0:  # one block only (the host refuses more rows)
                    _attention(qkv_ptr, cache_l, rope_ptr, my_att, rows, pos, scale, 0, 1,
                               Q_OUT_C, att_l)
                if ATT == 2:
                    _copy_into(xs, att_ptr + r0 * HIDDEN_C, n, RP, chunk_l)  # T's, published
                else:
                    _partition_barrier()  # every warp's attention rows are stored
                    _copy_into(xs, my_att, n, RP, chunk_l)
                _operand_ready()
                _mark(TL, tl_ptr, layer, 6)
                acc = gl.zeros([TILE_C, RP], gl.float32, acc_layout)
                it, acc = _gemm_full_k(ring, ready, empty, xs, it, acc, S)
                o = acc.to(gl.bfloat16).to(gl.float32)
                gl.store(m_ptr + offs, (h + o).to(gl.bfloat16), mask=bmask)
        _mark(TL, tl_ptr, layer, 7)
        budget = _publish(counters, g_b, budget, False)
        # ---- C: gate/up + SiLU * up + down's partial sums
        if pid < C_UNITS_C:
            budget = _wait_count(counters + g_b, target, budget)
        _mark(TL, tl_ptr, layer, 8)
        for c in range(pid, C_UNITS_C, P):
            for r0 in range(0, rows, RP):
                n = rows - r0
                _norm_into(xs, m_ptr + r0 * HIDDEN_C, acc_prev, norms + HIDDEN_C, n, eps, False,
                           RP, full_l, chunk_l)
                _operand_ready()
                _mark(TL, tl_ptr, layer, 9)
                acc_g = gl.zeros([TILE_C, RP], gl.float32, acc_layout)
                acc_u = gl.zeros([TILE_C, RP], gl.float32, acc_layout)
                for kb in gl.static_range(KT_C):
                    sg = _take(ready, it + 2 * kb, S)
                    acc_g = warpgroup_mma(ring.index(sg), xs.index(kb).permute((1, 0)), acc_g,
                                          use_acc=kb > 0, is_async=True)
                    su = _take(ready, it + 2 * kb + 1, S)
                    acc_u = warpgroup_mma(ring.index(su), xs.index(kb).permute((1, 0)), acc_u,
                                          use_acc=kb > 0, is_async=True)
                    acc_g, acc_u = warpgroup_mma_wait(2, deps=[acc_g, acc_u])
                    if kb > 0:
                        _give(empty, it + 2 * kb - 2, S)
                        _give(empty, it + 2 * kb - 1, S)
                acc_g, acc_u = warpgroup_mma_wait(0, deps=[acc_g, acc_u])
                _give(empty, it + 2 * KT_C - 2, S)
                _give(empty, it + 2 * KT_C - 1, S)
                it += 2 * KT_C
                _mark(TL, tl_ptr, layer, 10)
                gb = acc_g.to(gl.bfloat16).to(gl.float32)
                ub = acc_u.to(gl.bfloat16).to(gl.float32)
                s = (gb / (1.0 + gl.exp(-gb))).to(gl.bfloat16).to(gl.float32)
                y = (s * ub).to(gl.bfloat16)  # [64 features, RP]; padding rows are 0
                ys.store(gl.permute(y, (1, 0)))
                _operand_ready()
                # down's 16 output blocks, the next block's wgmma in flight while this one's
                # partial sums go out
                zero = gl.zeros([TILE_C, RP], gl.float32, acc_layout)
                part = warpgroup_mma(ring.index(_take(ready, it, S)), ys.permute((1, 0)), zero,
                                     use_acc=False, is_async=True)
                for mb in gl.static_range(OUT_BLOCKS_C):
                    if mb + 1 < OUT_BLOCKS_C:
                        nxt = warpgroup_mma(ring.index(_take(ready, it + mb + 1, S)),
                                            ys.permute((1, 0)), zero, use_acc=False,
                                            is_async=True)
                        part = warpgroup_mma_wait(1, deps=[part])
                    else:
                        part = warpgroup_mma_wait(0, deps=[part])
                    _give(empty, it + mb, S)
                    cols = mb * TILE_C + offs_n
                    gl.atomic_add(acc_cur + (r0 + offs_r)[None, :] * HIDDEN_C + cols[:, None],
                                  part, mask=offs_r[None, :] < n, sem="relaxed", scope="gpu")
                    if mb + 1 < OUT_BLOCKS_C:
                        part = nxt
                it += OUT_BLOCKS_C
        _mark(TL, tl_ptr, layer, 11)
        budget = _publish(counters, g_b + 1, budget, False)
    # ---- after the last layer: h = bf16(M + bf16(acc)) by row owners, the accumulator zeroed
    budget = _wait_count(counters + LAYERS_C * NPH - 1, target, budget)
    last = acc_ptr + ((LAYERS_C - 1) % 2) * rows * HIDDEN_C
    cols1 = gl.arange(0, HIDDEN_C, layout=row_l)  # each element one thread: read, then zeroed
    for r in range(pid, rows, P):
        offs = r * HIDDEN_C + cols1
        d = gl.load(last + offs, cache_modifier=".cg")
        gl.store(last + offs, gl.zeros_like(d))
        h = gl.load(m_ptr + offs, cache_modifier=".cg").to(gl.float32)
        gl.store(h_out_ptr + offs, (h + d.to(gl.bfloat16).to(gl.float32)).to(gl.bfloat16))
    if budget <= 0:
        gl.store(err_ptr, 1)


@gluon.jit
def _three_phase_loader(desc, ring, ready, empty, rows, S: gl.constexpr, RP: gl.constexpr):
    """Every tile of this program's units, 12 layers, in the consumers' order (a unit's tiles
    once a block of RP rows)."""
    pid = gl.program_id(0)
    P = gl.num_programs(0)
    a0 = P - 1 - pid
    b0 = (2 * P - 1 - A_UNITS_C - pid) % P
    it = 0
    for layer in range(LAYERS_C):
        base = layer * LAYER_TILES_C
        for a in range(a0, A_UNITS_C, P):
            for r0 in range(0, rows, RP):
                it = _load_tiles(desc, ring, ready, empty, it, base + a * KT_C, KT_C, S)
        for b in range(b0, B_UNITS_C, P):
            for r0 in range(0, rows, RP):
                it = _load_tiles(desc, ring, ready, empty, it, base + B_BASE_C + b * KT_C,
                                 KT_C, S)
        for c in range(pid, C_UNITS_C, P):
            for r0 in range(0, rows, RP):
                it = _load_tiles(desc, ring, ready, empty, it, base + C_BASE_C + c * C_TILES_C,
                                 C_TILES_C, S)


@gluon.jit
def _load_tiles(desc, ring, ready, empty, it, first_tile, n: gl.constexpr, S: gl.constexpr):
    for t in range(n):
        slot = it % S
        mbarrier.wait(empty.index(slot), ((it // S) & 1) ^ 1)
        mbarrier.expect(ready.index(slot), TILE_C * TILE_C * 2)
        tma.async_copy_global_to_shared(desc, [(first_tile + t) * TILE_C, 0], ready.index(slot),
                                        ring.index(slot))
        it += 1
    return it


@gluon.jit(do_not_specialize=["rows", "pos", "target", "budget"])
def _three_phase_kernel(desc, counters, err_ptr, x_in_ptr, h_out_ptr, m_ptr, qkv_ptr, att_ptr,
                        acc_ptr, norm_ptr, rope_ptr, cache_ptr, tl_ptr, rows, pos, target, budget,
                        eps, scale, S: gl.constexpr, RP: gl.constexpr, ATT: gl.constexpr,
                        NPH: gl.constexpr, TL: gl.constexpr, num_warps: gl.constexpr):
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, RP, 16])
    # 8 rows x 1024: 8 consecutive elements (16 B of bf16) a thread
    full_l: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [num_warps, 1], [1, 0])
    # 8 rows x 64: 4 consecutive elements a thread, nothing replicated with 4 warps
    chunk_l: gl.constexpr = gl.BlockedLayout([1, 4], [2, 16], [num_warps, 1], [1, 0])
    att_l: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])
    row_l: gl.constexpr = gl.BlockedLayout([8], [32], [num_warps], [0])  # 1024, no replicas
    # [4 items, 16 slots, 128]: one item a warp, 8 consecutive dims (16 B of bf16) a thread
    att3_l: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 2, 16], [num_warps, 1, 1],
                                            [2, 1, 0])
    x_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([RP, TILE_C], gl.bfloat16)
    ring = gl.allocate_shared_memory(gl.bfloat16, [S, TILE_C, TILE_C], desc.layout)
    xs = gl.allocate_shared_memory(gl.bfloat16, [KT_C, RP, TILE_C], x_layout)
    ys = gl.allocate_shared_memory(gl.bfloat16, [RP, TILE_C], x_layout)
    ready = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(S):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    gl.warp_specialize([
        (_three_phase_consumer, (ring, ready, empty, xs, ys, counters, err_ptr, x_in_ptr,
                                 h_out_ptr, m_ptr, qkv_ptr, att_ptr, acc_ptr, norm_ptr, rope_ptr,
                                 cache_ptr, rows, pos, target, budget, eps, scale, S, RP,
                                 acc_layout, full_l, chunk_l, att_l, row_l, att3_l, ATT,
                                 NPH, tl_ptr, TL)),
        (_three_phase_loader, (desc, ring, ready, empty, rows, S, RP)),
    ], [1], [LOADER_REGS_C])


# constexpr globals the device code reads (gluon.jit resolves module-level constexprs)
TILE_C = gl.constexpr(TILE)
HIDDEN_C = gl.constexpr(HIDDEN)
Q_OUT_C = gl.constexpr(Q_OUT)
KT_C = gl.constexpr(KT)
OUT_BLOCKS_C = gl.constexpr(HIDDEN // TILE)
RB_C = gl.constexpr(RB)
A_UNITS_C = gl.constexpr(A_UNITS)
B_UNITS_C = gl.constexpr(B_UNITS)
C_UNITS_C = gl.constexpr(C_UNITS)
C_TILES_C = gl.constexpr(C_TILES)
B_BASE_C = gl.constexpr(B_BASE)
C_BASE_C = gl.constexpr(C_BASE)
LAYER_TILES_C = gl.constexpr(LAYER_TILES)
LAYERS_C = gl.constexpr(LAYERS)
EVENTS_C = gl.constexpr(len(EVENTS))
KV_HEADS_C = gl.constexpr(KV_HEADS)
HEADS_C = gl.constexpr(HEADS)
SLOTS_C = gl.constexpr(SLOTS)
HEAD_DIM_C = gl.constexpr(HEAD_DIM)
LOADER_REGS_C = gl.constexpr(LOADER_REGS)

# ----------------------------------------------------------------------------- host side


def pack_layer(attn_qkv: torch.Tensor, o: torch.Tensor, gate_up: torch.Tensor,
               down: torch.Tensor) -> torch.Tensor:
    """One layer's four matrices as the loader reads them: ``[LAYER_TILES * 64, 64]``, tile t
    at rows t*64.. (module doc's order)."""

    def tiles(w: torch.Tensor) -> torch.Tensor:  # [N, K] -> [N/64, K/64, 64, 64], n-major
        n, k = w.shape
        return w.view(n // TILE, TILE, k // TILE, TILE).permute(0, 2, 1, 3)

    a = tiles(attn_qkv).reshape(-1, TILE)
    b = tiles(o).reshape(-1, TILE)
    gate, up = tiles(gate_up[:FFN]), tiles(gate_up[FFN:])  # [128, 16, 64, 64] each
    gu = torch.stack([gate, up], dim=2)  # [128, 16, 2, 64, 64]: gate k0, up k0, gate k1...
    dn = tiles(down).permute(1, 0, 2, 3)  # [128 feature blocks, 16 output blocks, 64, 64]
    c = torch.cat([gu.reshape(C_UNITS, 2 * KT, TILE, TILE), dn], dim=1)
    return torch.cat([a, b, c.reshape(-1, TILE)])


def unit_tiles(packed: torch.Tensor, layer: int, first_tile: int, n: int) -> torch.Tensor:
    """The ``n`` tiles from ``first_tile`` of ``layer`` as the loader brings them: [n, 64, 64]."""
    start = (layer * LAYER_TILES + first_tile) * TILE
    return packed[start:start + n * TILE].view(n, TILE, TILE)


class ThreePhaseFrame:
    """One position's buffers (the names ``depth_layers_wgmma.check`` reads: ``h`` is the
    output, ``out`` the two fp32 accumulators, ``x1024`` the residual M, ``x8192`` the
    pre-RoPE q/k/v) and the packed weights."""

    def __init__(self, rows: int, device: str, programs: int = 132,
                 attention: str = "items", timeline: bool = False) -> None:
        if attention not in ATTENTION:
            raise ValueError(f"attention {attention!r}: one of {ATTENTION}")
        self.attention = attention
        if not 1 <= rows <= MAX_ROWS:
            raise ValueError(f"{rows} rows: this body takes 1-{MAX_ROWS}")
        if attention == "rows" and rows > MAX_RP:
            raise ValueError(f"attention 'rows' takes one block of at most {MAX_RP} rows")
        self.rows, self.programs = rows, programs
        self.rp = min(MAX_RP, max(8, _pow2_at_least(rows)))  # rows a block
        ring_room = SMEM_BUDGET - (KT + 1) * self.rp * TILE * 2
        self.stages = min(MAX_STAGES, ring_room // (TILE * TILE * 2))
        bf16 = torch.bfloat16
        self.w = torch.empty(LAYERS * LAYER_TILES * TILE, TILE, dtype=bf16, device=device)
        self.x_in = torch.empty(rows, HIDDEN, dtype=bf16, device=device)
        self.h = torch.empty_like(self.x_in)
        self.x1024 = torch.empty_like(self.x_in)  # M
        self.x8192 = torch.empty(rows, Q_OUT, dtype=bf16, device=device)  # q/k/v
        # items: a block's attention rows a program; phase: one [rows, 1024] output
        self.att = torch.zeros(max(programs * self.rp, rows), HIDDEN, dtype=bf16, device=device)
        self.out = torch.zeros(2 * rows, HIDDEN, dtype=torch.float32, device=device)
        self.norm_w = torch.empty(LAYERS, 2, HIDDEN, dtype=bf16, device=device)
        self.rope = torch.empty(2, HEAD_DIM, dtype=bf16, device=device)
        self.cache = torch.empty(LAYERS, 2, rows, KV_HEADS, SLOTS, HEAD_DIM, dtype=bf16,
                                 device=device)
        self.counters = torch.zeros(LAYERS * 4, dtype=torch.int32, device=device)
        self.err = torch.zeros(1, dtype=torch.int32, device=device)
        self.timeline = torch.zeros(programs if timeline else 1, LAYERS, len(EVENTS),
                                    dtype=torch.int64, device=device)
        self.stamps = timeline
        self.position = 0
        self.epoch = 0
        layout = gl.NVMMASharedLayout.get_default_for([TILE, TILE], gl.bfloat16)
        self.desc = TensorDescriptor(self.w, list(self.w.shape), list(self.w.stride()),
                                     [TILE, TILE], layout)

    def load(self, modules) -> None:
        for layer, m in enumerate(modules):
            packed = pack_layer(m.self_attn.qkv_weight, m.self_attn.o_proj.weight,
                                m.mlp.gate_up_weight, m.mlp.down_proj.weight)
            self.w[layer * LAYER_TILES * TILE:(layer + 1) * LAYER_TILES * TILE] = packed
            self.norm_w[layer, 0] = m.input_layernorm.weight
            self.norm_w[layer, 1] = m.post_attention_layernorm.weight

    def run_layers(self, programs: int, maxnreg: int, spin_budget: int,
                   cooperative: bool = True):
        if programs != self.programs:
            raise ValueError(f"built for {self.programs} programs, launched with {programs}")
        if programs < A_UNITS + B_UNITS or programs < 1:
            raise ValueError(f"{programs} programs: the A and B units need {A_UNITS + B_UNITS}")
        self.epoch += 1  # counters only grow: a launch waits for epoch * programs arrivals
        kwargs = {"launch_cooperative_grid": True} if cooperative else {}
        return _three_phase_kernel[(programs,)](
            self.desc, self.counters, self.err, self.x_in, self.h, self.x1024, self.x8192,
            self.att, self.out, self.norm_w, self.rope, self.cache, self.timeline, self.rows,
            self.position, self.epoch * programs, spin_budget, EPS, 1.0 / math.sqrt(HEAD_DIM),
            S=self.stages, RP=self.rp, ATT=ATTENTION.index(self.attention),
            NPH=4 if self.attention == "phase" else 3, TL=self.stamps, num_warps=4,
            maxnreg=maxnreg or 248, **kwargs)

    def label(self) -> str:
        return f"3phase-{self.attention} S{self.stages} r{self.rows} (RP {self.rp})"


# ----------------------------------------------------------------------------- CPU emulation


class EmulatedThreePhase(ThreePhaseFrame):
    """``--emulate``: the body's data flow in torch on the packed tiles, unit by unit in the
    phases' order, with the kernel's rounding points and accumulator schedule (module doc)."""

    def __init__(self, rows: int) -> None:
        super().__init__(rows, "cpu")

    def label(self) -> str:
        return f"emulated 3phase r{self.rows}"

    def _gemm(self, layer: int, first_tile: int, x: torch.Tensor) -> torch.Tensor:
        """acc[rows, 64] of a unit's 16 K-tiles against X [rows, 1024]."""
        tiles = unit_tiles(self.w, layer, first_tile, KT).float()  # [16, 64 out, 64 k]
        xk = x.float().view(self.rows, KT, TILE)
        return torch.einsum("nok,rnk->ro", tiles, xk)

    def run_layers(self, **_launch) -> None:
        rows = self.rows
        acc = self.out.view(2, rows, HIDDEN)
        for layer in range(LAYERS):
            prev, cur = acc[(layer + 1) % 2], acc[layer % 2]
            g1, g2 = self.norm_w[layer, 0], self.norm_w[layer, 1]
            if layer == 0:
                h = self.x_in.float()
            else:
                h = self.x1024.float() + prev.to(torch.bfloat16).float()
            x = EmulatedFrame.normed(h.to(torch.bfloat16), g1)
            for a in range(A_UNITS):  # A
                self.x8192[:, a * TILE:(a + 1) * TILE] = self._gemm(
                    layer, a * A_TILES, x).to(torch.bfloat16)
            att = emulated_attention(self.x8192.float(), self.rope, self.cache[layer],
                                     self.position)  # B
            h = h.to(torch.bfloat16).float()
            if layer > 0:
                prev.zero_()
            for b in range(B_UNITS):
                o = self._gemm(layer, B_BASE + b * B_TILES, att).to(torch.bfloat16).float()
                cols = slice(b * TILE, (b + 1) * TILE)
                self.x1024[:, cols] = (h[:, cols] + o).to(torch.bfloat16)
            x = EmulatedFrame.normed(self.x1024, g2)  # C
            for c in range(C_UNITS):
                tiles = unit_tiles(self.w, layer, C_BASE + c * C_TILES, C_TILES).float()
                gu = tiles[:2 * KT].view(KT, 2, TILE, TILE)
                xk = x.float().view(rows, KT, TILE)
                gate = torch.einsum("nok,rnk->ro", gu[:, 0], xk).to(torch.bfloat16).float()
                up = torch.einsum("nok,rnk->ro", gu[:, 1], xk).to(torch.bfloat16).float()
                y = ((gate / (1 + torch.exp(-gate))).to(torch.bfloat16).float() * up).to(
                    torch.bfloat16).float()
                down = tiles[2 * KT:]  # [16 output blocks, 64 out, 64 features]
                cur += torch.einsum("mof,rf->rmo", down, y).reshape(rows, HIDDEN)
        last = acc[(LAYERS - 1) % 2]
        self.h.copy_((self.x1024.float() + last.to(torch.bfloat16).float()).to(torch.bfloat16))
        last.zero_()


def emulate(rows_list: list[int]) -> None:
    """``--emulate``: ``check`` on ``EmulatedThreePhase`` (CPU), positions 0 and 15."""
    from depth_layers_wgmma import SLOTS as slots

    torch.manual_seed(0)
    depth = build_depth("cpu")
    modules = list(depth.model.layers)
    for rows in rows_list:
        frame = EmulatedThreePhase(rows)
        frame.load(modules)
        for pos in (0, slots - 1):
            check(frame, modules, depth, pos, {})
            print(f"  {frame.label()} pos {pos}: passes the check", flush=True)
        assert not after_launches(frame), after_launches(frame)


# ----------------------------------------------------------------------------- builds, GPU


def compile_only(rows_list: list[int], attentions: list[str], programs: int, maxnreg: int,
                 spin_budget: int, timeline: bool = False) -> None:
    """Builds every padded row count for sm_90a here (no GPU) and prints resources."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.sm90_build import build_only

    print(f"triton {triton.__version__}; 4 consumer warps + 1 loader warp; maxnreg "
          f"{maxnreg or 248}")
    for rows in rows_list:
        for attention in attentions:
            frame = ThreePhaseFrame(rows, "cpu", programs, attention, timeline)  # not read
            with build_only(90) as built:
                frame.run_layers(programs, maxnreg, spin_budget)
            kernel = built[-1]
            print(describe_build(kernel, frame.label(), "3phase") +
                  f"; {kernel.asm['ptx'].count('wgmma.mma_async')} wgmma PTX sites, "
                  f"{_sass_hgmma(kernel)}", flush=True)


def measure(rows: int, depth, args, programs: int, result: dict, attention: str) -> None:
    """The checks at positions 0 and 15 (a mismatch is recorded; the launch is still timed
    unless a wait ran out of budget), then ms a position (CUDA events, median)."""
    frame = ThreePhaseFrame(rows, "cuda", programs, attention, timeline=args.timeline)
    row: dict = {"body": f"3phase-{attention}", "rows": rows, "padded_rows": frame.rp,
                 "stages": frame.stages, "checks": [], "correct": True}
    result["rows"].append(row)
    timed = check_and_time(frame, depth, args, programs, row, result)
    if timed is None:
        return
    ms, min_ms = timed
    weight_bytes = frame.w.numel() * frame.w.element_size()
    if args.timeline:  # the last timed launch's stamps
        row["timeline"] = timeline_summary(frame.timeline, rows, attention)
        print(f"  {frame.label()} timeline (us, layers 1-10, median): "
              f"{row['timeline']['us']}", flush=True)
    row.update(ms=round(ms, 4), min_ms=round(min_ms, 4),
               tb_per_s=round(weight_bytes / ms / 1e9, 3),
               frame_ms_15_positions=round(15 * ms, 3))
    print(f"  {frame.label()}: {ms:.4f} ms a position (min {min_ms:.4f}), {row['tb_per_s']} "
          f"TB/s of weights; x15 = {15 * ms:.2f} ms a frame", flush=True)


def timeline_summary(stamps: torch.Tensor, rows: int, attention: str) -> dict:
    """Where a layer's time goes, from one launch's stamps (``EVENTS``), us, over layers 1-10
    (steady: neither the first nor the last): each phase's span on the critical path (from the
    last program's publish of the phase before to the last program's publish of this one) and,
    over the programs that hold the phase's work, the median wait (publish seen after the last
    one) and work pieces."""
    import numpy as np

    t = stamps.double().cpu().numpy() / 1e3  # [P, L, E] us
    e = {name: i for i, name in enumerate(EVENTS)}
    programs = t.shape[0]
    a_prog = np.array([programs - 1 - p < A_UNITS for p in range(programs)])
    b_prog = np.array([(2 * programs - 1 - A_UNITS - p) % programs < B_UNITS
                       for p in range(programs)])
    c_prog = np.arange(programs) < C_UNITS
    t_prog = np.arange(programs) * 4 < rows * KV_HEADS
    phase = attention == "phase"
    out: dict = {"layers": "1-10", "us": {}}
    spans, pieces = [], []
    for layer in range(1, LAYERS - 1):
        prev_c = t[c_prog, layer - 1, e["c_done"]].max()
        a_done = t[a_prog, layer, e["a_done"]].max()
        t_done = t[t_prog, layer, e["t_done"]].max() if phase else a_done
        b_done = t[b_prog, layer, e["b_done"]].max()
        c_done = t[c_prog, layer, e["c_done"]].max()
        spans.append([a_done - prev_c, t_done - a_done, b_done - t_done, c_done - b_done,
                      c_done - prev_c])
        row = [np.median(t[a_prog, layer, e["a_waited"]] - prev_c),
               np.median(t[a_prog, layer, e["a_done"]] - t[a_prog, layer, e["a_waited"]]),
               np.median(t[b_prog, layer, e["b_waited"]] - t_done),
               np.median(t[b_prog, layer, e["b_operand"]] - t[b_prog, layer, e["b_waited"]]),
               np.median(t[b_prog, layer, e["b_done"]] - t[b_prog, layer, e["b_operand"]]),
               np.median(t[c_prog, layer, e["c_waited"]] - b_done),
               np.median(t[c_prog, layer, e["c_normed"]] - t[c_prog, layer, e["c_waited"]]),
               np.median(t[c_prog, layer, e["c_gate_up"]] - t[c_prog, layer, e["c_normed"]]),
               np.median(t[c_prog, layer, e["c_done"]] - t[c_prog, layer, e["c_gate_up"]])]
        if phase:
            row += [np.median(t[t_prog, layer, e["t_waited"]] - a_done),
                    np.median(t[t_prog, layer, e["t_done"]] - t[t_prog, layer, e["t_waited"]])]
        pieces.append(row)
    for name, v in zip(("span_a", "span_t", "span_b", "span_c", "layer"),
                       np.median(np.array(spans), axis=0)):
        out["us"][name] = round(float(v), 2)
    names = ["a_wait", "a_work", "b_wait", "b_attention_and_operand", "b_gemm_and_residual",
             "c_wait", "c_norm", "c_gate_up", "c_act_and_down"]
    names += ["t_wait", "t_attention"] * phase
    for name, v in zip(names, np.median(np.array(pieces), axis=0)):
        out["us"][name] = round(float(v), 2)
    return out


def measure_8phase(rows: int, depth, args, programs: int, result: dict) -> None:
    """The 8-phase body at the same rows (``depth_layers_wgmma``, config 64x128x6w4)."""
    from depth_layers_wgmma import LayersFrame
    from depth_stream_gluon import Stream

    frame = LayersFrame(Stream.parse("64x128x6w4"), rows, "cuda", timeline=args.timeline)
    frame.load(list(depth.model.layers))
    launch = {"programs": programs, "maxnreg": args.maxnreg, "spin_budget": args.spin_budget,
              "cooperative": not args.no_cooperative}
    ms, _ = event_ms(lambda: frame.run_layers(**launch), args.iters)
    row = {"ms": round(ms, 4), "hang": bool(frame.err.item())}
    print(f"  8-phase body r{rows}: {ms:.4f} ms a position", flush=True)
    if args.timeline:
        row["timeline"] = phase_timeline(frame.timeline, programs)
        print(f"  8-phase body r{rows} timeline (us, layers 1-10, median): {row['timeline']}",
              flush=True)
    result["eight_phase"][str(rows)] = row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default=ROWS, help="rows a launch (2 a request with CFG)")
    ap.add_argument("--maxnreg", type=int, default=0, help="0: 248")
    ap.add_argument("--programs", type=int, default=0, help="0: one per SM")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--spin-budget", type=int, default=1 << 20)
    ap.add_argument("--deadline-s", type=float, default=300)
    ap.add_argument("--no-baselines", action="store_true")
    ap.add_argument("--with-8phase", action="store_true")
    ap.add_argument("--attention", default="items,phase", help=f"of {ATTENTION}")
    ap.add_argument("--no-cooperative", action="store_true")
    ap.add_argument("--timeline", action="store_true",
                    help="stamp each program's phases (%%globaltimer) and print where a layer's "
                         "time goes")
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--emulate", action="store_true")
    ap.add_argument("--out", default="depth-layers-3phase.json")
    args = ap.parse_args()
    t_start = time.monotonic()
    rows_list = [int(r) for r in args.rows.split(",")]
    attentions = args.attention.split(",")
    if args.compile_only:
        compile_only(rows_list, attentions, args.programs or 132, args.maxnreg,
                     args.spin_budget, args.timeline)
        return
    if args.emulate:
        emulate(rows_list)
        return
    from breezert_bench.provenance import provenance

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    programs = args.programs or props.multi_processor_count
    print(f"triton {triton.__version__}, {props.name}, {programs} programs", flush=True)
    result = {"meta": provenance(script="bench/depth_layers_3phase.py", triton=triton.__version__,
                                 programs=programs, layers=LAYERS),
              "rows": [], "baselines": {}, "eight_phase": {}, "failures": []}

    def save() -> None:
        Path(args.out).write_text(json.dumps(result, indent=1))

    depth = build_depth("cuda")
    for rows in rows_list:
        if time.monotonic() - t_start > args.deadline_s:
            print(f"deadline: r{rows} not run", flush=True)
            break
        runs = [f"3phase-{a}" for a in attentions]
        runs += ["8phase"] * args.with_8phase + ["baselines"] * (not args.no_baselines)
        for name in runs:
            try:
                if name == "baselines":
                    result["baselines"][str(rows)] = baselines(depth, rows, args.iters)
                    print(f"  baselines r{rows}: {result['baselines'][str(rows)]}", flush=True)
                elif name == "8phase":
                    measure_8phase(rows, depth, args, programs, result)
                else:
                    measure(rows, depth, args, programs, result, name.split("-")[1])
            except Exception as exc:
                print(f"{name} r{rows}: FAILED: {exc!r}"[:2000], flush=True)
                traceback.print_exc(limit=3)
                result["failures"].append(f"{name} r{rows}: {exc!r}"[:1000])
            torch.cuda.empty_cache()
            save()
    save()
    print("\nbody | rows | correct | ms a position | 8-phase ms | served fused ms | "
          "eager bf16 ms | TB/s")
    for r in result["rows"]:
        b = result["baselines"].get(str(r["rows"]), {})
        e = result["eight_phase"].get(str(r["rows"]), {})
        print(f"{r['body']} | {r['rows']} | {r['correct']} | {r.get('ms', '-')} | "
              f"{e.get('ms', '-')} | "
              f"{b.get('served_fused_ms', '-')} | {b.get('eager_bf16_ms', '-')} | "
              f"{r.get('tb_per_s', '-')}")
    if result["failures"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
