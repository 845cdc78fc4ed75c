"""Experiment (issue 30): does a warp-specialized weight stream reach the H200's HBM floor for
the depth frame? Written in Triton's Gluon dialect against triton 3.6.0.

    PYTHONPATH=runtime python3 bench/depth_stream_gluon.py --out depth-stream-gluon.json
    PYTHONPATH=runtime:. python bench/depth_stream_gluon.py --compile-only   # no GPU: sm_90a build

One persistent kernel streams the weights of one depth frame (16 positions x 12 layers x 5
phases: qkv 1536x1024, attention (no weights), o 1024x1024, gate_up 16384x1024, down 1024x8192)
through a GEMV against 2 bf16 rows. The 12 layers' weights are random bf16 in ONE contiguous
buffer, pre-tiled in the order the stream reads them: tile (n-block, k-block) of a matrix is BN x
BK contiguous elements, tiles n-major, matrices in phase order, layers in order. Each of the P
programs (one per SM) owns a contiguous share of each phase's tiles (tiles ``[p*T//P,
(p+1)*T//P)``), sums k-blocks of one n-block in registers and adds the result into fp32 outputs
with relaxed atomics (split-K).

Per program, ``gl.warp_specialize`` forks
- a loader (1 warp): for every tile of its share, in stream order across all phases, waits for
  the ring slot to be empty, then one TMA copy of the BN x BK tile into the slot, completing on
  the slot's ``ready`` mbarrier (expect-tx); it never looks at activations;
- consumers (the default partition, 8 warps unless a config says ``wN``): wait ``ready``, read
  the tile from shared memory into registers, fence and arrive on ``empty`` (the loader may
  refill it), then FMA and reduce against the activation chunk (register-prefetched one tile
  ahead, L1-cached).

Modes (``--modes``):
- ``stream``: no dependencies at all: the design's pure bandwidth;
- ``phased``: before a phase the consumers wait (``ld.acquire.gpu`` spin) until all P programs
  published the previous phase (per-phase int32 counter, ``atom.add.release.gpu`` after a
  partition barrier), then read that phase's activation; the loader keeps streaming ahead;
- ``blocked``: ``phased`` with the loader also waiting for the previous phase before its loads
  (today's kernel: the pipeline drains at every barrier);
- ``barriers``: ``phased`` with no tiles: the 960 dependency waits alone.

Every spin has an iteration budget per program and launch (``--spin-budget``); a program that
exhausts it stops waiting and raises a flag, reported as a hang (no launch outlasts a few seconds).
Each mode is checked once (outputs against torch over the whole frame) and timed by CUDA events
(median of 20). A failing mode is printed and the others still run. One GEMV phase alone is
checked first against torch (max abs error, asserted within bf16 tolerance).

Owns: this experiment only. Must not: be imported by the runtime or the tests.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

ROWS = 2
HIDDEN, FFN = 1024, 8192
Q_OUT = 8 * 128 + 2 * 2 * 128  # q + k + v: 8 query and 2 key/value heads of 128
# (name, N, K) of the five phases of a layer; the attention phase reads no weights
PHASES = (("qkv", Q_OUT, HIDDEN), ("attn", 0, 0), ("o", HIDDEN, HIDDEN),
          ("gate_up", 2 * FFN, HIDDEN), ("down", HIDDEN, FFN))
MODES = {"stream": 0, "phased": 1, "blocked": 2, "barriers": 1}
HBM_TBS = 4.8  # H200 HBM3e peak
FLOOR_MS = 2.1  # issue 30's floor for a frame


@dataclass(frozen=True)
class Stream:
    """Tile shape, ring depth and the derived offsets (in tiles) of each phase in a layer."""

    bn: int
    bk: int
    stages: int
    warps: int = 8  # consumer warps (the loader adds one, in a warpgroup of its own)

    @classmethod
    def parse(cls, text: str) -> Stream:
        """``BNxBKxS`` or ``BNxBKxSwW``, e.g. ``64x128x8`` or ``64x128x8w4``."""
        shape, _, warps = text.lower().partition("w")
        bn, bk, stages = (int(v) for v in shape.split("x"))
        return cls(bn, bk, stages, int(warps) if warps else 8)

    def __str__(self) -> str:
        return f"{self.bn}x{self.bk}x{self.stages}w{self.warps}"

    def tiles(self, n: int, k: int) -> int:
        return (n // self.bn) * (k // self.bk)

    @property
    def offsets(self) -> list[int]:
        out, acc = [], 0
        for _, n, k in PHASES:
            out.append(acc)
            acc += self.tiles(n, k) if n else 0
        return out

    @property
    def layer_tiles(self) -> int:
        return sum(self.tiles(n, k) for _, n, k in PHASES if n)

    @property
    def out_cols(self) -> list[int]:
        """Column offset of each phase's output in the [rows, total N] fp32 output."""
        out, acc = [], 0
        for _, n, _k in PHASES:
            out.append(acc)
            acc += n
        return out


# ----------------------------------------------------------------------------- device code


@gluon.jit
def _acquire(ptr):
    return gl.inline_asm_elementwise("ld.global.acquire.gpu.b32 $0, [$1];", "=r,l", [ptr],
                                     dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _wait_count(ptr, target, budget):
    """Spin until ``*ptr >= target`` or the budget is spent; returns what is left."""
    seen = _acquire(ptr)
    while (seen < target) & (budget > 0):
        budget -= 1
        seen = _acquire(ptr)
    return budget


@gluon.jit
def _share(pid, P, T: gl.constexpr):
    return pid * T // P, (pid + 1) * T // P


@gluon.jit
def _loader_phase(desc, ring, ready, empty, it, row0, pid, P, N: gl.constexpr,
                  K: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, S: gl.constexpr):
    T: gl.constexpr = (N // BN) * (K // BK)
    t0, t1 = _share(pid, P, T)
    for t in range(t0, t1):
        slot = it % S
        mbarrier.wait(empty.index(slot), ((it // S) & 1) ^ 1)
        mbarrier.expect(ready.index(slot), BN * BK * 2)
        tma.async_copy_global_to_shared(desc, [row0 + t * BN, 0], ready.index(slot),
                                        ring.index(slot))
        it += 1
    return it


@gluon.jit
def _loader(desc, ring, ready, empty, counters, err_ptr, positions, layers, target, budget,
            MODE: gl.constexpr, WORK: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
            S: gl.constexpr, LAYER_TILES: gl.constexpr, OFF0: gl.constexpr,
            OFF2: gl.constexpr, OFF3: gl.constexpr, OFF4: gl.constexpr):
    pid = gl.program_id(0)
    P = gl.num_programs(0)
    it = 0
    g = 0  # phase index in the frame
    for pos in range(positions):
        for layer in range(layers):
            row = layer * LAYER_TILES * BN
            for ph in gl.static_range(5):
                if MODE == 2:
                    if g > 0:
                        budget = _wait_count(counters + g - 1, target, budget)
                if WORK:
                    if ph == 0:
                        it = _loader_phase(desc, ring, ready, empty, it, row + OFF0 * BN, pid, P,
                                           Q_OUT_C, HIDDEN_C, BN, BK, S)
                    elif ph == 2:
                        it = _loader_phase(desc, ring, ready, empty, it, row + OFF2 * BN, pid, P,
                                           HIDDEN_C, HIDDEN_C, BN, BK, S)
                    elif ph == 3:
                        it = _loader_phase(desc, ring, ready, empty, it, row + OFF3 * BN, pid, P,
                                           2 * FFN_C, HIDDEN_C, BN, BK, S)
                    elif ph == 4:
                        it = _loader_phase(desc, ring, ready, empty, it, row + OFF4 * BN, pid, P,
                                           HIDDEN_C, FFN_C, BN, BK, S)
                g += 1
    if budget <= 0:
        gl.store(err_ptr, 1)


@gluon.jit
def _x_chunk(x_ptr, kb, K: gl.constexpr, BK: gl.constexpr, layout: gl.constexpr):
    cols = kb * BK + gl.arange(0, BK, layout=gl.SliceLayout(0, layout))
    x0 = gl.load(x_ptr + cols)  # L1-cached: after an ld.acquire.gpu it sees the release
    x1 = gl.load(x_ptr + K + cols)
    return x0, x1


@gluon.jit
def _consume_phase(ring, ready, empty, it, x_ptr, out_ptr, pid, P, N: gl.constexpr,
                   K: gl.constexpr, OUT_W: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                   S: gl.constexpr, layout: gl.constexpr):
    KT: gl.constexpr = K // BK
    T: gl.constexpr = (N // BN) * KT
    t0, t1 = _share(pid, P, T)
    acc_layout: gl.constexpr = gl.SliceLayout(1, layout)
    offs_n = gl.arange(0, BN, layout=acc_layout)
    acc0 = gl.zeros([BN], gl.float32, acc_layout)
    acc1 = gl.zeros([BN], gl.float32, acc_layout)
    nx0, nx1 = _x_chunk(x_ptr, t0 % KT, K, BK, layout)
    for t in range(t0, t1):
        x0 = nx0.to(gl.float32)
        x1 = nx1.to(gl.float32)
        slot = it % S
        mbarrier.wait(ready.index(slot), (it // S) & 1)
        w = ring.index(slot).load(layout)
        fence_async_shared()  # (a MEMBAR.CTA: the next chunk's loads are issued after it)
        mbarrier.arrive(empty.index(slot), count=1)
        it += 1
        tn = gl.minimum(t + 1, t1 - 1)
        nx0, nx1 = _x_chunk(x_ptr, tn % KT, K, BK, layout)  # in flight during this tile
        w = w.to(gl.float32)
        acc0 += gl.sum(w * x0[None, :], axis=1)
        acc1 += gl.sum(w * x1[None, :], axis=1)
        if ((t % KT) == KT - 1) | (t == t1 - 1):  # the n-block ends here: add it out
            cols = (t // KT) * BN + offs_n
            gl.atomic_add(out_ptr + cols, acc0, sem="relaxed", scope="gpu")
            gl.atomic_add(out_ptr + OUT_W + cols, acc1, sem="relaxed", scope="gpu")
            acc0 = gl.zeros([BN], gl.float32, acc_layout)
            acc1 = gl.zeros([BN], gl.float32, acc_layout)
    return it


@gluon.jit
def _consumer(ring, ready, empty, counters, err_ptr, x1024_ptr, x8192_ptr, out_ptr, positions,
              layers, target, budget, MODE: gl.constexpr, WORK: gl.constexpr, BN: gl.constexpr,
              BK: gl.constexpr, S: gl.constexpr, OUT_W: gl.constexpr, COL0: gl.constexpr,
              COL2: gl.constexpr, COL3: gl.constexpr, COL4: gl.constexpr,
              layout: gl.constexpr):
    pid = gl.program_id(0)
    P = gl.num_programs(0)
    it = 0
    g = 0
    for pos in range(positions):
        for layer in range(layers):
            for ph in gl.static_range(5):
                if MODE != 0:
                    if g > 0:  # the previous phase's outputs are this phase's inputs
                        budget = _wait_count(counters + g - 1, target, budget)
                if WORK:
                    if ph == 0:
                        it = _consume_phase(ring, ready, empty, it, x1024_ptr, out_ptr + COL0,
                                            pid, P, Q_OUT_C, HIDDEN_C, OUT_W, BN, BK, S, layout)
                    elif ph == 2:
                        it = _consume_phase(ring, ready, empty, it, x1024_ptr, out_ptr + COL2,
                                            pid, P, HIDDEN_C, HIDDEN_C, OUT_W, BN, BK, S, layout)
                    elif ph == 3:
                        it = _consume_phase(ring, ready, empty, it, x1024_ptr, out_ptr + COL3,
                                            pid, P, 2 * FFN_C, HIDDEN_C, OUT_W, BN, BK, S,
                                            layout)
                    elif ph == 4:
                        it = _consume_phase(ring, ready, empty, it, x8192_ptr, out_ptr + COL4,
                                            pid, P, HIDDEN_C, FFN_C, OUT_W, BN, BK, S, layout)
                if MODE != 0:
                    _partition_barrier()  # every warp's output atomics are issued first
                    gl.atomic_add(counters + g, 1, sem="release", scope="gpu")
                g += 1
    if budget <= 0:
        gl.store(err_ptr, 1)


@gluon.jit
def _stream_kernel(desc, counters, err_ptr, x1024_ptr, x8192_ptr, out_ptr, positions, layers,
                   target, budget, MODE: gl.constexpr, WORK: gl.constexpr, BN: gl.constexpr,
                   BK: gl.constexpr, S: gl.constexpr, LAYER_TILES: gl.constexpr,
                   OFF0: gl.constexpr, OFF2: gl.constexpr, OFF3: gl.constexpr,
                   OFF4: gl.constexpr, OUT_W: gl.constexpr, COL0: gl.constexpr,
                   COL2: gl.constexpr, COL3: gl.constexpr, COL4: gl.constexpr,
                   TK: gl.constexpr, num_warps: gl.constexpr):
    # consumers: 8 contiguous bf16 (16 B) a thread, TK lanes along K, the warps along N
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TK, TK], [num_warps, 1], [1, 0])
    ring = gl.allocate_shared_memory(gl.bfloat16, [S, BN, BK], desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(S):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    gl.warp_specialize([
        (_consumer, (ring, ready, empty, counters, err_ptr, x1024_ptr, x8192_ptr, out_ptr,
                     positions, layers, target, budget, MODE, WORK, BN, BK, S, OUT_W, COL0,
                     COL2, COL3, COL4, layout)),
        (_loader, (desc, ring, ready, empty, counters, err_ptr, positions, layers, target,
                   budget, MODE, WORK, BN, BK, S, LAYER_TILES, OFF0, OFF2, OFF3, OFF4)),
    ], [1], [40])


# triton 3.6 names the partition-wide barrier thread_barrier; 3.7 renamed it barrier
_partition_barrier = getattr(gl, "thread_barrier", None) or gl.barrier

# constexpr globals the device code reads (gluon.jit resolves module-level constexprs)
Q_OUT_C = gl.constexpr(Q_OUT)
HIDDEN_C = gl.constexpr(HIDDEN)
FFN_C = gl.constexpr(FFN)


# ----------------------------------------------------------------------------- host side


class Frame:
    """The packed weights, activations, outputs and counters of one experiment."""

    def __init__(self, stream: Stream, layers: int, positions: int, device: str,
                 seed: int = 0, init: bool = True, rows: int = ROWS) -> None:
        self.s, self.layers, self.positions, self.rows = stream, layers, positions, rows
        for name, n, k in PHASES:
            if n and (n % stream.bn or k % stream.bk):
                raise ValueError(f"{name} ({n}x{k}) is not a whole number of {stream.bn}x"
                                 f"{stream.bk} tiles")
        self.check_tiles()
        gen = torch.Generator(device=device).manual_seed(seed)
        w_rows = layers * stream.layer_tiles * stream.bn
        self.w = torch.empty(w_rows, stream.bk, dtype=torch.bfloat16, device=device)
        if init:
            for layer in range(layers):
                for (name, n, k), off in zip(PHASES, stream.offsets):
                    if n:
                        view = self.tile_rows(layer, off, n, k)
                        view.normal_(0, k ** -0.5, generator=gen)
        self.x1024 = torch.randn(rows, HIDDEN, generator=gen, device=device).to(torch.bfloat16)
        self.x8192 = torch.randn(rows, FFN, generator=gen, device=device).to(torch.bfloat16)
        self.out = torch.zeros(rows, sum(n for _, n, _ in PHASES), dtype=torch.float32,
                               device=device)
        self.counters = torch.zeros(positions * layers * len(PHASES), dtype=torch.int32,
                                    device=device)
        self.err = torch.zeros(1, dtype=torch.int32, device=device)
        self.epoch = 0
        self._expected: dict[tuple[int, int], torch.Tensor] = {}
        self.desc = TensorDescriptor(self.w, list(self.w.shape), list(self.w.stride()),
                                     [stream.bn, stream.bk], self.weight_layout())

    def check_tiles(self) -> None:
        """Raises where the consumers cannot take the tile shape (here: the FMA consumer)."""
        stream = self.s
        if self.rows != ROWS:
            raise ValueError(f"the FMA consumer takes exactly {ROWS} rows, not {self.rows}")
        rows_per_pass = 32 // min(stream.bk // 8, 8) * stream.warps  # the consumers' layout
        if stream.bn % rows_per_pass or stream.bn & (stream.bn - 1) or stream.bk not in (
                64, 128, 256):
            raise ValueError(f"{stream}: BN must be a power of 2 and a multiple of "
                             f"{rows_per_pass}, BK one of 64, 128, 256")

    def weight_layout(self) -> gl.NVMMASharedLayout:
        """The ring's shared layout, which the weight descriptor's TMA box writes (unswizzled:
        the FMA consumer reads rows of 16 B vectors)."""
        return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)

    def tile_rows(self, layer: int, off: int, n: int, k: int) -> torch.Tensor:
        s = self.s
        start = (layer * s.layer_tiles + off) * s.bn
        return self.w[start:start + s.tiles(n, k) * s.bn]

    def matrix(self, layer: int, phase: int) -> torch.Tensor:
        """Phase ``phase``'s weight of ``layer`` as an [N, K] matrix (unpacked tiles)."""
        _, n, k = PHASES[phase]
        s = self.s
        tiles = self.tile_rows(layer, s.offsets[phase], n, k)
        return (tiles.view(n // s.bn, k // s.bk, s.bn, s.bk).permute(0, 2, 1, 3)
                .reshape(n, k))

    def extra(self, programs: int) -> dict:
        """What a consumer adds to each timed row (here: nothing)."""
        return {}

    @property
    def nbytes(self) -> int:
        return self.positions * self.w.numel() * self.w.element_size()

    def launch(self, mode: str, programs: int, maxnreg: int, spin_budget: int,
               positions: int | None = None, layers: int | None = None,
               cooperative: bool = True):
        positions = self.positions if positions is None else positions
        layers = self.layers if layers is None else layers
        s = self.s
        offs, cols = s.offsets, s.out_cols
        self.epoch += 1  # counters only grow: a launch waits for epoch * programs arrivals
        kwargs = {"launch_cooperative_grid": True} if cooperative else {}
        return _stream_kernel[(programs,)](
            self.desc, self.counters, self.err, self.x1024, self.x8192, self.out, positions,
            layers, self.epoch * programs, spin_budget,
            MODE=MODES[mode], WORK=mode != "barriers", BN=s.bn, BK=s.bk, S=s.stages,
            LAYER_TILES=s.layer_tiles, OFF0=offs[0], OFF2=offs[2], OFF3=offs[3],
            OFF4=offs[4], OUT_W=self.out.shape[1], COL0=cols[0], COL2=cols[2], COL3=cols[3],
            COL4=cols[4], TK=min(s.bk // 8, 8), num_warps=s.warps, maxnreg=maxnreg,
            **kwargs)

    def expected(self, positions: int, layers: int) -> torch.Tensor:
        """The outputs a launch over ``positions`` x ``layers`` adds up, by torch (fp32)."""
        if (positions, layers) in self._expected:
            return self._expected[positions, layers]
        ref = torch.zeros_like(self.out)
        cols = self.s.out_cols
        for layer in range(layers):
            for p, (_, n, k) in enumerate(PHASES):
                if n:
                    x = self.x1024 if k == HIDDEN else self.x8192
                    ref[:, cols[p]:cols[p] + n] += x.float() @ self.matrix(layer, p).float().T
        self._expected[positions, layers] = positions * ref
        return self._expected[positions, layers]


SMS = [132]  # the device's SM count (set in main)


@dataclass(frozen=True)
class Launch:
    """What every launch of a run shares."""

    programs: int
    maxnreg: int
    spin_budget: int
    iters: int


def check_one_phase(frame: Frame, run: Launch) -> dict:
    """One layer, one position, no dependencies: each GEMV against torch (bf16 tolerance)."""
    frame.out.zero_()
    frame.launch("stream", run.programs, run.maxnreg, run.spin_budget, positions=1, layers=1,
                 cooperative=False)
    torch.cuda.synchronize()
    ref = frame.expected(1, 1)
    cols = frame.s.out_cols
    errs = {}
    for p, (name, n, _) in enumerate(PHASES):
        if n:
            got, want = frame.out[:, cols[p]:cols[p] + n], ref[:, cols[p]:cols[p] + n]
            errs[name] = round((got - want).abs().max().item(), 6)
    print(f"  one-layer GEMV check, max abs error (outputs ~N(0,1)): {errs}", flush=True)
    worst = max(errs.values())
    assert worst < 2e-2, f"GEMV differs from torch by {worst} (bf16 tolerance 2e-2)"
    return errs


def run_mode(frame: Frame, mode: str, run: Launch, cooperative: bool) -> dict:
    """Check one launch of ``mode`` over the whole frame, then time ``run.iters`` launches."""
    frame.counters.zero_()
    frame.epoch = 0
    frame.err.zero_()
    frame.out.zero_()

    def launch():
        return frame.launch(mode, run.programs, run.maxnreg, run.spin_budget,
                            cooperative=cooperative)

    kernel = launch()
    torch.cuda.synchronize()
    row: dict = {"config": str(frame.s), "rows": frame.rows, "mode": mode,
                 "cooperative": cooperative, "hang": bool(frame.err.item())}
    if mode != "barriers":  # every tile of the frame read once per position, summed right
        ref = frame.expected(frame.positions, frame.layers)
        err = (frame.out - ref).abs().max().item()
        row["max_abs_err"] = round(err, 6)
        row["correct"] = err <= 2e-4 * ref.abs().max().item() + 1e-2
    row.update(frame.extra(run.programs))
    row["n_regs"], row["n_spills"] = kernel.n_regs, kernel.n_spills
    row["shared_bytes"] = kernel.metadata.shared
    threads = 32 * kernel.metadata.num_warps  # the loader's warpgroup included
    row["blocks_per_sm"] = min((228 * 1024) // (kernel.metadata.shared + 1024),
                               65536 // max(kernel.n_regs * threads, 1))
    row["co_resident"] = run.programs <= row["blocks_per_sm"] * SMS[0]
    if row["hang"]:  # a spin ran out of budget: timing it would only add hangs
        row["ms"] = None
        return row
    times = []
    for i in range(3 + run.iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1_000_000)  # the GPU waits here while the host enqueues the launch
        start.record()
        launch()
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end))
    ms = sorted(times)[len(times) // 2]
    row["hang"] = row["hang"] or bool(frame.err.item())
    row["ms"] = round(ms, 3)
    row["min_ms"] = round(min(times), 3)
    if mode != "barriers":
        tbs = frame.nbytes / ms / 1e9
        row["tb_per_s"] = round(tbs, 3)
        row["of_peak"] = round(tbs / HBM_TBS, 3)
        row["x_floor"] = round(ms / FLOOR_MS, 2)
        row["tflop_per_s"] = round(frame.rows * tbs, 2)  # 2 FLOP a weight and row, 2 B a weight
    return row


SETMAXNREG = r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)"


def cuobjdump(kernel, flag: str) -> str:
    """``cuobjdump FLAG`` of a build's cubin (Triton's own cuobjdump: no GPU needed)."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        return subprocess.run([str(tool), flag, cubin.name], capture_output=True, text=True,
                              check=True).stdout


def describe_build(kernel, label: str, mode: str) -> str:
    """One build's line: registers (and the setmaxnreg values of its partitions), spills (the
    stack frame: a warp-specialized build spills there, not to LOCAL), shared memory, warps,
    blocks an SM holds, TMA copy sites, launch problems."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.sm90_build import resources

    r = resources(kernel, mode)
    stack = re.search(r"STACK:(\d+)", cuobjdump(kernel, "--dump-resource-usage"))
    ptx = kernel.asm["ptx"]
    regs = sorted({int(v) for v in re.findall(SETMAXNREG, ptx)})
    return (f"{label} {mode:8s} sm_{kernel.metadata.target.arch}a: regs {r.registers} "
            f"(setmaxnreg {regs}), spills {r.local_bytes} B, stack "
            f"{stack.group(1) if stack else '?'} B, shared {r.shared_bytes} B, "
            f"{r.num_warps} warps, {r.blocks_per_sm} block(s)/SM, "
            f"{ptx.count('cp.async.bulk.tensor')} TMA copy sites, "
            f"problems: {r.problems() or 'none'}")


def compile_only(streams: list[Stream], modes: list[str], run: Launch) -> None:
    """Build every mode's kernel for sm_90a on this machine (no GPU) and print resources."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.sm90_build import build_only

    print(f"triton {triton.__version__}; configs BNxBKxStages w consumer warps (+1 loader "
          f"warp); maxnreg {run.maxnreg}")
    for stream in streams:
        # nothing is read: the build needs shapes and strides only
        frame = Frame(stream, layers=1, positions=1, device="cpu", init=False)
        for mode in modes:
            with build_only(90) as built:
                frame.launch(mode, run.programs, run.maxnreg, run.spin_budget)
            kernel = built[-1]
            print(describe_build(kernel, str(stream), mode), flush=True)
            if mode == modes[0]:  # the box the host encodes must be the tile the ring expects
                print(f"  TMA descriptor: {kernel.metadata.tensordesc_meta}", flush=True)


def add_args(ap: argparse.ArgumentParser, modes: str, configs: str, out: str) -> None:
    """The options this experiment and its siblings share."""
    ap.add_argument("--modes", default=modes)
    ap.add_argument("--configs", default=configs,
                    help="BNxBKxS[wW] list: tile rows (output features) x tile columns (K, "
                         "<= 256) x ring slots [w consumer warps, default 8; the loaders add "
                         "a warpgroup]; each config runs every mode")
    ap.add_argument("--maxnreg", type=int, default=128,
                    help="registers a thread (a warp-specialized kernel needs it set)")
    ap.add_argument("--programs", type=int, default=0, help="0: one per SM")
    ap.add_argument("--positions", type=int, default=16)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--spin-budget", type=int, default=1 << 20,
                    help="spin iterations a program may spend per launch before it reports a "
                         "hang and stops waiting")
    ap.add_argument("--deadline-s", type=float, default=110,
                    help="start no new config or mode after this many seconds (a mode takes "
                         "seconds: the whole run stays inside `timeout 150`)")
    ap.add_argument("--no-cooperative", action="store_true")
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--out", default=out)


def device_run(args: argparse.Namespace, script: str) -> tuple[Launch, dict]:
    """On the GPU: the launch settings and the result document (provenance first)."""
    from breezert_bench.provenance import provenance

    torch.backends.cuda.matmul.allow_tf32 = False  # the references are full fp32 GEMVs
    props = torch.cuda.get_device_properties(0)
    SMS[0] = props.multi_processor_count
    run = Launch(args.programs or props.multi_processor_count, args.maxnreg, args.spin_budget,
                 args.iters)
    print(f"triton {triton.__version__}, {props.name}, {run.programs} programs", flush=True)
    meta = provenance(script=script, triton=triton.__version__,
                      programs=run.programs, maxnreg=run.maxnreg,
                      positions=args.positions, layers=args.layers, floor_ms=FLOOR_MS)
    return run, {"meta": meta, "gemv_check": {}, "rows": [], "failures": []}


def measure(frame: Frame, label: str, modes: list[str], run: Launch, args: argparse.Namespace,
            result: dict, t_start: float) -> None:
    """One frame: the one-layer GEMV check, then every mode (cooperative first, plain if the
    cooperative launch fails); ``result`` is written to ``args.out`` after every row."""
    def save() -> None:  # after every row: a later failure or kill keeps what ran
        Path(args.out).write_text(json.dumps(result, indent=1))

    try:
        result["gemv_check"][label] = check_one_phase(frame, run)
    except Exception as exc:  # the timing still says something about the stream
        print(f"  GEMV check FAILED: {exc!r}"[:1500], flush=True)
        result["gemv_check"][label] = {"failed": repr(exc)[:500]}
    for mode in modes:
        if time.monotonic() - t_start > args.deadline_s:
            print(f"deadline: {label} {mode} not run", flush=True)
            break
        for cooperative in ((False,) if args.no_cooperative else (True, False)):
            try:
                row = run_mode(frame, mode, run, cooperative)
            except Exception as exc:
                print(f"  {mode} (cooperative={cooperative}) FAILED: {exc!r}"[:1500],
                      flush=True)
                traceback.print_exc(limit=2)
                result["failures"].append(f"{label} {mode} coop={cooperative}: {exc!r}"[:500])
                save()
                continue
            result["rows"].append(row)
            print("  " + json.dumps(row), flush=True)
            save()
            break
    save()


def print_table(result: dict) -> None:
    print("\nconfig BNxBKxSwW | rows | mode | cooperative | ms/frame | TB/s | TFLOP/s | x 2.1 ms "
          "floor | correct | hang | regs | spills | smem B")
    for r in result["rows"]:
        print(f"{r['config']:12s} | {r['rows']} | {r['mode']:8s} | {r['cooperative']} | "
              f"{r['ms']} | {r.get('tb_per_s', '-')} | {r.get('tflop_per_s', '-')} "
              f"| {r.get('x_floor', '-')} | {r.get('correct', '-')} | {r['hang']} | "
              f"{r['n_regs']} | {r['n_spills']} | {r['shared_bytes']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(ap, "stream,phased,blocked,barriers", "64x128x8", "depth-stream-gluon.json")
    args = ap.parse_args()
    t_start = time.monotonic()
    streams = [Stream.parse(c) for c in args.configs.split(",")]
    modes = args.modes.split(",")
    if args.compile_only:
        compile_only(streams, modes, Launch(args.programs or 132, args.maxnreg,
                                            args.spin_budget, args.iters))
        return
    run, result = device_run(args, "bench/depth_stream_gluon.py")
    for stream in streams:
        if time.monotonic() - t_start > args.deadline_s:
            print(f"deadline: {stream} not run", flush=True)
            break
        try:
            frame = Frame(stream, args.layers, args.positions, "cuda")
        except Exception as exc:
            print(f"{stream}: FAILED to set up: {exc!r}"[:1500], flush=True)
            result["failures"].append(f"{stream}: {exc!r}"[:500])
            continue
        shares = {name: -(-stream.tiles(n, k) // run.programs) * stream.bn * stream.bk * 2
                  for name, n, k in PHASES if n}
        print(f"{stream}: ring {stream.stages * stream.bn * stream.bk * 2 // 1024} KB; "
              f"{frame.nbytes / 1e9:.2f} GB a frame ({args.layers} layers read "
              f"{args.positions}x), floor {frame.nbytes / HBM_TBS / 1e9:.2f} ms at {HBM_TBS} "
              f"TB/s; largest share a phase (bytes): {shares}", flush=True)
        measure(frame, str(stream), modes, run, args, result, t_start)
        del frame
        torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps(result, indent=1))
    print_table(result)


if __name__ == "__main__":
    main()
