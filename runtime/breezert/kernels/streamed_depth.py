"""The depth decoder's frame with its weights streamed: one warp-specialized Gluon launch per
position, the loader never waiting on activations.

Owns: ``_position_kernel`` (Gluon, sm_90) and ``StreamedDepthFrame``, a drop-in for the 15-step
loop of ``stages/depth.depth_frames`` for small batches on Hopper (``rows <= max_rows``, at most
``MAX_ROWS``): for position p of every request of the batch, the input projector (p = 0: the
backbone's hidden state; p >= 1: the audio table's row of code c_{p-1}), the 12 layers
(RMSNorm + q/k/v, RoPE and attention over <= 16 keys in a frame-local cache, o_proj +
residual, RMSNorm + gate/up, SiLU * up + down + residual), the final norm and the codebook head
(fp32 logits) run in ONE launch; the draw of code p (CFG, temperature, top-k, top-p,
counter-based Gumbel noise: ``persistent_depth._draw_phase``, the persistent frame's own draw)
is a small Triton launch after it. A frame is 16 + 15 launches instead of ~1,200.

Why (issue 30, ``bench/depth_stream_gluon.py``, H200): the persistent Triton frame
(``persistent_depth.py``) reads its 10.7 GB a frame at 1.4 TB/s because each program's load
pipeline refills from empty at every one of its 1,008 phases. Here every program (one per SM,
launched cooperatively) forks
- a loader warp that walks the launch's phases and, for each of the program's work items,
  copies the item's weight tiles (``BN x BK`` bf16, TMA) into a shared-memory ring, waiting only
  for free slots: it runs ahead across phase boundaries, so the HBM stream never drains;
- consumer warps that wait for the previous phase (a per-phase counter in global memory:
  release on arrival, acquire spin), stage the phase's input in shared memory (made inside the
  launch, ``.cg`` loads, every load of it issued at once): q/k/v, gate/up and the head stage
  their whole input once a phase, summing the previous phase's K-split partials in split order,
  adding the residual and applying RMSNorm with its statistics from the same registers; an
  o_proj item stages its KV group's attention output (the attention folded into o_proj), a
  projector or down_proj item its K range; then multiply each ring tile by it on the tensor
  cores (``mma_v2``: the ``BN x BK`` weight tile is the 16-row operand, the rows, padded to 8
  or 16, the other), so 16 rows cost about what 2 do. The staged input is XOR-swizzled in
  16-byte units, so those operand loads are free of bank conflicts; its registers are sized for
  the live rows (RB = 2, 4, 8 or 16), not the tensor cores' 8 or 16.

Status (H200, bench/README.md "third session"): v3 8.6 ms a frame at one request, v4 7.9,
against the persistent frame's 7.8: each phase's dependency chain of L2 round trips (~5 us) is
the cost, not the stream. This version (v5) shortens the chains; built for sm_90, not yet run.
Off in every profile until it wins.

Dependency points a frame (16 launches; v4 -> v5): phase waits 61 a position (60 at p = 0) ->
49 (48): o_proj carries the attention; last-arriver hand-offs of split tiles (tile counter
atomic, then the partials read back) 38 a position (37) -> 0. In all 1,582 -> 783. On a split
phase's critical path, L2 round trips ~5 -> ~3 (acquire, the staging loads, the partial stores
+ release).

Work items: a phase's weight ``[N, K]`` is cut into ``BN``-column tiles and ``S`` K splits
(``StreamTiles``); item ``i`` = (column tile ``i % n_tiles``, split ``i // n_tiles``), taken by
program ``i % P``. Each item of a split phase (projector, q/k/v, o_proj, down_proj) stores its
fp32 partial; the next phase's staging sums a value's ``S`` partials in split order, so a row's
bits depend neither on its batch (every row's sums run in the same order whatever ``RB``) nor on
which program finished first. Gate/up (a gate tile and its up tile an item) and the head are
not split: their epilogues store SiLU(gate) * up and the logits.

Buffers and their reuse (global memory; phase g of a launch: the projector 0, then q/k/v,
o_proj, gate/up, down_proj 4l+1 .. 4l+4, the head 49). Every phase's writer stores only after
its wait on phase g-1's counter, and every reader finishes its reads before its release on the
counter of the phase that reads: so a buffer written in phase g and read only in phase g+1 may
be written again from phase g+2 on (its writer has then acquired the counter that all of g+1's
readers released).
- partials[0] ``[S, R, d]``: the projector's, o_proj's and down_proj's (phases 0, 4l+2, 4l+4),
  read by the next phase's staging only; partials[1] ``[S, R, qkv]``: q/k/v's (4l+1), read by
  o_proj's attention (4l+2) only; ``act``: gate/up's (4l+3), read by down_proj (4l+4) only.
- ``h`` is never written by a serial step: the residual stream lives in two bf16 buffers, each
  written while staging by the programs that own its K tiles (tile t: program t % P; each of
  them sums the same partials and gets the same bits) and read two phases later: ``h[0]`` = h_l
  (written by layer l's q/k/v staging, read by its gate/up staging), ``h[1]`` = h_l + attention
  (written by gate/up's staging, read by layer l+1's q/k/v staging or the head's). Each is
  written again four phases after it was written, two after its readers released.
- the frame cache: the key and value at ``pos`` are written by o_proj's item 0 of each KV group
  while every o_proj item reads slots < pos only (slot ``pos`` comes from the q/k/v partials);
  the next launch reads them.
- Ordering: the consumers' stores are issued, a partition barrier, then one thread's
  ``atom.release.gpu`` on the phase counter (the barrier makes the other warps' stores part of
  what it releases); each consumer thread spins with ``ld.acquire.gpu`` before its own ``.cg``
  loads. The counters only grow (by P a launch), so they need no reset between launches.

Numerics: the bf16 rounding points of the eager modules, as ``persistent_depth.py``: projector
and q/k/v, gate/up rounded to bf16; RoPE products and sums rounded; attention with bf16
unnormalised probabilities for P @ V and fp32 row sums; residual adds ``bf16(h + bf16(sum))``;
``act = bf16(bf16(silu(gate)) * up)``; fp32 head logits from bf16 weights. Summation orders
differ from cuBLAS and from the persistent frame (within bf16 tolerance; tests/gpu compare with
fp32 math).

Must not: sample the first code (``depth_frames`` does), know about requests beyond per-row
parameters, sync with the host, or be imported where Gluon is missing (CUDA only; the CPU and
larger batches run ``depth_frames``' step loop).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from breezert.kernels.persistent_depth import CODEBOOK_CODES, MAX_K, _draw_phase

MAX_ROWS = 16
"""Rows of one tensor-core GEMV (``mma_v2`` m16n8k16 with the weight tile as the 16-row operand
and the rows padded to 8 or 16 as the other): 8 requests with CFG."""

# phase kinds (constexpr globals: the device code reads them)
PROJ, QKV, O, GATE_UP, DOWN, HEAD = (gl.constexpr(k) for k in range(6))

# The rows' staged input in shared memory, ``[K tile, row, column in the tile]``: each tile's
# rows XOR-swizzled in 16-byte units (row r's unit u at u ^ (r % 8)), so the tensor cores' operand
# loads, 8 rows' same unit at a time (256-byte rows: one bank group unswizzled), read 8 distinct
# bank groups. STAGED is the layout the input is stored through (rank 3); STAGED_TILE the same
# bytes as tiles (rank 2 over the leading index, as the TMA ring is), so a runtime tile index
# (``.index(t)``) can pick an item's split. tests/unit/test_streamed_depth.py checks that the two
# give every tile the same addresses and that the operand loads have no bank conflicts.
STAGED = gl.constexpr(gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[2, 1, 0]))
STAGED_TILE = gl.constexpr(gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[1, 0]))

# The staging store's view of the same bytes, ``[K tile, RX // RB, RB, column]``: its rows
# ``[t, 0, r]`` for r < RB have STAGED's addresses (the swizzle row is r in both), so an input of
# RB < RX rows (2 or 4: one or two requests) is staged from registers sized for RB rows, not RX.
STAGED_ROWS = gl.constexpr(gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8,
                                                   order=[3, 2, 1, 0]))
# The attention output before it is copied into xs: unswizzled, so a pair of rows can be stored.
PLAIN = gl.constexpr(gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0]))

# triton 3.6 names the partition-wide barrier thread_barrier; 3.7 renamed it barrier
_partition_barrier = getattr(gl, "thread_barrier", None) or gl.barrier


@dataclass(frozen=True)
class StreamTiles:
    """Weight tile ``bn x bk`` (one ring slot; ``bk`` is the head size: an o_proj K tile is
    one head), ring ``slots``, consumer ``warps`` (the loader adds one), and each weight
    phase's K splits (``*_split``: they set the sum order, so they never change with the rows).
    o_proj's split is the KV heads (an item is one KV group's heads: its attention is the
    item's input). Gate/up and the head are never split: a gate/up item holds a gate tile and
    its up tile, so SiLU(gate) * up is its epilogue; the head's logits have no next phase in the
    launch to sum partials."""

    bn: int = 64
    bk: int = 128
    slots: int = 8
    warps: int = 4
    proj_split: int = 8
    qkv_split: int = 4
    o_split: int = 2
    down_split: int = 8
    maxnreg: int = 168


# ---------------------------------------------------------------------------------------------
# Device helpers


@gluon.jit
def _acquire(ptr):
    """``ld.acquire.gpu`` of an int64 counter: later reads cannot pass it."""
    return gl.inline_asm_elementwise("ld.global.acquire.gpu.b64 $0, [$1];", "=l,l", [ptr],
                                     dtype=gl.int64, is_pure=False, pack=1)


@gluon.jit
def _arrive(bar_ptr, P):
    """This program finished a phase: every consumer warp's stores are issued, then one release
    add. Returns the count that means "every program arrived" for this launch (the counters only
    grow, by P a launch, so no reset between launches or graph replays)."""
    _partition_barrier()
    old = gl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")
    return (old // P + 1) * P


@gluon.jit
def _wait(bar_ptr, target):
    seen = _acquire(bar_ptr)
    while seen < target:
        seen = _acquire(bar_ptr)


@gluon.jit
def _bf16(x):
    """fp32 -> bf16 (nearest even) -> fp32: an eager module's bf16 output."""
    return x.to(gl.bfloat16).to(gl.float32)


@gluon.jit
def _store_staged(xs, x, RB: gl.constexpr):
    """``x [NT, 1, RB, BK]`` (bf16) into rows ``0 .. RB`` of ``xs`` tiles ``0 .. NT``. Rows RB..RX
    of a tile keep what they held: the tensor cores' columns for them are never stored. The
    swizzle cannot be split along rows, so the store goes through ``STAGED_ROWS``, a view of the
    same bytes whose rows ``0 .. RB`` have STAGED's addresses
    (tests/unit/test_streamed_depth.py)."""
    XT: gl.constexpr = xs.shape[0]
    RX: gl.constexpr = xs.shape[1]
    BK: gl.constexpr = xs.shape[2]
    NT: gl.constexpr = x.shape[0]
    view = xs._reinterpret(gl.bfloat16, [XT, RX // RB, RB, BK], STAGED_ROWS)
    view.slice(0, 1, dim=1).slice(0, NT, dim=0).store(x)


@gluon.jit
def _indices4(NT: gl.constexpr, RB: gl.constexpr, BK: gl.constexpr, X4: gl.constexpr):
    """``[NT, 1, 1, 1]`` K tiles, ``[1, 1, RB, 1]`` rows, ``[1, 1, 1, BK]`` columns in a tile."""
    tiles = gl.arange(0, NT, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, X4))))
    rows = gl.arange(0, RB, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, X4))))
    offs = gl.arange(0, BK, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, X4))))
    return tiles[:, None, None, None], rows[None, None, :, None], offs[None, None, None, :]


@gluon.jit
def _stage_norm(xs, part_ptr, n_split, ws_split, res_ptr, res_rows, h_ptr, WRITE_H: gl.constexpr,
                nw_ptr, pid, P, R, eps, K: gl.constexpr, SMAX: gl.constexpr, RB: gl.constexpr,
                BK: gl.constexpr, X4: gl.constexpr):
    """The whole input of q/k/v, gate/up or the head, every row, into ``xs`` (one load of all of
    it, one L2 round trip): ``h = bf16(res + bf16(sum of the n_split K-split partials))``, the
    sum in split order (a row's bits depend neither on its batch nor on the programs); the
    residual ``res`` for rows below ``res_rows`` (0: none, the projector's output is h itself);
    then RMSNorm at RMSNorm.forward's rounding, ``bf16(w * bf16(h * rstd))``, its statistics from
    these registers in the same reduction order for every ``RB``. ``WRITE_H``: this program
    also writes the K tiles it owns (tile t: program t % P) of ``h`` to ``h_ptr``, for the phase
    two steps on that adds its residual to it."""
    NT: gl.constexpr = K // BK
    tiles, rows, offs = _indices4(NT, RB, BK, X4)
    cols = tiles * BK + offs
    at = rows * K + cols  # [NT, 1, RB, BK]
    mask = (rows < R) & (cols < K)
    total = gl.load(part_ptr + at, mask=mask, other=0.0, cache_modifier=".cg")
    for s in gl.static_range(1, SMAX):
        total += gl.load(part_ptr + s * ws_split + at, mask=mask & (n_split > s), other=0.0,
                         cache_modifier=".cg")
    res = gl.load(res_ptr + at, mask=mask & (rows < res_rows), other=0.0,
                  cache_modifier=".cg").to(gl.float32)
    h = _bf16(res + _bf16(total))
    if WRITE_H:
        gl.store(h_ptr + at, h.to(gl.bfloat16), mask=mask & (tiles % P == pid))
    rstd = 1.0 / gl.sqrt(gl.sum(gl.sum(h * h, axis=3), axis=0) / K + eps)  # [1, RB]
    w = gl.load(nw_ptr + cols).to(gl.float32)
    x = _bf16(w * _bf16(h * rstd[None, :, :, None]))
    _store_staged(xs, x.to(gl.bfloat16), RB)


@gluon.jit
def _stage_range(KIND: gl.constexpr, xs, t0, pos, R, B, x_ptr, codes_ptr, hidden_ptr,
                 K: gl.constexpr, V: gl.constexpr, NCB: gl.constexpr, NT: gl.constexpr,
                 RB: gl.constexpr, BK: gl.constexpr, X4: gl.constexpr):
    """K tiles ``t0 .. t0 + NT`` of a projector or down_proj item's input, every row, into
    ``xs[0 .. NT]``: PROJ the backbone state (p = 0) or the audio table's row of code c_{p-1}
    (an EOS first code clamped into the table, as ``depth_frames`` does); DOWN
    ``bf16(bf16(silu(g)) * u)`` (made by GATE_UP's epilogue)."""
    tiles, rows, offs = _indices4(NT, RB, BK, X4)
    cols = (t0 + tiles) * BK + offs
    mask = (rows < R) & (cols < K)
    if KIND == PROJ:
        if pos == 0:
            src = hidden_ptr + rows.to(gl.int64) * K
        else:
            code = gl.load(codes_ptr + (rows % B) * NCB + pos - 1, mask=rows < R, other=0,
                           cache_modifier=".cg")
            code = gl.minimum(code, V - 1)
            src = x_ptr + (code + V * (pos - 1)).to(gl.int64) * K
        x = gl.load(src + cols, mask=mask, other=0.0, cache_modifier=".cg")
    else:
        x = gl.load(x_ptr + rows * K + cols, mask=mask, other=0.0, cache_modifier=".cg")
    _store_staged(xs, x, RB)


@gluon.jit
def _sum_splits(ptr, ws_split, mask, S: gl.constexpr):
    """A q/k/v output value from its K-split partials: the sum in split order, to bf16 (q/k/v's
    rounding)."""
    total = gl.load(ptr, mask=mask, other=0.0, cache_modifier=".cg")
    for s in gl.static_range(1, S):
        total += gl.load(ptr + s * ws_split, mask=mask, other=0.0, cache_modifier=".cg")
    return _bf16(total)


@gluon.jit
def _rope(x, partner, sign, cos, sin):
    """``apply_rope`` over a whole head: ``partner`` is ``rotate_half``'s other column (``sign``
    -1 below the half), each product and the sum rounded to bf16."""
    return _bf16(_bf16(x * cos) + _bf16(sign * partner * sin))


@gluon.jit
def _stage_attention(xs, ab, grp, nb, pos, R, qkv_ptr, ws_split, QS: gl.constexpr, cos_ptr,
                     sin_ptr, cache_ptr, scale, c_kv, c_row, c_head, c_pos, H: gl.constexpr,
                     KVH: gl.constexpr, HD: gl.constexpr, NP: gl.constexpr, RX: gl.constexpr,
                     A3: gl.constexpr, CL: gl.constexpr):
    """An o_proj item's input (the attention folded into o_proj: no phase of its own): the
    attention output of KV group ``grp``'s query heads, every row, into ``xs[0 .. G]`` (tile hh:
    head ``grp * G + hh``). q, k and v are the q/k/v phase's partials summed in split order (its
    bf16 output); RoPE on q and on the key at ``pos``; keys and values at slots < pos from the
    frame cache, at ``pos`` from q/k/v (item ``nb == 0`` of the group writes them into the cache:
    no program reads slot ``pos`` of the cache in this launch); flash attention's rounding
    (unnormalised probabilities to bf16 for P @ V, fp32 row sums). Rows go two at a time (RG):
    one L2 round trip a pair, the registers of [2, NP, HD] keys and values. Each pair's heads go
    to ``ab`` (plain layout: rows can be sliced), copied into the swizzled ``xs`` at the end."""
    G: gl.constexpr = H // KVH
    HALF: gl.constexpr = HD // 2
    NQKV: gl.constexpr = (H + 2 * KVH) * HD
    RG: gl.constexpr = 2
    QL: gl.constexpr = gl.SliceLayout(1, A3)  # [RG, HD]
    SL: gl.constexpr = gl.SliceLayout(2, A3)  # [RG, NP]
    rq = gl.arange(0, RG, layout=gl.SliceLayout(1, QL))[:, None]
    dq = gl.arange(0, HD, layout=gl.SliceLayout(0, QL))
    partner = ((dq + HALF) % HD)[None, :]  # rotate_half's column
    sign = gl.where(dq < HALF, -1.0, 1.0)[None, :]
    cos = gl.load(cos_ptr + pos * HD + dq).to(gl.float32)[None, :]
    sin = gl.load(sin_ptr + pos * HD + dq).to(gl.float32)[None, :]
    dq = dq[None, :]
    r3 = gl.arange(0, RG, layout=gl.SliceLayout(1, SL))[:, None, None]
    s3 = gl.arange(0, NP, layout=gl.SliceLayout(0, SL))[None, :, None]
    d3 = gl.arange(0, HD, layout=gl.SliceLayout(0, QL))[None, None, :]
    slots = gl.arange(0, NP, layout=gl.SliceLayout(0, SL))[None, :]
    kcol = (H + grp) * HD
    vcol = (H + KVH + grp) * HD
    for g in range(0, gl.cdiv(R, RG)):
        r0 = g * RG
        qmask = (r0 + rq < R) & (dq < HD)
        src = qkv_ptr + (r0 + rq) * NQKV
        k_new = _rope(_sum_splits(src + kcol + dq, ws_split, qmask, QS),
                      _sum_splits(src + kcol + partner, ws_split, qmask, QS), sign, cos, sin)
        v_new = _sum_splits(src + vcol + dq, ws_split, qmask, QS)
        cache = cache_ptr + (r0 + r3) * c_row + grp * c_head + s3 * c_pos + d3
        live = (r0 + r3 < R) & (s3 < pos) & (d3 < HD)
        k = gl.load(cache, mask=live, other=0.0, cache_modifier=".cg").to(gl.float32)
        v = gl.load(cache + c_kv, mask=live, other=0.0, cache_modifier=".cg").to(gl.float32)
        here = s3 == pos
        k = gl.where(here, gl.expand_dims(k_new, 1), k)
        v = gl.where(here, gl.expand_dims(v_new, 1), v)
        if nb == 0:  # one item of the group: the key and value at pos into the frame cache
            at = cache_ptr + (r0 + rq) * c_row + grp * c_head + pos * c_pos + dq
            gl.store(at, k_new.to(gl.bfloat16), mask=qmask)
            gl.store(at + c_kv, v_new.to(gl.bfloat16), mask=qmask)
        for hh in gl.static_range(G):
            qcol = (grp * G + hh) * HD
            q = _rope(_sum_splits(src + qcol + dq, ws_split, qmask, QS),
                      _sum_splits(src + qcol + partner, ws_split, qmask, QS), sign, cos, sin)
            scores = gl.sum(gl.expand_dims(q, 1) * k, axis=2) * scale  # [RG, NP]
            scores = gl.where(slots <= pos, scores, float("-inf"))
            p = gl.exp(scores - gl.max(scores, axis=1)[:, None])
            total = gl.convert_layout(gl.sum(p, axis=1), gl.SliceLayout(1, QL))[:, None]
            out = _bf16(gl.sum(gl.expand_dims(_bf16(p), 2) * v, axis=1) / total)
            ab.index(hh * (RX // RG) + g).store(out.to(gl.bfloat16))
    _partition_barrier()  # every warp's heads are in ab
    heads = ab._reinterpret(gl.bfloat16, [G, RX, HD], PLAIN)
    tiles = xs._reinterpret(gl.bfloat16, xs.shape, STAGED_TILE)
    for hh in gl.static_range(G):
        tiles.index(hh).store(heads.index(hh).load(CL))


@gluon.jit
def _epilogue(KIND: gl.constexpr, acc, acc_up, nb, split, pos, R, out_ptr, ws_split,
              N: gl.constexpr, V: gl.constexpr, RX: gl.constexpr, BN: gl.constexpr,
              AL: gl.constexpr):
    """An item's sums ``acc [BN, RX]`` (output columns x rows: the tensor cores' transposed
    product) into the phase's output: a K split's fp32 partial for PROJ, QKV, O and DOWN (the
    next phase's staging sums them); ``bf16(bf16(silu(gate)) * up)`` of the bf16 gate and up
    (``acc_up``) for GATE_UP, as the eager MLP rounds; fp32 logits for HEAD."""
    rows = gl.arange(0, RX, layout=gl.SliceLayout(0, AL))
    n = nb * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, AL))
    mask = (rows < R)[None, :]
    if KIND == HEAD:
        dst = out_ptr + pos.to(gl.int64) * R * V + rows[None, :] * V + n[:, None]
        gl.store(dst, acc, mask=mask & (n < V)[:, None])
    elif KIND == GATE_UP:
        gate = _bf16(acc)
        out = _bf16(_bf16(gate / (1.0 + gl.exp(-gate))) * _bf16(acc_up))  # F.silu, then * up
        gl.store(out_ptr + rows[None, :] * N + n[:, None], out.to(gl.bfloat16), mask=mask)
    else:
        gl.store(out_ptr + split * ws_split + rows[None, :] * N + n[:, None], acc, mask=mask)


# ---------------------------------------------------------------------------------------------
# The two partitions


@gluon.jit
def _load_phase(desc, row0, ring, ready, empty, it, pid, P, N: gl.constexpr, K: gl.constexpr,
                SPLIT: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, SLOTS: gl.constexpr,
                PAIR: gl.constexpr = 0):
    """The loader's share of one weight phase: rows ``row0 ..`` of ``desc`` (a ``[*, K]``
    weight), item by item as the consumers take them, every K tile into the next free slot
    (``PAIR``: then the tile ``PAIR`` rows below it too, the up tile of a gate tile)."""
    n_tiles: gl.constexpr = N // BN
    KTI: gl.constexpr = K // BK // SPLIT  # K tiles an item
    for item in range(pid, n_tiles * SPLIT, P):
        nb = item % n_tiles
        k0 = (item // n_tiles) * KTI
        for kb in range(k0, k0 + KTI):
            slot = it % SLOTS
            mbarrier.wait(empty.index(slot), ((it // SLOTS) & 1) ^ 1)
            mbarrier.expect(ready.index(slot), BN * BK * 2)
            tma.async_copy_global_to_shared(desc, [row0 + nb * BN, kb * BK], ready.index(slot),
                                            ring.index(slot))
            it += 1
            if PAIR > 0:
                slot = it % SLOTS
                mbarrier.wait(empty.index(slot), ((it // SLOTS) & 1) ^ 1)
                mbarrier.expect(ready.index(slot), BN * BK * 2)
                tma.async_copy_global_to_shared(desc, [row0 + PAIR + nb * BN, kb * BK],
                                                ready.index(slot), ring.index(slot))
                it += 1
    return it


@gluon.jit
def _loader(proj_desc, qkv_desc, o_desc, gu_desc, down_desc, head_desc, ring, ready, empty,
            pos, D: gl.constexpr, DB: gl.constexpr, I: gl.constexpr, NQKV: gl.constexpr,
            HHD: gl.constexpr, L: gl.constexpr, VP: gl.constexpr, BN: gl.constexpr,
            BK: gl.constexpr, SLOTS: gl.constexpr, PROJ_S: gl.constexpr, QKV_S: gl.constexpr,
            O_S: gl.constexpr, DOWN_S: gl.constexpr):
    """The weight stream: the same items in the same order as the consumers take them."""
    pid = gl.program_id(0)
    P = gl.num_programs(0)
    it = _load_phase(proj_desc, 0, ring, ready, empty, pid * 0, pid, P, D, DB, PROJ_S, BN, BK,
                     SLOTS)
    for layer in range(L):
        it = _load_phase(qkv_desc, layer * NQKV, ring, ready, empty, it, pid, P, NQKV, D,
                         QKV_S, BN, BK, SLOTS)
        it = _load_phase(o_desc, layer * D, ring, ready, empty, it, pid, P, D, HHD, O_S, BN, BK,
                         SLOTS)
        it = _load_phase(gu_desc, layer * 2 * I, ring, ready, empty, it, pid, P, I, D, 1, BN,
                         BK, SLOTS, I)
        it = _load_phase(down_desc, layer * D, ring, ready, empty, it, pid, P, D, I, DOWN_S, BN,
                         BK, SLOTS)
    if pos > 0:
        _load_phase(head_desc, (pos - 1) * VP, ring, ready, empty, it, pid, P, VP, D, 1, BN, BK,
                    SLOTS)


@gluon.jit
def _take(ring, ready, empty, it, SLOTS: gl.constexpr, WL: gl.constexpr):
    """The ring's tile number ``it`` in registers (layout ``WL``); its slot goes back to the
    loader."""
    slot = it % SLOTS
    mbarrier.wait(ready.index(slot), (it // SLOTS) & 1)
    w = ring.index(slot).load(WL)
    fence_async_shared()
    mbarrier.arrive(empty.index(slot), count=1)  # the loader may refill the slot
    return w


@gluon.jit
def _gemv_phase(KIND: gl.constexpr, ring, xs, ab, ready, empty, it, pid, P, pos, R, B, src_ptr,
                n_split, res_ptr, res_rows, h_ptr, nw_ptr, codes_ptr, hidden_ptr, out_ptr,
                ws_split, eps, cos_ptr, sin_ptr, cache_ptr, scale, c_kv, c_row, c_head, c_pos,
                N: gl.constexpr, K: gl.constexpr, SPLIT: gl.constexpr, SMAX: gl.constexpr,
                QS: gl.constexpr, V: gl.constexpr, NCB: gl.constexpr, H: gl.constexpr,
                KVH: gl.constexpr, HD: gl.constexpr, RB: gl.constexpr, BN: gl.constexpr,
                BK: gl.constexpr, SLOTS: gl.constexpr, X4: gl.constexpr, MMA: gl.constexpr,
                A3: gl.constexpr, CL: gl.constexpr):
    """The consumers' share of one weight phase. Its input goes into shared memory ``xs`` (K
    tile by K tile): q/k/v, gate/up and the head stage all of it once a phase
    (``_stage_norm``: the previous phase's partials summed, the residual added, RMSNorm) and an
    item reads its split's tiles; an o_proj item stages its KV group's attention output
    (``_stage_attention``), a projector or down_proj item its K range. Per item, each K tile from
    the ring times the input on the tensor cores (``[BN, BK] @ [BK, RX]``: the weight tile is
    the 16-row operand, the rows the 8- or 16-column one; GATE_UP: a gate tile and its up tile a
    K step, ``N`` the intermediate size), then ``_epilogue``. No item waits on another: a split
    item's partial is summed by the next phase."""
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    B_L: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    RX: gl.constexpr = xs.shape[1]
    n_tiles: gl.constexpr = N // BN
    KTI: gl.constexpr = K // BK // SPLIT  # K tiles an item
    WHOLE: gl.constexpr = (KIND == QKV) | (KIND == GATE_UP) | (KIND == HEAD)
    if WHOLE:
        gl.static_assert((KIND == HEAD) | (n_tiles * SPLIT >= K // BK),
                         "every owner of a K tile of h stages")
        if pid < n_tiles * SPLIT:  # this program has an item in the phase
            _partition_barrier()  # the last reads of xs are done
            _stage_norm(xs, src_ptr, n_split, ws_split, res_ptr, res_rows, h_ptr, KIND != HEAD,
                        nw_ptr, pid, P, R, eps, K, SMAX, RB, BK, X4)
            _partition_barrier()  # every consumer warp sees the whole input
    tiles = xs._reinterpret(gl.bfloat16, xs.shape, STAGED_TILE)  # the same bytes, by tile
    for item in range(pid, n_tiles * SPLIT, P):
        nb = item % n_tiles
        split = item // n_tiles
        t0 = split * KTI  # the item's first K tile in xs
        if not WHOLE:
            _partition_barrier()  # the last reads of xs (and ab) are done
            if KIND == O:
                gl.static_assert(KTI * KVH == H, "an o_proj item is one KV group's heads")
                _stage_attention(xs, ab, split, nb, pos, R, src_ptr, ws_split, QS, cos_ptr,
                                 sin_ptr, cache_ptr, scale, c_kv, c_row, c_head, c_pos, H, KVH,
                                 HD, NCB, RX, A3, CL)
            else:
                _stage_range(KIND, xs, t0, pos, R, B, src_ptr, codes_ptr, hidden_ptr, K, V, NCB,
                             KTI, RB, BK, X4)
            _partition_barrier()  # every consumer warp sees the item's input
            t0 = 0
        acc = gl.zeros([BN, RX], gl.float32, MMA)
        acc_up = gl.zeros([BN, RX], gl.float32, MMA)  # GATE_UP: the up tile's sums
        for kk in gl.static_range(KTI):
            xt = tiles.index(t0 + kk).permute((1, 0)).load(B_L)  # [BK, RX]
            w = _take(ring, ready, empty, it, SLOTS, A_L)
            it += 1
            acc = mma_v2(w, xt, acc)
            if KIND == GATE_UP:
                w = _take(ring, ready, empty, it, SLOTS, A_L)
                it += 1
                acc_up = mma_v2(w, xt, acc_up)
        _epilogue(KIND, acc, acc_up, nb, split, pos, R, out_ptr, ws_split, N, V, RX, BN, MMA)
    return it


@gluon.jit
def _consumer(ring, xs, ab, ready, empty, hidden_ptr, codes_ptr, embed_ptr, ln1_ptr, ln2_ptr,
              norm_ptr, cos_ptr, sin_ptr, h_ptr, act_ptr, cache_ptr, logits_ptr, ws_ptr, bar_ptr,
              pos, R, B, eps, scale, ws_split, ws_buf, h_buf, c_layer, c_kv, c_row, c_head,
              c_pos, D: gl.constexpr, DB: gl.constexpr, I: gl.constexpr, H: gl.constexpr,
              KVH: gl.constexpr, HD: gl.constexpr, L: gl.constexpr, NCB: gl.constexpr,
              V: gl.constexpr, VP: gl.constexpr, RB: gl.constexpr, BN: gl.constexpr,
              BK: gl.constexpr, SLOTS: gl.constexpr, PROJ_S: gl.constexpr, QKV_S: gl.constexpr,
              O_S: gl.constexpr, DOWN_S: gl.constexpr, X4: gl.constexpr, MMA: gl.constexpr,
              A3: gl.constexpr, CL: gl.constexpr):
    """The phases of a position in order, each after the previous one's counter (module
    docstring: which buffer each phase writes, and why none is overwritten while it is read)."""
    pid = gl.program_id(0)
    P = gl.num_programs(0)
    NQKV: gl.constexpr = (H + 2 * KVH) * HD
    SMAX: gl.constexpr = PROJ_S if PROJ_S > DOWN_S else DOWN_S
    res_ws = ws_ptr  # buffer 0: the projector's, o_proj's and down_proj's partials [S, R, D]
    qkv_ws = ws_ptr + ws_buf  # buffer 1: q/k/v's partials [S, R, NQKV]
    h_in = h_ptr  # h_l, the layer's input (written by q/k/v's staging)
    h_mid = h_ptr + h_buf  # h_l + attention (written by gate/up's staging)
    it = _gemv_phase(PROJ, ring, xs, ab, ready, empty, pid * 0, pid, P, pos, R, B, embed_ptr, 0,
                     h_mid, 0, h_in, ln1_ptr, codes_ptr, hidden_ptr, res_ws, ws_split, eps,
                     cos_ptr, sin_ptr, cache_ptr, scale, c_kv, c_row, c_head, c_pos, D, DB,
                     PROJ_S, 1, 1, V, NCB, H, KVH, HD, RB, BN, BK, SLOTS, X4, MMA, A3, CL)
    target = _arrive(bar_ptr, P)
    g = 1  # the phase this program runs next: it waits for phase g - 1
    for layer in range(L):
        later = (layer > 0).to(gl.int32)  # layer 0's input is the projector's output alone
        cache = cache_ptr + layer.to(gl.int64) * c_layer
        for step in gl.static_range(4):  # q/k/v, o_proj (with the attention), gate/up, down
            _wait(bar_ptr + g - 1, target)
            if step == 0:
                it = _gemv_phase(QKV, ring, xs, ab, ready, empty, it, pid, P, pos, R, B, res_ws,
                                 PROJ_S + (DOWN_S - PROJ_S) * later, h_mid, R * later, h_in,
                                 ln1_ptr + layer * D, codes_ptr, hidden_ptr, qkv_ws, ws_split,
                                 eps, cos_ptr, sin_ptr, cache, scale, c_kv, c_row, c_head, c_pos,
                                 NQKV, D, QKV_S, SMAX, 1, V, NCB, H, KVH, HD, RB, BN, BK, SLOTS,
                                 X4, MMA, A3, CL)
            elif step == 1:
                it = _gemv_phase(O, ring, xs, ab, ready, empty, it, pid, P, pos, R, B, qkv_ws, 0,
                                 h_mid, 0, h_in, ln1_ptr, codes_ptr, hidden_ptr, res_ws, ws_split,
                                 eps, cos_ptr, sin_ptr, cache, scale, c_kv, c_row, c_head, c_pos,
                                 D, H * HD, O_S, 1, QKV_S, V, NCB, H, KVH, HD, RB, BN, BK, SLOTS,
                                 X4, MMA, A3, CL)
            elif step == 2:
                it = _gemv_phase(GATE_UP, ring, xs, ab, ready, empty, it, pid, P, pos, R, B,
                                 res_ws, O_S, h_in, R, h_mid, ln2_ptr + layer * D, codes_ptr,
                                 hidden_ptr, act_ptr, ws_split, eps, cos_ptr, sin_ptr, cache,
                                 scale, c_kv, c_row, c_head, c_pos, I, D, 1, O_S, 1, V, NCB, H,
                                 KVH, HD, RB, BN, BK, SLOTS, X4, MMA, A3, CL)
            else:
                it = _gemv_phase(DOWN, ring, xs, ab, ready, empty, it, pid, P, pos, R, B,
                                 act_ptr, 0, h_mid, 0, h_in, ln1_ptr, codes_ptr, hidden_ptr,
                                 res_ws, ws_split, eps, cos_ptr, sin_ptr, cache, scale, c_kv,
                                 c_row, c_head, c_pos, D, I, DOWN_S, 1, 1, V, NCB, H, KVH, HD,
                                 RB, BN, BK, SLOTS, X4, MMA, A3, CL)
            target = _arrive(bar_ptr + g, P)
            g += 1
    if pos > 0:
        _wait(bar_ptr + g - 1, target)
        _gemv_phase(HEAD, ring, xs, ab, ready, empty, it, pid, P, pos, R, B, res_ws, DOWN_S,
                    h_mid, R, h_in, norm_ptr, codes_ptr, hidden_ptr, logits_ptr, ws_split, eps,
                    cos_ptr, sin_ptr, cache_ptr, scale, c_kv, c_row, c_head, c_pos, VP, D, 1,
                    DOWN_S, 1, V, NCB, H, KVH, HD, RB, BN, BK, SLOTS, X4, MMA, A3, CL)


@gluon.jit(do_not_specialize=["pos", "R", "B"])
def _position_kernel(
    proj_desc, qkv_desc, o_desc, gu_desc, down_desc, head_desc,
    hidden_ptr, codes_ptr, embed_ptr, ln1_ptr, ln2_ptr, norm_ptr, cos_ptr, sin_ptr,
    h_ptr, act_ptr, cache_ptr, logits_ptr, ws_ptr, bar_ptr,
    pos, R, B, eps, scale, ws_split, ws_buf, h_buf, c_layer, c_kv, c_row, c_head, c_pos,
    D: gl.constexpr, DB: gl.constexpr, I: gl.constexpr, H: gl.constexpr, KVH: gl.constexpr,
    HD: gl.constexpr, L: gl.constexpr, NCB: gl.constexpr, V: gl.constexpr, VP: gl.constexpr,
    RB: gl.constexpr, RX: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
    SLOTS: gl.constexpr, PROJ_S: gl.constexpr, QKV_S: gl.constexpr, O_S: gl.constexpr,
    DOWN_S: gl.constexpr, XT: gl.constexpr, X4: gl.constexpr, MMA: gl.constexpr,
    A3: gl.constexpr, CL: gl.constexpr, num_warps: gl.constexpr,
):
    """Position ``pos`` of a frame: projector, 12 layers, head (``pos >= 1``); the phases of one
    launch wait on ``bar_ptr[0 .. 4 L]`` (see the module docstring)."""
    ring = gl.allocate_shared_memory(gl.bfloat16, [SLOTS, BN, BK], qkv_desc.layout)
    xs = gl.allocate_shared_memory(gl.bfloat16, [XT, RX, BK], STAGED)  # the rows' input
    ab = gl.allocate_shared_memory(gl.bfloat16, [(H // KVH) * (RX // 2), 2, HD], PLAIN)
    ready = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(SLOTS):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    NQKV: gl.constexpr = (H + 2 * KVH) * HD
    gl.warp_specialize([
        (_consumer, (ring, xs, ab, ready, empty, hidden_ptr, codes_ptr, embed_ptr, ln1_ptr,
                     ln2_ptr, norm_ptr, cos_ptr, sin_ptr, h_ptr, act_ptr, cache_ptr, logits_ptr,
                     ws_ptr, bar_ptr, pos, R, B, eps, scale, ws_split, ws_buf, h_buf, c_layer,
                     c_kv, c_row, c_head, c_pos, D, DB, I, H, KVH, HD, L, NCB, V, VP, RB, BN,
                     BK, SLOTS, PROJ_S, QKV_S, O_S, DOWN_S, X4, MMA, A3, CL)),
        (_loader, (proj_desc, qkv_desc, o_desc, gu_desc, down_desc, head_desc, ring, ready,
                   empty, pos, D, DB, I, NQKV, H * HD, L, VP, BN, BK, SLOTS, PROJ_S, QKV_S, O_S,
                   DOWN_S)),
    ], [1], [40])


@triton.jit(do_not_specialize=["R", "B", "pos"])
def _draw_kernel(logits_ptr, has_cfg_ptr, scale_ptr, params_ptr, seeds_ptr, frames_ptr,
                 codes_ptr, pos, R, B, V: tl.constexpr, NCB: tl.constexpr, CODES: tl.constexpr,
                 BLOCK: tl.constexpr, MAX_K: tl.constexpr, EXACT_LOG: tl.constexpr):
    """Code ``pos`` of every request from the head's logits: the persistent frame's draw."""
    _draw_phase(tl.program_id(0), tl.num_programs(0), pos, R, B, logits_ptr, has_cfg_ptr,
                scale_ptr, params_ptr, seeds_ptr, frames_ptr, codes_ptr, V, NCB, CODES, BLOCK,
                MAX_K, EXACT_LOG)


# ---------------------------------------------------------------------------------------------
# Host side


class StreamedDepthFrame:
    """``codes[:, 1:]`` of a frame for up to ``max_rows`` rows (see the module docstring).

    Holds the depth weights stacked per layer as 2-D ``[L * N, K]`` matrices with a TMA
    descriptor each, the head transposed and padded to ``[15 * VP, d]``, the RoPE tables of
    positions 0..15 and the workspaces, all made once, so CUDA graphs capture the launches.
    Needs ``BreezeModel.fuse_projections_()`` first (packed q/k/v and gate/up)."""

    def __init__(self, depth: torch.nn.Module, max_rows: int = MAX_ROWS,
                 tiles: StreamTiles | None = None, programs: int | None = None,
                 max_k: int = MAX_K) -> None:
        cfg = depth.cfg
        model = depth.model
        layers = model.layers
        if any(layer.self_attn.qkv_weight is None or layer.mlp.gate_up_weight is None
               for layer in layers):
            raise ValueError("the streamed depth frame needs BreezeModel.fuse_projections_()")
        if not 1 <= max_rows <= MAX_ROWS:
            raise ValueError(f"max_rows {max_rows} outside 1..{MAX_ROWS}")
        if model.norm.weight.dtype != torch.bfloat16:
            raise ValueError("the streamed depth frame needs bf16 depth weights")
        self.cfg, self.max_rows, self.max_k = cfg, max_rows, max_k
        self.tiles = t = tiles or StreamTiles()
        self._check(cfg, t)
        device = model.norm.weight.device
        self.device = device
        with torch.no_grad():
            self.embed = model.embed_tokens.weight
            self.proj = model.inputs_embeds_projector.weight.contiguous()
            self.ln1 = torch.stack([layer.input_layernorm.weight for layer in layers])
            self.ln2 = torch.stack([layer.post_attention_layernorm.weight for layer in layers])
            self.qkv = torch.cat([layer.self_attn.qkv_weight for layer in layers])
            self.o = torch.cat([layer.self_attn.o_proj.weight for layer in layers])
            self.gate_up = torch.cat([layer.mlp.gate_up_weight for layer in layers])
            self.down = torch.cat([layer.mlp.down_proj.weight for layer in layers])
            self.norm = model.norm.weight
            heads = depth.codebooks_head.weight.to(torch.bfloat16)  # [15, d, V]
            self.vocab = heads.shape[-1]
            self.vocab_padded = triton.cdiv(self.vocab, t.bn) * t.bn
            head = torch.zeros(heads.shape[0], self.vocab_padded, heads.shape[1],
                               dtype=torch.bfloat16, device=device)
            head[:, : self.vocab] = heads.transpose(1, 2)
            self.head = head.view(-1, heads.shape[1])
            steps = torch.arange(cfg.num_codebooks, device=device)
            cos, sin = depth.rope.cos_sin(steps, torch.bfloat16)
            self.cos, self.sin = cos.contiguous(), sin.contiguous()
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
        self.descs = [TensorDescriptor(w, list(w.shape), list(w.stride()), [t.bn, t.bk], layout)
                      for w in (self.proj, self.qkv, self.o, self.gate_up, self.down, self.head)]
        # the K tiles a consumer stages in shared memory at once: a phase's whole input (q/k/v,
        # o_proj, gate/up, head) or one item's K range (projector, down_proj)
        self.staged_tiles = max(cfg.backbone_hidden_size // t.proj_split, cfg.hidden_size,
                                cfg.num_heads * cfg.head_dim,
                                cfg.intermediate_size // t.down_split) // t.bk
        self.mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[t.warps, 1],
                                             instr_shape=[16, 8])
        # staging registers [K tile, 1, row, column]: 8 contiguous values a lane, 16 lanes a
        # tile row, 2 rows a warp, the warps over K tiles (so every RB reduces a row over K in
        # the same order, and RB rows cost RB / 2 registers a value)
        self.x4 = gl.BlockedLayout([1, 1, 1, 8], [1, 1, 2, 16], [t.warps, 1, 1, 1], [3, 2, 1, 0])
        # attention: [row pair, slots, head dim]; the copy of its output into xs: [rows, dim]
        self.a3 = gl.BlockedLayout([1, 1, 8], [1, 2, 16], [2, t.warps // 2, 1], [2, 1, 0])
        self.cl = gl.BlockedLayout([1, 8], [2, 16], [t.warps, 1], [1, 0])
        if programs is None:
            programs = (torch.cuda.get_device_properties(device).multi_processor_count
                        if device.type == "cuda" else 132)
        self.programs = programs
        self._alloc(max_rows)

    @staticmethod
    def _check(cfg, t: StreamTiles) -> None:
        problems = []
        qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        for name, n, k, split in (
            ("projector", cfg.hidden_size, cfg.backbone_hidden_size, t.proj_split),
            ("q/k/v", qkv, cfg.hidden_size, t.qkv_split),
            ("o_proj", cfg.hidden_size, cfg.num_heads * cfg.head_dim, t.o_split),
            ("gate/up", cfg.intermediate_size, cfg.hidden_size, 1),
            ("down_proj", cfg.hidden_size, cfg.intermediate_size, t.down_split),
            ("head", t.bn, cfg.hidden_size, 1),
        ):
            if n % t.bn or k % (t.bk * split):
                problems.append(f"{name} ({n} x {k}, {split} splits)")
        if t.o_split != cfg.num_kv_heads or t.bk != cfg.head_dim:
            problems.append(f"o_proj ({t.o_split} splits of {t.bk} columns: want one a KV "
                            f"head, {cfg.num_kv_heads}, of {cfg.head_dim}-column heads)")
        if t.warps % 2:  # the attention's row pair: two warps
            problems.append(f"{t.warps} consumer warps")
        if cfg.hidden_size & (cfg.hidden_size - 1) or cfg.num_heads % cfg.num_kv_heads:
            problems.append(f"hidden_size {cfg.hidden_size}")
        if cfg.head_dim != 128 or (cfg.num_heads // cfg.num_kv_heads) & (
                cfg.num_heads // cfg.num_kv_heads - 1) or cfg.num_codebooks != 16:
            problems.append(f"attention ({cfg.num_heads} heads of {cfg.head_dim}, "
                            f"{cfg.num_codebooks} positions)")
        if problems:
            raise ValueError("the streamed depth frame does not fit " + ", ".join(problems))

    def _alloc(self, rows: int) -> None:
        cfg, dev, bf = self.cfg, self.device, torch.bfloat16
        t = self.tiles
        d = cfg.hidden_size
        qkv_width = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        self.h = torch.empty(2, rows, d, dtype=bf, device=dev)  # h_l, h_l + attention
        self.act = torch.empty(rows, cfg.intermediate_size, dtype=bf, device=dev)
        self.cache = torch.zeros(cfg.num_layers, 2, rows, cfg.num_kv_heads, cfg.num_codebooks,
                                 cfg.head_dim, dtype=bf, device=dev)
        self.logits = torch.empty(cfg.num_codebooks, rows, self.vocab, dtype=torch.float32,
                                  device=dev)
        # the K-split partials: [0] the projector's, o_proj's, down_proj's (d wide), [1] q/k/v's
        splits = max(t.proj_split, t.qkv_split, t.o_split, t.down_split)
        self.workspace = torch.empty(2, splits, MAX_ROWS, max(d, qkv_width),
                                     dtype=torch.float32, device=dev)
        # no tile counters since v5 (split partials are summed by the next phase); kept empty
        # for callers that check that a frame leaves none set
        self.counters = torch.zeros(0, dtype=torch.int32, device=dev)
        # a counter a phase but the head (it waits on the last down_proj's)
        self.barriers = torch.zeros(1 + 4 * cfg.num_layers, dtype=torch.int64, device=dev)
        self.rows = rows

    def frame_logits(self, rows: int) -> torch.Tensor:
        """The last call's fp32 logits ``[16, rows, V]`` (position 0's are never written)."""
        size = self.cfg.num_codebooks * rows * self.vocab
        return self.logits.view(-1)[:size].view(self.cfg.num_codebooks, rows, self.vocab)

    def __call__(self, hidden: torch.Tensor, code0: torch.Tensor, has_cfg: torch.Tensor,
                 cfg_scale: torch.Tensor, depth_sampling: torch.Tensor, seeds: torch.Tensor,
                 frames_at: torch.Tensor) -> torch.Tensor:
        """As ``PersistentDepthFrame.__call__``: ``hidden [R, backbone_hidden]`` (R = B or 2B),
        ``code0 [B]`` and per-request CFG and depth sampling -> codes ``[B, 16]`` int64."""
        rows, num = hidden.shape[0], code0.shape[0]
        if rows not in (num, 2 * num):
            raise ValueError(f"hidden has {rows} rows for {num} requests (want B or 2B)")
        if rows > self.rows:
            raise ValueError(f"{rows} rows past the streamed depth frame's {self.rows}")
        cfg, t = self.cfg, self.tiles
        codes = torch.empty(num, cfg.num_codebooks, dtype=torch.long, device=hidden.device)
        codes[:, 0] = code0
        hidden = hidden.contiguous()
        has = has_cfg.to(torch.int8).contiguous()
        scale = cfg_scale.to(torch.float32).contiguous()
        params = depth_sampling.to(torch.float32).contiguous()
        seeds = seeds.to(torch.long).contiguous()
        frames_at = frames_at.to(torch.long).contiguous()
        c = self.cache.stride()  # [L, 2, R, KVH, P, D]
        rb = max(2, triton.next_power_of_2(rows))  # the rows staged (registers)
        rx = max(8, rb)  # the tensor cores' row operand: 8 or 16 columns
        for pos in range(cfg.num_codebooks):
            _position_kernel[(self.programs,)](
                *self.descs, hidden, codes, self.embed, self.ln1, self.ln2, self.norm, self.cos,
                self.sin, self.h, self.act, self.cache, self.logits, self.workspace,
                self.barriers, pos, rows, num, cfg.rms_norm_eps, self.scale,
                self.workspace.stride(1), self.workspace.stride(0), self.h.stride(0), c[0],
                c[1], c[2], c[3], c[4],
                D=cfg.hidden_size, DB=cfg.backbone_hidden_size, I=cfg.intermediate_size,
                H=cfg.num_heads, KVH=cfg.num_kv_heads, HD=cfg.head_dim, L=cfg.num_layers,
                NCB=cfg.num_codebooks, V=self.vocab, VP=self.vocab_padded, RB=rb, RX=rx,
                BN=t.bn, BK=t.bk, SLOTS=t.slots, PROJ_S=t.proj_split, QKV_S=t.qkv_split,
                O_S=t.o_split, DOWN_S=t.down_split, XT=self.staged_tiles, X4=self.x4,
                MMA=self.mma, A3=self.a3, CL=self.cl,
                num_warps=t.warps, maxnreg=t.maxnreg, launch_cooperative_grid=True)
            if pos > 0:
                _draw_kernel[(num,)](
                    self.logits, has, scale, params, seeds, frames_at, codes, pos, rows, num,
                    V=self.vocab, NCB=cfg.num_codebooks, CODES=CODEBOOK_CODES,
                    BLOCK=triton.next_power_of_2(self.vocab), MAX_K=self.max_k,
                    EXACT_LOG=hidden.is_cuda)
        return codes
