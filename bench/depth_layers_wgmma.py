"""Experiment (issue 30): the real math of the depth decoder's 12-layer body for one position in
ONE persistent Gluon launch, built on ``depth_stream_wgmma.py``'s TMA weight ring and swap-AB
wgmma consumer. Built for triton 3.6.0 / 3.7.1 (sm_90a).

    PYTHONPATH=runtime:bench:. python3 bench/depth_layers_wgmma.py --out depth-layers-wgmma.json
    PYTHONPATH=runtime:bench:. python bench/depth_layers_wgmma.py --compile-only  # no GPU
    PYTHONPATH=runtime:bench:. python bench/depth_layers_wgmma.py --emulate --rows 2,16  # no GPU

What one launch computes (``DepthLayer.forward`` x 12, R rows, position ``pos`` of the frame,
the frame-local K/V cache ``[L, 2, R, KVH, 16, D]`` holding positions < pos), 8 phases a layer,
each phase starting when every program published the one before (per-phase counters, as in the
streams' ``phased`` mode):

    0 norm1   rows: h = bf16(h + bf16(down acc))  (layer 0: h = x), X = bf16(g1 * bf16(rms(h)))
    1 q/k/v   wgmma GEMM, split-K partial sums added into an fp32 accumulator (relaxed atomics)
    2 attn    (row, KV head): q, k, v rounded to bf16, RoPE (sign-folded table, eager's rounding
              points), k and v written into the cache at pos, attention over slots <= pos in
              fp32 on CUDA cores, out rounded to bf16 into X
    3 o       wgmma GEMM into an fp32 accumulator
    4 norm2   rows: h = bf16(h + bf16(o acc)), X = bf16(g2 * bf16(rms(h)))
    5 gate/up wgmma GEMM into an fp32 accumulator
    6 act     (row, 4096 columns): Y = bf16(bf16(silu(bf16(gate))) * bf16(up))
    7 down    wgmma GEMM into an fp32 accumulator
    and after the last layer: h = bf16(h + bf16(down acc)) (the output; no final norm).

The depth model has no q/k norm (``models/depth.py``; the backbone's layers have one). Split-K
is why the nonlinear work (RoPE, SiLU * up, the norms) runs in its own CUDA-core phase instead of
a GEMM epilogue: a program owns a contiguous share of a phase's weight tiles (132 programs for 24
q/k/v n-blocks), so no program holds a whole output. Every accumulator element is read by one
thread of one phase and zeroed by it (or, for q/k/v, by the row's owner two phases later), so a
launch leaves the accumulators zero for the next; nothing else is reset between launches.

Per program, ``gl.warp_specialize`` forks (the weight loader is ``depth_stream_wgmma``'s, the
GEMM consumer its ``_mma_phase``, both imported):
- the weight loader (1 warp): TMA of every tile of the program's shares of the 12 layers' four
  GEMMs into the ring, in order, never waiting for a phase (it runs ahead across phases);
- the activation loader (1 warp): before each GEMM phase it waits for the phase before, fences
  (``fence.proxy.async.global``) and TMA-loads the activation chunk of each tile (X or Y);
- the consumers (the default partition, 4 or 8 warps): wait for the phase before, then either the
  GEMM (wgmma over the ring) or the CUDA-core phase, then a partition barrier and a release
  arrival on the phase's counter. Reads of another program's results bypass L1 (``.cg``).
  Ordinary stores that a TMA reads next (X, Y) are fenced on both sides: the writing thread's
  ``fence.proxy.async.global`` before the barrier and release, the loader's after its acquire
  (the stream experiment never wrote its activations, so this hand-over is new here).

A 5-phase body (the norms and SiLU x up staged by the next GEMM's consumers, 60 waits a
position) ran beside this one on an H100 on 6 Dec: correct, and slower from 8 rows on
(bench/README.md, "H100, 6 Dec"). It was deleted after that measurement; the code is at
c480e90.

A weight loader that also asked L2 (``cp.async.bulk.prefetch.L2``) for its share of the GEMM 1
or 2 places ahead of the ring, so that the memory would keep streaming through the CUDA-core
phases (half of a layer's ~40 us on the H100 timeline of 6 Dec), lost at every size on an H100
on 6 Dec (seventh session, bench/README.md): 0.48 -> 0.56 ms a position at 2 rows, 0.52 ->
0.61 at 16, 0.62 -> 0.74-0.78 at 64 (the prefetches compete with the ring's own reads). It was
deleted after that measurement; the code is at 0031a14 (``--l2-ahead``).

Checked on a GPU against torch fp32 math of the same layers (from the same bf16 weights): the
output h, the layers' delta (h - x) and the cache entries written at pos, at positions 0 and 15,
by relative L2 error (of the whole tensor and of its worst row) and max abs error; fails where
the whole tensor's error exceeds ``REL_TOL`` (3e-2) or either error exceeds 2x the eager bf16
module's own on the same inputs + 2e-3 (one bf16 GEMM lands at 1e-3 to 1e-2; twelve layers
on a bf16 residual stream put the eager module at ~1.2-1.6e-2 on the CPU, checked against this
reference, which itself matches the module run in fp32 within 1e-6; ``--emulate`` runs the same
check on the body's data flow emulated in torch, ``EmulatedFrame``). A mismatch is recorded
and the run exits 1 at its end, but the launch is still timed (unless a wait ran out of budget):
CUDA events, median, beside the phased stream's GEMMs alone (``depth_stream_wgmma``, one
position: what the real math adds), the eager bf16 ``DepthLayer`` x 12 and the served
``FusedDepthLayers`` (projector + 12 layers + final norm: the served unit a position), the last
two as CUDA-graph replays.

Owns: this experiment only. Must not: be imported by the runtime or the tests.
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
from depth_stream_gluon import (
    HIDDEN,
    PHASES,
    Stream,
    _partition_barrier,
    _wait_count,
    describe_build,
)
from depth_stream_wgmma import (
    LOADER_REGS,
    WgmmaFrame,
    _fence_proxy_async_global,
    _mma_phase,
    _sass_hgmma,
    _w_loader,
    _x_loader_phase,
)
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

LAYERS = 12
HEADS, KV_HEADS, HEAD_DIM, SLOTS = 8, 2, 128, 16  # DepthConfig; 16 positions a frame
FFN = 8192
EPS = 1e-5
PHASES_A_LAYER = 8
PHASE_NAMES = ("norm1", "qkv", "attn", "o", "norm2", "gate_up", "act", "down")
PROGRAMS_MAX = 132  # the timeline's rows (one per SM on an H100 or H200)
ACT_COLS = 4096  # columns of the 8192 a SiLU * up item: 2 items a row
REL_TOL = 3e-2  # 12 layers on a bf16 residual: the eager bf16 module's own error is ~1.5e-2
CONFIGS = "64x64x8w8,64x128x6w4"  # the stream's two configs that ran on the H100 (5 Dec)
ROWS = "2,16,64,128,256"

# ----------------------------------------------------------------------------- device code


@gluon.jit
def _residual_norm(x_in_ptr, h_ptr, acc_ptr, norm_ptr, x_out_ptr, zero_ptr, rows, first, eps,
                   pid, P, OUT_W: gl.constexpr, NORM: gl.constexpr, ZERO_N: gl.constexpr,
                   layout: gl.constexpr):
    """For each row this program owns (r = pid, pid + P, ...): h = bf16(h + bf16(acc)) (or the
    input x when ``first``), the accumulator row read and zeroed; with NORM, the RMSNorm of h
    times the norm weight into X (eager's rounding: normed to bf16, then the bf16 product);
    ZERO_N > 0 zeroes that many accumulator columns at ``zero_ptr`` (the q/k/v accumulator,
    read two phases ago)."""
    cols = gl.arange(0, HIDDEN_C, layout=layout)
    for r in range(pid, rows, P):
        if first:
            h = gl.load(x_in_ptr + r * HIDDEN_C + cols).to(gl.float32)
        else:
            a = gl.load(acc_ptr + r * OUT_W + cols, cache_modifier=".cg")
            gl.store(acc_ptr + r * OUT_W + cols, gl.zeros_like(a))  # each element: this thread
            h = gl.load(h_ptr + r * HIDDEN_C + cols).to(gl.float32)  # this thread wrote it
            h = h + a.to(gl.bfloat16).to(gl.float32)
        hb = h.to(gl.bfloat16)
        gl.store(h_ptr + r * HIDDEN_C + cols, hb)
        if NORM:
            h = hb.to(gl.float32)
            inv = gl.rsqrt(gl.sum(h * h, axis=0) / HIDDEN_C + eps)
            normed = (h * inv).to(gl.bfloat16).to(gl.float32)
            g = gl.load(norm_ptr + cols).to(gl.float32)
            gl.store(x_out_ptr + r * HIDDEN_C + cols, (g * normed).to(gl.bfloat16))
        if ZERO_N > 0:
            for c in gl.static_range(0, ZERO_N, HIDDEN_C):
                zc = c + cols
                gl.store(zero_ptr + r * OUT_W + zc, gl.zeros_like(cols.to(gl.float32)),
                         mask=zc < ZERO_N)


@gluon.jit
def _rope_bf16(ptr, d, cos, sin):
    """One head's 128 accumulator values rounded to bf16 and rotated as ``apply_rope_signed``
    in bf16: x * cos + roll(x, 64) * sin_signed, each product and the sum rounded; roll by half
    of 128 is d ^ 64. Returns fp32 values of the bf16 result."""
    x = gl.load(ptr + d, cache_modifier=".cg").to(gl.bfloat16).to(gl.float32)
    xr = gl.load(ptr + (d ^ 64), cache_modifier=".cg").to(gl.bfloat16).to(gl.float32)
    a = (x * cos).to(gl.bfloat16).to(gl.float32)
    b = (xr * sin).to(gl.bfloat16).to(gl.float32)
    return (a + b).to(gl.bfloat16).to(gl.float32)


@gluon.jit
def _attention(qkv_ptr, cache_ptr, rope_ptr, x_out_ptr, rows, pos, scale, pid, P,
               OUT_W: gl.constexpr, layout: gl.constexpr):
    """Items (row, KV head): RoPE'd k and v into the layer's cache ``[2, R, KVH, 16, D]`` at
    pos, then each of the head group's 4 queries against slots <= pos (slots < pos from the
    cache, pos from registers), fp32 softmax, the output rounded to bf16 into X."""
    vec_l: gl.constexpr = gl.SliceLayout(0, layout)
    slot_l: gl.constexpr = gl.SliceLayout(1, layout)
    d = gl.arange(0, HEAD_DIM_C, layout=vec_l)
    t = gl.arange(0, SLOTS_C, layout=slot_l)
    cos = gl.load(rope_ptr + d).to(gl.float32)
    sin = gl.load(rope_ptr + HEAD_DIM_C + d).to(gl.float32)
    earlier = (t[:, None] < pos) & (d[None, :] < HEAD_DIM_C)
    here = (t[:, None] == pos) & (d[None, :] < HEAD_DIM_C)
    live = t <= pos
    tile = t[:, None] * HEAD_DIM_C + d[None, :]
    for item in range(pid, rows * KV_HEADS_C, P):
        r = item // KV_HEADS_C
        j = item % KV_HEADS_C
        base = qkv_ptr + r * OUT_W
        k = _rope_bf16(base + (HEADS_C + j) * HEAD_DIM_C, d, cos, sin)
        v = gl.load(base + (HEADS_C + KV_HEADS_C + j) * HEAD_DIM_C + d,
                    cache_modifier=".cg").to(gl.bfloat16)
        k_cache = cache_ptr + (r * KV_HEADS_C + j) * SLOTS_C * HEAD_DIM_C
        v_cache = k_cache + rows * KV_HEADS_C * SLOTS_C * HEAD_DIM_C
        gl.store(k_cache + pos * HEAD_DIM_C + d, k.to(gl.bfloat16))
        gl.store(v_cache + pos * HEAD_DIM_C + d, v)
        keys = gl.load(k_cache + tile, mask=earlier, other=0.0).to(gl.float32)
        keys = gl.where(here, k[None, :], keys)
        values = gl.load(v_cache + tile, mask=earlier, other=0.0).to(gl.float32)
        values = gl.where(here, v.to(gl.float32)[None, :], values)
        for hh in gl.static_range(HEADS_C // KV_HEADS_C):
            head = j * (HEADS_C // KV_HEADS_C) + hh
            q = _rope_bf16(base + head * HEAD_DIM_C, d, cos, sin)
            s = gl.sum(keys * q[None, :], axis=1) * scale
            s = gl.where(live, s, float("-inf"))
            p = gl.exp(s - gl.max(s, axis=0))
            p = gl.where(live, p, 0.0)
            o = gl.sum(values * p[:, None], axis=0) / gl.sum(p, axis=0)
            gl.store(x_out_ptr + r * HIDDEN_C + head * HEAD_DIM_C + d, o.to(gl.bfloat16))


@gluon.jit
def _silu_mul(gu_ptr, y_ptr, rows, pid, P, OUT_W: gl.constexpr, layout: gl.constexpr):
    """Items (row, ACT_COLS columns of the 8192: 16 fp32 of gate and of up a thread with 8
    warps, all loads in flight at once): gate and up read and zeroed (each element by one
    thread), Y = bf16(bf16(silu(bf16(gate))) * bf16(up))."""
    cols = gl.arange(0, ACT_COLS_C, layout=layout)
    chunks: gl.constexpr = FFN_C // ACT_COLS_C
    for item in range(pid, rows * chunks, P):
        r = item // chunks
        c = (item % chunks) * ACT_COLS_C + cols
        gate_ptr = gu_ptr + r * OUT_W + c
        g = gl.load(gate_ptr, cache_modifier=".cg")
        u = gl.load(gate_ptr + FFN_C, cache_modifier=".cg")
        gl.store(gate_ptr, gl.zeros_like(g))
        gl.store(gate_ptr + FFN_C, gl.zeros_like(u))
        g = g.to(gl.bfloat16).to(gl.float32)
        u = u.to(gl.bfloat16).to(gl.float32)
        s = (g / (1.0 + gl.exp(-g))).to(gl.bfloat16).to(gl.float32)
        gl.store(y_ptr + r * FFN_C + c, (s * u).to(gl.bfloat16))


@gluon.jit
def _stamp(TL: gl.constexpr, ptr):
    """With TL: this thread's ``%globaltimer`` (ns) into ``*ptr``, a slot of a per-program
    timeline (``--timeline``); without: nothing."""
    if TL:
        now = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r",
                                        [gl.program_id(0)], dtype=gl.int64, is_pure=False,
                                        pack=1)
        gl.store(ptr, now)


@gluon.jit
def _publish(counters, g, token, FENCE: gl.constexpr):
    """Phase g done in this program: with FENCE (a phase that wrote X or Y with ordinary stores,
    which the activation loaders' TMA reads next) each thread's proxy fence, then every
    consumer warp's stores and atomics issued (partition barrier), then one release arrival.
    Returns ``token`` (threaded through the fence so it stays in place)."""
    if FENCE:
        token = _fence_proxy_async_global(token)
    _partition_barrier()
    gl.atomic_add(counters + g, 1, sem="release", scope="gpu")
    return token


@gluon.jit
def _layers_consumer(ring, ready, empty, xs, xready, xempty, counters, err_ptr, out_ptr,
                     x_in_ptr, h_ptr, x_ptr, y_ptr, norm_ptr, rope_ptr, cache_ptr, rows, pos,
                     layers, target, budget, eps, scale, BN: gl.constexpr, BK: gl.constexpr,
                     S: gl.constexpr, XS: gl.constexpr, RP: gl.constexpr,
                     OUT_W: gl.constexpr, COL0: gl.constexpr, COL2: gl.constexpr,
                     COL3: gl.constexpr, COL4: gl.constexpr, acc_layout: gl.constexpr,
                     row_layout: gl.constexpr, att_layout: gl.constexpr, tl_ptr,
                     TL: gl.constexpr):
    pid = gl.program_id(0)
    P = gl.num_programs(0)
    it = 0
    g = 0
    for layer in range(layers):
        norm = norm_ptr + layer * 2 * HIDDEN_C
        marks = tl_ptr + (pid * layers + layer) * 2 * PHASES_A_LAYER_C
        for ph in gl.static_range(PHASES_A_LAYER_C):
            if g > 0:  # every program published the phase before
                budget = _wait_count(counters + g - 1, target, budget)
            _stamp(TL, marks + 2 * ph)  # the phase's inputs are published
            if ph == 0:
                _residual_norm(x_in_ptr, h_ptr, out_ptr + COL4, norm, x_ptr, out_ptr, rows,
                               layer == 0, eps, pid, P, OUT_W, True, 0, row_layout)
            elif ph == 1:
                it = _mma_phase(ring, ready, empty, xs, xready, xempty, it, out_ptr + COL0,
                                rows, pid, P, Q_OUT_C, HIDDEN_C, OUT_W, BN, BK, S, XS, RP,
                                acc_layout)
            elif ph == 2:
                _attention(out_ptr + COL0, cache_ptr + layer * 2 * rows * KV_CACHE_ROW_C,
                           rope_ptr, x_ptr, rows, pos, scale, pid, P, OUT_W, att_layout)
            elif ph == 3:
                it = _mma_phase(ring, ready, empty, xs, xready, xempty, it, out_ptr + COL2,
                                rows, pid, P, HIDDEN_C, HIDDEN_C, OUT_W, BN, BK, S, XS, RP,
                                acc_layout)
            elif ph == 4:
                _residual_norm(x_in_ptr, h_ptr, out_ptr + COL2, norm + HIDDEN_C, x_ptr,
                               out_ptr + COL0, rows, False, eps, pid, P, OUT_W, True, Q_OUT_C,
                               row_layout)
            elif ph == 5:
                it = _mma_phase(ring, ready, empty, xs, xready, xempty, it, out_ptr + COL3,
                                rows, pid, P, 2 * FFN_C, HIDDEN_C, OUT_W, BN, BK, S, XS, RP,
                                acc_layout)
            elif ph == 6:
                _silu_mul(out_ptr + COL3, y_ptr, rows, pid, P, OUT_W, row_layout)
            else:
                it = _mma_phase(ring, ready, empty, xs, xready, xempty, it, out_ptr + COL4,
                                rows, pid, P, HIDDEN_C, FFN_C, OUT_W, BN, BK, S, XS, RP,
                                acc_layout)
            _stamp(TL, marks + 2 * ph + 1)  # its work is done
            budget = _publish(counters, g, budget, ph % 2 == 0)  # even: CUDA-core phases
            g += 1
    budget = _wait_count(counters + g - 1, target, budget)
    _residual_norm(x_in_ptr, h_ptr, out_ptr + COL4, norm_ptr, x_ptr, out_ptr, rows, False, eps,
                   pid, P, OUT_W, False, 0, row_layout)
    if budget <= 0:
        gl.store(err_ptr, 1)


@gluon.jit
def _layers_x_loader(x_desc, y_desc, xs, xready, xempty, counters, err_ptr, layers, target,
                     budget, BN: gl.constexpr, BK: gl.constexpr, XS: gl.constexpr,
                     RB: gl.constexpr, NRB: gl.constexpr):
    """Each GEMM phase's activation chunks (X for q/k/v, o and gate/up, Y for down), each
    phase's after the CUDA-core phase before it was published by every program."""
    pid = gl.program_id(0)
    P = gl.num_programs(0)
    jt = 0
    for layer in range(layers):
        g = layer * PHASES_A_LAYER_C
        budget = _fence_proxy_async_global(_wait_count(counters + g, target, budget))
        jt = _x_loader_phase(x_desc, xs, xready, xempty, jt, pid, P, Q_OUT_C, HIDDEN_C, BN, BK,
                             XS, RB, NRB)
        budget = _fence_proxy_async_global(_wait_count(counters + g + 2, target, budget))
        jt = _x_loader_phase(x_desc, xs, xready, xempty, jt, pid, P, HIDDEN_C, HIDDEN_C, BN, BK,
                             XS, RB, NRB)
        budget = _fence_proxy_async_global(_wait_count(counters + g + 4, target, budget))
        jt = _x_loader_phase(x_desc, xs, xready, xempty, jt, pid, P, 2 * FFN_C, HIDDEN_C, BN,
                             BK, XS, RB, NRB)
        budget = _fence_proxy_async_global(_wait_count(counters + g + 6, target, budget))
        jt = _x_loader_phase(y_desc, xs, xready, xempty, jt, pid, P, HIDDEN_C, FFN_C, BN, BK,
                             XS, RB, NRB)
    if budget <= 0:
        gl.store(err_ptr, 1)


@gluon.jit(do_not_specialize=["rows", "pos", "layers", "target", "budget"])
def _layers_kernel(desc, x_desc, y_desc, counters, err_ptr, out_ptr, x_in_ptr, h_ptr, x_ptr,
                   y_ptr, norm_ptr, rope_ptr, cache_ptr, tl_ptr, rows, pos, layers, target,
                   budget, eps, scale, BN: gl.constexpr, BK: gl.constexpr, S: gl.constexpr,
                   XS: gl.constexpr, RP: gl.constexpr, RB: gl.constexpr,
                   INSTR_N: gl.constexpr, WARPS_M: gl.constexpr, LAYER_TILES: gl.constexpr,
                   OFF0: gl.constexpr, OFF2: gl.constexpr, OFF3: gl.constexpr,
                   OFF4: gl.constexpr, OUT_W: gl.constexpr, COL0: gl.constexpr,
                   COL2: gl.constexpr, COL3: gl.constexpr, COL4: gl.constexpr,
                   TL: gl.constexpr, num_warps: gl.constexpr):
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[WARPS_M, num_warps // WARPS_M],
        instr_shape=[16, INSTR_N, 16])
    # rows of 1024: 4 consecutive fp32 a thread, nothing replicated (each element one thread)
    row_layout: gl.constexpr = gl.BlockedLayout([4], [32], [num_warps], [0])
    # [16 slots, 128 head dims]: 8 bf16 (16 B) a thread along D
    att_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])
    ring = gl.allocate_shared_memory(gl.bfloat16, [S, BN, BK], desc.layout)
    xs = gl.allocate_shared_memory(gl.bfloat16, [XS, RP, BK], x_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
    xready = gl.allocate_shared_memory(gl.int64, [XS, 1], mbarrier.MBarrierLayout())
    xempty = gl.allocate_shared_memory(gl.int64, [XS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(S):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(XS):
        mbarrier.init(xready.index(i), count=1)
        mbarrier.init(xempty.index(i), count=1)
    NRB: gl.constexpr = RP // RB
    gl.warp_specialize([
        (_layers_consumer, (ring, ready, empty, xs, xready, xempty, counters, err_ptr, out_ptr,
                            x_in_ptr, h_ptr, x_ptr, y_ptr, norm_ptr, rope_ptr, cache_ptr, rows,
                            pos, layers, target, budget, eps, scale, BN, BK, S, XS, RP, OUT_W,
                            COL0, COL2, COL3, COL4, acc_layout, row_layout, att_layout, tl_ptr,
                            TL)),
        (_w_loader, (desc, ring, ready, empty, 1, layers, BN, BK, S, LAYER_TILES, OFF0, OFF2,
                     OFF3, OFF4)),
        (_layers_x_loader, (x_desc, y_desc, xs, xready, xempty, counters, err_ptr, layers,
                            target, budget, BN, BK, XS, RB, NRB)),
    ], [1, 1], [LOADER_REGS_C, LOADER_REGS_C])


# constexpr globals the device code reads (gluon.jit resolves module-level constexprs)
Q_OUT_C = gl.constexpr(PHASES[0][1])
HIDDEN_C = gl.constexpr(HIDDEN)
FFN_C = gl.constexpr(FFN)
HEADS_C = gl.constexpr(HEADS)
KV_HEADS_C = gl.constexpr(KV_HEADS)
HEAD_DIM_C = gl.constexpr(HEAD_DIM)
SLOTS_C = gl.constexpr(SLOTS)
ACT_COLS_C = gl.constexpr(ACT_COLS)
KV_CACHE_ROW_C = gl.constexpr(KV_HEADS * SLOTS * HEAD_DIM)  # one row's keys (or values)
PHASES_A_LAYER_C = gl.constexpr(PHASES_A_LAYER)
LOADER_REGS_C = gl.constexpr(LOADER_REGS)

# ----------------------------------------------------------------------------- host side


class LayersFrame(WgmmaFrame):
    """One position's buffers: the 12 layers' packed weights (``Frame``'s tiles, filled from
    ``DepthLayer`` modules by ``load``), the input x, the residual h (the output), the norm
    weights, the RoPE table of the position, the frame cache, X (``x1024``) and Y (``x8192``)
    for the GEMMs' TMA, the fp32 accumulators (``out``) and the phase counters."""

    def __init__(self, stream: Stream, rows: int, device: str, layers: int = LAYERS,
                 seed: int = 0, timeline: bool = False) -> None:
        super().__init__(stream, layers, 1, device, seed, init=False, rows=rows)
        bf16 = torch.bfloat16
        self.x_in = torch.empty(rows, HIDDEN, dtype=bf16, device=device)
        self.h = torch.empty_like(self.x_in)
        self.norm_w = torch.empty(layers, 2, HIDDEN, dtype=bf16, device=device)
        self.rope = torch.empty(2, HEAD_DIM, dtype=bf16, device=device)  # cos, sin_signed
        self.cache = torch.empty(layers, 2, rows, KV_HEADS, SLOTS, HEAD_DIM, dtype=bf16,
                                 device=device)
        self.counters = torch.zeros(layers * PHASES_A_LAYER + 1, dtype=torch.int32,
                                    device=device)
        self.position = 0
        self.stamps = timeline
        self.timeline = torch.zeros(PROGRAMS_MAX if timeline else 1, layers,
                                    2 * PHASES_A_LAYER, dtype=torch.int64, device=device)

    def load(self, modules) -> None:
        """Packs each ``DepthLayer``'s packed q/k/v, o, packed gate/up and down weights into
        the stream's tiles (``Frame.matrix`` reads them back) and copies the norm weights."""
        s = self.s
        for layer, m in enumerate(modules):
            mats = (m.self_attn.qkv_weight, None, m.self_attn.o_proj.weight,
                    m.mlp.gate_up_weight, m.mlp.down_proj.weight)
            for p, w in enumerate(mats):
                if w is None:
                    continue
                _, n, k = PHASES[p]
                tiles = self.tile_rows(layer, s.offsets[p], n, k)
                tiles.copy_(w.view(n // s.bn, s.bn, k // s.bk, s.bk).permute(0, 2, 1, 3)
                            .reshape(-1, s.bk))
                assert torch.equal(self.matrix(layer, p), w), f"layer {layer} phase {p} packing"
            self.norm_w[layer, 0] = m.input_layernorm.weight
            self.norm_w[layer, 1] = m.post_attention_layernorm.weight

    def run_layers(self, programs: int, maxnreg: int, spin_budget: int,
                   cooperative: bool = True):
        s = self.s
        offs, cols = s.offsets, s.out_cols
        if self.stamps and programs > PROGRAMS_MAX:
            raise ValueError(f"the timeline holds {PROGRAMS_MAX} programs, not {programs}")
        self.epoch += 1  # counters only grow: a launch waits for epoch * programs arrivals
        kwargs = {"launch_cooperative_grid": True} if cooperative else {}
        return _layers_kernel[(programs,)](
            self.desc, *self.x_descs, self.counters, self.err, self.out, self.x_in, self.h,
            self.x1024, self.x8192, self.norm_w, self.rope, self.cache, self.timeline,
            self.rows, self.position, self.layers, self.epoch * programs, spin_budget, EPS,
            1.0 / math.sqrt(HEAD_DIM), BN=s.bn, BK=s.bk, S=s.stages, XS=self.x_stages,
            RP=self.rp, RB=self.rb, INSTR_N=self.instr_n, WARPS_M=self.warps_m,
            LAYER_TILES=s.layer_tiles, OFF0=offs[0], OFF2=offs[2], OFF3=offs[3], OFF4=offs[4],
            OUT_W=self.out.shape[1], COL0=cols[0], COL2=cols[2], COL3=cols[3], COL4=cols[4],
            TL=self.stamps, num_warps=s.warps, maxnreg=maxnreg or self.default_maxnreg,
            **kwargs)

    def label(self) -> str:
        return f"{self.s} r{self.rows} (RP {self.rp})"


def compile_only(configs: list[Stream], rows_list: list[int], programs: int, maxnreg: int,
                 spin_budget: int, timeline: bool = False) -> list[dict]:
    """Builds every (config, padded rows) for sm_90a here (no GPU) and prints resources."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.sm90_build import build_only, resources

    print(f"triton {triton.__version__}; configs BNxBKxStages w consumer warps (+2 loader "
          f"warps); maxnreg {maxnreg or 'auto'}")
    builds = []
    for stream in configs:
        for rows in rows_list:
            try:  # nothing is read: the build needs shapes and strides only
                frame = LayersFrame(stream, rows, "cpu", timeline=timeline)
            except ValueError as exc:
                print(f"{stream} r{rows}: not built: {exc}", flush=True)
                continue
            with build_only(90) as built:
                frame.run_layers(programs, maxnreg, spin_budget)
            kernel = built[-1]
            r = resources(kernel, frame.label())
            line = (describe_build(kernel, frame.label(), "layers") +
                    f"; RP {frame.rp} (wgmma N {frame.instr_n}), {frame.x_stages} x-slots, "
                    f"{kernel.asm['ptx'].count('wgmma.mma_async')} wgmma PTX sites, "
                    f"{_sass_hgmma(kernel)}, "
                    f"{kernel.asm['ptx'].count('fence.proxy.async.global')} proxy fences")
            print(line, flush=True)
            builds.append({"config": str(stream), "rows": rows, "rp": frame.rp,
                           "registers": r.registers, "shared_bytes": r.shared_bytes,
                           "local_bytes": r.local_bytes, "problems": r.problems(),
                           "line": line})
    return builds


# ----------------------------------------------------------------------------- on the GPU


def build_depth(device: str):
    """The full-size depth decoder with random bf16 weights, packed as serving packs them; norm
    weights 1 + N(0, 0.1) (random_bf16_packed's N(0, 1/32) would scale the layers' work down
    to nothing beside the residual and hide it from the check)."""
    from breezert.models.config import DepthConfig
    from breezert.models.depth import DepthDecoder
    from cuda_bench import random_bf16_packed

    cfg = DepthConfig()
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.num_heads,
            cfg.num_kv_heads, cfg.head_dim, cfg.num_codebooks) == (
        HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, SLOTS), "DepthConfig changed"
    with torch.device(device):
        depth = random_bf16_packed(DepthDecoder(cfg))
    with torch.no_grad():
        for layer in depth.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight.copy_(1 + 0.1 * torch.randn_like(norm.weight, dtype=torch.float32))
    return depth


def rope_tables(depth, pos: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The position's (cos, sin_signed): bf16 as ``run_layers`` makes them, and fp32."""
    from breezert.layers.rope import fold_rotation_sign

    _, cos, sin = depth._frame_rope(torch.device(device), torch.bfloat16)
    cos32, sin32 = depth.rope.cos_sin(torch.tensor([pos], device=device))
    return (torch.stack([cos[pos], fold_rotation_sign(sin[pos])]),
            torch.stack([cos32[0], fold_rotation_sign(sin32[0])]))


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w.float()


def reference(modules, x: torch.Tensor, cache: torch.Tensor, rope32: torch.Tensor, pos: int):
    """torch fp32 math of the 12 layers from the same bf16 weights: the output h and each
    layer's rotated key and value at pos ``[L, 2, R, KVH, D]``."""
    x = x.float()
    rows = x.shape[0]
    cos, sin = rope32[0], rope32[1]
    group = HEADS // KV_HEADS
    new_kv = []
    for layer, m in enumerate(modules):
        qkv = _rms(x, m.input_layernorm.weight) @ m.self_attn.qkv_weight.float().T
        q = qkv[:, :HEADS * HEAD_DIM].view(rows, HEADS, HEAD_DIM)
        k = qkv[:, HEADS * HEAD_DIM:(HEADS + KV_HEADS) * HEAD_DIM].view(rows, KV_HEADS, HEAD_DIM)
        v = qkv[:, (HEADS + KV_HEADS) * HEAD_DIM:].view(rows, KV_HEADS, HEAD_DIM)
        q = q * cos + q.roll(HEAD_DIM // 2, -1) * sin
        k = k * cos + k.roll(HEAD_DIM // 2, -1) * sin
        keys, values = cache[layer, 0].float().clone(), cache[layer, 1].float().clone()
        keys[:, :, pos], values[:, :, pos] = k, v
        scores = torch.einsum("rhd,rhtd->rht", q, keys.repeat_interleave(group, 1))
        scores = (scores / math.sqrt(HEAD_DIM)).masked_fill(
            torch.arange(SLOTS, device=x.device) > pos, float("-inf"))
        attn = torch.einsum("rht,rhtd->rhd", scores.softmax(-1),
                            values.repeat_interleave(group, 1)).reshape(rows, -1)
        x = x + attn @ m.self_attn.o_proj.weight.float().T
        gate_up = _rms(x, m.post_attention_layernorm.weight) @ m.mlp.gate_up_weight.float().T
        act = torch.nn.functional.silu(gate_up[:, :FFN]) * gate_up[:, FFN:]
        x = x + act @ m.mlp.down_proj.weight.float().T
        new_kv.append(torch.stack([k, v]))
    return x, torch.stack(new_kv)


def eager_layers(modules, x: torch.Tensor, cache: torch.Tensor, rope: torch.Tensor,
                 pos: torch.Tensor) -> torch.Tensor:
    """``DepthLayer.forward`` x 12 in bf16, as ``DepthDecoder.run_layers`` calls them."""
    from breezert.models.depth import StepRope

    rows = x.shape[0]
    step = StepRope(rope[0].expand(rows, -1)[:, None, :], rope[1].expand(rows, -1)[:, None, :],
                    (torch.arange(SLOTS, device=x.device) <= pos).view(1, 1, 1, -1))
    for layer, m in enumerate(modules):
        x = m.forward(x, step, cache[layer], pos)
    return x


def _errors(got: torch.Tensor, want: torch.Tensor, row_dim: int = 0) -> dict:
    """Relative L2 error of the whole tensor and of its worst row (``row_dim`` indexes the
    rows: one wrong row of 256 moves the whole tensor's error by less than the tolerance)."""
    got, want = got.float(), want.float()
    other = [d for d in range(want.dim()) if d != row_dim]
    per_row = (torch.linalg.vector_norm(got - want, dim=other)
               / torch.linalg.vector_norm(want, dim=other))
    return {"rel_l2": (got - want).norm().item() / want.norm().item(),
            "worst_row_rel": per_row.max().item(),
            "max_abs": (got - want).abs().max().item(),
            "finite": bool(torch.isfinite(got).all().item())}


def check(frame: LayersFrame, modules, depth, pos: int, launch: dict) -> dict:
    """One launch at ``pos`` on fresh inputs (outputs poisoned with NaN first) against torch fp32
    math, beside the eager bf16 module's error; raises AssertionError on a mismatch."""
    rows, device = frame.rows, str(frame.x_in.device)
    frame.x_in.copy_(torch.randn(rows, HIDDEN, device=device))
    frame.cache.copy_(torch.randn_like(frame.cache, dtype=torch.float32))
    rope, rope32 = rope_tables(depth, pos, device)
    frame.rope.copy_(rope)
    frame.position = pos
    inputs_cache = frame.cache.clone()
    for t in (frame.h, frame.x1024, frame.x8192):
        t.fill_(float("nan"))
    frame.cache[:, :, :, :, pos] = float("nan")
    frame.out.zero_()
    frame.err.zero_()
    frame.run_layers(**launch)
    if frame.x_in.is_cuda:
        torch.cuda.synchronize()
    ref, ref_kv = reference(modules, frame.x_in, inputs_cache, rope32, pos)
    eager_cache = inputs_cache.clone()
    eager = eager_layers(modules, frame.x_in, eager_cache,
                         rope, torch.tensor([pos], device=device))
    x = frame.x_in.float()
    other = torch.arange(SLOTS, device=device) != pos
    got = {"out": _errors(frame.h, ref), "delta": _errors(frame.h.float() - x, ref - x),
           "kv_at_pos": _errors(frame.cache[:, :, :, :, pos], ref_kv, row_dim=2),
           "kv_other_slots_unchanged": bool(torch.equal(frame.cache[:, :, :, :, other],
                                                        inputs_cache[:, :, :, :, other]))}
    base = {"out": _errors(eager, ref), "delta": _errors(eager.float() - x, ref - x),
            "kv_at_pos": _errors(eager_cache[:, :, :, :, pos], ref_kv, row_dim=2)}
    row = {"position": pos, "hang": bool(frame.err.item()), "kernel": got, "eager_bf16": base,
           "accumulators_left_zero": bool((frame.out == 0).all().item())}
    print(f"  {frame.label()} pos {pos}: " + ", ".join(
        f"{k} rel {got[k]['rel_l2']:.2e} worst row {got[k]['worst_row_rel']:.2e} max "
        f"{got[k]['max_abs']:.3g} (eager bf16 rel {base[k]['rel_l2']:.2e} worst row "
        f"{base[k]['worst_row_rel']:.2e} max {base[k]['max_abs']:.3g})" for k in base),
        flush=True)
    bad = [k for k in base if not got[k]["finite"] or got[k]["rel_l2"] > REL_TOL
           or got[k]["rel_l2"] > 2 * base[k]["rel_l2"] + 2e-3
           or got[k]["worst_row_rel"] > 2 * base[k]["worst_row_rel"] + 2e-3]
    assert not row["hang"], f"{frame.label()} pos {pos}: a phase wait ran out of budget"
    assert not bad, f"{frame.label()} pos {pos}: {bad} differ from fp32 math: {got}"
    assert got["kv_other_slots_unchanged"], "the kernel wrote cache slots other than pos"
    assert row["accumulators_left_zero"], "an fp32 accumulator was left non-zero"
    return row


def after_launches(frame) -> list[str]:
    """What every launch since the last check must have left, checked after the timed ones
    too (4 + ``--iters`` launches a config and rows, where a race has more chances than in the
    2 checked): no wait out of budget (``err`` is sticky) and the fp32 accumulators zero (the next
    launch adds into them)."""
    problems = []
    if frame.err.item():
        problems.append("a phase wait ran out of budget")
    if not bool((frame.out == 0).all().item()):
        problems.append("an fp32 accumulator was left non-zero")
    return problems


# ----------------------------------------------------------------------------- CPU emulation


def emulated_attention(qkv: torch.Tensor, rope: torch.Tensor, cache: torch.Tensor,
                       pos: int) -> torch.Tensor:
    """The kernels' attention in torch: ``qkv`` [rows, 1536] (fp32 of bf16 values), RoPE at its
    rounding points (``rope``: cos, sin_signed), k and v into the layer's ``cache`` [2, rows,
    KVH, 16, D] at ``pos``, fp32 softmax over slots <= pos; the output [rows, 1024] in bf16."""
    rows = qkv.shape[0]
    cos, sin = rope[0].float(), rope[1].float()

    def rotate(x):
        a = (x * cos).to(torch.bfloat16).float()
        b = (x.roll(HEAD_DIM // 2, -1) * sin).to(torch.bfloat16).float()
        return (a + b).to(torch.bfloat16)

    q = rotate(qkv[:, :HEADS * HEAD_DIM].view(rows, HEADS, HEAD_DIM)).float()
    k = rotate(qkv[:, HEADS * HEAD_DIM:(HEADS + KV_HEADS) * HEAD_DIM]
               .view(rows, KV_HEADS, HEAD_DIM))
    v = qkv[:, (HEADS + KV_HEADS) * HEAD_DIM:].view(rows, KV_HEADS, HEAD_DIM)
    cache[0, :, :, pos] = k
    cache[1, :, :, pos] = v.to(torch.bfloat16)
    group = HEADS // KV_HEADS
    keys = cache[0].float().repeat_interleave(group, 1)
    values = cache[1].float().repeat_interleave(group, 1)
    s = torch.einsum("rhd,rhtd->rht", q, keys) / math.sqrt(HEAD_DIM)
    s = s.masked_fill(torch.arange(SLOTS) > pos, float("-inf"))
    o = torch.einsum("rht,rhtd->rhd", s.softmax(-1), values)
    return o.reshape(rows, -1).to(torch.bfloat16)


class EmulatedFrame:
    """``--emulate``: the kernel's data flow in torch (no GPU), for ``check`` in place of a
    ``LayersFrame``: the same buffers (h, X, Y, the fp32 accumulators at the kernel's columns,
    the cache), phase by phase in the kernel's order, the same bf16 rounding points;
    a GEMM adds its fp32 product into its accumulator (so a zeroing missed or done before the
    last reader shows as a wrong result). Each phase names the buffers its programs read and
    write; a buffer one program writes while another reads it in the same phase (not an owner's
    read-modify-write of its own elements) raises: the cross-program hazards, which a sequential
    emulation cannot show by its numbers. Split-K order and the norms' sum order are not
    emulated (fp32 rounding of the sums only)."""

    def __init__(self, rows: int, modules) -> None:
        self.rows, self.modules = rows, modules
        bf16 = torch.bfloat16
        self.x_in = torch.empty(rows, HIDDEN, dtype=bf16)
        self.h = torch.empty_like(self.x_in)
        self.x1024 = torch.empty_like(self.x_in)
        self.x8192 = torch.empty(rows, FFN, dtype=bf16)
        self.rope = torch.empty(2, HEAD_DIM, dtype=bf16)
        self.cache = torch.empty(LAYERS, 2, rows, KV_HEADS, SLOTS, HEAD_DIM, dtype=bf16)
        cols = Stream(64, 64, 2).out_cols
        self.cols = {"qkv": cols[0], "o": cols[2], "gate_up": cols[3], "down": cols[4]}
        self.width = {"qkv": PHASES[0][1], "o": HIDDEN, "gate_up": 2 * FFN, "down": HIDDEN}
        self.out = torch.zeros(rows, sum(n for _, n, _ in PHASES))
        self.err = torch.zeros(1, dtype=torch.int32)
        self.position = 0
        self.phases_run = 0

    def label(self) -> str:
        return f"emulated r{self.rows}"

    def acc(self, name: str) -> torch.Tensor:
        return self.out[:, self.cols[name]:self.cols[name] + self.width[name]]

    def phase(self, reads: set, writes: set, own: set = frozenset()) -> None:
        """One phase's buffers: read by any program, written by some (``own``: each element
        read and/or written by the one thread that owns it, and by no other program). Raises
        on a cross-program hazard."""
        clash = (reads & writes) | (own & (reads | writes))
        assert not clash, f"phase {self.phases_run}: {sorted(clash)} read and written"
        self.phases_run += 1

    def gemm(self, x: torch.Tensor, w: torch.Tensor, name: str) -> None:
        self.acc(name).add_(x.float() @ w.float().T)  # the split-K partial sums, as one

    @staticmethod
    def residual(h: torch.Tensor, acc: torch.Tensor | None) -> torch.Tensor:
        """bf16(h + bf16(acc)) (layer 0's norm1: h alone)."""
        h = h.float()
        if acc is not None:
            h = h + acc.to(torch.bfloat16).float()
        return h.to(torch.bfloat16)

    @staticmethod
    def normed(hb: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """bf16(g * bf16(h * rsqrt(mean(h^2) + eps))): the kernels' (and eager's) rounding."""
        h = hb.float()
        inv = torch.rsqrt(h.pow(2).sum(-1, keepdim=True) / HIDDEN + EPS)
        return (g.float() * (h * inv).to(torch.bfloat16).float()).to(torch.bfloat16)

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        g = gate_up[:, :FFN].to(torch.bfloat16).float()
        u = gate_up[:, FFN:].to(torch.bfloat16).float()
        s = (g / (1.0 + torch.exp(-g))).to(torch.bfloat16).float()
        return (s * u).to(torch.bfloat16)

    def attention(self, layer: int) -> None:
        """``_attention`` (``emulated_attention``), the output in X."""
        self.x1024.copy_(emulated_attention(self.acc("qkv").to(torch.bfloat16).float(),
                                            self.rope, self.cache[layer], self.position))

    def zero(self, *names: str) -> None:
        for name in names:
            self.acc(name).zero_()

    def run_layers(self, **_launch) -> None:
        """norm1, q/k/v, attention, o, norm2, gate/up, act, down; h in place by its owner."""
        self.phases_run = 0
        for layer, m in enumerate(self.modules):
            attn, mlp = m.self_attn, m.mlp
            first = layer == 0
            self.phase({"x_in"} if first else set(), {"X"}, {"h"} | (
                set() if first else {"acc.down"}))
            self.h.copy_(self.residual(self.x_in if first else self.h,
                                       None if first else self.acc("down")))
            if not first:
                self.zero("down")
            self.x1024.copy_(self.normed(self.h, m.input_layernorm.weight))
            self.phase({"X"}, {"acc.qkv"})
            self.gemm(self.x1024, attn.qkv_weight, "qkv")
            self.phase({"acc.qkv", "cache"}, {"X", "cache@pos"})
            self.attention(layer)
            self.phase({"X"}, {"acc.o"})
            self.gemm(self.x1024, attn.o_proj.weight, "o")
            self.phase(set(), {"X", "acc.qkv"}, {"h", "acc.o"})
            self.h.copy_(self.residual(self.h, self.acc("o")))
            self.zero("o", "qkv")
            self.x1024.copy_(self.normed(self.h, m.post_attention_layernorm.weight))
            self.phase({"X"}, {"acc.gate_up"})
            self.gemm(self.x1024, mlp.gate_up_weight, "gate_up")
            self.phase(set(), {"Y"}, {"acc.gate_up"})
            self.x8192.copy_(self.silu_mul(self.acc("gate_up")))
            self.zero("gate_up")
            self.phase({"Y"}, {"acc.down"})
            self.gemm(self.x8192, mlp.down_proj.weight, "down")
        self.phase(set(), set(), {"h", "acc.down"})
        self.h.copy_(self.residual(self.h, self.acc("down")))
        self.zero("down")


def emulate(rows_list: list[int]) -> None:
    """``--emulate``: ``check`` on ``EmulatedFrame`` (CPU), each row count, at positions 0 and
    15; raises on the first mismatch."""
    torch.manual_seed(0)
    depth = build_depth("cpu")
    modules = list(depth.model.layers)
    for rows in rows_list:
        frame = EmulatedFrame(rows, modules)
        for pos in (0, SLOTS - 1):
            row = check(frame, modules, depth, pos, {})
            print(f"  {frame.label()} pos {pos}: passes the check "
                  f"({frame.phases_run} phases, accumulators left zero "
                  f"{row['accumulators_left_zero']})", flush=True)
        assert not after_launches(frame), after_launches(frame)


def event_ms(fn, iters: int) -> tuple[float, float]:
    """Median and min ms of ``fn`` by CUDA events, each launch queued behind a GPU sleep (the
    host's launch time stays out), after 3 warm-up launches."""
    times = []
    for i in range(3 + iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1_000_000)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2], min(times)


def graph_ms(fn, iters: int) -> float:
    """Median ms of ``fn`` replayed from a CUDA graph (cuda_bench.median_ms)."""
    from cuda_bench import median_ms

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return median_ms(graph.replay, iters=iters, warmup=3)


def baselines(depth, rows: int, iters: int) -> dict:
    """The same position's layers as the eager bf16 modules (12 ``DepthLayer.forward``) and as
    served (``FusedDepthLayers``: projector + 12 layers + final norm, 5 launches a layer),
    CUDA-graph replays, ms."""
    from breezert.kernels.fused_depth import FusedDepthLayers

    device, pos = "cuda", SLOTS - 1
    modules = list(depth.model.layers)
    rope, _ = rope_tables(depth, pos, device)
    pos_t = torch.tensor([pos], device=device)
    x = torch.randn(rows, HIDDEN, device=device).to(torch.bfloat16)
    cache = torch.randn(LAYERS, 2, rows, KV_HEADS, SLOTS, HEAD_DIM, device=device).to(
        torch.bfloat16)
    out = {"eager_bf16_ms": round(graph_ms(lambda: eager_layers(modules, x, cache, rope, pos_t),
                                           iters), 3)}
    fused = FusedDepthLayers(depth, max_rows=rows)
    xb = torch.randn(rows, depth.cfg.backbone_hidden_size, device=device).to(torch.bfloat16)
    _, cos, sin = depth._frame_rope(torch.device(device), torch.bfloat16)
    cos, sin = cos[pos].expand(rows, -1), sin[pos].expand(rows, -1)
    out["served_fused_ms"] = round(graph_ms(lambda: fused(xb, cos, sin, cache, pos_t), iters), 3)
    return out


def phased_stream_ms(stream: Stream, rows: int, programs: int, args) -> dict:
    """The same 12 layers' GEMMs alone, as ``depth_stream_wgmma``'s ``phased`` mode streams
    them for one position (random weights, fake dependencies, 60 waits): what the real math's
    phases add over them on the same card."""
    wf = WgmmaFrame(stream, LAYERS, 1, "cuda", rows=rows)
    ms, _ = event_ms(lambda: wf.launch("phased", programs, args.maxnreg, args.spin_budget,
                                       cooperative=not args.no_cooperative), args.iters)
    return {"phased_stream_ms": round(ms, 4), "phased_stream_hang": bool(wf.err.item())}


def phase_timeline(stamps: torch.Tensor, programs: int) -> dict:
    """Where a layer's time goes, from one launch's stamps (``[P, L, 16]``: per phase, when its
    inputs were seen published and when its work was done), us, over layers 1-10: each phase's
    span on the critical path (the last program's done of the phase before to the last
    program's done of this one) and, over the programs, the median wait (seen less that last
    done) and work (done less seen)."""
    import numpy as np

    t = stamps[:programs].double().cpu().numpy() / 1e3
    seen, done = t[..., 0::2], t[..., 1::2]
    rows = []
    for layer in range(1, t.shape[1] - 1):
        prev = done[:, layer - 1, -1].max()
        for ph in range(PHASES_A_LAYER):
            last = done[:, layer, ph].max()
            rows.append([last - prev, np.median(seen[:, layer, ph] - prev),
                         np.median(done[:, layer, ph] - seen[:, layer, ph])])
            prev = last
    med = np.median(np.array(rows).reshape(-1, PHASES_A_LAYER, 3), axis=0)
    out = {name: {"span": round(float(a), 2), "wait": round(float(b), 2),
                  "work": round(float(c), 2)} for name, (a, b, c) in zip(PHASE_NAMES, med)}
    out["layer_us"] = round(float(med[:, 0].sum()), 2)
    return out


def check_and_time(frame, depth, args, programs: int, row: dict,
                   result: dict) -> tuple[float, float] | None:
    """A body's frame (``LayersFrame`` or the 3-phase one) loaded with ``depth``'s layers, its
    launch checked at positions 0 and 15 (a mismatch is recorded in ``row`` and ``result`` and
    the launch is still timed, unless a wait ran out of budget: then ``None``), its build's
    registers and shared memory, then timed (median and min ms, CUDA events) and checked again
    for what the timed launches left."""
    modules = list(depth.model.layers)
    frame.load(modules)
    launch = {"programs": programs, "maxnreg": args.maxnreg, "spin_budget": args.spin_budget,
              "cooperative": not args.no_cooperative}
    for pos in (0, SLOTS - 1):
        try:
            row["checks"].append(check(frame, modules, depth, pos, launch))
        except AssertionError as exc:
            print(f"  {frame.label()} pos {pos}: CHECK FAILED: {exc}"[:2000], flush=True)
            result["failures"].append(f"{frame.label()} pos {pos}: {exc}"[:1000])
            row["correct"] = False
            if frame.err.item():  # a wait ran out of budget: timing it would only add hangs
                return None
    kernel = frame.run_layers(**launch)
    row["n_regs"], row["n_spills"] = kernel.n_regs, kernel.n_spills
    row["shared_bytes"] = kernel.metadata.shared
    ms, min_ms = event_ms(lambda: frame.run_layers(**launch), args.iters)
    row["hang"] = bool(frame.err.item())
    problems = after_launches(frame)
    if problems:  # a hang or a leftover in a timed launch fails the run, as in a check
        print(f"  {frame.label()}: after the timed launches: {problems}", flush=True)
        result["failures"].append(f"{frame.label()} after the timed launches: {problems}")
        row["correct"] = False
    return ms, min_ms


def measure(stream: Stream, rows: int, depth, args, programs: int, result: dict) -> None:
    """One config at one row count: the checks (a mismatch is recorded as a failure, and the
    launch is still timed unless a wait ran out of budget), then ms a position beside the phased
    stream's GEMMs alone."""
    frame = LayersFrame(stream, rows, "cuda", timeline=args.timeline)
    row: dict = {"config": str(stream), "rows": rows, "padded_rows": frame.rp,
                 "x_stages": frame.x_stages, "checks": [], "correct": True}
    result["rows"].append(row)
    timed = check_and_time(frame, depth, args, programs, row, result)
    if timed is None:
        return
    ms, min_ms = timed
    if args.timeline:  # the last timed launch's stamps
        row["timeline"] = phase_timeline(frame.timeline, programs)
        print(f"  {frame.label()} timeline (us, layers 1-10, median): {row['timeline']}",
              flush=True)
    weight_bytes = frame.w.numel() * frame.w.element_size()
    row.update(ms=round(ms, 4), min_ms=round(min_ms, 4),
               tb_per_s=round(weight_bytes / ms / 1e9, 3),
               tflop_per_s=round(rows * weight_bytes / ms / 1e9, 2))  # 2 FLOP a weight, 2 B
    del frame
    row.update(phased_stream_ms(stream, rows, programs, args))
    print(f"  {stream} r{rows}: {ms:.4f} ms a position (min {min_ms:.4f}), "
          f"{row['tb_per_s']} TB/s of weights, {row['tflop_per_s']} TFLOP/s; the phased "
          f"stream's GEMMs alone {row['phased_stream_ms']} ms", flush=True)


def print_table(result: dict) -> None:
    print("\nconfig | rows | correct | checks (rel L2 of the delta: kernel / eager bf16) | "
          "ms a position | phased stream (GEMMs alone) ms | eager bf16 ms | served fused ms | "
          "TB/s | TFLOP/s | regs | smem B")
    base = result["baselines"]
    for r in result["rows"]:
        checks = " ".join(f"p{c['position']} {c['kernel']['delta']['rel_l2']:.1e}/"
                          f"{c['eager_bf16']['delta']['rel_l2']:.1e}" for c in r["checks"])
        b = base.get(str(r["rows"]), {})
        print(f"{r['config']} | {r['rows']} | {r['correct']} | {checks or '-'} | "
              f"{r.get('ms', '-')} | {r.get('phased_stream_ms', '-')} | "
              f"{b.get('eager_bf16_ms', '-')} | {b.get('served_fused_ms', '-')} | "
              f"{r.get('tb_per_s', '-')} | {r.get('tflop_per_s', '-')} | {r.get('n_regs', '-')}"
              f" | {r.get('shared_bytes', '-')}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=CONFIGS, help="BNxBKxSwW list (depth_stream_wgmma's)")
    ap.add_argument("--rows", default=ROWS, help="rows a launch (2 a request with CFG)")
    ap.add_argument("--maxnreg", type=int, default=0, help="0: the most at one block per SM")
    ap.add_argument("--programs", type=int, default=0, help="0: one per SM")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--spin-budget", type=int, default=1 << 20,
                    help="spin iterations a program may spend per launch before it reports a "
                         "hang and stops waiting")
    ap.add_argument("--deadline-s", type=float, default=400,
                    help="start no new config or rows after this many seconds")
    ap.add_argument("--no-baselines", action="store_true")
    ap.add_argument("--no-cooperative", action="store_true")
    ap.add_argument("--timeline", action="store_true",
                    help="stamp each program's phases (%%globaltimer) and print where a layer's "
                         "time goes")
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--emulate", action="store_true",
                    help="no GPU: the check on the body's data flow emulated in torch")
    ap.add_argument("--out", default="depth-layers-wgmma.json")
    args = ap.parse_args()
    t_start = time.monotonic()
    configs = [Stream.parse(c) for c in args.configs.split(",")]
    rows_list = [int(r) for r in args.rows.split(",")]
    if args.compile_only:
        compile_only(configs, rows_list, args.programs or 132, args.maxnreg, args.spin_budget,
                     args.timeline)
        return
    if args.emulate:
        emulate(rows_list)
        return
    from breezert_bench.provenance import provenance

    torch.backends.cuda.matmul.allow_tf32 = False  # the reference is full fp32
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    programs = args.programs or props.multi_processor_count
    print(f"triton {triton.__version__}, {props.name}, {programs} programs", flush=True)
    result = {"meta": provenance(script="bench/depth_layers_wgmma.py", triton=triton.__version__,
                                 programs=programs, layers=LAYERS, rel_tol=REL_TOL),
              "rows": [], "baselines": {}, "failures": []}

    def save() -> None:  # after every row: a later failure or kill keeps what ran
        Path(args.out).write_text(json.dumps(result, indent=1))

    depth = build_depth("cuda")
    for stream in configs:
        for rows in rows_list:
            if time.monotonic() - t_start > args.deadline_s:
                print(f"deadline: {stream} r{rows} not run", flush=True)
                break
            try:
                measure(stream, rows, depth, args, programs, result)
            except Exception as exc:  # the next config still runs
                print(f"{stream} r{rows}: FAILED: {exc!r}"[:2000], flush=True)
                traceback.print_exc(limit=3)
                result["failures"].append(f"{stream} r{rows}: {exc!r}"[:1000])
            torch.cuda.empty_cache()
            save()
    for rows in ([] if args.no_baselines else rows_list):
        if time.monotonic() - t_start > args.deadline_s + 60:
            print(f"deadline: baselines at {rows} rows not run", flush=True)
            break
        try:
            result["baselines"][str(rows)] = baselines(depth, rows, args.iters)
            print(f"  baselines r{rows}: {result['baselines'][str(rows)]}", flush=True)
        except Exception as exc:
            print(f"baselines r{rows}: FAILED: {exc!r}"[:2000], flush=True)
            result["failures"].append(f"baselines r{rows}: {exc!r}"[:1000])
        save()
    save()
    print_table(result)
    if result["failures"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
