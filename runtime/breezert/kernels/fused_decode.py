"""Hand-fused backbone DECODE step (one new token per row): 5 Triton launches per Qwen3 layer.

Owns: the decode-attention kernel and ``FusedBackboneDecode``, a drop-in for the backbone's
forward in the DECODE stage (``stages/backbone.backbone_decode(..., backbone=...)``). Per layer:
  1. input RMSNorm + packed q/k/v GEMM (``gemm.norm_linear``);
  2. one program per row x KV head: q/k RMSNorm (QK-norm), RoPE, the new k/v written into the
     paged cache, attention over the row's cached tokens (read through its ``read_rows``, only
     the ``length - 1`` valid ones) plus the new token from registers, online softmax;
  3. o_proj, split-K, + residual; 4. RMSNorm + gate/up + SiLU * up; 5. down, split-K, + residual.
NOTE(kernels): the eager decode runs ~43 launches per layer (1220 per step at 16 rows on the
H200, 4.4 ms in a graph against a 0.66 ms weight-read floor), among them a gather of every row's
padded context into a contiguous copy before SDPA; here attention reads the paged rows in
place and stops at each row's length. Must not: run prefill (several new tokens per sequence
keep the eager ``GatherKV`` path) or choose cache rows (``PagedKVCache.decode_meta`` does).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from breezert.kernels.gemm import (
    INTERPRETED,
    FusedGemms,
    Tiles,
    bf16,
    check_bf16,
    rope,
    warm_row_counts,
)
from breezert.worker.kv_cache import GatherKV


@triton.jit
def _rms_rope(lo, hi, w_ptr, cos_lo, cos_hi, sin_lo, sin_hi, eps, D: tl.constexpr):
    """RMSNorm over each head (rows of ``lo``/``hi`` ``[heads, D/2]``, fp32 of bf16 values) then
    RoPE, at ``RMSNorm``'s and ``apply_rope``'s bf16 rounding points."""
    HALF: tl.constexpr = D // 2
    d = tl.arange(0, HALF)
    rstd = 1.0 / tl.sqrt((tl.sum(lo * lo, axis=1) + tl.sum(hi * hi, axis=1)) / D + eps)
    w_lo = tl.load(w_ptr + d).to(tl.float32)[None, :]
    w_hi = tl.load(w_ptr + HALF + d).to(tl.float32)[None, :]
    n_lo = bf16(w_lo * bf16(lo * rstd[:, None]))
    n_hi = bf16(w_hi * bf16(hi * rstd[:, None]))
    return rope(n_lo, n_hi, cos_lo, cos_hi, sin_lo, sin_hi)


@triton.jit
def _attend_tile(q_lo, q_hi, m, total, acc_lo, acc_hi, kv_ptr, read_ptr, step, cached, c_kv,
                 c_row, c_head, g, scale, D: tl.constexpr, BT: tl.constexpr):
    """Online softmax over cached tokens ``step*BT ..`` (< ``cached``) of one row and KV head."""
    HALF: tl.constexpr = D // 2
    d = tl.arange(0, HALF)
    t = step * BT + tl.arange(0, BT)
    live = t < cached
    rows = tl.load(read_ptr + t, mask=live, other=0)
    key = kv_ptr + rows[:, None] * c_row + g * c_head + d[None, :]
    kt_lo = tl.load(key, mask=live[:, None], other=0.0).to(tl.float32)  # [BT, HALF]
    kt_hi = tl.load(key + HALF, mask=live[:, None], other=0.0).to(tl.float32)
    s = (tl.sum(q_lo[:, None, :] * kt_lo[None, :, :], axis=2)
         + tl.sum(q_hi[:, None, :] * kt_hi[None, :, :], axis=2)) * scale  # [G, BT]
    s = tl.where(live[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(s - m_new[:, None])
    total = total * alpha + tl.sum(p, axis=1)
    p = bf16(p)  # as flash attention rounds P for P @ V
    vt_lo = tl.load(key + c_kv, mask=live[:, None], other=0.0).to(tl.float32)
    vt_hi = tl.load(key + c_kv + HALF, mask=live[:, None], other=0.0).to(tl.float32)
    acc_lo = acc_lo * alpha[:, None] + tl.sum(p[:, :, None] * vt_lo[None, :, :], axis=1)
    acc_hi = acc_hi * alpha[:, None] + tl.sum(p[:, :, None] * vt_hi[None, :, :], axis=1)
    return m_new, total, acc_lo, acc_hi


@triton.jit(do_not_specialize=["stride_read"])  # one build serves every context bucket
def _decode_attention_kernel(
    qkv_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, kv_ptr, write_ptr, read_ptr, len_ptr, out_ptr,
    eps, scale, stride_qkv, stride_cos, stride_read, stride_out, c_kv, c_row, c_head,
    H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, BT: tl.constexpr,
    STATIC_TILES: tl.constexpr,
):
    """Program (row r, KV head g): its G = H / KVH query heads."""
    r = tl.program_id(0)
    g = tl.program_id(1)
    G: tl.constexpr = H // KVH
    HALF: tl.constexpr = D // 2
    heads = g * G + tl.arange(0, G)
    d = tl.arange(0, HALF)
    dd = d[None, :]
    row = qkv_ptr + r * stride_qkv
    cos_lo = tl.load(cos_ptr + r * stride_cos + dd).to(tl.float32)  # [1, HALF]
    cos_hi = tl.load(cos_ptr + r * stride_cos + HALF + dd).to(tl.float32)
    sin_lo = tl.load(sin_ptr + r * stride_cos + dd).to(tl.float32)
    sin_hi = tl.load(sin_ptr + r * stride_cos + HALF + dd).to(tl.float32)
    q_lo, q_hi = _rms_rope(
        tl.load(row + heads[:, None] * D + dd).to(tl.float32),
        tl.load(row + heads[:, None] * D + HALF + dd).to(tl.float32),
        qn_ptr, cos_lo, cos_hi, sin_lo, sin_hi, eps, D,
    )  # [G, HALF] each
    k_col = row + (H + g) * D
    k_lo, k_hi = _rms_rope(
        tl.load(k_col + dd).to(tl.float32), tl.load(k_col + HALF + dd).to(tl.float32),
        kn_ptr, cos_lo, cos_hi, sin_lo, sin_hi, eps, D,
    )  # [1, HALF] each
    v_col = row + (H + KVH + g) * D
    v_lo = tl.load(v_col + dd).to(tl.float32)
    v_hi = tl.load(v_col + HALF + dd).to(tl.float32)
    slot = kv_ptr + tl.load(write_ptr + r) * c_row + g * c_head
    tl.store(slot + dd, k_lo.to(tl.bfloat16))
    tl.store(slot + HALF + dd, k_hi.to(tl.bfloat16))
    tl.store(slot + c_kv + dd, v_lo.to(tl.bfloat16))
    tl.store(slot + c_kv + HALF + dd, v_hi.to(tl.bfloat16))
    # Online softmax, seeded with the new token (its probability is exp(0) = 1).
    m = (tl.sum(q_lo * k_lo, axis=1) + tl.sum(q_hi * k_hi, axis=1)) * scale  # [G]
    total = tl.full([G], 1.0, dtype=tl.float32)
    acc_lo = tl.zeros([G, HALF], dtype=tl.float32) + v_lo
    acc_hi = tl.zeros([G, HALF], dtype=tl.float32) + v_hi
    cached = tl.load(len_ptr + r) - 1  # tokens before this one
    read = read_ptr + r * stride_read
    if STATIC_TILES > 0:  # Triton's interpreter: loop bounds must be constants
        for step in range(STATIC_TILES):
            if step * BT < cached:
                m, total, acc_lo, acc_hi = _attend_tile(
                    q_lo, q_hi, m, total, acc_lo, acc_hi, kv_ptr, read, step, cached, c_kv,
                    c_row, c_head, g, scale, D, BT)
    else:  # GPU: stop at this row's length (the loop pipelines)
        for step in range(tl.cdiv(cached, BT)):
            m, total, acc_lo, acc_hi = _attend_tile(
                q_lo, q_hi, m, total, acc_lo, acc_hi, kv_ptr, read, step, cached, c_kv, c_row,
                c_head, g, scale, D, BT)
    out = out_ptr + r * stride_out + heads[:, None] * D + d[None, :]
    tl.store(out, bf16(acc_lo / total[:, None]).to(tl.bfloat16))
    tl.store(out + HALF, bf16(acc_hi / total[:, None]).to(tl.bfloat16))


class FusedBackboneDecode:
    """The backbone's forward for DECODE steps (``Qwen3Backbone.forward`` with a decode-form
    ``GatherKV``), as 5 launches per layer (see the module docstring).

    Needs ``BreezeModel.fuse_projections_()`` first (packed q/k/v and gate/up weights).
    """

    ATTENTION_TILE = 32  # cached tokens per attention iteration

    def __init__(self, model: torch.nn.Module, max_rows: int, tiles: Tiles | None = None) -> None:
        backbone = model.backbone_model
        cfg = backbone.cfg
        self.backbone = backbone
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.eps = cfg.rms_norm_eps
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        device = backbone.norm.weight.device
        self.gemms = gemms = FusedGemms(tiles or Tiles(), max_rows, cfg.hidden_size, device)
        check_bf16(backbone.norm.weight, "backbone")
        d, attn_width = cfg.hidden_size, self.heads * self.head_dim
        gemms.check("backbone hidden_size", norm_k=d,
                    linear=((self.heads + 2 * self.kv_heads) * self.head_dim, d),
                    split=(d, attn_width))
        gemms.check("backbone intermediate_size", gate_up=(cfg.intermediate_size, d),
                    split=(d, cfg.intermediate_size))
        group = self.heads // self.kv_heads
        if group * self.kv_heads != self.heads or group & (group - 1) or self.head_dim & (
                self.head_dim - 1):
            raise ValueError("fused decode kernels need power-of-two head_dim and query groups")
        if any(layer.self_attn.qkv_weight is None or layer.mlp.gate_up_weight is None
               for layer in backbone.layers):
            raise ValueError("fused decode kernels need BreezeModel.fuse_projections_() first")
        self.max_rows = max_rows
        if device.type == "cuda":
            self.warm()

    @property
    def counters(self) -> torch.Tensor:
        return self.gemms.counters

    @torch.inference_mode()
    def warm(self) -> None:
        """Builds every kernel variant (one per row-block size) now, on a one-block scratch
        cache: a Triton build in the middle of serving stalls every stream for seconds."""
        weight = self.backbone.norm.weight
        layers = len(self.backbone.layers)
        kv = torch.zeros(layers, 2, 16, self.kv_heads, self.head_dim, dtype=weight.dtype,
                         device=weight.device)
        for rows in warm_row_counts(self.max_rows):
            zeros = torch.zeros(rows, dtype=torch.long, device=weight.device)
            read = torch.zeros(rows, 16, dtype=torch.long, device=weight.device)
            mask = torch.zeros(rows, 1, 1, 16, dtype=torch.bool, device=weight.device)
            mask[..., :4] = True
            embeds = torch.zeros(rows, weight.shape[0], dtype=weight.dtype, device=weight.device)
            self(embeds, zeros, GatherKV(kv, zeros, read, mask))

    def __call__(self, embeds: torch.Tensor, positions: torch.Tensor, view: GatherKV) -> torch.Tensor:
        """``Qwen3Backbone.forward`` for a decode step: ``embeds [R, D]`` of one new token per
        row and a decode-form ``view`` (metadata as ``PagedKVCache.decode_meta`` builds it:
        ``mask [R, 1, 1, T]`` a prefix of each row's ``read_rows``, the new token last) ->
        final-normed hidden ``[R, D]``; writes the new k/v at ``view.write_rows``."""
        kv, write_rows, read_rows, mask = view.kv, view.write_rows, view.read_rows, view.mask
        backbone, gemms = self.backbone, self.gemms
        rows = embeds.shape[0]
        cos, sin = backbone.rope.cos_sin(positions, embeds.dtype)  # [R, head_dim]
        lengths = mask.reshape(rows, -1).sum(dim=1)  # valid keys per row, the new one included
        x = embeds.contiguous()
        attn = torch.empty(rows, self.heads * self.head_dim, dtype=x.dtype, device=x.device)
        # Only the interpreter needs a constant trip count (a power of two: few builds).
        static_tiles = (triton.next_power_of_2(triton.cdiv(read_rows.shape[1], self.ATTENTION_TILE))
                        if INTERPRETED else 0)
        for layer, store in zip(backbone.layers, kv):
            qkv = gemms.norm_linear(x, layer.input_layernorm.weight, layer.self_attn.qkv_weight,
                                    self.eps)
            c = store.stride()  # [2, rows, KVH, D]
            _decode_attention_kernel[(rows, self.kv_heads)](
                qkv, layer.self_attn.q_norm.weight, layer.self_attn.k_norm.weight, cos, sin,
                store, write_rows, read_rows, lengths, attn, layer.self_attn.q_norm.eps,
                self.scale, qkv.stride(0), cos.stride(0), read_rows.stride(0), attn.stride(0),
                c[0], c[1], c[2], H=self.heads, KVH=self.kv_heads, D=self.head_dim,
                BT=self.ATTENTION_TILE, STATIC_TILES=static_tiles, num_warps=4,
            )
            x = gemms.linear_residual(attn, layer.self_attn.o_proj.weight, x)
            act = gemms.norm_gate_up(x, layer.post_attention_layernorm.weight,
                                     layer.mlp.gate_up_weight, self.eps)
            x = gemms.linear_residual(act, layer.mlp.down_proj.weight, x)
        return backbone.norm(x)
