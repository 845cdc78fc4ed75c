"""The codec transformer's windowed attention, reading and writing each stream's K/V ring in place.

Owns: ``ring_attention`` (one launch per layer: RoPE on the step's queries and keys, the queries
against the ``R`` cached keys of each row's slot plus the step's own new keys, then the new keys
of the row's real frames written into the slot's ring) and its kernel. The codec keeps, per stream and layer, the RoPE'd
keys and values of its last ``R = window - 1`` frames in a ring: the key of frame ``p`` sits at
``p % R`` (``models/codec.py`` states the layout and holds the eager math this kernel matches).
Before it, a CODEC step gathered every row's whole window (4.6 MB a stream in fp32 at full size),
concatenated the new keys, kept the last ``R`` and scattered the windows back: ~5 copies of the
window a step, most of a 256-stream step's state traffic; this kernel reads the window once and
writes only the new frames' entries; RoPE in the kernel spares the step four launches a tensor
and layer. Must not: compute the projections or the RoPE tables, or know slots' positions
beyond what the caller passes (``pos``: frames decoded before the step).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from breezert.kernels.gemm import DOT_F32

MAX_NEW_FRAMES = 64
"""Most frames of one step this kernel takes (the serving codec decodes <= 16 a replay)."""
_RC = 32  # ring entries a block of the online softmax (71 entries: 3 blocks)


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, F32: tl.constexpr):
    if F32:  # the interpreter: 16-bit operands upcast (gemm.DOT_F32)
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _attend(q_lo, q_hi, k_lo, k_hi, v, keep, m, total, acc, scale, PRECISION: tl.constexpr,
            F32: tl.constexpr):
    """One block of keys (halves ``k_lo``/``k_hi`` [N, HP]) and values ``v`` [N, DP] (``keep``
    [BT, N]) into the online softmax of the queries (halves [BT, HP]): running max ``m``, sum
    ``total`` and output ``acc`` (fp32)."""
    s = (_dot(q_lo, tl.trans(k_lo), PRECISION, F32)
         + _dot(q_hi, tl.trans(k_hi), PRECISION, F32)) * scale
    s = tl.where(keep, s, -1.0e30)
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.exp(m - m_new)
    p = tl.where(keep, tl.exp(s - m_new[:, None]), 0.0)
    total = total * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION, F32)
    return m_new, total, acc


@triton.jit
def _rope_halves(x_ptr, rope_at, hs, mask, cos_ptr, sin_ptr, HD: tl.constexpr):
    """``x * cos + roll(x, D / 2) * sin_signed`` (``layers.rope.apply_rope_signed``) of the
    rows at ``x_ptr + rope_at``, as its two halves [BT, HP] in fp32, stored dtype's rounding
    last; ``cos``/``sin`` at the same offsets of their own rows."""
    x_lo = tl.load(x_ptr + hs, mask=mask, other=0.0).to(tl.float32)
    x_hi = tl.load(x_ptr + HD + hs, mask=mask, other=0.0).to(tl.float32)
    c_lo = tl.load(cos_ptr + rope_at, mask=mask, other=0.0).to(tl.float32)
    c_hi = tl.load(cos_ptr + HD + rope_at, mask=mask, other=0.0).to(tl.float32)
    s_lo = tl.load(sin_ptr + rope_at, mask=mask, other=0.0).to(tl.float32)
    s_hi = tl.load(sin_ptr + HD + rope_at, mask=mask, other=0.0).to(tl.float32)
    return x_lo * c_lo + x_hi * s_lo, x_hi * c_hi + x_lo * s_hi


@triton.jit(do_not_specialize=["T", "R", "W"])
def _ring_attention_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, out_ptr, ring_ptr, slot_ptr, pos_ptr, frames_ptr,
    T, R, W, scale,
    sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, sc_b, sc_t,
    sr_s, sr_kv, sr_h, sr_r,
    H: tl.constexpr, REP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, HP: tl.constexpr,
    BT: tl.constexpr, RP: tl.constexpr, RC: tl.constexpr, HAS_FRAMES: tl.constexpr,
    PRECISION: tl.constexpr, F32: tl.constexpr,
):
    """Program (row b, KV head g): RoPE on its new keys and its ``REP`` query heads, their
    attention, then its ring entries' update.

    ``q``/``k`` come straight from the projections (RoPE here, from the step's ``cos`` and
    signed ``sin`` [B, T, D] rows: the rotation done in fp32 and rounded once to the state's
    dtype); ``out`` is ``[B, T, H, D]`` contiguous (o_proj's input as it is). Keys are used as
    two halves of ``D / 2`` (padded to ``HP >= 16``), so the rotation needs no shuffle. The
    ring is read in blocks of ``RC`` entries, then the step's own keys, into an online softmax
    (fp32 max, sum and output; the whole ring at once held 255 registers and spilled in IEEE
    fp32). Dots in the state's dtype (fp32: ``PRECISION``, ``ieee`` or ``tf32``, as the
    codec's matmuls are set; the probabilities cast to the state's dtype for the second dot, as
    a 16-bit flash attention does); the query tile is padded to ``BT >= 16`` rows and the
    values to ``DP >= 16`` columns for ``tl.dot``.
    """
    HD: tl.constexpr = D // 2
    b = tl.program_id(0)
    g = tl.program_id(1)
    slot = tl.load(slot_ptr + b)
    pos = tl.load(pos_ptr + b)
    if HAS_FRAMES:
        n = tl.load(frames_ptr + b)
    else:
        n = T
    ts = tl.arange(0, BT)
    ds = tl.arange(0, DP)
    hs = tl.arange(0, HP)
    t_ok = ts < T
    new_mask = t_ok[:, None] & (ds < D)[None, :]
    half_mask = t_ok[:, None] & (hs < HD)[None, :]
    rope_at = b * sc_b + ts[:, None] * sc_t + hs[None, :]

    ring = ring_ptr + slot * sr_s + g * sr_h
    dtype = ring_ptr.dtype.element_ty
    k_lo, k_hi = _rope_halves(k_ptr + b * sk_b + g * sk_h + ts[:, None] * sk_t, rope_at,
                              hs[None, :], half_mask, cos_ptr, sin_ptr, HD)
    k_lo, k_hi = k_lo.to(dtype), k_hi.to(dtype)  # [BT, HP] each: as the ring keeps them
    v_new = tl.load(v_ptr + b * sv_b + g * sv_h + ts[:, None] * sv_t + ds[None, :],
                    mask=new_mask, other=0.0)
    q_pos = pos + ts  # [BT]
    rel = ts[:, None] - ts[None, :]
    keep_new = (rel >= 0) & (rel < W) & t_ok[None, :]  # [BT, BT]: causal, inside the window
    for j in tl.static_range(REP):
        h = g * REP + j
        q_lo, q_hi = _rope_halves(q_ptr + b * sq_b + h * sq_h + ts[:, None] * sq_t, rope_at,
                                  hs[None, :], half_mask, cos_ptr, sin_ptr, HD)
        q_lo, q_hi = q_lo.to(dtype), q_hi.to(dtype)
        m = tl.full([BT], -1.0e30, tl.float32)
        total = tl.zeros([BT], tl.float32)
        acc = tl.zeros([BT, DP], tl.float32)
        for r0 in tl.static_range(0, RP, RC):  # RP: R rounded up to whole blocks
            rs = r0 + tl.arange(0, RC)
            r_ok = rs < R
            key_at = rs[:, None] * sr_r + hs[None, :]
            key_mask = r_ok[:, None] & (hs < HD)[None, :]
            ring_k_lo = tl.load(ring + key_at, mask=key_mask, other=0.0)  # [RC, HP]
            ring_k_hi = tl.load(ring + HD + key_at, mask=key_mask, other=0.0)
            v_ring = tl.load(ring + sr_kv + rs[:, None] * sr_r + ds[None, :],
                             mask=r_ok[:, None] & (ds < D)[None, :], other=0.0)  # [RC, DP]
            # entry r holds the latest frame p < pos with p % R == r (p < 0: never written)
            ring_pos = pos - 1 - ((pos - 1 - rs + R) % R)  # [RC]
            keep = ((ring_pos[None, :] >= 0) & r_ok[None, :]
                    & (q_pos[:, None] - ring_pos[None, :] < W))  # [BT, RC]
            m, total, acc = _attend(q_lo, q_hi, ring_k_lo, ring_k_hi, v_ring, keep, m, total,
                                    acc, scale, PRECISION, F32)
        m, total, acc = _attend(q_lo, q_hi, k_lo, k_hi, v_new, keep_new, m, total, acc, scale,
                                PRECISION, F32)
        total = tl.where(total > 0, total, 1.0)  # padding query rows (t >= T): never stored
        o = acc / total[:, None]
        tl.store(out_ptr + ((b * T + ts[:, None]) * H + h) * D + ds[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=new_mask)

    # every thread has read the ring before any overwrites it
    tl.debug_barrier()
    # the last R real frames go to their entries (t < n - R would be overwritten in this step)
    write = t_ok & (ts < n) & (ts >= n - R)
    entry = ((pos + ts) % R)[:, None] * sr_r
    key_mask = write[:, None] & (hs < HD)[None, :]
    tl.store(ring + entry + hs[None, :], k_lo, mask=key_mask)
    tl.store(ring + entry + HD + hs[None, :], k_hi, mask=key_mask)
    tl.store(ring + sr_kv + entry + ds[None, :], v_new, mask=write[:, None] & (ds < D)[None, :])


def ring_attention(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, ring: Tensor,
                   slot_ids: Tensor, pos: Tensor, num_frames: Tensor | None,
                   window: int) -> Tensor:
    """Windowed causal attention of ``q [B, H, T, D]`` over each row's ring and ``k``, ``v
    [B, Hkv, T, D]``, RoPE applied here to ``q`` and ``k`` (``cos``, ``sin``: the step's
    ``[B, 1, T, D]`` tables with the rotation's sign folded into ``sin``, as
    ``layers.rope.apply_rope_signed`` takes them), then the real frames' rotated keys and values
    written into the ring.

    ``ring [S, 2, Hkv, R, D]``: one layer's rings of every slot (a view of the arena), updated
    in place at ``slot_ids [B]`` (distinct, except padding rows that may share a scratch slot);
    ``pos [B]`` int64: each row's frames before this step; ``num_frames [B]`` (or ``None``: all
    ``T``): its real frames, the others are decoded and not kept. Returns ``[B, T, H * D]``.
    CUDA, or CPU tensors under ``TRITON_INTERPRET=1``.
    """
    bsz, heads, t, d = q.shape
    kv_heads, r = k.shape[1], ring.shape[3]
    if t > MAX_NEW_FRAMES:
        raise ValueError(f"ring_attention takes at most {MAX_NEW_FRAMES} new frames, got {t}")
    for x in (q, k, v, cos, sin):
        assert x.stride(-1) == 1, "the head dim must be contiguous"
    assert d % 2 == 0 and cos.shape == sin.shape == (bsz, 1, t, d), cos.shape
    assert ring.stride(-1) == 1 and ring.shape[1:] == (2, kv_heads, r, d), ring.shape
    assert r == window - 1, f"a ring keeps window - 1 = {window - 1} frames, not {r}"
    for ids in (slot_ids, pos, num_frames):  # read by raw pointer: element b at b
        assert ids is None or ids.is_contiguous(), "slot ids, pos, frame counts: dense [B]"
    out = torch.empty(bsz, t, heads, d, device=q.device, dtype=q.dtype)
    frames = pos if num_frames is None else num_frames  # never read without frames
    _ring_attention_kernel[(bsz, kv_heads)](
        q, k, v, cos, sin, out, ring, slot_ids, pos, frames,
        t, r, window, d ** -0.5,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), cos.stride(0), cos.stride(2),
        ring.stride(0), ring.stride(1), ring.stride(2), ring.stride(3),
        H=heads, REP=heads // kv_heads, D=d, DP=max(16, triton.next_power_of_2(d)),
        HP=max(16, triton.next_power_of_2(d // 2)),
        BT=max(16, triton.next_power_of_2(t)), RP=triton.cdiv(r, _RC) * _RC, RC=_RC,
        HAS_FRAMES=num_frames is not None, num_warps=4,
        PRECISION="tf32" if torch.backends.cuda.matmul.allow_tf32 and not DOT_F32 else "ieee",
        F32=DOT_F32,
    )
    return out.view(bsz, t, heads * d)
