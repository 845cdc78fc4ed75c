"""Experiment (issue 30): does a swap-AB wgmma consumer keep the weight stream's bandwidth at 2
rows and reach tensor-core speed at 64-512 rows? Gluon, built for triton 3.6.0 and 3.7.1.

    PYTHONPATH=runtime:bench python3 bench/depth_stream_wgmma.py --out depth-stream-wgmma.json
    PYTHONPATH=runtime:.:bench python bench/depth_stream_wgmma.py --compile-only  # no GPU: sm_90a

The frame, its packed weights, the modes' meaning, the checks and the timing are
``depth_stream_gluon.py``'s (imported, not copied): 16 positions x 12 layers x (q/k/v, attention,
o, gate/up, down), each program one contiguous share of each phase's BN x BK weight tiles, split-K
partial sums added into fp32 outputs with relaxed atomics. What changes is the consumer: the
GEMV becomes ``out^T[N, R] = W[N, K] @ x^T[K, R]`` on the tensor cores (swap-AB), so the weight
tile is wgmma's A operand straight from the ring (M = 64 a warpgroup) and the R rows are wgmma's
N (padded to a power of 2, at least 8 a warpgroup along N: TMA fills the padding with zeros).

Per program, ``gl.warp_specialize`` forks
- the weight loader (1 warp), as in ``depth_stream_gluon.py``: TMA of every tile of its shares
  into the ring of S slots, in stream order across phases, never looking at activations;
- an activation loader (1 warp): for the same tiles in the same order, TMA of the chunk
  ``x[:, kb*BK:(kb+1)*BK]`` (rows padded to RP, boxes of <= 256 rows) into a ring of XS slots;
  in ``phased`` mode it waits, before a phase, until all programs published the previous one
  (per-phase counters, ``ld.acquire.gpu`` spin, then ``fence.proxy.async.global`` so that the
  TMA reads what the acquire saw): it is the consumers' input side;
- consumers (the default partition, 4 or 8 warps = one or two warpgroups): wait for both slots,
  ``warpgroup_mma`` (async, one in flight: tile t's wgmma runs while tile t-1's slots are given
  back), fp32 accumulators in registers (NVMMADistributedLayout v3); at the end of an n-block
  the [BN, RP] accumulator is added into the outputs with relaxed atomics (rows < R only). With
  8 warps and BN = 64 the two warpgroups split the rows (warps [4, 2]): each multiplies the SAME
  weight tile in shared memory by its own <= 256-row block, so the weights are read from HBM once
  per position whatever R is; with BN = 128 they split the tile's rows (warps [8, 1]).

Modes: ``stream`` (no dependencies) and ``phased`` (per-phase waits, loaders ahead), as the
FMA script defines them. Checked like it: one layer's GEMVs against torch fp32 (max abs error
< 2e-2), the whole frame per mode (within 2e-4 of the largest output + 1e-2). Each row of the JSON
adds TFLOP/s (2 FLOP a weight and real row), the activation bytes TMA reads from L2 a frame (each
program re-reads x's chunk for every tile: R/BN times the weight bytes) and the atomic adds.

Owns: this experiment only. Must not: be imported by the runtime or the tests.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

import torch
import triton
from depth_stream_gluon import (
    FFN,
    HIDDEN,
    MODES,
    PHASES,
    Frame,
    Launch,
    Stream,
    _loader_phase,
    _partition_barrier,
    _share,
    _wait_count,
    add_args,
    cuobjdump,
    describe_build,
    device_run,
    measure,
    print_table,
)
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

WGMMA_MODES = ("stream", "phased")
SMEM_BUDGET = 227 * 1024 - 2048  # a block's shared memory, less the barriers and Triton's scratch
MAX_X_STAGES = 4
TMA_BOX_ROWS = 256  # a TMA box is at most 256 elements along each dimension
LOADER_REGS = 40
MAX_ACC_REGS = 128  # of a consumer thread's <= 240: the rest hold addresses, indices, masks

# ----------------------------------------------------------------------------- device code


@gluon.jit
def _fence_proxy_async_global(token):
    """Orders this thread's earlier generic-proxy accesses (the acquire) before its later
    async-proxy ones (TMA reads of global memory)."""
    return gl.inline_asm_elementwise("fence.proxy.async.global;\nmov.b32 $0, $1;", "=r,r",
                                     [token], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _w_loader(desc, ring, ready, empty, positions, layers, BN: gl.constexpr, BK: gl.constexpr,
              S: gl.constexpr, LAYER_TILES: gl.constexpr, OFF0: gl.constexpr,
              OFF2: gl.constexpr, OFF3: gl.constexpr, OFF4: gl.constexpr):
    """The weights of every phase, in stream order; never waits for a phase."""
    pid = gl.program_id(0)
    P = gl.num_programs(0)
    it = 0
    for pos in range(positions):
        for layer in range(layers):
            row = layer * LAYER_TILES * BN
            it = _loader_phase(desc, ring, ready, empty, it, row + OFF0 * BN, pid, P,
                                 Q_OUT_C, HIDDEN_C, BN, BK, S)
            it = _loader_phase(desc, ring, ready, empty, it, row + OFF2 * BN, pid, P,
                                 HIDDEN_C, HIDDEN_C, BN, BK, S)
            it = _loader_phase(desc, ring, ready, empty, it, row + OFF3 * BN, pid, P,
                                 2 * FFN_C, HIDDEN_C, BN, BK, S)
            it = _loader_phase(desc, ring, ready, empty, it, row + OFF4 * BN, pid, P,
                                 HIDDEN_C, FFN_C, BN, BK, S)


@gluon.jit
def _x_loader_phase(xdesc, xs, xready, xempty, jt, pid, P, N: gl.constexpr, K: gl.constexpr,
                    BN: gl.constexpr, BK: gl.constexpr, XS: gl.constexpr, RB: gl.constexpr,
                    NRB: gl.constexpr):
    KT: gl.constexpr = K // BK
    T: gl.constexpr = (N // BN) * KT
    t0, t1 = _share(pid, P, T)
    for t in range(t0, t1):
        slot = jt % XS
        mbarrier.wait(xempty.index(slot), ((jt // XS) & 1) ^ 1)
        mbarrier.expect(xready.index(slot), NRB * RB * BK * 2)  # the whole box: TMA zero-fills
        for rb in gl.static_range(NRB):  # row blocks of <= 256 (a TMA box's limit)
            tma.async_copy_global_to_shared(xdesc, [rb * RB, (t % KT) * BK], xready.index(slot),
                                            xs.index(slot).slice(rb * RB, RB))
        jt += 1
    return jt


@gluon.jit
def _x_loader(x1024_desc, x8192_desc, xs, xready, xempty, counters, err_ptr, positions, layers,
              target, budget, MODE: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
              XS: gl.constexpr, RB: gl.constexpr, NRB: gl.constexpr):
    """The activation chunk of every tile, in the consumers' order; in ``phased`` mode it waits
    for the previous phase before a phase's first chunk."""
    pid = gl.program_id(0)
    P = gl.num_programs(0)
    jt = 0
    g = 0  # phase index in the frame
    for pos in range(positions):
        for layer in range(layers):
            for ph in gl.static_range(5):
                if MODE != 0:
                    if g > 0:  # the previous phase's outputs are this phase's inputs
                        budget = _wait_count(counters + g - 1, target, budget)
                        budget = _fence_proxy_async_global(budget)
                if ph == 0:
                    jt = _x_loader_phase(x1024_desc, xs, xready, xempty, jt, pid, P, Q_OUT_C,
                                         HIDDEN_C, BN, BK, XS, RB, NRB)
                elif ph == 2:
                    jt = _x_loader_phase(x1024_desc, xs, xready, xempty, jt, pid, P, HIDDEN_C,
                                         HIDDEN_C, BN, BK, XS, RB, NRB)
                elif ph == 3:
                    jt = _x_loader_phase(x1024_desc, xs, xready, xempty, jt, pid, P,
                                         2 * FFN_C, HIDDEN_C, BN, BK, XS, RB, NRB)
                elif ph == 4:
                    jt = _x_loader_phase(x8192_desc, xs, xready, xempty, jt, pid, P, HIDDEN_C,
                                         FFN_C, BN, BK, XS, RB, NRB)
                g += 1
    if budget <= 0:
        gl.store(err_ptr, 1)


@gluon.jit
def _release(empty, xempty, it, S: gl.constexpr, XS: gl.constexpr, pred):
    """Tile ``it``'s weight and activation slots go back to the loaders (one arrival each)."""
    _partition_barrier()  # every warpgroup's wgmma on them has retired
    mbarrier.arrive(empty.index(it % S), count=1, pred=pred)
    mbarrier.arrive(xempty.index(it % XS), count=1, pred=pred)


@gluon.jit
def _mma_phase(ring, ready, empty, xs, xready, xempty, it, out_ptr, rows, pid, P,
               N: gl.constexpr, K: gl.constexpr, OUT_W: gl.constexpr, BN: gl.constexpr,
               BK: gl.constexpr, S: gl.constexpr, XS: gl.constexpr, RP: gl.constexpr,
               acc_layout: gl.constexpr):
    KT: gl.constexpr = K // BK
    T: gl.constexpr = (N // BN) * KT
    t0, t1 = _share(pid, P, T)
    offs_n = gl.arange(0, BN, layout=gl.SliceLayout(1, acc_layout))
    offs_r = gl.arange(0, RP, layout=gl.SliceLayout(0, acc_layout))
    acc = gl.zeros([BN, RP], gl.float32, acc_layout)
    nb_end = gl.where(t1 > t0, (t1 - 1) // KT + 1, t0 // KT)
    for nb in range(t0 // KT, nb_end):  # the n-blocks of this share, each over its k-tiles
        k0 = gl.maximum(t0, nb * KT)
        k1 = gl.minimum(t1, nb * KT + KT)
        for t in range(k0, k1):
            slot = it % S
            xslot = it % XS
            mbarrier.wait(ready.index(slot), (it // S) & 1)
            mbarrier.wait(xready.index(xslot), (it // XS) & 1)
            # out^T[BN, RP] += W[BN, BK] @ x^T[BK, RP]: A the weight tile, B the chunk
            # transposed; the n-block's first tile overwrites the accumulator
            acc = warpgroup_mma(ring.index(slot), xs.index(xslot).permute((1, 0)), acc,
                                use_acc=t != k0, is_async=True)
            acc = warpgroup_mma_wait(1, deps=[acc])  # tile t-1's wgmma is done, t's runs
            _release(empty, xempty, it + S * XS - 1, S, XS, t != k0)  # tile t-1's slots
            it += 1
        acc = warpgroup_mma_wait(0, deps=[acc])
        _release(empty, xempty, it - 1, S, XS, True)
        cols = nb * BN + offs_n  # the n-block's partial sum over k0..k1, added out
        ptrs = out_ptr + offs_r[None, :] * OUT_W + cols[:, None]
        mask = (offs_r[None, :] < rows) & (cols[:, None] < N)
        gl.atomic_add(ptrs, acc, mask=mask, sem="relaxed", scope="gpu")
    return it


@gluon.jit
def _consumer(ring, ready, empty, xs, xready, xempty, counters, out_ptr, rows, positions,
              layers, MODE: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, S: gl.constexpr,
              XS: gl.constexpr, RP: gl.constexpr, OUT_W: gl.constexpr, COL0: gl.constexpr,
              COL2: gl.constexpr, COL3: gl.constexpr, COL4: gl.constexpr,
              acc_layout: gl.constexpr):
    pid = gl.program_id(0)
    P = gl.num_programs(0)
    it = 0
    g = 0
    for pos in range(positions):
        for layer in range(layers):
            for ph in gl.static_range(5):
                if ph == 0:
                    it = _mma_phase(ring, ready, empty, xs, xready, xempty, it, out_ptr + COL0,
                                    rows, pid, P, Q_OUT_C, HIDDEN_C, OUT_W, BN, BK, S, XS, RP,
                                    acc_layout)
                elif ph == 2:
                    it = _mma_phase(ring, ready, empty, xs, xready, xempty, it, out_ptr + COL2,
                                    rows, pid, P, HIDDEN_C, HIDDEN_C, OUT_W, BN, BK, S, XS, RP,
                                    acc_layout)
                elif ph == 3:
                    it = _mma_phase(ring, ready, empty, xs, xready, xempty, it, out_ptr + COL3,
                                    rows, pid, P, 2 * FFN_C, HIDDEN_C, OUT_W, BN, BK, S, XS,
                                    RP, acc_layout)
                elif ph == 4:
                    it = _mma_phase(ring, ready, empty, xs, xready, xempty, it, out_ptr + COL4,
                                    rows, pid, P, HIDDEN_C, FFN_C, OUT_W, BN, BK, S, XS, RP,
                                    acc_layout)
                if MODE != 0:
                    _partition_barrier()  # every warp's output atomics are issued first
                    gl.atomic_add(counters + g, 1, sem="release", scope="gpu")
                g += 1


@gluon.jit
def _wgmma_kernel(desc, x1024_desc, x8192_desc, counters, err_ptr, out_ptr, rows, positions,
                  layers, target, budget, MODE: gl.constexpr, BN: gl.constexpr,
                  BK: gl.constexpr, S: gl.constexpr, XS: gl.constexpr, RP: gl.constexpr,
                  RB: gl.constexpr, INSTR_N: gl.constexpr, WARPS_M: gl.constexpr,
                  LAYER_TILES: gl.constexpr, OFF0: gl.constexpr, OFF2: gl.constexpr,
                  OFF3: gl.constexpr, OFF4: gl.constexpr, OUT_W: gl.constexpr,
                  COL0: gl.constexpr, COL2: gl.constexpr, COL3: gl.constexpr,
                  COL4: gl.constexpr, num_warps: gl.constexpr):
    # wgmma's accumulator: 16 rows of M a warp, 4 warps (a warpgroup) a 64-row block of M
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[WARPS_M, num_warps // WARPS_M],
        instr_shape=[16, INSTR_N, 16])
    ring = gl.allocate_shared_memory(gl.bfloat16, [S, BN, BK], desc.layout)
    xs = gl.allocate_shared_memory(gl.bfloat16, [XS, RP, BK], x1024_desc.layout)
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
        (_consumer, (ring, ready, empty, xs, xready, xempty, counters, out_ptr, rows,
                     positions, layers, MODE, BN, BK, S, XS, RP, OUT_W, COL0, COL2, COL3, COL4,
                     acc_layout)),
        (_w_loader, (desc, ring, ready, empty, positions, layers, BN, BK, S, LAYER_TILES, OFF0,
                     OFF2, OFF3, OFF4)),
        (_x_loader, (x1024_desc, x8192_desc, xs, xready, xempty, counters, err_ptr, positions,
                     layers, target, budget, MODE, BN, BK, XS, RB, NRB)),
    ], [1, 1], [LOADER_REGS_C, LOADER_REGS_C])


# constexpr globals the device code reads (gluon.jit resolves module-level constexprs)
Q_OUT_C = gl.constexpr(PHASES[0][1])
HIDDEN_C = gl.constexpr(HIDDEN)
FFN_C = gl.constexpr(FFN)
LOADER_REGS_C = gl.constexpr(LOADER_REGS)

# ----------------------------------------------------------------------------- host side


def _pow2_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


class WgmmaFrame(Frame):
    """``Frame`` with the wgmma consumer: swizzled tiles, activation descriptors, RP rows."""

    def check_tiles(self) -> None:
        s = self.s
        if s.bn not in (64, 128) or s.bk not in (64, 128, 256):
            raise ValueError(f"{s}: BN must be 64 or 128 (warpgroups of M = 64), BK 64-256")
        self.warps_m = s.bn // 16  # a warp holds 16 rows of M
        warps_n = s.warps // self.warps_m
        if s.warps % self.warps_m or warps_n not in (1, 2):
            raise ValueError(f"{s}: {s.warps} warps cannot hold {s.bn} rows of M in "
                             f"warpgroups (4 or 8 warps for BN 64, 8 for BN 128)")
        # wgmma's N: a multiple of 8 per warpgroup along N, a power of 2 for Gluon's tensors
        self.rp = max(_pow2_at_least(self.rows), 8 * warps_n)
        self.instr_n = min(256, self.rp // warps_n)
        acc_regs = s.bn * self.rp // (32 * s.warps)
        if acc_regs > MAX_ACC_REGS:
            raise ValueError(f"{s} at {self.rows} rows: {acc_regs} accumulator registers a "
                             f"thread (> {MAX_ACC_REGS}: it would spill); more warps or BN 64")
        self.rb = min(self.rp, TMA_BOX_ROWS)
        ring = s.stages * s.bn * s.bk * 2
        x_stage = self.rp * s.bk * 2
        self.x_stages = min(MAX_X_STAGES, (SMEM_BUDGET - ring) // x_stage)
        if self.x_stages < 2:
            raise ValueError(f"{s} at {self.rows} rows: a {ring // 1024} KB ring and two "
                             f"{x_stage // 1024} KB activation chunks exceed "
                             f"{SMEM_BUDGET // 1024} KB of shared memory")

    def weight_layout(self) -> gl.NVMMASharedLayout:
        """wgmma's A operand: the default NVMMA swizzle for a [BN, BK] bf16 tile."""
        return gl.NVMMASharedLayout.get_default_for([self.s.bn, self.s.bk], gl.bfloat16)

    def __init__(self, stream: Stream, layers: int, positions: int, device: str,
                 seed: int = 0, init: bool = True, rows: int = 2) -> None:
        super().__init__(stream, layers, positions, device, seed, init, rows)
        layout = gl.NVMMASharedLayout.get_default_for([self.rb, stream.bk], gl.bfloat16)
        self.x_descs = [TensorDescriptor(x, list(x.shape), list(x.stride()),
                                         [self.rb, stream.bk], layout)
                        for x in (self.x1024, self.x8192)]

    @property
    def default_maxnreg(self) -> int:
        """The most registers a thread at one block per SM: consumers + one loader warpgroup."""
        return min(248, 65536 // (32 * (self.s.warps + 4)) // 8 * 8)  # ptxas: <= 255

    def launch(self, mode: str, programs: int, maxnreg: int, spin_budget: int,
               positions: int | None = None, layers: int | None = None,
               cooperative: bool = True):
        if mode not in WGMMA_MODES:
            raise ValueError(f"mode {mode!r}: the wgmma consumer runs {WGMMA_MODES}")
        positions = self.positions if positions is None else positions
        layers = self.layers if layers is None else layers
        s = self.s
        offs, cols = s.offsets, s.out_cols
        self.epoch += 1  # counters only grow: a launch waits for epoch * programs arrivals
        kwargs = {"launch_cooperative_grid": True} if cooperative else {}
        return _wgmma_kernel[(programs,)](
            self.desc, *self.x_descs, self.counters, self.err, self.out, self.rows, positions,
            layers, self.epoch * programs, spin_budget, MODE=MODES[mode], BN=s.bn, BK=s.bk,
            S=s.stages, XS=self.x_stages, RP=self.rp, RB=self.rb, INSTR_N=self.instr_n,
            WARPS_M=self.warps_m, LAYER_TILES=s.layer_tiles, OFF0=offs[0], OFF2=offs[2],
            OFF3=offs[3], OFF4=offs[4], OUT_W=self.out.shape[1], COL0=cols[0], COL2=cols[2],
            COL3=cols[3], COL4=cols[4], num_warps=s.warps,
            maxnreg=maxnreg or self.default_maxnreg, **kwargs)

    def extra(self, programs: int) -> dict:
        """What a frame moves besides the weights: activation bytes TMA reads (each tile
        re-reads its chunk; padding rows are zero-filled, not read) and output atomics (one per
        output element of each program's n-block piece, rows < R)."""
        s, x_bytes, atomics = self.s, 0, 0
        for _, n, k in PHASES:
            if not n:
                continue
            kt, tiles = k // s.bk, s.tiles(n, k)
            x_bytes += tiles * self.rows * s.bk * 2
            for p in range(programs):
                t0, t1 = p * tiles // programs, (p + 1) * tiles // programs
                if t1 > t0:
                    atomics += ((t1 - 1) // kt - t0 // kt + 1) * s.bn * self.rows
        frames = self.positions * self.layers
        return {"padded_rows": self.rp, "x_stages": self.x_stages, "wgmma_n": self.instr_n,
                "x_l2_gb": round(frames * x_bytes / 1e9, 2),
                "atomic_adds_m": round(frames * atomics / 1e6, 1)}

    def label(self) -> str:
        return f"{self.s} r{self.rows}"


def _sass_hgmma(kernel) -> str:
    """HGMMA instructions in the cubin's SASS and the warpgroup arrivals that start their
    batches: as many batches as HGMMAs means ptxas serialized them (warning C7511)."""
    sass = cuobjdump(kernel, "--dump-sass")
    return (f"{len(re.findall(r'HGMMA[.]', sass))} HGMMA in "
            f"{len(re.findall(r'WARPGROUP[.]ARRIVE', sass))} batches")


def compile_only(streams: list[Stream], rows_list: list[int], modes: list[str],
                 run: Launch) -> None:
    """Build every config x rows x mode for sm_90a on this machine (no GPU), print resources."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.sm90_build import build_only

    print(f"triton {triton.__version__}; configs BNxBKxStages w consumer warps (+2 loader "
          f"warps); maxnreg {run.maxnreg or 'auto'}")
    for stream in streams:
        for rows in rows_list:
            try:  # nothing is read: the build needs shapes and strides only
                frame = WgmmaFrame(stream, 1, 1, "cpu", init=False, rows=rows)
            except ValueError as exc:
                print(f"{stream} r{rows}: not built: {exc}", flush=True)
                continue
            for mode in modes:
                with build_only(90) as built:
                    frame.launch(mode, run.programs, run.maxnreg, run.spin_budget)
                kernel = built[-1]
                info = frame.extra(run.programs)
                print(describe_build(kernel, frame.label(), mode) +
                      f"; RP {frame.rp} (wgmma N {frame.instr_n}), {frame.x_stages} x-slots, "
                      f"{kernel.asm['ptx'].count('wgmma.mma_async')} wgmma PTX sites, "
                      f"{_sass_hgmma(kernel)}; a frame: x {info['x_l2_gb']} GB from L2, "
                      f"{info['atomic_adds_m']} M atomic adds", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(ap, ",".join(WGMMA_MODES), "64x64x8w8,64x128x6w4", "depth-stream-wgmma.json")
    ap.add_argument("--rows", default="2,16,64,128,256,512",
                    help="rows a GEMV (requests x 2 with CFG), each padded to wgmma's N")
    ap.set_defaults(maxnreg=0, deadline_s=240)  # maxnreg 0: the most at one block per SM
    args = ap.parse_args()
    t_start = time.monotonic()
    streams = [Stream.parse(c) for c in args.configs.split(",")]
    rows_list = [int(r) for r in args.rows.split(",")]
    modes = args.modes.split(",")
    if args.compile_only:
        compile_only(streams, rows_list, modes, Launch(args.programs or 132, args.maxnreg,
                                                       args.spin_budget, args.iters))
        return
    run, result = device_run(args, "bench/depth_stream_wgmma.py")
    for stream in streams:
        for rows in rows_list:
            if time.monotonic() - t_start > args.deadline_s:
                print(f"deadline: {stream} r{rows} not run", flush=True)
                break
            try:
                frame = WgmmaFrame(stream, args.layers, args.positions, "cuda", rows=rows)
            except Exception as exc:
                print(f"{stream} r{rows}: not run: {exc!r}"[:1500], flush=True)
                result["failures"].append(f"{stream} r{rows}: {exc!r}"[:500])
                continue
            print(f"{frame.label()}: {frame.extra(run.programs)}", flush=True)
            measure(frame, frame.label(), modes, run, args, result, t_start)
            del frame
            torch.cuda.empty_cache()
    print_table(result)


if __name__ == "__main__":
    main()
