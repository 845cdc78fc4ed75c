"""Hand-fused backbone PREFILL step (packed runs of new tokens): 6 Triton launches per Qwen3 layer.

Owns: the k/v write and packed causal attention kernels and ``FusedBackbonePrefill``, a drop-in
for the backbone's forward in the PREFILL stage (``stages/backbone.backbone_prefill(...,
backbone=...)``) for steps of up to ``max_tokens`` packed tokens. Per layer:
  1. input RMSNorm + packed q/k/v GEMM (``gemm.norm_linear``);
  2. the new tokens' k (QK-norm, RoPE) and v written into the paged cache at ``write_rows``
     (one program per token x KV head);
  3. attention: one program per block of queries x head does its queries' QK-norm and RoPE,
     then an online softmax over the step's keys, read in place through ``read_rows`` under
     the packed mask ``[N, Tk]`` (causal within each run, an earlier chunk's keys included),
     visiting only the key blocks between its queries' first and last readable keys;
  4. o_proj, split-K, + residual; 5. RMSNorm + gate/up + SiLU * up; 6. down, split-K, +
     residual (the GEMMs of ``fused_decode``, with ``DECODE_TILES``).
The rounding points are the eager modules' (``RMSNorm``, ``apply_rope``, bf16 probabilities
for P @ V as flash attention rounds them), so values match the eager step within bf16
rounding, not bit for bit (SDPA sums in another order).
NOTE(kernels): the eager prefill in a CUDA graph runs ~50 launches a layer, the largest part
of a first packet after the depth frame (bench/README.md). Past ``max_tokens`` (a burst's
prefill) the GEMMs are compute-bound and the eager backbone's cuBLAS GEMMs run instead.
Must not: decode (``kernels/fused_decode.py``) or choose cache rows (``PagedKVCache.packed_meta``).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from breezert.kernels.fused_decode import backbone_gemms
from breezert.kernels.gemm import (
    DOT_F32,
    Tiles,
    bf16,
    head_norm_rope,
    mm,
    pdl_launch,
    pdl_wait,
    softmax_step,
    warm_row_counts,
)
from breezert.layers.attention import GatherKV

QUERY_BLOCK = 16  # queries per attention program
KEY_BLOCK = 32  # keys per attention iteration


@triton.jit
def _cos_sin_halves(cos_ptr, sin_ptr, rows, rmask, stride, HALF: tl.constexpr):
    """RoPE tables of ``rows`` as ``[rows, HALF]`` fp32 halves."""
    d = tl.arange(0, HALF)[None, :]
    at = rows[:, None] * stride + d
    m = rmask[:, None]
    return (tl.load(cos_ptr + at, mask=m, other=0.0).to(tl.float32),
            tl.load(cos_ptr + at + HALF, mask=m, other=0.0).to(tl.float32),
            tl.load(sin_ptr + at, mask=m, other=0.0).to(tl.float32),
            tl.load(sin_ptr + at + HALF, mask=m, other=0.0).to(tl.float32))


@triton.jit
def _prefill_kv_kernel(
    qkv_ptr, kn_ptr, cos_ptr, sin_ptr, kv_ptr, write_ptr, eps, stride_qkv, stride_cos,
    c_kv, c_row, c_head,
    H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, PDL: tl.constexpr = False,
):
    """Program (token n, KV head g): k = RoPE(k_norm(k)) and v of the token into the cache row
    ``write_rows[n]`` (padding tokens all write the scratch row; nobody reads it as a key of
    a real token)."""
    pdl_wait(PDL)
    n = tl.program_id(0)
    g = tl.program_id(1)
    HALF: tl.constexpr = D // 2
    d = tl.arange(0, HALF)[None, :]
    one = tl.full([1], 0, dtype=tl.int32) + n
    cos_lo, cos_hi, sin_lo, sin_hi = _cos_sin_halves(cos_ptr, sin_ptr, one, one >= 0, stride_cos,
                                                     HALF)
    row = qkv_ptr + n * stride_qkv
    k_lo, k_hi = head_norm_rope(tl.load(row + (H + g) * D + d).to(tl.float32),
                           tl.load(row + (H + g) * D + HALF + d).to(tl.float32),
                           kn_ptr, cos_lo, cos_hi, sin_lo, sin_hi, eps, D)
    slot = kv_ptr + tl.load(write_ptr + n) * c_row + g * c_head
    tl.store(slot + d, k_lo.to(tl.bfloat16))
    tl.store(slot + HALF + d, k_hi.to(tl.bfloat16))
    v = tl.load(row + (H + KVH + g) * D + tl.arange(0, D))
    tl.store(slot + c_kv + tl.arange(0, D), v)


@triton.jit(do_not_specialize=["N", "Tk"])  # one build serves every token and key bucket
def _prefill_attention_kernel(
    qkv_ptr, qn_ptr, cos_ptr, sin_ptr, kv_ptr, read_ptr, mask_ptr, span_ptr, out_ptr, N, Tk, eps,
    scale, stride_qkv, stride_cos, stride_mask, stride_out, c_kv, c_row, c_head,
    H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, BQ: tl.constexpr, BKV: tl.constexpr,
    F32: tl.constexpr, PDL: tl.constexpr = False,
):
    """Program (query block, head h): its queries' q = RoPE(q_norm(q)), then an online softmax
    over the step's keys ``read_rows[0..Tk)`` (cache rows, already holding this step's k/v)
    where ``mask[query, key]``; a query with no key (never a real one) gets zeros. Only the key
    blocks between its queries' first and last readable keys (``span [2, N]``) are visited: a
    block no query of the program may read would leave every sum as it is, bit for bit."""
    pdl_wait(PDL)
    HALF: tl.constexpr = D // 2
    h = tl.program_id(1)
    g = h // (H // KVH)
    qrows = tl.program_id(0) * BQ + tl.arange(0, BQ)
    qmask = qrows < N
    d = tl.arange(0, HALF)[None, :]
    q_at = qkv_ptr + qrows[:, None] * stride_qkv + h * D + d
    cos_lo, cos_hi, sin_lo, sin_hi = _cos_sin_halves(cos_ptr, sin_ptr, qrows, qmask, stride_cos,
                                                     HALF)
    q_lo, q_hi = head_norm_rope(tl.load(q_at, mask=qmask[:, None], other=0.0).to(tl.float32),
                           tl.load(q_at + HALF, mask=qmask[:, None], other=0.0).to(tl.float32),
                           qn_ptr, cos_lo, cos_hi, sin_lo, sin_hi, eps, D)
    q_lo, q_hi = q_lo.to(tl.bfloat16), q_hi.to(tl.bfloat16)  # bf16 values already
    m = tl.full([BQ], float("-inf"), dtype=tl.float32)
    total = tl.zeros([BQ], dtype=tl.float32)
    acc_lo = tl.zeros([BQ, HALF], dtype=tl.float32)
    acc_hi = tl.zeros([BQ, HALF], dtype=tl.float32)
    k_first = tl.min(tl.load(span_ptr + qrows, mask=qmask, other=Tk), axis=0)
    k_end = tl.max(tl.load(span_ptr + N + qrows, mask=qmask, other=0), axis=0) + 1
    for k0 in range(k_first // BKV * BKV, k_end, BKV):
        kcols = k0 + tl.arange(0, BKV)
        kmask = kcols < Tk
        krows = tl.load(read_ptr + kcols, mask=kmask, other=0)
        key = kv_ptr + krows[:, None] * c_row + g * c_head + d  # [BKV, HALF]
        k_lo = tl.load(key, mask=kmask[:, None], other=0.0)
        k_hi = tl.load(key + HALF, mask=kmask[:, None], other=0.0)
        ok = tl.load(mask_ptr + qrows[:, None] * stride_mask + kcols[None, :],
                     mask=qmask[:, None] & kmask[None, :], other=0) != 0
        qk = mm(q_lo, tl.trans(k_lo), F32) + mm(q_hi, tl.trans(k_hi), F32)
        s = tl.where(ok, qk * scale, float("-inf"))
        m, p, alpha, total = softmax_step(s, m, total)
        p16 = bf16(p).to(tl.bfloat16)  # as flash attention rounds P for P @ V
        acc_lo = acc_lo * alpha[:, None] + mm(p16, tl.load(key + c_kv, mask=kmask[:, None],
                                                           other=0.0), F32)
        acc_hi = acc_hi * alpha[:, None] + mm(p16, tl.load(key + c_kv + HALF,
                                                           mask=kmask[:, None], other=0.0), F32)
    inv = 1.0 / tl.where(total > 0, total, 1.0)
    out = out_ptr + qrows[:, None] * stride_out + h * D + d
    tl.store(out, bf16(acc_lo * inv[:, None]).to(tl.bfloat16), mask=qmask[:, None])
    tl.store(out + HALF, bf16(acc_hi * inv[:, None]).to(tl.bfloat16), mask=qmask[:, None])


class FusedBackbonePrefill:
    """The backbone's forward for PREFILL steps of up to ``max_tokens`` packed tokens
    (``Qwen3Backbone.forward`` with a packed-form ``GatherKV``), as 6 launches per layer (see the
    module docstring); longer steps run the eager backbone.

    Needs ``BreezeModel.fuse_projections_()`` first (packed q/k/v and gate/up weights).
    """

    def __init__(self, model: torch.nn.Module, max_tokens: int, tiles: Tiles | None = None,
                 warm: bool = True) -> None:
        backbone = model.backbone_model
        cfg = backbone.cfg
        self.backbone = backbone
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.eps = cfg.rms_norm_eps
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        self.max_tokens = max_tokens
        device = backbone.norm.weight.device
        self.gemms = backbone_gemms(backbone, tiles, max_tokens, "fused prefill kernels")
        if self.heads % self.kv_heads or self.head_dim & (self.head_dim - 1) or self.head_dim < 32:
            raise ValueError("fused prefill kernels need whole query groups and a power-of-two "
                             "head_dim of at least 32")
        if warm and device.type == "cuda":
            self.warm()

    @torch.inference_mode()
    def warm(self) -> None:
        """Builds every kernel variant (one per GEMM row-block size) now, on a one-block
        scratch cache: a Triton build in the middle of serving stalls every stream."""
        weight = self.backbone.norm.weight
        layers, keys = len(self.backbone.layers), 16  # key buckets are multiples of 16: so are
        for tokens in warm_row_counts(self.max_tokens):  # the mask strides Triton specialises on
            kv = torch.zeros(layers, 2, max(tokens, keys) + 1, self.kv_heads, self.head_dim,
                             dtype=weight.dtype, device=weight.device)
            rows = torch.arange(tokens, device=weight.device)
            mask = (torch.arange(keys, device=weight.device)[None, :] <= rows[:, None])
            embeds = torch.zeros(tokens, weight.shape[0], dtype=weight.dtype,
                                 device=weight.device)
            self(embeds, rows, GatherKV(kv, rows, torch.arange(keys, device=weight.device),
                                        mask))

    def __call__(self, embeds: torch.Tensor, positions: torch.Tensor, view: GatherKV) -> torch.Tensor:
        """``Qwen3Backbone.forward`` for a prefill step: ``embeds [N, D]`` of the packed new
        tokens and a packed-form ``view`` (``read_rows [Tk]``, ``mask [N, Tk]`` as
        ``PagedKVCache.packed_meta`` builds them) -> final-normed hidden ``[N, D]``; writes the
        new k/v at ``view.write_rows``."""
        backbone, gemms = self.backbone, self.gemms
        tokens = embeds.shape[0]
        if tokens > self.max_tokens:
            return backbone(embeds, positions, view)
        pdl = pdl_launch(gemms.tiles.pdl)
        cos, sin = backbone.rope.cos_sin(positions, embeds.dtype)  # [N, head_dim]
        x = embeds.contiguous()
        attn = torch.empty(tokens, self.heads * self.head_dim, dtype=x.dtype, device=x.device)
        mask = view.mask.view(torch.uint8)  # [N, Tk], one byte a key
        keys = view.read_rows.shape[0]
        # each query's first and last readable key (a query that reads none: all of them)
        readable = view.mask.to(torch.int32)
        span = torch.stack([readable.argmax(dim=1),
                            keys - 1 - readable.flip(1).argmax(dim=1)]).to(torch.int32)
        h, kvh, hd = self.heads, self.kv_heads, self.head_dim
        for layer, store in zip(backbone.layers, view.kv):
            attn_mod = layer.self_attn
            qkv = gemms.norm_linear(x, layer.input_layernorm.weight, attn_mod.qkv_weight,
                                    self.eps)
            c = store.stride()  # [2, rows, KVH, D]
            _prefill_kv_kernel[(tokens, kvh)](
                qkv, attn_mod.k_norm.weight, cos, sin, store, view.write_rows,
                attn_mod.k_norm.eps, qkv.stride(0), cos.stride(0), c[0], c[1], c[2],
                H=h, KVH=kvh, D=hd, num_warps=1, **pdl,
            )
            _prefill_attention_kernel[(triton.cdiv(tokens, QUERY_BLOCK), h)](
                qkv, attn_mod.q_norm.weight, cos, sin, store, view.read_rows, mask, span, attn,
                tokens, keys, attn_mod.q_norm.eps, self.scale, qkv.stride(0), cos.stride(0),
                mask.stride(0), attn.stride(0), c[0], c[1], c[2],
                H=h, KVH=kvh, D=hd, BQ=QUERY_BLOCK, BKV=KEY_BLOCK, F32=DOT_F32, num_warps=4,
                **pdl,
            )
            x = gemms.linear_residual(attn, attn_mod.o_proj.weight, x)
            act = gemms.norm_gate_up(x, layer.post_attention_layernorm.weight,
                                     layer.mlp.gate_up_weight, self.eps)
            x = gemms.linear_residual(act, layer.mlp.down_proj.weight, x)
        return backbone.norm(x)
