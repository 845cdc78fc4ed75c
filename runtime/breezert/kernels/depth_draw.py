"""One depth code per request from a codebook head's logits in one Triton launch.

Owns: ``depth_draw_triton``: for each request, classifier-free guidance of its cond and uncond
rows, the reserved ids left out, temperature, top-k, top-p and the Gumbel-max draw from the
counter-based noise of ``layers/sampling.py`` (T = 0: the argmax), one program a request. It
stands for ``stages/depth.py``'s ``_guide`` -> ``suppress_reserved`` -> ``RowSampling.draw``
(about ten launches a depth position, a compiled ``topk`` among them). Only the codes below the
reserved ids are read (2048 of the heads' 2051 columns: the reserved ones could never be drawn).
Top-k and top-p find their thresholds over the logits' order-preserving 32-bit keys instead of a
sort. Top-k is a radix select, 5 bits a pass (7 histograms of 32 bins: one block-wide reduction
each, where a bitwise search took 32): the k-th largest value is exact and ties with it are kept
(as ``RowSampling`` keeps them). Top-p is a bitwise search over masses (32 masked sums): an id is
kept when the probability mass of the ids above it is under p, summed in a tree rather than
``cumsum``'s order (a boundary id may differ in the last bit of that sum). Must not: read the
first code's logits (penalty and EOS stay with ``depth_frames``) or allocate beyond its output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra import libdevice

from breezert.layers.sampling import _COLUMN_STEP, _MIX1, _MIX2, RESERVED_START

MIX1, MIX2, COLUMN_STEP = tl.constexpr(_MIX1), tl.constexpr(_MIX2), tl.constexpr(_COLUMN_STEP)


@triton.jit
def _u32(value):
    return tl.full([], value, tl.uint32)


@triton.jit
def _hash32(x):
    """``layers.sampling._hash32`` (lowbias32) on uint32 values, whose products wrap."""
    x = x ^ (x >> 16)
    x = x * _u32(MIX1)
    x = x ^ (x >> 15)
    x = x * _u32(MIX2)
    return x ^ (x >> 16)


@triton.jit
def _key(y):
    """fp32 -> uint32 in the same order (negatives flipped, positives above them)."""
    bits = y.to(tl.uint32, bitcast=True)
    return tl.where((bits >> 31) != 0, bits ^ _u32(0xFFFFFFFF), bits | _u32(0x80000000))


@triton.jit
def _log(x, PRECISE: tl.constexpr):
    """CUDA's correctly rounded ``logf`` (libdevice, as torch's ``log``) on the GPU; Triton's
    interpreter (numpy, also exact) has no libdevice."""
    if PRECISE:
        return libdevice.log(x)
    return tl.log(x)


@triton.jit
def _exp(x, PRECISE: tl.constexpr):
    if PRECISE:
        return libdevice.exp(x)
    return tl.exp(x)


@triton.jit
def _kth_largest(key, valid, want):
    """The ``want``-th largest of the valid keys (1 <= want <= their count), by radix select:
    each pass counts, among the keys that share the bits found so far, the values of the next 5
    bits (the last pass 2 bits), takes the largest digit with at least ``want`` keys at or above
    it, and leaves in ``want`` the rank within that digit."""
    kth, want = _radix_pass(key, valid, _u32(0), want, 27, 32)
    for i in tl.static_range(1, 6):
        kth, want = _radix_pass(key, valid, kth, want, 27 - 5 * i, 32 - 5 * i)
    kth, want = _radix_pass(key, valid, kth, want, 0, 2)
    return kth


@triton.jit
def _radix_pass(key, valid, kth, want, SHIFT: tl.constexpr, FOUND: tl.constexpr):
    """One digit of ``_kth_largest``: the bits from SHIFT up to FOUND (the bits above FOUND are
    those of ``kth`` already)."""
    bins = tl.arange(0, 32)
    same = valid
    if FOUND < 32:
        same = valid & (((key ^ kth) >> FOUND) == 0)
    digit = ((key >> SHIFT) & _u32(31)).to(tl.int32)
    count = tl.histogram(digit, 32, mask=same)
    at_or_above = tl.sum(tl.where(bins[None, :] >= bins[:, None], count[None, :], 0), axis=1)
    pick = tl.max(tl.where(at_or_above >= want, bins, 0), axis=0)
    want -= tl.sum(tl.where(bins > pick, count, 0), axis=0)
    return kth | (pick.to(tl.uint32) << SHIFT), want


@triton.jit(do_not_specialize=["B"])
def _depth_draw_kernel(logits_ptr, has_cfg_ptr, scale_ptr, temp_ptr, top_k_ptr, top_p_ptr,
                       seeds_ptr, counters_ptr, out_ptr, B, stride, s_cfg, s_scale, s_temp,
                       s_k, s_p, s_seed, s_counter,
                       V: tl.constexpr, BLOCK: tl.constexpr, CFG: tl.constexpr,
                       PRECISE: tl.constexpr):
    """Program b: request b's code from logits row b (and its uncond row B + b with ``CFG``)."""
    b = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    valid = cols < V  # V: the columns read, the codes below the reserved ids
    x = tl.load(logits_ptr + b * stride + cols, mask=valid, other=0.0)
    if CFG:  # uncond + s * (cond - uncond), each step rounded as torch's three kernels round it
        if tl.load(has_cfg_ptr + b * s_cfg) != 0:
            u = tl.load(logits_ptr + (B + b) * stride + cols, mask=valid, other=0.0)
            x = u + tl.load(scale_ptr + b * s_scale) * (x - u)
    x = tl.where(valid, x, float("-inf"))
    code = tl.argmax(x, axis=0, tie_break_left=True).to(tl.int64)  # T = 0: the argmax
    t = tl.load(temp_ptr + b * s_temp)
    if t > 0:
        y = tl.math.div_rn(x, tl.full([BLOCK], 1.0, tl.float32) * t)
        key = tl.where(valid, _key(y), _u32(0))
        keep = valid
        k = tl.load(top_k_ptr + b * s_k)
        if k > 0:
            keep = keep & (key >= _kth_largest(key, valid, tl.minimum(k, V).to(tl.int32)))
        p = tl.load(top_p_ptr + b * s_p)
        if p < 1:  # keep an id while the mass of the kept ids above it is under p
            e = tl.where(keep, _exp(y - tl.max(y, axis=0), PRECISE), 0.0)
            prob = e / tl.sum(e, axis=0)
            low = _u32(0)  # the largest u whose mass above it is >= p
            for i in tl.static_range(32):
                trial = low | (_u32(1) << (31 - i))
                mass = tl.sum(tl.where(key > trial, prob, 0.0), axis=0)
                low = tl.where(mass >= p, trial, low)
            above_all = tl.sum(tl.where(key > _u32(0), prob, 0.0), axis=0)
            keep = tl.where(above_all >= p, keep & (key > low), keep)
        # the Gumbel noise of (seed, counter, column): layers.sampling.counter_uniform
        seed = tl.load(seeds_ptr + b * s_seed)
        lo, hi = (seed & 0xFFFFFFFF).to(tl.uint32), ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
        row = _hash32(_hash32(lo) ^ hi)
        row = _hash32(row ^ (tl.load(counters_ptr + b * s_counter) & 0xFFFFFFFF).to(tl.uint32))
        bits = _hash32(_hash32(row + cols.to(tl.uint32) * _u32(COLUMN_STEP)) ^ row)
        uniform = ((bits >> 8).to(tl.float32) + 0.5) * (1.0 / (1 << 24))
        gumbel = -_log(-_log(uniform, PRECISE), PRECISE)
        drawn = tl.argmax(tl.where(keep, y, float("-inf")) + gumbel, axis=0, tie_break_left=True)
        code = drawn.to(tl.int64)
    tl.store(out_ptr + b, code)


def depth_draw_triton(logits: Tensor, num: int, has_cfg: Tensor, cfg_scale: Tensor,
                      temperature: Tensor, top_k: Tensor, top_p: Tensor, seeds: Tensor,
                      counters: Tensor) -> Tensor:
    """Codes ``[num]`` (int64) from a codebook head's fp32 ``logits [R, V]`` (R = num: cond rows
    only, or 2 * num: cond rows then uncond rows): what ``_guide`` -> ``suppress_reserved`` ->
    ``RowSampling.draw`` give with per-request ``temperature``, ``top_k`` (0: off), ``top_p``
    (1: off), ``seeds`` and draw ``counters``, each ``[>= num]`` with any stride (columns of
    the frame's settings as they are). Sync-free, graph-safe."""
    rows, vocab = logits.shape
    if logits.dtype != torch.float32 or logits.stride(1) != 1:
        raise ValueError(f"logits must be fp32 with unit column stride, got {logits.dtype} "
                         f"strides {logits.stride()}")
    if rows not in (num, 2 * num):
        raise ValueError(f"logits have {rows} rows for {num} requests (want {num} or {2 * num})")
    vectors = (has_cfg, cfg_scale, temperature, top_k, top_p, seeds, counters)
    if any(v.dim() != 1 or v.shape[0] < num for v in vectors):
        raise ValueError(f"every per-request tensor must be 1-D with >= {num} entries")
    out = torch.empty(num, dtype=torch.long, device=logits.device)
    codes = min(vocab, RESERVED_START)
    _depth_draw_kernel[(num,)](
        logits, *vectors, out, num, logits.stride(0), *(v.stride(0) for v in vectors),
        V=codes, BLOCK=triton.next_power_of_2(codes), CFG=rows == 2 * num,
        PRECISE=logits.is_cuda, num_warps=4,
        enable_fp_fusion=False)  # no FMA: the guidance rounds as torch's kernels do
    return out
