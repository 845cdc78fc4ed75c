"""Experiment (issue 30): the real math of the depth decoder's 12-layer body for one position in
ONE persistent Gluon launch, built on ``depth_stream_wgmma.py``'s TMA weight ring and swap-AB
wgmma consumer. Built for triton 3.6.0 / 3.7.1 (sm_90a).

    PYTHONPATH=runtime:bench:. python3 bench/depth_layers_wgmma.py --out depth-layers-wgmma.json
    PYTHONPATH=runtime:bench:. python bench/depth_layers_wgmma.py --compile-only  # no GPU

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
    6 act     (row, 1024 columns): Y = bf16(bf16(silu(bf16(gate))) * bf16(up))
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

Checked on a GPU against torch fp32 math of the same layers (from the same bf16 weights): the
output h, the layers' delta (h - x) and the cache entries written at pos, at positions 0 and 15,
by relative L2 error and max abs error; fails above ``REL_TOL`` (bf16 operands: METHOD.md's 1e-3
to 1e-2 band) or above 2x the eager bf16 module's own error + 2e-3. Timed (CUDA events, median)
beside the eager bf16 ``DepthLayer`` x 12 and the served ``FusedDepthLayers`` (projector +
12 layers + final norm: the served unit a position), both as CUDA-graph replays.

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
from depth_stream_gluon import HIDDEN, PHASES, Stream, _partition_barrier, _wait_count
from depth_stream_wgmma import (
    LOADER_REGS,
    WgmmaFrame,
    _fence_proxy_async_global,
    _mma_phase,
    _sass_hgmma,
    _w_loader,
    _x_loader_phase,
    describe_build,
)
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

LAYERS = 12
HEADS, KV_HEADS, HEAD_DIM, SLOTS = 8, 2, 128, 16  # DepthConfig; 16 positions a frame
FFN = 8192
EPS = 1e-5
PHASES_A_LAYER = 8
REL_TOL = 1e-2
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
    """Items (row, 1024 columns of the 8192): gate and up read and zeroed (each element by one
    thread), Y = bf16(bf16(silu(bf16(gate))) * bf16(up))."""
    cols = gl.arange(0, HIDDEN_C, layout=layout)
    chunks: gl.constexpr = FFN_C // HIDDEN_C
    for item in range(pid, rows * chunks, P):
        r = item // chunks
        c = (item % chunks) * HIDDEN_C + cols
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
def _publish(counters, g):
    """Phase g done in this program: every consumer warp's stores and atomics are issued
    (partition barrier), then one release arrival."""
    _partition_barrier()
    gl.atomic_add(counters + g, 1, sem="release", scope="gpu")


@gluon.jit
def _layers_consumer(ring, ready, empty, xs, xready, xempty, counters, err_ptr, out_ptr,
                     x_in_ptr, h_ptr, x_ptr, y_ptr, norm_ptr, rope_ptr, cache_ptr, rows, pos,
                     layers, target, budget, eps, scale, BN: gl.constexpr, BK: gl.constexpr,
                     S: gl.constexpr, XS: gl.constexpr, RP: gl.constexpr,
                     OUT_W: gl.constexpr, COL0: gl.constexpr, COL2: gl.constexpr,
                     COL3: gl.constexpr, COL4: gl.constexpr, acc_layout: gl.constexpr,
                     row_layout: gl.constexpr, att_layout: gl.constexpr):
    pid = gl.program_id(0)
    P = gl.num_programs(0)
    it = 0
    g = 0
    for layer in range(layers):
        norm = norm_ptr + layer * 2 * HIDDEN_C
        for ph in gl.static_range(PHASES_A_LAYER_C):
            if g > 0:  # every program published the phase before
                budget = _wait_count(counters + g - 1, target, budget)
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
            _publish(counters, g)
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
                   y_ptr, norm_ptr, rope_ptr, cache_ptr, rows, pos, layers, target, budget, eps,
                   scale, BN: gl.constexpr, BK: gl.constexpr, S: gl.constexpr,
                   XS: gl.constexpr, RP: gl.constexpr, RB: gl.constexpr,
                   INSTR_N: gl.constexpr, WARPS_M: gl.constexpr, LAYER_TILES: gl.constexpr,
                   OFF0: gl.constexpr, OFF2: gl.constexpr, OFF3: gl.constexpr,
                   OFF4: gl.constexpr, OUT_W: gl.constexpr, COL0: gl.constexpr,
                   COL2: gl.constexpr, COL3: gl.constexpr, COL4: gl.constexpr,
                   num_warps: gl.constexpr):
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
                            COL0, COL2, COL3, COL4, acc_layout, row_layout, att_layout)),
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
                 seed: int = 0) -> None:
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
        self.epoch += 1  # counters only grow: a launch waits for epoch * programs arrivals
        kwargs = {"launch_cooperative_grid": True} if cooperative else {}
        return _layers_kernel[(programs,)](
            self.desc, *self.x_descs, self.counters, self.err, self.out, self.x_in, self.h,
            self.x1024, self.x8192, self.norm_w, self.rope, self.cache, self.rows,
            self.position, self.layers, self.epoch * programs, spin_budget, EPS,
            1.0 / math.sqrt(HEAD_DIM), BN=s.bn, BK=s.bk, S=s.stages, XS=self.x_stages,
            RP=self.rp, RB=self.rb, INSTR_N=self.instr_n, WARPS_M=self.warps_m,
            LAYER_TILES=s.layer_tiles, OFF0=offs[0], OFF2=offs[2], OFF3=offs[3], OFF4=offs[4],
            OUT_W=self.out.shape[1], COL0=cols[0], COL2=cols[2], COL3=cols[3], COL4=cols[4],
            num_warps=s.warps, maxnreg=maxnreg or self.default_maxnreg, **kwargs)

    def label(self) -> str:
        return f"{self.s} r{self.rows} (RP {self.rp})"


def compile_only(configs: list[Stream], rows_list: list[int], programs: int, maxnreg: int,
                 spin_budget: int) -> list[dict]:
    """Builds every (config, padded rows) for sm_90a here (no GPU) and prints resources."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.sm90_build import build_only, resources

    print(f"triton {triton.__version__}; configs BNxBKxStages w consumer warps (+2 loader "
          f"warps); maxnreg {maxnreg or 'auto'}")
    builds = []
    for stream in configs:
        for rows in rows_list:
            try:  # nothing is read: the build needs shapes and strides only
                frame = LayersFrame(stream, rows, "cpu")
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
                    f"{_sass_hgmma(kernel)}")
            print(line, flush=True)
            builds.append({"config": str(stream), "rows": rows, "rp": frame.rp,
                           "registers": r.registers, "shared_bytes": r.shared_bytes,
                           "local_bytes": r.local_bytes, "problems": r.problems(),
                           "line": line})
    return builds
