"""Hand-fused T5Gemma2 text-encoder layers: 5 Triton launches per layer instead of ~70.

Owns: the kernels and ``FusedTextEncoder``, a drop-in for ``T5Gemma2TextEncoder.encode`` on
CUDA for packed batches of up to ``max_tokens`` tokens (longer ones run the eager encoder).
Per layer (N packed tokens, N <= max_tokens):
  1. residual join + pre-attention norm + packed q/k/v GEMM + per-head q/k norm + RoPE (one
     program per head x row block);
  2. packed bidirectional attention: segment and sliding-window masks from the tokens' segment
     ids and positions, online softmax over key blocks (one program per query block x head);
  3. o_proj, split-K;
  4. residual join + pre-feedforward norm + packed gate/up GEMM + GELU(tanh)(gate) * up;
  5. down_proj, split-K;
and one launch after the last layer (the last join and the final norm). Gemma's sandwich norms
put a norm on each branch before it joins the residual (``x + norm(branch)``), so a join needs
the whole branch row: each join runs in the prologue of the next GEMM, which reads the branch
and the residual rows (a few KB, from L2), and the GEMM's first column block writes the joined
residual once for the join after it.
NOTE(kernels): the first-packet path ran this encoder as ~70 launches per layer in a graph
(5.7-7 ms for a sentence on the H200 against ~0.35 ms of weight reads); torch.compile made it
4.0 ms and added 225 s of start-up (bench/README.md), so the fusion is by hand as for the depth
layers. Every kernel keeps the eager modules' bf16 rounding points (GemmaRMSNorm,
``F.linear``, ``apply_rope``, GELU, residual adds); attention rounds as flash attention does.
Must not: project to the backbone width or place segments in a prompt (``BreezeModel`` does),
or allocate per call beyond its activations (split-K workspaces are preallocated, so CUDA graphs
capture it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from breezert.kernels.gemm import (
    DOT_F32,
    FusedGemms,
    Tiles,
    bf16,
    check_bf16,
    mm,
    rope,
    row_block,
    warm_row_counts,
)

SLIDING = "sliding_attention"  # models.text_encoder's layer kind (kernels import no models)

MAX_TOKENS = 128
"""Most packed tokens the fused layers serve (a sentence is 20-60; the row blocks re-read each
weight once per 64 rows, so long batches are better served by the eager GEMMs)."""


@triton.jit
def _load(ptr, stride, rows, rmask, cols):
    return tl.load(ptr + rows[:, None] * stride + cols[None, :], mask=rmask[:, None],
                   other=0.0).to(tl.float32)


@triton.jit
def _gemma(x, rstd, w_ptr, cols):
    """GemmaRMSNorm of an fp32 tile as ``F.rms_norm(x, weight=1 + w)`` rounds it."""
    w = 1.0 + tl.load(w_ptr + cols).to(tl.float32)
    return bf16(x * rstd[:, None] * w[None, :])


@triton.jit
def _joined(x_ptr, b_ptr, wb_ptr, stride, rows, rmask, rstd_b, cols, HAS_B: tl.constexpr):
    """The residual tile after its join: ``bf16(x + norm_b(b))`` (``HAS_B`` off: ``x``)."""
    x = _load(x_ptr, stride, rows, rmask, cols)
    if HAS_B:
        x = bf16(x + _gemma(_load(b_ptr, stride, rows, rmask, cols), rstd_b, wb_ptr, cols))
    return x


@triton.jit
def _join_rstd(x_ptr, b_ptr, wb_ptr, stride, rows, rmask, eps, K: tl.constexpr,
               BM: tl.constexpr, BK: tl.constexpr, HAS_B: tl.constexpr):
    """Per row: the branch's ``1/rms`` and the joined residual's (fp32)."""
    rstd_b = tl.full([BM], 1.0, dtype=tl.float32)
    if HAS_B:
        sq = tl.zeros([BM], dtype=tl.float32)
        for k0 in tl.static_range(0, K, BK):
            b = _load(b_ptr, stride, rows, rmask, k0 + tl.arange(0, BK))
            sq += tl.sum(b * b, axis=1)
        rstd_b = 1.0 / tl.sqrt(sq / K + eps)
    sq = tl.zeros([BM], dtype=tl.float32)
    for k0 in tl.static_range(0, K, BK):
        x = _joined(x_ptr, b_ptr, wb_ptr, stride, rows, rmask, rstd_b, k0 + tl.arange(0, BK),
                    HAS_B)
        sq += tl.sum(x * x, axis=1)
    return rstd_b, 1.0 / tl.sqrt(sq / K + eps)


@triton.jit(do_not_specialize=["R"])
def _join_qkv_kernel(
    x_ptr, b_ptr, wb_ptr, wn_ptr, w_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, xout_ptr,
    q_ptr, k_ptr, v_ptr, R, eps, stride_x, stride_cs,
    H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, K: tl.constexpr, BM: tl.constexpr,
    BK: tl.constexpr, F32: tl.constexpr, HAS_B: tl.constexpr,
):
    """Program (head t, row block): heads 0..H-1 are q, then k heads, then v heads."""
    t = tl.program_id(0)
    rows = tl.program_id(1) * BM + tl.arange(0, BM)
    rmask = rows < R
    HALF: tl.constexpr = D // 2
    d = tl.arange(0, HALF)
    rstd_b, rstd = _join_rstd(x_ptr, b_ptr, wb_ptr, stride_x, rows, rmask, eps, K, BM, BK, HAS_B)
    lo = t * D + d  # weight rows of the head's lower half
    acc_lo = tl.zeros([BM, HALF], dtype=tl.float32)
    acc_hi = tl.zeros([BM, HALF], dtype=tl.float32)
    for k0 in range(0, K, BK):
        cols = k0 + tl.arange(0, BK)
        x = _joined(x_ptr, b_ptr, wb_ptr, stride_x, rows, rmask, rstd_b, cols, HAS_B)
        if HAS_B:  # noqa: SIM102 (a constexpr and a runtime test: Triton wants them apart)
            if t == 0:  # one program column writes the joined residual
                tl.store(xout_ptr + rows[:, None] * stride_x + cols[None, :],
                         x.to(tl.bfloat16), mask=rmask[:, None])
        xn = _gemma(x, rstd, wn_ptr, cols).to(tl.bfloat16)
        w_lo = tl.load(w_ptr + lo[:, None] * K + cols[None, :])
        w_hi = tl.load(w_ptr + (lo + HALF)[:, None] * K + cols[None, :])
        acc_lo += mm(xn, tl.trans(w_lo), F32)
        acc_hi += mm(xn, tl.trans(w_hi), F32)
    a_lo, a_hi = bf16(acc_lo), bf16(acc_hi)  # the packed GEMM's bf16 output
    if t < H + KVH:  # q/k: GemmaRMSNorm over the head, then RoPE with each token's position
        rs = 1.0 / tl.sqrt((tl.sum(a_lo * a_lo, axis=1) + tl.sum(a_hi * a_hi, axis=1)) / D + eps)
        if t < H:
            a_lo, a_hi = _gemma(a_lo, rs, qn_ptr, d), _gemma(a_hi, rs, qn_ptr, HALF + d)
        else:
            a_lo, a_hi = _gemma(a_lo, rs, kn_ptr, d), _gemma(a_hi, rs, kn_ptr, HALF + d)
        cs = rows[:, None] * stride_cs
        a_lo, a_hi = rope(
            a_lo, a_hi,
            tl.load(cos_ptr + cs + d[None, :], mask=rmask[:, None], other=0.0).to(tl.float32),
            tl.load(cos_ptr + cs + HALF + d[None, :], mask=rmask[:, None], other=0.0
                    ).to(tl.float32),
            tl.load(sin_ptr + cs + d[None, :], mask=rmask[:, None], other=0.0).to(tl.float32),
            tl.load(sin_ptr + cs + HALF + d[None, :], mask=rmask[:, None], other=0.0
                    ).to(tl.float32),
        )
    if t < H:
        dst = q_ptr + rows[:, None] * (H * D) + t * D + d[None, :]
    elif t < H + KVH:
        dst = k_ptr + rows[:, None] * (KVH * D) + (t - H) * D + d[None, :]
    else:
        dst = v_ptr + rows[:, None] * (KVH * D) + (t - H - KVH) * D + d[None, :]
    tl.store(dst, a_lo.to(tl.bfloat16), mask=rmask[:, None])
    tl.store(dst + HALF, a_hi.to(tl.bfloat16), mask=rmask[:, None])


@triton.jit(do_not_specialize=["N"])
def _packed_attention_kernel(
    q_ptr, k_ptr, v_ptr, seg_ptr, pos_ptr, out_ptr, N, scale, left, right,
    H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, BQ: tl.constexpr, BKV: tl.constexpr,
    NKB: tl.constexpr, SLIDING: tl.constexpr, F32: tl.constexpr,
):
    """Program (query block, head): its queries against every key of their own segment (and
    window, ``SLIDING``), NKB blocks of BKV keys (a power of two covering N: few builds) with
    an online softmax."""
    h = tl.program_id(1)
    g = h // (H // KVH)
    qrows = tl.program_id(0) * BQ + tl.arange(0, BQ)
    qmask = qrows < N
    dd = tl.arange(0, D)
    q = tl.load(q_ptr + qrows[:, None] * (H * D) + h * D + dd[None, :], mask=qmask[:, None],
                other=0.0)
    qseg = tl.load(seg_ptr + qrows, mask=qmask, other=-1)
    qpos = tl.load(pos_ptr + qrows, mask=qmask, other=0)
    m = tl.full([BQ], float("-inf"), dtype=tl.float32)
    total = tl.zeros([BQ], dtype=tl.float32)
    acc = tl.zeros([BQ, D], dtype=tl.float32)
    for kb in range(NKB):
        krows = kb * BKV + tl.arange(0, BKV)
        kmask = krows < N
        kv = krows[:, None] * (KVH * D) + g * D + dd[None, :]
        k = tl.load(k_ptr + kv, mask=kmask[:, None], other=0.0)
        v = tl.load(v_ptr + kv, mask=kmask[:, None], other=0.0)
        kseg = tl.load(seg_ptr + krows, mask=kmask, other=-2)
        ok = qseg[:, None] == kseg[None, :]
        if SLIDING:  # q - k in [-(right - 1), left - 1], as sliding_block_mask
            kpos = tl.load(pos_ptr + krows, mask=kmask, other=0)
            dist = qpos[:, None] - kpos[None, :]
            ok = ok & (dist < left) & (-dist < right)
        s = tl.where(ok, mm(q, tl.trans(k), F32) * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        base = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet
        p = tl.exp(s - base[:, None])
        alpha = tl.exp(m - base)
        total = total * alpha + tl.sum(p, axis=1)
        # as flash attention rounds: unnormalised probabilities to bf16 for P @ V
        acc = acc * alpha[:, None] + mm(bf16(p).to(tl.bfloat16), v, F32)
        m = m_new
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(out_ptr + qrows[:, None] * (H * D) + h * D + dd[None, :],
             bf16(out).to(tl.bfloat16), mask=qmask[:, None])


@triton.jit(do_not_specialize=["R"])
def _join_gate_up_kernel(
    x_ptr, b_ptr, wb_ptr, wn_ptr, w_ptr, xout_ptr, out_ptr, R, eps, stride_x, stride_out,
    I: tl.constexpr, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    F32: tl.constexpr,
):
    """Program (column block, row block): ``bf16(gelu_tanh(gate) * up)`` of the normed joined
    residual (gate rows 0..I-1, up rows I..2I-1 of the packed weight)."""
    pid = tl.program_id(0)
    rows = tl.program_id(1) * BM + tl.arange(0, BM)
    rmask = rows < R
    rstd_b, rstd = _join_rstd(x_ptr, b_ptr, wb_ptr, stride_x, rows, rmask, eps, K, BM, BK, True)
    g_rows = pid * BN + tl.arange(0, BN)
    acc_g = tl.zeros([BM, BN], dtype=tl.float32)
    acc_u = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        cols = k0 + tl.arange(0, BK)
        x = _joined(x_ptr, b_ptr, wb_ptr, stride_x, rows, rmask, rstd_b, cols, True)
        if pid == 0:  # one program column writes the joined residual
            tl.store(xout_ptr + rows[:, None] * stride_x + cols[None, :], x.to(tl.bfloat16),
                     mask=rmask[:, None])
        xn = _gemma(x, rstd, wn_ptr, cols).to(tl.bfloat16)
        w_g = tl.load(w_ptr + g_rows[:, None] * K + cols[None, :])
        w_u = tl.load(w_ptr + (g_rows + I)[:, None] * K + cols[None, :])
        acc_g += mm(xn, tl.trans(w_g), F32)
        acc_u += mm(xn, tl.trans(w_u), F32)
    gate, up = bf16(acc_g), bf16(acc_u)
    # F.gelu(approximate="tanh") in fp32 on the bf16 gate; tanh(y) = 1 - 2 / (exp(2y) + 1)
    y = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
    act = bf16(0.5 * gate * (2.0 - 2.0 / (tl.exp(2.0 * y) + 1.0)))
    n = pid * BN + tl.arange(0, BN)
    tl.store(out_ptr + rows[:, None] * stride_out + n[None, :], bf16(act * up).to(tl.bfloat16),
             mask=rmask[:, None])


@triton.jit(do_not_specialize=["R"])
def _join_norm_kernel(x_ptr, b_ptr, wb_ptr, wn_ptr, out_ptr, R, eps, stride_x,
                      K: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    """Program (row block): the last join, then the final norm."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    rmask = rows < R
    rstd_b, rstd = _join_rstd(x_ptr, b_ptr, wb_ptr, stride_x, rows, rmask, eps, K, BM, BK, True)
    for k0 in tl.static_range(0, K, BK):
        cols = k0 + tl.arange(0, BK)
        x = _joined(x_ptr, b_ptr, wb_ptr, stride_x, rows, rmask, rstd_b, cols, True)
        tl.store(out_ptr + rows[:, None] * stride_x + cols[None, :],
                 _gemma(x, rstd, wn_ptr, cols).to(tl.bfloat16), mask=rmask[:, None])


SMEM_BUDGET = 200 * 1024  # bytes of pipelined tiles per program (Hopper: 227 KB per block)


def _largest_block(length: int, most: int) -> int:
    """The largest power of two <= ``most`` that divides ``length`` (>= 16 for ``tl.dot``)."""
    block = most
    while block > 16 and length % block:
        block //= 2
    return block


def _stages(stage_bytes: int, most: int = 3) -> int:
    """Pipeline depth whose bf16 tiles fit the shared memory of one Hopper block.

    ``stage_bytes`` is one stage's tiles; Triton adds a little for the epilogue, so the budget
    stays below the 227 KB a block may hold (three stages of the q/k/v kernel's 80 KB did not).
    """
    return max(1, min(most, SMEM_BUDGET // stage_bytes))


def _split_for(k: int, block_k: int) -> int:
    """A K split for a split-K GEMM of reduction ``k``: the most of 4, 3, 2 that leaves whole
    ``block_k`` tiles (1152 x 6912 down_proj: 3; o_proj over 1024: 4)."""
    return next((s for s in (4, 3, 2) if k % (s * block_k) == 0), 1)


class FusedTextEncoder:
    """``T5Gemma2TextEncoder.encode`` as 5 Triton launches per layer (module docstring).

    Needs ``BreezeModel.fuse_projections_()`` first (packed q/k/v and gate/up weights) and a
    bf16 encoder; batches of more than ``max_tokens`` tokens run the eager ``encode``.
    """

    def __init__(self, encoder: torch.nn.Module, max_tokens: int = MAX_TOKENS,
                 warm: bool = True) -> None:
        cfg = encoder.cfg
        self.encoder, self.cfg, self.max_tokens = encoder, cfg, max_tokens
        self.eager = encoder.encode
        check_bf16(encoder.norm.weight, "text encoder")
        d, inter, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
        layers = encoder.layers
        if any(layer.self_attn.qkv_weight is None or layer.mlp.gate_up_weight is None
               for layer in layers):
            raise ValueError("fused text encoder needs BreezeModel.fuse_projections_() first")
        self.bk = _largest_block(d, 128)
        self.gate_bn = _largest_block(inter, 64)
        attn_width = cfg.num_heads * hd
        if d % self.bk or inter % self.gate_bn or hd % 32 or cfg.num_heads % cfg.num_kv_heads:
            raise ValueError(f"fused text encoder: hidden {d}, intermediate {inter}, head_dim "
                             f"{hd} do not fit whole tiles")
        device = encoder.norm.weight.device
        self.o_gemms = self._gemms(attn_width, d, device)
        self.down_gemms = self._gemms(inter, d, device)
        if warm and device.type == "cuda":
            self.warm()

    def _gemms(self, k: int, n: int, device: torch.device) -> FusedGemms:
        """A split-K launcher for ``[*, k] @ [k, n]`` with whole tiles."""
        split_bn = _largest_block(n, 32)
        bk = _largest_block(k, 256)
        split = _split_for(k, bk)
        bk = min(bk, k // split)
        gemms = FusedGemms(Tiles(split_k=split, split_bn=split_bn, split_bk=bk), self.max_tokens,
                           n, device)
        gemms.check("text encoder", split=(n, k))
        return gemms

    @torch.inference_mode()
    def warm(self) -> None:
        """Builds every kernel variant (each row-block size) now, not in the middle of serving."""
        device = self.encoder.norm.weight.device
        for rows in warm_row_counts(self.max_tokens):
            ids = torch.zeros(rows, dtype=torch.long, device=device)
            self(ids, ids, torch.arange(rows, device=device))

    def __call__(self, input_ids: torch.Tensor, seg_ids: torch.Tensor,
                 positions: torch.Tensor) -> torch.Tensor:
        """Same contract as ``T5Gemma2TextEncoder.encode``: ``[N]`` ids, segment ids and
        positions -> final-normed ``[N, d]``."""
        rows = input_ids.shape[0]
        if rows > self.max_tokens or rows == 0:
            return self.eager(input_ids, seg_ids, positions)
        enc, cfg = self.encoder, self.cfg
        dtype = enc.embed_tokens.weight.dtype
        tables = {t: (cos.contiguous(), sin.contiguous())
                  for t, (cos, sin) in enc.rope_tables(positions).items()}
        x = enc.embed_tokens(input_ids).contiguous()  # [N, d]
        d, hd, heads, kv_heads = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        bm = row_block(rows)
        eps = cfg.rms_norm_eps
        q = torch.empty(rows, heads * hd, dtype=dtype, device=x.device)
        k = torch.empty(rows, kv_heads * hd, dtype=dtype, device=x.device)
        v, attn = torch.empty_like(k), torch.empty_like(q)
        act = torch.empty(rows, cfg.intermediate_size, dtype=dtype, device=x.device)
        spare = torch.empty_like(x)  # the residual stream alternates between x and spare
        seg_ids, positions = seg_ids.contiguous(), positions.contiguous()
        window = cfg.sliding_window
        branch, branch_norm = x, enc.norm.weight  # no branch before the first layer
        block_q, block_kv = 16, 32
        key_blocks = triton.next_power_of_2(triton.cdiv(rows, block_kv))
        for i, layer in enumerate(enc.layers):
            cos, sin = tables[layer.layer_type]
            first = i == 0
            _join_qkv_kernel[(heads + 2 * kv_heads, triton.cdiv(rows, bm))](
                x, branch, branch_norm, layer.pre_self_attn_layernorm.weight,
                layer.self_attn.qkv_weight, layer.self_attn.q_norm.weight,
                layer.self_attn.k_norm.weight, cos, sin, spare, q, k, v, rows, eps, x.stride(0),
                cos.stride(0), H=heads, KVH=kv_heads, D=hd, K=d, BM=bm, BK=self.bk,
                F32=DOT_F32, HAS_B=not first, num_warps=4,
                num_stages=_stages(2 * (bm + hd) * self.bk),  # x tile + both weight halves
            )
            if not first:
                x, spare = spare, x
            _packed_attention_kernel[(triton.cdiv(rows, block_q), heads)](
                q, k, v, seg_ids, positions, attn, rows, layer.self_attn.scale,
                (window + 1) // 2, window // 2 + 1, H=heads, KVH=kv_heads, D=hd, BQ=block_q,
                BKV=block_kv, NKB=key_blocks, SLIDING=layer.layer_type == SLIDING, F32=DOT_F32, num_warps=4,
            )
            o = self.o_gemms.linear_residual(attn, layer.self_attn.o_proj.weight, None)
            _join_gate_up_kernel[(cfg.intermediate_size // self.gate_bn, triton.cdiv(rows, bm))](
                x, o, layer.post_self_attn_layernorm.weight, layer.pre_feedforward_layernorm.weight,
                layer.mlp.gate_up_weight, spare, act, rows, eps, x.stride(0), act.stride(0),
                I=cfg.intermediate_size, K=d, BM=bm, BN=self.gate_bn, BK=self.bk, F32=DOT_F32,
                num_warps=4, num_stages=_stages(2 * (bm + 2 * self.gate_bn) * self.bk),
            )
            x, spare = spare, x
            branch = self.down_gemms.linear_residual(act, layer.mlp.down_proj.weight, None)
            branch_norm = layer.post_feedforward_layernorm.weight
        out = torch.empty_like(x)
        _join_norm_kernel[(triton.cdiv(rows, bm),)](
            x, branch, branch_norm, enc.norm.weight, out, rows, eps, x.stride(0), K=d, BM=bm,
            BK=self.bk, num_warps=4,
        )
        return out
