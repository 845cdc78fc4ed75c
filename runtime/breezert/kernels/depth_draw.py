"""One depth code per request from a codebook head's logits in one Triton launch.

Owns: ``depth_draw_triton``: for each request, classifier-free guidance of its cond and uncond
rows, the reserved ids masked, temperature, top-k, top-p and the Gumbel-max draw from the
counter-based noise of ``layers/sampling.py`` (T = 0: the argmax), one program a request. It
stands for ``stages/depth.py``'s ``_guide`` -> ``suppress_reserved`` -> ``RowSampling.draw``
(about ten launches a depth position, a compiled ``topk`` among them). Top-k and top-p find
their thresholds by a bitwise search over the logits' order-preserving 32-bit keys (32 masked
counts or sums each) instead of a sort: the k-th largest value is exact, ties with it are kept
(as ``RowSampling`` keeps them), and an id is kept by top-p when the probability mass of the ids
above it is under p, summed in a tree rather than ``cumsum``'s order (a boundary id may differ
in the last bit of that sum). Must not: read the first code's logits (penalty and EOS stay
with ``depth_frames``) or allocate beyond its output.
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


@triton.jit(do_not_specialize=["B"])
def _depth_draw_kernel(logits_ptr, has_cfg_ptr, scale_ptr, temp_ptr, top_k_ptr, top_p_ptr,
                       seeds_ptr, counters_ptr, out_ptr, B, stride, s_cfg, s_scale, s_temp,
                       s_k, s_p, s_seed, s_counter,
                       V: tl.constexpr, BLOCK: tl.constexpr, CFG: tl.constexpr,
                       RESERVED: tl.constexpr, PRECISE: tl.constexpr):
    """Program b: request b's code from logits row b (and its uncond row B + b with ``CFG``)."""
    b = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    valid = cols < V
    x = tl.load(logits_ptr + b * stride + cols, mask=valid, other=0.0)
    if CFG:  # uncond + s * (cond - uncond), each step rounded as torch's three kernels round it
        if tl.load(has_cfg_ptr + b * s_cfg) != 0:
            u = tl.load(logits_ptr + (B + b) * stride + cols, mask=valid, other=0.0)
            x = u + tl.load(scale_ptr + b * s_scale) * (x - u)
    x = tl.where((cols >= RESERVED) | ~valid, float("-inf"), x)
    code = tl.argmax(x, axis=0, tie_break_left=True).to(tl.int64)  # T = 0: the argmax
    t = tl.load(temp_ptr + b * s_temp)
    if t > 0:
        y = tl.math.div_rn(x, tl.full([BLOCK], 1.0, tl.float32) * t)
        key = tl.where(valid, _key(y), _u32(0))
        keep = valid
        k = tl.load(top_k_ptr + b * s_k)
        if k > 0:  # the k-th largest key: the largest u with at least k keys >= u
            want = tl.minimum(k, V).to(tl.int32)
            kth = _u32(0)
            for i in tl.static_range(32):
                trial = kth | (_u32(1) << (31 - i))
                count = tl.sum((valid & (key >= trial)).to(tl.int32), axis=0)
                kth = tl.where(count >= want, trial, kth)
            keep = keep & (key >= kth)
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
    _depth_draw_kernel[(num,)](
        logits, *vectors, out, num, logits.stride(0), *(v.stride(0) for v in vectors),
        V=vocab, BLOCK=triton.next_power_of_2(vocab), CFG=rows == 2 * num,
        RESERVED=RESERVED_START, PRECISE=logits.is_cuda, num_warps=4,
        enable_fp_fusion=False)  # no FMA: the guidance rounds as torch's kernels do
    return out
