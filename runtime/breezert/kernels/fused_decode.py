"""Hand-fused backbone DECODE step (one new token per row): 6 Triton launches per Qwen3 layer.

Owns: the decode-attention kernel and ``FusedBackboneDecode``, a drop-in for the backbone's
forward in the DECODE stage (``stages/backbone.backbone_decode(..., backbone=...)``). Per layer:
  1. input RMSNorm + packed q/k/v GEMM (``gemm.norm_linear``);
  2. attention, split over the context (flash-decoding): one program per row x KV head x
     256-token split does q/k RMSNorm (QK-norm) and RoPE, online softmax over its split of the
     row's cached tokens (read in place through ``read_rows``, 64-token tiles, both products on
     tensor cores with the KV head's query heads padded to 16 rows; a split past the row's
     length does nothing), and split 0 writes the new k/v into the paged cache and counts the
     new token from registers; a second small launch joins the splits in a fixed order;
  3. o_proj, split-K, + residual; 4. RMSNorm + gate/up + SiLU * up; 5. down, split-K, + residual.
NOTE(kernels): the context splits give each SM several independent chains of tiles (one
program per row x KV head was one serial chain each: bench/README.md). The eager decode runs
~43 launches per layer, among them a gather of every row's padded context before SDPA; here
attention reads the paged rows in place and stops at each row's length. Must not: run prefill
(several new tokens per sequence keep the eager ``GatherKV`` path) or choose cache rows
(``decode_meta_on_device`` does).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from breezert.kernels.gemm import (
    DOT_F32,
    FusedGemms,
    Tiles,
    bf16,
    check_bf16,
    head_norm_rope,
    mm,
    pdl_launch,
    pdl_wait,
    warm_row_counts,
)
from breezert.layers.attention import GatherKV


_DOT_F32 = tl.constexpr(DOT_F32)


@triton.jit
def _attend_tile(q_lo, q_hi, m, total, acc_lo, acc_hi, kv_ptr, read_ptr, step, cached, c_kv,
                 c_row, c_head, g, scale, D: tl.constexpr, BT: tl.constexpr):
    """Online softmax over cached tokens ``step*BT ..`` (< ``cached``) of one row and KV head,
    both products on tensor cores: S = q K^T and P V as ``tl.dot`` of bf16 (q holds bf16 values
    already; P is rounded to bf16 as flash attention rounds it), fp32 accumulators. ``q_lo`` /
    ``q_hi``: ``[GR, D/2]``, GR >= 16 rows (tl.dot's least M)."""
    HALF: tl.constexpr = D // 2
    t = step * BT + tl.arange(0, BT)
    live = t < cached
    rows = tl.load(read_ptr + t, mask=live, other=0)
    key = kv_ptr + rows[:, None] * c_row + g * c_head + tl.arange(0, HALF)[None, :]
    k_lo = tl.load(key, mask=live[:, None], other=0.0)  # [BT, HALF] bf16
    k_hi = tl.load(key + HALF, mask=live[:, None], other=0.0)
    s = (mm(q_lo.to(tl.bfloat16), tl.trans(k_lo), _DOT_F32)
         + mm(q_hi.to(tl.bfloat16), tl.trans(k_hi), _DOT_F32)) * scale  # [GR, BT]
    s = tl.where(live[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(s - m_new[:, None])
    total = total * alpha + tl.sum(p, axis=1)
    p = bf16(p).to(tl.bfloat16)  # rounded to nearest even, under the interpreter too
    v_lo = tl.load(key + c_kv, mask=live[:, None], other=0.0)
    v_hi = tl.load(key + c_kv + HALF, mask=live[:, None], other=0.0)
    acc_lo = acc_lo * alpha[:, None] + mm(p, v_lo, _DOT_F32)
    acc_hi = acc_hi * alpha[:, None] + mm(p, v_hi, _DOT_F32)
    return m_new, total, acc_lo, acc_hi


# One build serves every context bucket and batch: the split count is not specialised on.
@triton.jit(do_not_specialize=["stride_read", "num_splits"])
def _decode_attention_kernel(
    qkv_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, kv_ptr, write_ptr, read_ptr, len_ptr, part_ptr,
    eps, scale, stride_qkv, stride_cos, stride_read, c_kv, c_row, c_head, num_splits,
    H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, BT: tl.constexpr,
    SPLIT_TILES: tl.constexpr, GR: tl.constexpr, STAGES: tl.constexpr, TILE: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Program (row r, KV head g, split s): its G = H / KVH query heads (padded with zero rows
    to ``GR``) over cached tokens ``s * SPLIT_TILES * BT ..`` of the row, a ``TILE`` step
    (``_attend_tile``) for each ``BT`` of them, the loop's loads pipelined over ``STAGES`` (None:
    the launch's default); split 0 also writes the new k/v into the cache and counts the new
    token. Writes the split's running max, sum and unnormalised output (fp32) to ``part_ptr``;
    ``_decode_combine_kernel`` joins the splits. A split past the row's cached tokens does
    nothing (the combine skips it)."""
    pdl_wait(PDL)
    r = tl.program_id(0)
    g = tl.program_id(1)
    s = tl.program_id(2)
    G: tl.constexpr = H // KVH
    HALF: tl.constexpr = D // 2
    cached = tl.load(len_ptr + r) - 1  # tokens before this one
    if (s == 0) | (s * SPLIT_TILES * BT < cached):
        qrow = tl.arange(0, GR)
        real = qrow < G
        heads = g * G + qrow
        d = tl.arange(0, HALF)
        dd = d[None, :]
        row = qkv_ptr + r * stride_qkv
        cos_lo = tl.load(cos_ptr + r * stride_cos + dd).to(tl.float32)  # [1, HALF]
        cos_hi = tl.load(cos_ptr + r * stride_cos + HALF + dd).to(tl.float32)
        sin_lo = tl.load(sin_ptr + r * stride_cos + dd).to(tl.float32)
        sin_hi = tl.load(sin_ptr + r * stride_cos + HALF + dd).to(tl.float32)
        q = row + heads[:, None] * D + dd
        q_lo, q_hi = head_norm_rope(
            tl.load(q, mask=real[:, None], other=0.0).to(tl.float32),
            tl.load(q + HALF, mask=real[:, None], other=0.0).to(tl.float32),
            qn_ptr, cos_lo, cos_hi, sin_lo, sin_hi, eps, D,
        )  # [GR, HALF] each; the padding rows stay 0
        m = tl.full([GR], float("-inf"), dtype=tl.float32)
        total = tl.zeros([GR], dtype=tl.float32)
        acc_lo = tl.zeros([GR, HALF], dtype=tl.float32)
        acc_hi = tl.zeros([GR, HALF], dtype=tl.float32)
        if s == 0:  # the new token: write it, and seed the softmax with it (probability 1)
            k_col = row + (H + g) * D
            k_lo, k_hi = head_norm_rope(
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
            m = (tl.sum(q_lo * k_lo, axis=1) + tl.sum(q_hi * k_hi, axis=1)) * scale  # [GR]
            total += 1.0
            acc_lo += v_lo
            acc_hi += v_hi
        read = read_ptr + r * stride_read
        # a tile past the row's tokens is all masked: no change
        for i in tl.range(0, SPLIT_TILES, num_stages=STAGES):
            m, total, acc_lo, acc_hi = TILE(
                q_lo, q_hi, m, total, acc_lo, acc_hi, kv_ptr, read, s * SPLIT_TILES + i, cached,
                c_kv, c_row, c_head, g, scale, D, BT)
        # part layout: [rows, KVH, num_splits, G, D + 2] fp32 = output, max, sum
        base = part_ptr + (((r * KVH + g) * num_splits + s) * G + qrow) * (D + 2)
        tl.store(base[:, None] + dd, acc_lo, mask=real[:, None])
        tl.store(base[:, None] + HALF + dd, acc_hi, mask=real[:, None])
        tl.store(base + D, m, mask=real)
        tl.store(base + D + 1, total, mask=real)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_combine_kernel(part_ptr, len_ptr, out_ptr, stride_out, num_splits,
                           KVH: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                           SPLIT_T: tl.constexpr, MAX_SPLITS: tl.constexpr,
                           PDL: tl.constexpr = False):
    """Program (row r, KV head g): joins the splits that ran (all at once, the others masked to
    exact zeros) and writes the G heads' output in bf16. Split token ranges and the reduction
    over ``MAX_SPLITS`` are fixed, so a row's result does not depend on its batch or bucket."""
    pdl_wait(PDL)
    r = tl.program_id(0)
    g = tl.program_id(1)
    cached = tl.load(len_ptr + r) - 1
    s = tl.arange(0, MAX_SPLITS)
    live = (s < num_splits) & ((s == 0) | (s * SPLIT_T < cached))  # [S]
    heads = tl.arange(0, G)
    d = tl.arange(0, D)
    base = part_ptr + (((r * KVH + g) * num_splits + s[:, None]) * G + heads[None, :]) * (D + 2)
    m = tl.load(base + D, mask=live[:, None], other=float("-inf"))  # [S, G]
    w = tl.exp(m - tl.max(m, axis=0)[None, :])  # 0 for the splits that did not run
    total = tl.sum(w * tl.load(base + D + 1, mask=live[:, None], other=0.0), axis=0)  # [G]
    acc = tl.load(base[:, :, None] + d[None, None, :], mask=live[:, None, None], other=0.0)
    acc = tl.sum(w[:, :, None] * acc, axis=0)  # [G, D]
    out = out_ptr + r * stride_out + (g * G + heads)[:, None] * D + d[None, :]
    tl.store(out, bf16(acc / total[:, None]).to(tl.bfloat16))


ATTENTION_TILE = 64
"""Cached tokens a step of the attention's tile loop (the N of S = q K^T)."""
SPLIT_TOKENS = 256
"""Cached tokens a split program reads (flash-decoding's context split)."""
ATTENTION_WARPS, ATTENTION_STAGES = 4, 3
"""The attention's launch: warps, and the tile loop's pipeline depth. With ``ATTENTION_TILE``
and ``SPLIT_TOKENS``: ``dot:64/256/4/3`` of ``bench/decode_attention_ab.py``, within a few % of
its best shape at 64-512 rows x 256-2048 tokens on the H100 and ~2x as fast as the elementwise
kernel it replaced (32/128/4, CUDA-core products), at the same difference from fp32."""
GROUP_ROWS = 16
"""Query rows a program multiplies at least: a KV head's query heads padded for tl.dot."""
MIN_COMBINE_SPLITS = 16
"""The combine reduces over at least this many splits (4096 tokens at 256 per split), so
every context bucket up to that gives the same bits; a longer bucket reduces over more
(another build, and a row's bits may then differ from the shorter buckets')."""


def decode_attention(qkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor, kv: torch.Tensor,
                     write_rows: torch.Tensor, read_rows: torch.Tensor, lengths: torch.Tensor,
                     part: torch.Tensor, out: torch.Tensor, eps: float, scale: float, heads: int,
                     *, split_tokens: int = SPLIT_TOKENS, tile: int = ATTENTION_TILE,
                     warps: int = ATTENTION_WARPS, stages: int | None = ATTENTION_STAGES,
                     step: object = _attend_tile, min_rows: int = GROUP_ROWS,
                     pdl: bool = False) -> None:
    """One layer's DECODE attention (QK-norm with weights ``q_norm``/``k_norm`` and ``eps``, RoPE
    by ``cos``/``sin [R, D]``) and its split combine, as two launches: ``qkv [R, (H + 2 KVH) D]``
    the new tokens' packed projections, ``kv [2, slots, KVH, D]`` the layer's paged cache (the new
    k/v written at ``write_rows``, each row's cached ones read through ``read_rows [R, T]``, the
    first ``lengths - 1`` of them), ``part [R, KVH, cdiv(T, split_tokens), G, D + 2]`` fp32
    scratch -> ``out [R, H * D]`` bf16. No host sync, no allocation: CUDA graphs capture it.
    ``step``, ``min_rows`` and ``stages``: the tile step (``_attend_tile``), the query rows it
    takes at least and the loop's pipeline depth; ``bench/decode_attention_ab.py`` runs the
    elementwise step this kernel replaced through them."""
    rows, kv_heads, d = qkv.shape[0], kv.shape[2], kv.shape[3]
    group = heads // kv_heads
    splits = triton.cdiv(read_rows.shape[1], split_tokens)
    if part.shape != (rows, kv_heads, splits, group, d + 2) or split_tokens % tile:
        raise ValueError(f"part {tuple(part.shape)} for {splits} splits of {split_tokens} tokens "
                         f"(a multiple of the {tile}-token tile)")
    c = kv.stride()  # [2, slots, KVH, D]
    _decode_attention_kernel[(rows, kv_heads, splits)](
        qkv, q_norm, k_norm, cos, sin, kv, write_rows, read_rows, lengths, part, eps, scale,
        qkv.stride(0), cos.stride(0), read_rows.stride(0), c[0], c[1], c[2], splits, H=heads,
        KVH=kv_heads, D=d, BT=tile, SPLIT_TILES=split_tokens // tile,
        GR=max(min_rows, group), STAGES=stages, TILE=step, num_warps=warps, **pdl_launch(pdl),
    )
    # one combine build up to MIN_COMBINE_SPLITS splits
    _decode_combine_kernel[(rows, kv_heads)](
        part, lengths, out, out.stride(0), splits, KVH=kv_heads, G=group, D=d,
        SPLIT_T=split_tokens, MAX_SPLITS=max(MIN_COMBINE_SPLITS, triton.next_power_of_2(splits)),
        num_warps=4, **pdl_launch(pdl),
    )


DECODE_TILES = Tiles()
"""The DECODE step's launch shapes (``worker/compile.decode_fn``): ``Tiles()``, the depth
layers' first tuned shapes; ``bench/tune_fused_decode.py`` searches the fields that keep the
bits."""


def backbone_gemms(backbone: torch.nn.Module, tiles: Tiles | None, max_rows: int,
                   kernels: str) -> FusedGemms:
    """The fused GEMMs of the backbone's layers (norm + q/k/v, o_proj, gate/up, down) for up to
    ``max_rows`` rows, shared by the DECODE and PREFILL steps (``tiles``: default
    ``DECODE_TILES``). Raises ValueError (naming ``kernels``) for weights that are not bf16, do
    not fit the tiles, or are not packed yet."""
    cfg = backbone.cfg
    check_bf16(backbone.norm.weight, "backbone")
    gemms = FusedGemms(tiles or DECODE_TILES, max_rows, cfg.hidden_size,
                       backbone.norm.weight.device)
    d, attn_width = cfg.hidden_size, cfg.num_heads * cfg.head_dim
    gemms.check("backbone hidden_size", norm_k=d,
                linear=((cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim, d),
                split=(d, attn_width))
    gemms.check("backbone intermediate_size", gate_up=(cfg.intermediate_size, d),
                split=(d, cfg.intermediate_size))
    if any(layer.self_attn.qkv_weight is None or layer.mlp.gate_up_weight is None
           for layer in backbone.layers):
        raise ValueError(f"{kernels} need BreezeModel.fuse_projections_() first")
    return gemms


class FusedBackboneDecode:
    """The backbone's forward for DECODE steps (``Qwen3Backbone.forward`` with a decode-form
    ``GatherKV``), as 5 launches per layer (see the module docstring).

    Needs ``BreezeModel.fuse_projections_()`` first (packed q/k/v and gate/up weights).
    """

    def __init__(self, model: torch.nn.Module, max_rows: int, tiles: Tiles | None = None,
                 split_tokens: int = SPLIT_TOKENS, warm: bool = True) -> None:
        """``tiles``: default ``DECODE_TILES``; ``warm``: build every kernel variant now (on
        CUDA)."""
        backbone = model.backbone_model
        cfg = backbone.cfg
        self.backbone = backbone
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.eps = cfg.rms_norm_eps
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        device = backbone.norm.weight.device
        self.gemms = backbone_gemms(backbone, tiles, max_rows, "fused decode kernels")
        group = self.heads // self.kv_heads
        if group * self.kv_heads != self.heads or group & (group - 1) or self.head_dim & (
                self.head_dim - 1):
            raise ValueError("fused decode kernels need power-of-two head_dim and query groups")
        if split_tokens % ATTENTION_TILE:
            raise ValueError(f"split_tokens={split_tokens} must be a multiple of "
                             f"{ATTENTION_TILE}")
        self.split_tokens = split_tokens
        self.max_rows = max_rows
        if warm and device.type == "cuda":
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

    def __call__(self, embeds: torch.Tensor, positions: torch.Tensor,
                 view: GatherKV) -> torch.Tensor:
        """``Qwen3Backbone.forward`` for a decode step: ``embeds [R, D]`` of one new token per
        row and a decode-form ``view`` (metadata as ``decode_meta_on_device`` builds it:
        ``mask [R, 1, 1, T]`` a prefix of each row's ``read_rows``, the new token last) ->
        final-normed hidden ``[R, D]``; writes the new k/v at ``view.write_rows``."""
        kv, write_rows, read_rows, mask = view.kv, view.write_rows, view.read_rows, view.mask
        backbone, gemms = self.backbone, self.gemms
        pdl = gemms.tiles.pdl
        rows = embeds.shape[0]
        cos, sin = backbone.rope.cos_sin(positions, embeds.dtype)  # [R, head_dim]
        lengths = mask.reshape(rows, -1).sum(dim=1)  # valid keys per row, the new one included
        x = embeds.contiguous()
        attn = torch.empty(rows, self.heads * self.head_dim, dtype=x.dtype, device=x.device)
        group, d = self.heads // self.kv_heads, self.head_dim
        splits = triton.cdiv(read_rows.shape[1], self.split_tokens)
        part = torch.empty(rows, self.kv_heads, splits, group, d + 2, dtype=torch.float32,
                           device=x.device)
        for layer, store in zip(backbone.layers, kv):
            sa = layer.self_attn
            qkv = gemms.norm_linear(x, layer.input_layernorm.weight, sa.qkv_weight, self.eps)
            decode_attention(qkv, sa.q_norm.weight, sa.k_norm.weight, cos, sin, store,
                             write_rows, read_rows, lengths, part, attn, sa.q_norm.eps,
                             self.scale, self.heads, split_tokens=self.split_tokens, pdl=pdl)
            x = gemms.linear_residual(attn, sa.o_proj.weight, x)
            act = gemms.norm_gate_up(x, layer.post_attention_layernorm.weight,
                                     layer.mlp.gate_up_weight, self.eps)
            x = gemms.linear_residual(act, layer.mlp.down_proj.weight, x)
        return backbone.norm(x)
