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
  launch: ``.cg`` loads; RMSNorm applied there, its statistics from the staged registers): the
  whole input once a phase where it fits (q/k/v, o_proj, gate/up, head), else a work item's K
  range (projector, down_proj); then multiply each ring tile by it on the tensor cores
  (``mma_v2``: the ``BN x BK`` weight tile is the 16-row operand, the rows, padded to 8 or 16,
  the other), so 16 rows cost about what 2 do. The staged input is XOR-swizzled in 16-byte
  units, so those operand loads are free of bank conflicts; o_proj's and down's residual is
  read before the tiles are multiplied.

Status (H200, bench/README.md "third session"): v3 (one staging per item, the rstd read apart,
a plain staging layout, the residual read in the epilogue) correct (tests/gpu), 8.6 ms a frame
at one request against the persistent frame's 7.8: each phase's dependency chain (~5 us of L2
round trips) is the cost, not the stream. This version (v4) shortens those chains; built for
sm_90, not yet run. Off in every profile until it wins.

Work items: a phase's weight ``[N, K]`` is cut into ``BN``-column tiles and ``S`` K splits
(``StreamTiles``); item ``i`` = (column tile ``i % n_tiles``, split ``i // n_tiles``), taken by
program ``i % P``. A split item leaves fp32 partials; the last of the ``S`` programs to finish a
tile (an atomic tile counter) sums them in split order and runs the epilogue, so a row's bits
depend neither on its batch (every row's sums run in the same order whatever ``RB``) nor on
which program finishes last.

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

# triton 3.6 names the partition-wide barrier thread_barrier; 3.7 renamed it barrier
_partition_barrier = getattr(gl, "thread_barrier", None) or gl.barrier


@dataclass(frozen=True)
class StreamTiles:
    """Weight tile ``bn x bk`` (one ring slot), ring ``slots``, consumer ``warps`` (the loader
    adds one), and each weight phase's K splits (``*_split``: they set the sum order, so they
    never change with the rows). Gate/up is never split: an item holds a gate tile and its up
    tile, so SiLU(gate) * up is its epilogue."""

    bn: int = 64
    bk: int = 128
    slots: int = 8
    warps: int = 4
    proj_split: int = 8
    qkv_split: int = 4
    o_split: int = 8
    down_split: int = 8
    head_split: int = 4
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
def _stage(KIND: gl.constexpr, t0, pos, R, B, x_ptr, nw_ptr, codes_ptr, hidden_ptr, xs, eps,
           NT: gl.constexpr, K: gl.constexpr, V: gl.constexpr, NCB: gl.constexpr,
           RB: gl.constexpr, BK: gl.constexpr, X3: gl.constexpr):
    """K tiles ``t0 .. t0 + NT`` of the phase's input, every row, into ``xs[0 .. NT]`` (bf16,
    tile by tile: ``xs[t]`` is ``[RB, BK]``): one load of all of them (one L2 round trip),
    then the store, between two partition barriers (the last reads of ``xs`` are done before;
    every consumer warp sees the whole input after). PROJ the backbone state (p = 0) or the audio
    table's row of code c_{p-1} (an EOS first code clamped into the table, as ``depth_frames``
    does); QKV, GATE_UP, HEAD the RMSNormed ``h`` (``bf16(w * bf16(x * rstd))``, the statistics
    from the registers it stages: the whole row, ``NT * BK == K``); O the attention output;
    DOWN ``bf16(bf16(silu(g)) * u)`` (made by GATE_UP's epilogue)."""
    tiles = t0 + gl.arange(0, NT, layout=gl.SliceLayout(1, gl.SliceLayout(2, X3)))
    rows = gl.arange(0, RB, layout=gl.SliceLayout(0, gl.SliceLayout(2, X3)))
    offs = gl.arange(0, BK, layout=gl.SliceLayout(0, gl.SliceLayout(1, X3)))
    cols = tiles[:, None, None] * BK + offs[None, None, :]  # [NT, 1, BK]
    rmask = (rows < R)[None, :, None]
    if KIND == PROJ:
        if pos == 0:
            src = hidden_ptr + rows.to(gl.int64) * K
        else:
            code = gl.load(codes_ptr + (rows % B) * NCB + pos - 1, mask=rows < R, other=0,
                           cache_modifier=".cg")
            code = gl.minimum(code, V - 1)
            src = x_ptr + (code + V * (pos - 1)).to(gl.int64) * K
        x = gl.load(src[None, :, None] + cols, mask=rmask, other=0.0,
                    cache_modifier=".cg").to(gl.float32)
    elif (KIND == O) | (KIND == DOWN):
        x = gl.load(x_ptr + rows[None, :, None] * K + cols, mask=rmask, other=0.0,
                    cache_modifier=".cg").to(gl.float32)
    else:  # QKV, GATE_UP, HEAD: RMSNorm at RMSNorm.forward's rounding
        gl.static_assert(NT * BK == K, "an RMSNormed input is staged whole")
        h = gl.load(x_ptr + rows[None, :, None] * K + cols, mask=rmask, other=0.0,
                    cache_modifier=".cg").to(gl.float32)
        rstd = 1.0 / gl.sqrt(gl.sum(gl.sum(h * h, axis=2), axis=0) / K + eps)
        w = gl.load(nw_ptr + cols).to(gl.float32)
        x = _bf16(w * _bf16(h * rstd[None, :, None]))
    _partition_barrier()  # the last reads of xs are done
    xs.slice(0, NT, dim=0).store(x.to(gl.bfloat16))
    _partition_barrier()  # every consumer warp sees the whole input


@gluon.jit
def _epilogue(KIND: gl.constexpr, total, up, res, nb, pos, R, out_ptr, N: gl.constexpr,
              V: gl.constexpr, RB: gl.constexpr, BN: gl.constexpr, AL: gl.constexpr):
    """A finished tile ``total [BN, RB]`` (fp32 sums, output columns x rows: the tensor cores'
    transposed product) into the phase's output: bf16 for PROJ and
    QKV; for GATE_UP (``up``: the up tile's sums) ``bf16(bf16(silu(gate)) * up)`` of the bf16
    gate and up, as the eager MLP rounds; ``h = bf16(h + bf16(total))`` for O and DOWN
    (``out_ptr`` is ``h``, ``res`` its bf16 values of these columns, read before the tile was
    multiplied: this item owns these columns, no other program reads ``h`` in this phase); fp32
    logits for HEAD."""
    rows = gl.arange(0, RB, layout=gl.SliceLayout(0, AL))
    n = nb * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, AL))
    if KIND == HEAD:
        dst = out_ptr + pos.to(gl.int64) * R * V + rows[None, :] * V + n[:, None]
        gl.store(dst, total, mask=(rows < R)[None, :] & (n < V)[:, None])
    else:
        dst = out_ptr + rows[None, :] * N + n[:, None]
        mask = (rows < R)[None, :]
        if (KIND == O) | (KIND == DOWN):
            out = _bf16(res.to(gl.float32) + _bf16(total))
        elif KIND == GATE_UP:
            gate = _bf16(total)
            out = _bf16(_bf16(gate / (1.0 + gl.exp(-gate))) * _bf16(up))  # F.silu, then * up
        else:
            out = _bf16(total)
        gl.store(dst, out.to(gl.bfloat16), mask=mask)


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
            O_S: gl.constexpr, DOWN_S: gl.constexpr, HEAD_S: gl.constexpr):
    pid = gl.program_id(0)
    P = gl.num_programs(0)
    it = _load_phase(proj_desc, 0, ring, ready, empty, pid * 0, pid, P, D, DB, PROJ_S, BN, BK, SLOTS)
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
        _load_phase(head_desc, (pos - 1) * VP, ring, ready, empty, it, pid, P, VP, D, HEAD_S, BN,
                    BK, SLOTS)


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
def _gemv_phase(KIND: gl.constexpr, ring, xs, ready, empty, it, pid, P, pos, R, B, x_ptr,
                nw_ptr, codes_ptr, hidden_ptr, out_ptr, ws_ptr, ws_split, cnt_ptr, eps,
                N: gl.constexpr, K: gl.constexpr, SPLIT: gl.constexpr, V: gl.constexpr,
                NCB: gl.constexpr, RB: gl.constexpr, BN: gl.constexpr,
                BK: gl.constexpr, SLOTS: gl.constexpr, X3: gl.constexpr, MMA: gl.constexpr):
    """The consumers' share of one weight phase. Its input goes into shared memory ``xs`` (K
    tile by K tile): the whole of it once a phase where it fits (every phase but PROJ and DOWN:
    one load, the RMSNorm statistics from the same registers; an item reads its split's tiles),
    else the item's K range per item. Per item: O and DOWN read the residual first (its load is
    in flight while the tiles are multiplied), then each K tile from the ring times the input on
    the tensor cores (``[BN, BK] @ [BK, RB]``: the weight tile is the 16-row operand, the rows the
    8- or 16-column one; GATE_UP: a gate tile and its up tile a K step, ``N`` the intermediate
    size), then the split-K sum and the epilogue."""
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    B_L: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    n_tiles: gl.constexpr = N // BN
    KTI: gl.constexpr = K // BK // SPLIT  # K tiles an item
    WHOLE: gl.constexpr = (KIND != PROJ) & (KIND != DOWN)  # the input staged once a phase
    if WHOLE:
        if pid < n_tiles * SPLIT:  # this program has an item in the phase
            _stage(KIND, 0, pos, R, B, x_ptr, nw_ptr, codes_ptr, hidden_ptr, xs, eps, K // BK,
                   K, V, NCB, RB, BK, X3)
    tiles = xs._reinterpret(gl.bfloat16, xs.shape, STAGED_TILE)  # the same bytes, by tile
    rows = gl.arange(0, RB, layout=gl.SliceLayout(0, MMA))
    offs_n = gl.arange(0, BN, layout=gl.SliceLayout(1, MMA))
    mask = (rows < R)[None, :]
    for item in range(pid, n_tiles * SPLIT, P):
        nb = item % n_tiles
        split = item // n_tiles
        res = gl.zeros([BN, RB], gl.bfloat16, MMA)
        if (KIND == O) | (KIND == DOWN):  # the residual h of the tile's columns, in flight now
            res = gl.load(out_ptr + rows[None, :] * N + (nb * BN + offs_n)[:, None], mask=mask,
                          other=0.0, cache_modifier=".cg")
        t0 = split * KTI  # the item's first K tile in xs
        if not WHOLE:
            _stage(KIND, t0, pos, R, B, x_ptr, nw_ptr, codes_ptr, hidden_ptr, xs, eps, KTI, K,
                   V, NCB, RB, BK, X3)
            t0 = 0
        acc = gl.zeros([BN, RB], gl.float32, MMA)
        acc_up = gl.zeros([BN, RB], gl.float32, MMA)  # GATE_UP: the up tile's sums
        for kk in gl.static_range(KTI):
            xt = tiles.index(t0 + kk).permute((1, 0)).load(B_L)  # [BK, RB]
            w = _take(ring, ready, empty, it, SLOTS, A_L)
            it += 1
            acc = mma_v2(w, xt, acc)
            if KIND == GATE_UP:
                w = _take(ring, ready, empty, it, SLOTS, A_L)
                it += 1
                acc_up = mma_v2(w, xt, acc_up)
        if SPLIT == 1:
            _epilogue(KIND, acc, acc_up, res, nb, pos, R, out_ptr, N, V, RB, BN, MMA)
        else:
            part = ws_ptr + rows[None, :] * N + (nb * BN + offs_n)[:, None]
            gl.store(part + split * ws_split, acc, mask=mask)
            _partition_barrier()  # every warp's partial is written before the counter says so
            arrived = gl.atomic_add(cnt_ptr + nb, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT - 1:  # the last of the tile's splits sums them, in order
                total = gl.zeros([BN, RB], gl.float32, MMA)
                for s in gl.static_range(SPLIT):  # every partial's load issued at once
                    total += gl.load(part + s * ws_split, mask=mask, other=0.0,
                                     cache_modifier=".cg")
                gl.store(cnt_ptr + nb, 0)
                _epilogue(KIND, total, acc_up, res, nb, pos, R, out_ptr, N, V, RB, BN, MMA)
    return it


@gluon.jit
def _rope(lo, hi, cos_lo, cos_hi, sin_lo, sin_hi):
    """``apply_rope`` on the two halves of heads: each product and the sum rounded to bf16."""
    out_lo = _bf16(_bf16(lo * cos_lo) + _bf16(-hi * sin_lo))
    out_hi = _bf16(_bf16(hi * cos_hi) + _bf16(lo * sin_hi))
    return out_lo, out_hi


@gluon.jit
def _attention_phase(pid, P, pos, R, qkv_ptr, cos_ptr, sin_ptr, cache_ptr, attn_ptr, scale,
                     c_kv, c_row, c_head, c_pos, H: gl.constexpr, KVH: gl.constexpr,
                     HD: gl.constexpr, NP: gl.constexpr, A3: gl.constexpr):
    """Item (row, KV head): RoPE on its query heads and on the key at ``pos``, the key and the
    value at ``pos`` into the frame cache, then attention over slots 0..pos (flash attention's
    rounding: unnormalised probabilities to bf16 for P @ V, fp32 row sums)."""
    G: gl.constexpr = H // KVH
    HALF: gl.constexpr = HD // 2
    NQKV: gl.constexpr = (H + 2 * KVH) * HD
    QL: gl.constexpr = gl.SliceLayout(1, A3)  # [G, HALF]
    KL: gl.constexpr = gl.SliceLayout(0, A3)  # [NP, HALF]
    SL: gl.constexpr = gl.SliceLayout(2, A3)  # [G, NP]
    heads = gl.arange(0, G, layout=gl.SliceLayout(1, QL))
    dq = gl.arange(0, HALF, layout=gl.SliceLayout(0, QL))
    slots = gl.arange(0, NP, layout=gl.SliceLayout(1, KL))
    dk = gl.arange(0, HALF, layout=gl.SliceLayout(0, KL))
    here = (slots == pos)[:, None]
    live = (slots <= pos)[:, None]
    cq_lo = gl.load(cos_ptr + pos * HD + dq).to(gl.float32)[None, :]
    cq_hi = gl.load(cos_ptr + pos * HD + HALF + dq).to(gl.float32)[None, :]
    sq_lo = gl.load(sin_ptr + pos * HD + dq).to(gl.float32)[None, :]
    sq_hi = gl.load(sin_ptr + pos * HD + HALF + dq).to(gl.float32)[None, :]
    ck_lo = gl.load(cos_ptr + pos * HD + dk).to(gl.float32)[None, :]
    ck_hi = gl.load(cos_ptr + pos * HD + HALF + dk).to(gl.float32)[None, :]
    sk_lo = gl.load(sin_ptr + pos * HD + dk).to(gl.float32)[None, :]
    sk_hi = gl.load(sin_ptr + pos * HD + HALF + dk).to(gl.float32)[None, :]
    s_slots = gl.arange(0, NP, layout=gl.SliceLayout(0, SL))
    for item in range(pid, R * KVH, P):
        r = item // KVH
        g = item % KVH
        q_src = qkv_ptr + r * NQKV + (g * G + heads)[:, None] * HD + dq[None, :]
        q_lo = gl.load(q_src, cache_modifier=".cg").to(gl.float32)
        q_hi = gl.load(q_src + HALF, cache_modifier=".cg").to(gl.float32)
        q_lo, q_hi = _rope(q_lo, q_hi, cq_lo, cq_hi, sq_lo, sq_hi)
        # the key and value at pos come from this phase's q/k/v, the others from the cache
        cache = cache_ptr + r * c_row + g * c_head + slots[:, None] * c_pos + dk[None, :]
        k_new = qkv_ptr + r * NQKV + (H + g) * HD + dk[None, :] + 0 * slots[:, None]
        k_src = gl.where(here, k_new, cache)
        v_src = gl.where(here, k_new + KVH * HD, cache + c_kv)
        k_lo = gl.load(k_src, mask=live, other=0.0, cache_modifier=".cg").to(gl.float32)
        k_hi = gl.load(k_src + HALF, mask=live, other=0.0, cache_modifier=".cg").to(gl.float32)
        v_lo = gl.load(v_src, mask=live, other=0.0, cache_modifier=".cg").to(gl.float32)
        v_hi = gl.load(v_src + HALF, mask=live, other=0.0, cache_modifier=".cg").to(gl.float32)
        r_lo, r_hi = _rope(k_lo, k_hi, ck_lo, ck_hi, sk_lo, sk_hi)
        k_lo = gl.where(here, r_lo, k_lo)
        k_hi = gl.where(here, r_hi, k_hi)
        gl.store(cache, k_lo.to(gl.bfloat16), mask=here)
        gl.store(cache + HALF, k_hi.to(gl.bfloat16), mask=here)
        gl.store(cache + c_kv, v_lo.to(gl.bfloat16), mask=here)
        gl.store(cache + c_kv + HALF, v_hi.to(gl.bfloat16), mask=here)
        scores = (gl.sum(gl.expand_dims(q_lo, 1) * gl.expand_dims(k_lo, 0), axis=2)
                  + gl.sum(gl.expand_dims(q_hi, 1) * gl.expand_dims(k_hi, 0), axis=2)) * scale
        scores = gl.where((s_slots <= pos)[None, :], scores, float("-inf"))
        p = gl.exp(scores - gl.max(scores, axis=1)[:, None])
        pb = gl.expand_dims(_bf16(p), 2)
        total = gl.convert_layout(gl.sum(p, axis=1), gl.SliceLayout(1, QL))[:, None]
        out_lo = _bf16(gl.sum(pb * gl.expand_dims(v_lo, 0), axis=1) / total)
        out_hi = _bf16(gl.sum(pb * gl.expand_dims(v_hi, 0), axis=1) / total)
        dst = attn_ptr + r * (H * HD) + (g * G + heads)[:, None] * HD + dq[None, :]
        gl.store(dst, out_lo.to(gl.bfloat16))
        gl.store(dst + HALF, out_hi.to(gl.bfloat16))


@gluon.jit
def _consumer(ring, xs, ready, empty, hidden_ptr, codes_ptr, embed_ptr, ln1_ptr, ln2_ptr, norm_ptr,
              cos_ptr, sin_ptr, h_ptr, qkv_ptr, attn_ptr, act_ptr, cache_ptr, logits_ptr, ws_ptr,
              cnt_ptr, bar_ptr, pos, R, B, eps, scale, ws_split, c_layer, c_kv, c_row, c_head,
              c_pos, D: gl.constexpr, DB: gl.constexpr, I: gl.constexpr, H: gl.constexpr,
              KVH: gl.constexpr, HD: gl.constexpr, L: gl.constexpr, NCB: gl.constexpr,
              V: gl.constexpr, VP: gl.constexpr, RB: gl.constexpr, BN: gl.constexpr,
              BK: gl.constexpr, SLOTS: gl.constexpr, PROJ_S: gl.constexpr, QKV_S: gl.constexpr,
              O_S: gl.constexpr, DOWN_S: gl.constexpr,
              HEAD_S: gl.constexpr, X3: gl.constexpr, MMA: gl.constexpr, A3: gl.constexpr):
    pid = gl.program_id(0)
    P = gl.num_programs(0)
    NQKV: gl.constexpr = (H + 2 * KVH) * HD
    HHD: gl.constexpr = H * HD
    it = _gemv_phase(PROJ, ring, xs, ready, empty, pid * 0, pid, P, pos, R, B, embed_ptr, ln1_ptr,
                     codes_ptr, hidden_ptr, h_ptr, ws_ptr, ws_split, cnt_ptr, eps, D, DB,
                     PROJ_S, V, NCB, RB, BN, BK, SLOTS, X3, MMA)
    target = _arrive(bar_ptr, P)
    g = 1  # the phase this program runs next: it waits for phase g - 1
    for layer in range(L):
        for step in gl.static_range(5):  # q/k/v, attention, o_proj, gate/up, down
            _wait(bar_ptr + g - 1, target)
            if step == 0:
                it = _gemv_phase(QKV, ring, xs, ready, empty, it, pid, P, pos, R, B, h_ptr,
                                 ln1_ptr + layer * D, codes_ptr, hidden_ptr, qkv_ptr, ws_ptr,
                                 ws_split, cnt_ptr, eps, NQKV, D, QKV_S, V, NCB, RB, BN, BK,
                                 SLOTS, X3, MMA)
            elif step == 1:
                _attention_phase(pid, P, pos, R, qkv_ptr, cos_ptr, sin_ptr,
                                 cache_ptr + layer.to(gl.int64) * c_layer, attn_ptr, scale, c_kv,
                                 c_row, c_head, c_pos, H, KVH, HD, NCB, A3)
            elif step == 2:
                it = _gemv_phase(O, ring, xs, ready, empty, it, pid, P, pos, R, B, attn_ptr, ln1_ptr,
                                 codes_ptr, hidden_ptr, h_ptr, ws_ptr, ws_split, cnt_ptr, eps, D,
                                 HHD, O_S, V, NCB, RB, BN, BK, SLOTS, X3, MMA)
            elif step == 3:
                it = _gemv_phase(GATE_UP, ring, xs, ready, empty, it, pid, P, pos, R, B, h_ptr,
                                 ln2_ptr + layer * D, codes_ptr, hidden_ptr, act_ptr, ws_ptr,
                                 ws_split, cnt_ptr, eps, I, D, 1, V, NCB, RB, BN, BK, SLOTS,
                                 X3, MMA)
            else:
                it = _gemv_phase(DOWN, ring, xs, ready, empty, it, pid, P, pos, R, B, act_ptr, ln1_ptr,
                                 codes_ptr, hidden_ptr, h_ptr, ws_ptr, ws_split, cnt_ptr, eps, D,
                                 I, DOWN_S, V, NCB, RB, BN, BK, SLOTS, X3, MMA)
            target = _arrive(bar_ptr + g, P)
            g += 1
    if pos > 0:
        _wait(bar_ptr + g - 1, target)
        _gemv_phase(HEAD, ring, xs, ready, empty, it, pid, P, pos, R, B, h_ptr, norm_ptr, codes_ptr,
                    hidden_ptr, logits_ptr, ws_ptr, ws_split, cnt_ptr, eps, VP, D, HEAD_S, V,
                    NCB, RB, BN, BK, SLOTS, X3, MMA)


@gluon.jit(do_not_specialize=["pos", "R", "B"])
def _position_kernel(
    proj_desc, qkv_desc, o_desc, gu_desc, down_desc, head_desc,
    hidden_ptr, codes_ptr, embed_ptr, ln1_ptr, ln2_ptr, norm_ptr, cos_ptr, sin_ptr,
    h_ptr, qkv_ptr, attn_ptr, act_ptr, cache_ptr, logits_ptr, ws_ptr, cnt_ptr, bar_ptr,
    pos, R, B, eps, scale, ws_split, c_layer, c_kv, c_row, c_head, c_pos,
    D: gl.constexpr, DB: gl.constexpr, I: gl.constexpr, H: gl.constexpr, KVH: gl.constexpr,
    HD: gl.constexpr, L: gl.constexpr, NCB: gl.constexpr, V: gl.constexpr, VP: gl.constexpr,
    RB: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, SLOTS: gl.constexpr,
    PROJ_S: gl.constexpr, QKV_S: gl.constexpr, O_S: gl.constexpr,
    DOWN_S: gl.constexpr, HEAD_S: gl.constexpr, XT: gl.constexpr, MMA: gl.constexpr,
    num_warps: gl.constexpr,
):
    """Position ``pos`` of a frame: projector, 12 layers, head (``pos >= 1``); the phases of one
    launch wait on ``bar_ptr[0 .. 61]`` (see the module docstring)."""
    # the rows' inputs as they are made: 8 contiguous values a lane along K
    # the rows' input in registers as it is staged, [K tile, row, column in the tile]: 8
    # contiguous values a lane (16-byte loads and shared stores)
    X3: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 2, 16], [1, num_warps, 1], [2, 1, 0])
    # attention: [query heads, slots, half a head]
    A3: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 4, 8], [1, num_warps, 1], [2, 1, 0])
    ring = gl.allocate_shared_memory(gl.bfloat16, [SLOTS, BN, BK], qkv_desc.layout)
    xs = gl.allocate_shared_memory(gl.bfloat16, [XT, RB, BK], STAGED)  # the rows' input
    ready = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(SLOTS):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    NQKV: gl.constexpr = (H + 2 * KVH) * HD
    gl.warp_specialize([
        (_consumer, (ring, xs, ready, empty, hidden_ptr, codes_ptr, embed_ptr, ln1_ptr, ln2_ptr,
                     norm_ptr, cos_ptr, sin_ptr, h_ptr, qkv_ptr, attn_ptr, act_ptr, cache_ptr,
                     logits_ptr, ws_ptr, cnt_ptr, bar_ptr, pos, R, B, eps, scale, ws_split,
                     c_layer, c_kv, c_row, c_head, c_pos, D, DB, I, H, KVH, HD, L, NCB, V, VP,
                     RB, BN, BK, SLOTS, PROJ_S, QKV_S, O_S, DOWN_S, HEAD_S, X3, MMA, A3)),
        (_loader, (proj_desc, qkv_desc, o_desc, gu_desc, down_desc, head_desc, ring, ready,
                   empty, pos, D, DB, I, NQKV, H * HD, L, VP, BN, BK, SLOTS, PROJ_S, QKV_S, O_S,
                   DOWN_S, HEAD_S)),
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
            ("head", t.bn, cfg.hidden_size, t.head_split),
        ):
            if n % t.bn or k % (t.bk * split):
                problems.append(f"{name} ({n} x {k}, {split} splits)")
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
        self.h = torch.empty(rows, d, dtype=bf, device=dev)
        self.qkv_out = torch.empty(rows, qkv_width, dtype=bf, device=dev)
        self.attn = torch.empty(rows, cfg.num_heads * cfg.head_dim, dtype=bf, device=dev)
        self.act = torch.empty(rows, cfg.intermediate_size, dtype=bf, device=dev)
        self.cache = torch.zeros(cfg.num_layers, 2, rows, cfg.num_kv_heads, cfg.num_codebooks,
                                 cfg.head_dim, dtype=bf, device=dev)
        self.logits = torch.empty(cfg.num_codebooks, rows, self.vocab, dtype=torch.float32,
                                  device=dev)
        splits = max(t.proj_split, t.qkv_split, t.o_split, t.down_split, t.head_split)
        widest = max(d, qkv_width, self.vocab_padded)
        self.workspace = torch.empty(splits, MAX_ROWS, widest, dtype=torch.float32, device=dev)
        self.counters = torch.zeros(widest // t.bn, dtype=torch.int32, device=dev)
        self.barriers = torch.zeros(2 + 5 * cfg.num_layers, dtype=torch.int64, device=dev)
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
        rb = 8 if rows <= 8 else 16  # the tensor cores' row operand: 8 or 16 columns
        for pos in range(cfg.num_codebooks):
            _position_kernel[(self.programs,)](
                *self.descs, hidden, codes, self.embed, self.ln1, self.ln2, self.norm, self.cos,
                self.sin, self.h, self.qkv_out, self.attn, self.act, self.cache, self.logits,
                self.workspace, self.counters, self.barriers,
                pos, rows, num, cfg.rms_norm_eps, self.scale, self.workspace.stride(0), c[0],
                c[1], c[2], c[3], c[4],
                D=cfg.hidden_size, DB=cfg.backbone_hidden_size, I=cfg.intermediate_size,
                H=cfg.num_heads, KVH=cfg.num_kv_heads, HD=cfg.head_dim, L=cfg.num_layers,
                NCB=cfg.num_codebooks, V=self.vocab, VP=self.vocab_padded, RB=rb, BN=t.bn,
                XT=self.staged_tiles, MMA=self.mma,
                BK=t.bk, SLOTS=t.slots, PROJ_S=t.proj_split, QKV_S=t.qkv_split, O_S=t.o_split,
                DOWN_S=t.down_split, HEAD_S=t.head_split,
                num_warps=t.warps, maxnreg=t.maxnreg, launch_cooperative_grid=True)
            if pos > 0:
                _draw_kernel[(num,)](
                    self.logits, has, scale, params, seeds, frames_at, codes, pos, rows, num,
                    V=self.vocab, NCB=cfg.num_codebooks, CODES=CODEBOOK_CODES,
                    BLOCK=triton.next_power_of_2(self.vocab), MAX_K=self.max_k,
                    EXACT_LOG=hidden.is_cuda)
        return codes
