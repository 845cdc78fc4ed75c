"""One draw per row in one Triton launch: temperature, top-k, top-p, counter-based Gumbel-max.

Owns: ``sample_row``, one row's draw inside a Triton program, and ``fused_sample``, its
launcher over a batch: a drop-in for ``layers.sampling.sample`` with a bounded top-k
(``max_k``: every row's k in 1..max_k), through which the tests hold the draw to ``sample``'s
(no config switch serves it: the depth frame took the same time with it).
``sample`` under Inductor is a chain of launches per draw (top-k, softmax and its cumulative
sum, the scatter back to the vocabulary, the counter hash and Gumbel noise, the masked argmax);
the depth frame makes 16 draws, so at one row that chain, not arithmetic, is most of the
sampler's time. Here one program holds a row in registers and does all of it.

Numerics: the same order and the same formulas as ``sample`` (fp32), the same counter hash
bit for bit (so the same noise columns), ``log`` from libdevice as CUDA's ``logf``; the top-p
cut is taken on the sorted top ``max_k`` values as ``filter_top_k_top_p`` does. Rows differ
from ``sample`` only where two candidates tie exactly (the order among tied values is not
defined there either) or where the softmax's rounding moves the top-p cut. Each row is
independent of the others, so a row's code does not depend on its batch.

Must not: know about requests or models, or sync with the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra import libdevice


@triton.jit
def _mul32(x, c: tl.constexpr):
    """``x * c mod 2**32`` on uint32 (wraps)."""
    return x * tl.cast(c, tl.uint32)


@triton.jit
def _hash32(x):
    """lowbias32 on uint32, as ``layers.sampling._hash32``."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


@triton.jit
def sample_row(x, t, k, p, seed, counter, cols, inside, MAX_K: tl.constexpr,
               EXACT_LOG: tl.constexpr):
    """One draw from a row ``x`` (fp32 ``[BLOCK]`` logits, -inf outside the vocabulary):
    temperature ``t``, top-k ``k``, top-p ``p``, Gumbel noise of (``seed``, ``counter``,
    column); ``t <= 0``: the argmax. ``_sample_kernel``'s body for one row."""
    y = x / tl.where(t > 0, t, 1.0)

    # top-k: the k-th largest of the row (ties with it kept), from the sorted top MAX_K
    top = tl.topk(y, MAX_K)  # [MAX_K] descending
    rank = tl.arange(0, MAX_K)
    k = tl.minimum(tl.maximum(k, 1), MAX_K)
    kth = tl.max(tl.where(rank == k - 1, top, float("-inf")), axis=0)
    # top-p on the sorted survivors: drop from the first one whose exclusive mass reaches p
    in_k = top >= kth
    e = tl.where(in_k, tl.exp(top - tl.max(top, axis=0)), 0.0)
    probs = e / tl.sum(e, axis=0)
    before = tl.cumsum(probs, axis=0) - probs
    dropped = in_k & (before >= tl.where(p < 1.0, p, 2.0))  # p >= 1 drops nothing
    cut = tl.max(tl.where(dropped, top, float("-inf")), axis=0)  # largest dropped value
    none_dropped = tl.sum(dropped.to(tl.int32), axis=0) == 0
    keep = (y >= kth) & ((y > cut) | none_dropped) & inside

    # Gumbel noise of (seed, counter, column), as layers.sampling.counter_uniform
    lo = seed.to(tl.uint32)  # int64 -> uint32 keeps the low 32 bits
    hi = (seed >> 32).to(tl.uint32)
    h = _hash32(_hash32(lo) ^ hi)
    h = _hash32(h ^ counter.to(tl.uint32))
    c = cols.to(tl.uint32)
    bits = _hash32(_hash32(h + _mul32(c, 0x9E3779B1)) ^ h)
    u = ((bits >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
    if EXACT_LOG:  # CUDA: libdevice's logf, the one torch's CUDA log calls
        gumbel = -libdevice.log(-libdevice.log(u))
    else:  # Triton's interpreter runs no libdevice
        gumbel = -tl.log(-tl.log(u))

    drawn = tl.argmax(tl.where(keep, y + gumbel, float("-inf")), axis=0)
    greedy = tl.argmax(x, axis=0)
    return tl.where(t > 0, drawn, greedy)


@triton.jit
def _sample_kernel(logits_ptr, temp_ptr, top_k_ptr, top_p_ptr, seeds_ptr, counters_ptr, out_ptr,
                   V, stride_row, t_stride, k_stride, p_stride,
                   BLOCK: tl.constexpr, MAX_K: tl.constexpr, EXACT_LOG: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < V
    x = tl.load(logits_ptr + row * stride_row + cols, mask=inside, other=float("-inf"))
    code = sample_row(
        x.to(tl.float32), tl.load(temp_ptr + row * t_stride).to(tl.float32),
        tl.load(top_k_ptr + row * k_stride).to(tl.int32),
        tl.load(top_p_ptr + row * p_stride).to(tl.float32),
        tl.load(seeds_ptr + row).to(tl.int64), tl.load(counters_ptr + row).to(tl.int64),
        cols, inside, MAX_K, EXACT_LOG)
    tl.store(out_ptr + row, code.to(tl.int64))


def _column(value: Tensor | float, rows: int, dtype: torch.dtype,
            device: torch.device) -> tuple[Tensor, int]:
    """A per-row parameter as ``(tensor, stride)``: a scalar or one-element tensor is read with
    stride 0 (no expanded copy)."""
    if not isinstance(value, Tensor):
        return torch.full((1,), value, dtype=dtype, device=device), 0
    value = value.to(device=device, dtype=dtype)
    if value.numel() == 1:
        return value.reshape(1), 0
    if value.shape != (rows,):
        raise ValueError(f"a per-row parameter has shape {tuple(value.shape)}, expected ({rows},)")
    return value, value.stride(0)


def fused_sample(
    logits: Tensor,
    temperature: Tensor | float,
    top_k: Tensor | int,
    top_p: Tensor | float,
    seeds: Tensor,
    counters: Tensor,
    max_k: int | None = 64,
    gumbel: Tensor | None = None,
) -> Tensor:
    """``layers.sampling.sample`` for ``logits [R, V]`` with every row's top-k in 1..max_k:
    codes ``[R]`` int64, one launch, no host sync (CUDA, or CPU tensors under
    ``TRITON_INTERPRET=1``). ``gumbel`` is not taken: the noise is made in the kernel from
    ``seeds`` and ``counters``."""
    if max_k is None or not 1 <= max_k <= 1024:
        raise ValueError(f"fused_sample needs a top-k bound in 1..1024, got {max_k}")
    if gumbel is not None:
        raise ValueError("fused_sample makes its own noise from seeds and counters")
    if logits.dim() != 2:
        raise ValueError(f"logits must be [rows, vocab], got {tuple(logits.shape)}")
    rows, vocab = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    dev = logits.device
    temp, t_stride = _column(temperature, rows, torch.float32, dev)
    k, k_stride = _column(top_k, rows, torch.int32, dev)
    p, p_stride = _column(top_p, rows, torch.float32, dev)
    seeds = seeds.to(device=dev, dtype=torch.int64).expand(rows).contiguous()
    counters = torch.as_tensor(counters, device=dev, dtype=torch.int64).expand(rows).contiguous()
    out = torch.empty(rows, dtype=torch.int64, device=dev)
    block = triton.next_power_of_2(vocab)
    max_k_block = triton.next_power_of_2(max_k)
    _sample_kernel[(rows,)](logits, temp, k, p, seeds, counters, out, vocab, logits.stride(0),
                            t_stride, k_stride, p_stride, BLOCK=block, MAX_K=max_k_block,
                            EXACT_LOG=logits.is_cuda,
                            num_warps=4 if block <= 2048 else 8)
    return out
