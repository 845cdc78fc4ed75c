"""Hand-fused T5Gemma2 text-encoder layers: 7 Triton launches per layer instead of ~70.

Owns: the kernels and ``FusedTextEncoder``, a drop-in for ``T5Gemma2TextEncoder.encode`` on
CUDA for packed batches of up to ``max_tokens`` tokens (longer ones run the eager encoder).
Per layer (N packed tokens, N <= max_tokens):
  1. residual join + pre-attention norm (whole rows, a few per program);
  2. packed q/k/v GEMM, split-K;
  3. packed bidirectional attention: per-head q/k norm and RoPE of the GEMM's output, segment
     and sliding-window masks from the tokens' segment ids and positions, online softmax over
     key blocks (one program per query block x head);
  4. o_proj, split-K;
  5. residual join + pre-feedforward norm;
  6. packed gate/up GEMM + GELU(tanh)(gate) * up;
  7. down_proj, split-K;
and one launch after the last layer (the last join and the final norm). Gemma's sandwich norms
put a norm on each branch before it joins the residual (``x + norm(branch)``), so a join needs
the whole branch row: it runs on its own, writing the joined residual and its norm once.
NOTE(kernels): the eager encoder is launch-bound on the first-packet path and torch.compile
adds minutes of start-up (bench/README.md), so the fusion is by hand as for the depth layers;
the GEMMs spread over the SMs (one program per head was too few).
Every kernel keeps the eager modules' bf16 rounding points (GemmaRMSNorm, ``F.linear``,
``apply_rope``, GELU, residual adds); attention rounds as flash attention does.
Must not: project to the backbone width or place segments in a prompt (``BreezeModel`` does),
or allocate per call beyond its activations (split-K workspaces are preallocated, so CUDA graphs
capture it).
"""

from __future__ import annotations

from dataclasses import replace

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
    pdl_launch,
    pdl_wait,
    rope,
    row_block,
    softmax_step,
    warm_row_counts,
)

SLIDING = "sliding_attention"  # models.text_encoder's layer kind (kernels import no models)

MAX_TOKENS = 128
"""Most packed tokens the fused layers serve by default (a sentence is 20-60)."""

WIDE_ROWS = 128
"""With ``wide_tiles``: batches of more tokens run the GEMMs in 128 x 64 tiles (8 warps)
instead of 64 x 32. At 512 tokens the narrow tiles move ~1 GB per layer through L2 (the
gate/up GEMM's 216 column programs each read all the normed rows, and each row block reads
the weights again: ~0.5 GB of it); the wide ones about half. The same K split and K tiles."""


@triton.jit
def _gemma(x, rstd, w_ptr, cols):
    """GemmaRMSNorm of an fp32 tile as ``F.rms_norm(x, weight=1 + w)`` rounds it."""
    w = 1.0 + tl.load(w_ptr + cols).to(tl.float32)
    return bf16(x * rstd[:, None] * w[None, :])


@triton.jit(do_not_specialize=["R"])
def _join_norm_kernel(
    x_ptr, b_ptr, wb_ptr, wn_ptr, xout_ptr, xn_ptr, R, eps, stride,
    K: tl.constexpr, BLOCK: tl.constexpr, BR: tl.constexpr, HAS_B: tl.constexpr,
    WRITE_X: tl.constexpr, PDL: tl.constexpr = False,
):
    """Program (BR whole rows): the joined residual ``bf16(x + norm_b(b))`` (``HAS_B`` off:
    ``x``; stored at ``xout`` if ``WRITE_X``) and its norm ``norm_n(joined)`` at ``xn``."""
    pdl_wait(PDL)
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BLOCK)
    cmask = cols < K
    mask = (rows < R)[:, None] & cmask[None, :]
    at = rows[:, None] * stride + cols[None, :]
    x = tl.load(x_ptr + at, mask=mask, other=0.0).to(tl.float32)
    wcols = tl.where(cmask, cols, 0)
    if HAS_B:
        b = tl.load(b_ptr + at, mask=mask, other=0.0).to(tl.float32)
        rstd_b = 1.0 / tl.sqrt(tl.sum(b * b, axis=1) / K + eps)
        x = bf16(x + _gemma(b, rstd_b, wb_ptr, wcols))
        if WRITE_X:
            tl.store(xout_ptr + at, x.to(tl.bfloat16), mask=mask)
    x = tl.where(mask, x, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / K + eps)
    tl.store(xn_ptr + at, _gemma(x, rstd, wn_ptr, wcols).to(tl.bfloat16), mask=mask)


@triton.jit
def _head_halves(qkv_ptr, stride_qkv, rows, rmask, col0, HALF: tl.constexpr):
    """The two RoPE halves of one head's columns ``col0..col0+2*HALF-1`` (fp32 of bf16)."""
    d = tl.arange(0, HALF)
    at = qkv_ptr + rows[:, None] * stride_qkv + col0 + d[None, :]
    lo = tl.load(at, mask=rmask[:, None], other=0.0).to(tl.float32)
    hi = tl.load(at + HALF, mask=rmask[:, None], other=0.0).to(tl.float32)
    return lo, hi


@triton.jit
def _norm_rope(lo, hi, w_ptr, cos_ptr, sin_ptr, stride_cs, rows, rmask, eps,
               HALF: tl.constexpr):
    """Per-head GemmaRMSNorm (q_norm / k_norm), then RoPE at each token's position, as the
    eager modules round them; bf16 halves for the dots."""
    d = tl.arange(0, HALF)
    rs = 1.0 / tl.sqrt((tl.sum(lo * lo, axis=1) + tl.sum(hi * hi, axis=1)) / (2 * HALF) + eps)
    lo, hi = _gemma(lo, rs, w_ptr, d), _gemma(hi, rs, w_ptr, HALF + d)
    cs = rows[:, None] * stride_cs + d[None, :]
    m = rmask[:, None]
    lo, hi = rope(
        lo, hi,
        tl.load(cos_ptr + cs, mask=m, other=0.0).to(tl.float32),
        tl.load(cos_ptr + cs + HALF, mask=m, other=0.0).to(tl.float32),
        tl.load(sin_ptr + cs, mask=m, other=0.0).to(tl.float32),
        tl.load(sin_ptr + cs + HALF, mask=m, other=0.0).to(tl.float32),
    )
    return lo.to(tl.bfloat16), hi.to(tl.bfloat16)


@triton.jit(do_not_specialize=["N"])
def _packed_attention_kernel(
    qkv_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, seg_ptr, pos_ptr, out_ptr, N, scale, left,
    right, eps, stride_qkv, stride_cs,
    H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, BQ: tl.constexpr, BKV: tl.constexpr,
    NKB: tl.constexpr, SLIDING: tl.constexpr, F32: tl.constexpr, PDL: tl.constexpr = False,
):
    """Program (query block, head): q/k norm and RoPE of the packed q/k/v GEMM's output, then
    its queries against every key of their own segment (and window, ``SLIDING``), NKB blocks
    of BKV keys (a power of two covering N: few builds) with an online softmax. Each program
    norms and rotates the keys it reads (a few KB: cheaper than a launch of its own)."""
    pdl_wait(PDL)
    HALF: tl.constexpr = D // 2
    h = tl.program_id(1)
    g = h // (H // KVH)
    qrows = tl.program_id(0) * BQ + tl.arange(0, BQ)
    qmask = qrows < N
    q_lo, q_hi = _head_halves(qkv_ptr, stride_qkv, qrows, qmask, h * D, HALF)
    q_lo, q_hi = _norm_rope(q_lo, q_hi, qn_ptr, cos_ptr, sin_ptr, stride_cs, qrows, qmask, eps,
                            HALF)
    qseg = tl.load(seg_ptr + qrows, mask=qmask, other=-1)
    qpos = tl.load(pos_ptr + qrows, mask=qmask, other=0)
    dd = tl.arange(0, D)
    m = tl.full([BQ], float("-inf"), dtype=tl.float32)
    total = tl.zeros([BQ], dtype=tl.float32)
    acc = tl.zeros([BQ, D], dtype=tl.float32)
    for kb in range(NKB):
        krows = kb * BKV + tl.arange(0, BKV)
        kmask = krows < N
        k_lo, k_hi = _head_halves(qkv_ptr, stride_qkv, krows, kmask, (H + g) * D, HALF)
        k_lo, k_hi = _norm_rope(k_lo, k_hi, kn_ptr, cos_ptr, sin_ptr, stride_cs, krows, kmask,
                                eps, HALF)
        v = tl.load(qkv_ptr + krows[:, None] * stride_qkv + (H + KVH + g) * D + dd[None, :],
                    mask=kmask[:, None], other=0.0)
        kseg = tl.load(seg_ptr + krows, mask=kmask, other=-2)
        ok = qseg[:, None] == kseg[None, :]
        if SLIDING:  # q - k in [-(right - 1), left - 1], as sliding_block_mask
            kpos = tl.load(pos_ptr + krows, mask=kmask, other=0)
            dist = qpos[:, None] - kpos[None, :]
            ok = ok & (dist < left) & (-dist < right)
        qk = mm(q_lo, tl.trans(k_lo), F32) + mm(q_hi, tl.trans(k_hi), F32)
        s = tl.where(ok, qk * scale, float("-inf"))
        m, p, alpha, total = softmax_step(s, m, total)
        # as flash attention rounds: unnormalised probabilities to bf16 for P @ V
        acc = acc * alpha[:, None] + mm(bf16(p).to(tl.bfloat16), v, F32)
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(out_ptr + qrows[:, None] * (H * D) + h * D + dd[None, :],
             bf16(out).to(tl.bfloat16), mask=qmask[:, None])


@triton.jit(do_not_specialize=["R"])
def _gate_up_kernel(
    xn_ptr, w_ptr, out_ptr, R, stride_x, stride_out,
    I: tl.constexpr, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    F32: tl.constexpr, PDL: tl.constexpr = False,
):
    """Program (column block, row block): ``bf16(gelu_tanh(gate) * up)`` of the normed
    residual (gate rows 0..I-1, up rows I..2I-1 of the packed weight)."""
    pdl_wait(PDL)
    pid = tl.program_id(0)
    rows = tl.program_id(1) * BM + tl.arange(0, BM)
    rmask = rows < R
    g_rows = pid * BN + tl.arange(0, BN)
    acc_g = tl.zeros([BM, BN], dtype=tl.float32)
    acc_u = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        cols = k0 + tl.arange(0, BK)
        xn = tl.load(xn_ptr + rows[:, None] * stride_x + cols[None, :], mask=rmask[:, None],
                     other=0.0)
        w_g = tl.load(w_ptr + g_rows[:, None] * K + cols[None, :])
        w_u = tl.load(w_ptr + (g_rows + I)[:, None] * K + cols[None, :])
        acc_g += mm(xn, tl.trans(w_g), F32)
        acc_u += mm(xn, tl.trans(w_u), F32)
    gate, up = bf16(acc_g), bf16(acc_u)
    # F.gelu(approximate="tanh") in fp32 on the bf16 gate; tanh(y) = 1 - 2 / (exp(2y) + 1)
    y = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
    act = bf16(0.5 * gate * (2.0 - 2.0 / (tl.exp(2.0 * y) + 1.0)))
    tl.store(out_ptr + rows[:, None] * stride_out + g_rows[None, :],
             bf16(act * up).to(tl.bfloat16), mask=rmask[:, None])


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
    stays below the 227 KB a block may hold (three stages of 80 KB tiles did not build).
    """
    return max(1, min(most, SMEM_BUDGET // stage_bytes))


def _split_for(k: int, block_k: int) -> int:
    """A K split for a split-K GEMM of reduction ``k``: the most of 4, 3, 2 that leaves whole
    ``block_k`` tiles (1152 x 6912 down_proj: 3; o_proj over 1024: 4)."""
    return next((s for s in (4, 3, 2) if k % (s * block_k) == 0), 1)


class FusedTextEncoder:
    """``T5Gemma2TextEncoder.encode`` as 7 Triton launches per layer (module docstring).

    Needs ``BreezeModel.fuse_projections_()`` first (packed q/k/v and gate/up weights) and a
    bf16 encoder; batches of more than ``max_tokens`` tokens run the eager ``encode``.
    """

    JOIN_ROWS = 2  # rows per program of the join + norm launches (whole rows in registers)
    GATE_BN = 32  # gate/up columns per program: 6912 / 32 = 216 programs for 132 SMs
    WIDE_BN, WIDE_BM = 64, 128  # every GEMM's tiles past ``WIDE_ROWS`` tokens (8 warps)
    BLOCK_Q, BLOCK_KV = 16, 32  # attention: query rows per program, keys per iteration

    def __init__(self, encoder: torch.nn.Module, max_tokens: int = MAX_TOKENS,
                 warm: bool = True, pdl: bool = False, wide_tiles: bool = False) -> None:
        """``pdl``: every launch with programmatic dependent launch (``gemm.pdl_launch``);
        ``wide_tiles``: batches of more than ``WIDE_ROWS`` tokens run wider GEMM tiles."""
        cfg = encoder.cfg
        self.encoder, self.cfg, self.max_tokens, self.pdl = encoder, cfg, max_tokens, pdl
        self.wide_tiles = wide_tiles and max_tokens > WIDE_ROWS
        self.eager = encoder.encode
        check_bf16(encoder.norm.weight, "text encoder")
        d, inter, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
        layers = encoder.layers
        if any(layer.self_attn.qkv_weight is None or layer.mlp.gate_up_weight is None
               for layer in layers):
            raise ValueError("fused text encoder needs BreezeModel.fuse_projections_() first")
        self.bk = _largest_block(d, 128)
        self.gate_bn = _largest_block(inter, self.GATE_BN)
        attn_width = cfg.num_heads * hd
        if d % self.bk or inter % self.gate_bn or hd % 32 or cfg.num_heads % cfg.num_kv_heads:
            raise ValueError(f"fused text encoder: hidden {d}, intermediate {inter}, head_dim "
                             f"{hd} do not fit whole tiles")
        self.wide_gate_bn = _largest_block(inter, self.WIDE_BN)
        if self.wide_tiles and inter % self.wide_gate_bn:
            raise ValueError(f"fused text encoder: intermediate {inter} does not fit wide tiles")
        device = encoder.norm.weight.device
        shapes = {"qkv": (d, (cfg.num_heads + 2 * cfg.num_kv_heads) * hd),
                  "o": (attn_width, d), "down": (inter, d)}
        self.gemms = {name: self._gemms(k, n, device) for name, (k, n) in shapes.items()}
        self.wide_gemms = ({name: self._gemms(k, n, device, wide=True)
                            for name, (k, n) in shapes.items()} if self.wide_tiles else {})
        if warm and device.type == "cuda":
            self.warm()

    def _gemms(self, k: int, n: int, device: torch.device, wide: bool = False) -> FusedGemms:
        """A split-K launcher for ``[*, k] @ [k, n]`` with whole tiles; ``wide``: 128-row,
        64-column tiles with 8 warps (``WIDE_ROWS``), the same K split and K tiles."""
        split_bn = _largest_block(n, self.WIDE_BN if wide else 32)
        bk = _largest_block(k, 256)
        split = _split_for(k, bk)
        bk = min(bk, k // split)
        tiles = Tiles(split_k=split, split_bn=split_bn, split_bk=bk, pdl=self.pdl)
        if wide:
            tiles = replace(tiles, split_bm=self.WIDE_BM, split_warps=8,
                            split_stages=_stages(2 * (self.WIDE_BM + split_bn) * bk))
        # with wide tiles the narrow ones serve at most WIDE_ROWS rows: workspace for those
        rows = self.max_tokens if wide or not self.wide_tiles else WIDE_ROWS
        gemms = FusedGemms(tiles, rows, n, device)
        gemms.check("text encoder", split=(n, k))
        return gemms

    @torch.inference_mode()
    def warm(self) -> None:
        """Builds every kernel variant now, not in the middle of serving: each row-block size
        of the GEMMs, and each key-block count (a power of two of ``BLOCK_KV``-token blocks)
        of attention."""
        device = self.encoder.norm.weight.device
        counts, blocks = set(warm_row_counts(self.max_tokens)), 2
        if self.wide_tiles:  # the wide tiles' 128-row blocks
            counts.add(WIDE_ROWS + 1)
        while self.BLOCK_KV * (blocks // 2) < self.max_tokens:  # fewest tokens needing ``blocks``
            counts.add(self.BLOCK_KV * (blocks // 2) + 1)
            blocks *= 2
        for rows in sorted(counts):
            ids = torch.zeros(rows, dtype=torch.long, device=device)
            self(ids, ids, torch.arange(rows, device=device))

    def _join_norm(self, x: torch.Tensor, branch: torch.Tensor | None,
                   branch_norm: torch.Tensor | None, norm: torch.Tensor,
                   x_out: torch.Tensor | None, out: torch.Tensor) -> None:
        """``out = norm(x + branch_norm(branch))``, the joined residual into ``x_out`` (no
        ``branch``: ``out = norm(x)``)."""
        rows, d = x.shape
        has_b = branch is not None
        _join_norm_kernel[(triton.cdiv(rows, self.JOIN_ROWS),)](
            x, branch if has_b else x, branch_norm if has_b else norm, norm,
            x_out if x_out is not None else out, out, rows, self.cfg.rms_norm_eps, x.stride(0),
            K=d, BLOCK=triton.next_power_of_2(d), BR=self.JOIN_ROWS, HAS_B=has_b,
            WRITE_X=x_out is not None, num_warps=4, **pdl_launch(self.pdl),
        )

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
        hd, heads, kv_heads = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        wide = self.wide_tiles and rows > WIDE_ROWS
        gemms = self.wide_gemms if wide else self.gemms
        bm = row_block(rows, self.WIDE_BM) if wide else row_block(rows)
        gate_bn = self.wide_gate_bn if wide else self.gate_bn
        eps = cfg.rms_norm_eps
        attn = torch.empty(rows, heads * hd, dtype=dtype, device=x.device)
        act = torch.empty(rows, cfg.intermediate_size, dtype=dtype, device=x.device)
        xn = torch.empty_like(x)  # the normed residual each GEMM reads
        spare = torch.empty_like(x)  # the residual stream alternates between x and spare
        seg_ids, positions = seg_ids.contiguous(), positions.contiguous()
        window = cfg.sliding_window
        block_q, block_kv = self.BLOCK_Q, self.BLOCK_KV
        key_blocks = triton.next_power_of_2(triton.cdiv(rows, block_kv))
        branch = branch_norm = None  # no branch before the first layer
        for layer in enc.layers:
            cos, sin = tables[layer.layer_type]
            joined = spare if branch is not None else None
            self._join_norm(x, branch, branch_norm, layer.pre_self_attn_layernorm.weight,
                            joined, xn)
            if joined is not None:
                x, spare = spare, x
            qkv = gemms["qkv"].linear_residual(xn, layer.self_attn.qkv_weight, None)
            _packed_attention_kernel[(triton.cdiv(rows, block_q), heads)](
                qkv, layer.self_attn.q_norm.weight, layer.self_attn.k_norm.weight, cos, sin,
                seg_ids, positions, attn, rows, layer.self_attn.scale, (window + 1) // 2,
                window // 2 + 1, eps, qkv.stride(0), cos.stride(0), H=heads, KVH=kv_heads, D=hd,
                BQ=block_q, BKV=block_kv, NKB=key_blocks, SLIDING=layer.layer_type == SLIDING,
                F32=DOT_F32, num_warps=4, **pdl_launch(self.pdl),
            )
            o = gemms["o"].linear_residual(attn, layer.self_attn.o_proj.weight, None)
            self._join_norm(x, o, layer.post_self_attn_layernorm.weight,
                            layer.pre_feedforward_layernorm.weight, spare, xn)
            x, spare = spare, x
            _gate_up_kernel[(cfg.intermediate_size // gate_bn, triton.cdiv(rows, bm))](
                xn, layer.mlp.gate_up_weight, act, rows, xn.stride(0), act.stride(0),
                I=cfg.intermediate_size, K=cfg.hidden_size, BM=bm, BN=gate_bn, BK=self.bk,
                F32=DOT_F32, num_warps=8 if wide else 4,
                num_stages=_stages(2 * (bm + 2 * gate_bn) * self.bk), **pdl_launch(self.pdl),
            )
            branch = gemms["down"].linear_residual(act, layer.mlp.down_proj.weight, None)
            branch_norm = layer.post_feedforward_layernorm.weight
        out = torch.empty_like(x)
        self._join_norm(x, branch, branch_norm, enc.norm.weight, None, out)
        return out
