"""Hand-fused depth-decoder layer step: 5 Triton launches per layer instead of ~19.

Owns: the kernels and ``FusedDepthLayers``, a drop-in for ``DepthDecoder.run_layers`` on CUDA.
Per layer and step (R rows, R <= 128 in our buckets):
  1. input RMSNorm + packed q/k/v GEMM + RoPE, q to a buffer and k/v into the frame cache;
  2. short-cache attention (<= 16 keys; one program per row x KV head, its query group at once);
  3. o_proj, split-K, + residual;
  4. post-attention RMSNorm + packed gate/up GEMM + SiLU(gate) * up;
  5. down_proj, split-K, + residual.
NOTE(kernels): why Triton rather than torch.compile here. The H200 census of one frame at batch
16 (bench/profile_stages.py) was 3579 launches with Inductor (default mode) and 10.7 ms of GPU
busy time for 2.2 ms of weight reads: the frame is launch- and tail-bound, and 1024-wide
outputs (o_proj, down) fill only 16-32 of 132 SMs. Split-K gives those GEMMs ~128 programs; the
last-arriving program of each output tile (an atomic counter) sums the partials in a fixed order,
so results are deterministic and do not depend on which program finishes last. Norms, RoPE and
SiLU run in the GEMM prologues/epilogues at the same bf16 rounding points as the eager modules.
Must not: sample, mix CFG branches or allocate per step beyond its outputs (the split-K
workspace and counters are preallocated, so CUDA graphs capture it).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# Triton 3.6's interpreter (CPU tests) mis-multiplies bf16 ``tl.dot`` operands and truncates
# fp32 -> bf16 instead of rounding to nearest even. Under it the kernels upcast dot operands to
# fp32 (the same exact products) and round to bf16 by hand, so the CPU tests check the real
# rounding points.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
_DOT_F32 = _INTERPRETED
_RNE_BY_HAND = tl.constexpr(_INTERPRETED)

BM_MAX = 64  # rows per program; more rows run as more row blocks


@dataclass(frozen=True)
class Tiles:
    """Launch shapes. The defaults won bench/tune_fused_depth.py on the H200 at 32 rows
    (bench/results/h200-tune-fused-depth-20261129.json): one frame of layer steps 8.8 ms, from
    10.1 ms with the first guess; num_stages 2 -> 4 alone was worth 2.4 ms.

    ``qkv_split``: programs per head (each takes matching slices of both RoPE halves), so
    12 heads give 48 programs; ``split_k``: K splits of o_proj/down (32 column tiles x 8 splits
    against the H200's 132 SMs)."""

    qkv_split: int = 4
    qkv_bk: int = 256
    gate_bn: int = 64
    gate_bk: int = 64
    split_k: int = 8
    split_bn: int = 32
    split_bk: int = 256
    num_warps: int = 4
    num_stages: int = 4


@triton.jit
def _mm(a, b, F32: tl.constexpr):
    """``a [M, K] @ b [K, N]`` -> fp32."""
    if F32:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def _bf16(x):
    """Rounds fp32 to bf16 (nearest even) and back: an eager module's bf16 output."""
    if _RNE_BY_HAND:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        out = bits.to(tl.float32, bitcast=True)
    else:
        out = x.to(tl.bfloat16).to(tl.float32)
    return out


@triton.jit
def _row_rstd(x_ptr, stride_x, rows, rmask, eps, K: tl.constexpr, BM: tl.constexpr,
              BK: tl.constexpr):
    """``1 / sqrt(mean(x^2) + eps)`` per row, in fp32 (``F.rms_norm`` of ``x.float()``)."""
    sq = tl.zeros([BM], dtype=tl.float32)
    for k0 in tl.static_range(0, K, BK):  # unrolled: every load is in flight at once
        cols = k0 + tl.arange(0, BK)
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=rmask[:, None],
                    other=0.0).to(tl.float32)
        sq += tl.sum(x * x, axis=1)
    return 1.0 / tl.sqrt(sq / K + eps)


@triton.jit
def _normed_tile(x_ptr, nw_ptr, stride_x, rows, rmask, rstd, cols):
    """RMSNorm of an input tile as ``RMSNorm.forward`` rounds it: ``bf16(w * bf16(x * rstd))``."""
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=rmask[:, None],
                other=0.0).to(tl.float32)
    w = tl.load(nw_ptr + cols).to(tl.float32)
    return _bf16(w[None, :] * _bf16(x * rstd[:, None])).to(tl.bfloat16)


@triton.jit(do_not_specialize=["R"])  # one build serves every row count
def _norm_qkv_rope_kernel(
    x_ptr, nw_ptr, w_ptr, cos_ptr, sin_ptr, pos_ptr, q_ptr, cache_ptr,
    R, eps, stride_x, stride_q, c_kv, c_row, c_head, c_pos,
    H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, K: tl.constexpr, SUB: tl.constexpr,
    BM: tl.constexpr, BK: tl.constexpr, NK: tl.constexpr, F32: tl.constexpr,
):
    """Program (head t x slice j, row block): q heads 0..H-1, then k heads, then v heads.
    Slice j covers columns j*C.. of both halves of the head (C = D / 2 / SUB), so RoPE's
    rotate-half pairs stay inside one program."""
    t = tl.program_id(0) // SUB
    HALF: tl.constexpr = D // 2
    C: tl.constexpr = HALF // SUB
    d = (tl.program_id(0) % SUB) * C + tl.arange(0, C)  # columns within the lower half
    rows = tl.program_id(1) * BM + tl.arange(0, BM)
    rmask = rows < R
    rstd = _row_rstd(x_ptr, stride_x, rows, rmask, eps, K, BM, NK)
    lo = t * D + d
    acc_lo = tl.zeros([BM, C], dtype=tl.float32)
    acc_hi = tl.zeros([BM, C], dtype=tl.float32)
    for k0 in range(0, K, BK):
        cols = k0 + tl.arange(0, BK)
        xn = _normed_tile(x_ptr, nw_ptr, stride_x, rows, rmask, rstd, cols)
        w_lo = tl.load(w_ptr + lo[:, None] * K + cols[None, :])
        w_hi = tl.load(w_ptr + (lo + HALF)[:, None] * K + cols[None, :])
        acc_lo += _mm(xn, tl.trans(w_lo), F32)
        acc_hi += _mm(xn, tl.trans(w_hi), F32)
    a_lo, a_hi = _bf16(acc_lo), _bf16(acc_hi)  # the packed GEMM's bf16 output
    if t < H + KVH:  # apply_rope: x * cos + rotate_half(x) * sin, each product rounded to bf16
        cos_lo = tl.load(cos_ptr + d).to(tl.float32)
        cos_hi = tl.load(cos_ptr + HALF + d).to(tl.float32)
        sin_lo = tl.load(sin_ptr + d).to(tl.float32)
        sin_hi = tl.load(sin_ptr + HALF + d).to(tl.float32)
        out_lo = _bf16(a_lo * cos_lo[None, :]) + _bf16(-a_hi * sin_lo[None, :])
        out_hi = _bf16(a_hi * cos_hi[None, :]) + _bf16(a_lo * sin_hi[None, :])
    else:
        out_lo, out_hi = a_lo, a_hi
    if t < H:
        dst = q_ptr + rows[:, None] * stride_q + t * D + d[None, :]
    else:
        pos = tl.load(pos_ptr)
        is_v = (t >= H + KVH).to(tl.int32)
        head = t - H - is_v * KVH
        dst = (cache_ptr + is_v * c_kv + rows[:, None] * c_row + head * c_head + pos * c_pos
               + d[None, :])
    tl.store(dst, _bf16(out_lo).to(tl.bfloat16), mask=rmask[:, None])
    tl.store(dst + HALF, _bf16(out_hi).to(tl.bfloat16), mask=rmask[:, None])


@triton.jit
def _short_attention_kernel(
    q_ptr, cache_ptr, pos_ptr, out_ptr, scale, stride_q, stride_out, c_kv, c_row, c_head, c_pos,
    G: tl.constexpr, D: tl.constexpr, P: tl.constexpr,
):
    """Program (row, KV head): its G query heads against cache slots 0..pos (<= P keys)."""
    r = tl.program_id(0)
    g = tl.program_id(1)
    pos = tl.load(pos_ptr)
    heads = g * G + tl.arange(0, G)
    d = tl.arange(0, D)
    slots = tl.arange(0, P)
    live = slots <= pos
    q = tl.load(q_ptr + r * stride_q + heads[:, None] * D + d[None, :]).to(tl.float32)
    base = cache_ptr + r * c_row + g * c_head + slots[:, None] * c_pos + d[None, :]
    k = tl.load(base, mask=live[:, None], other=0.0).to(tl.float32)  # [P, D]
    v = tl.load(base + c_kv, mask=live[:, None], other=0.0).to(tl.float32)
    scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [G, P]
    scores = tl.where(live[None, :], scores, float("-inf"))
    # As flash attention rounds: unnormalised probabilities to bf16 for P @ V, fp32 row sums.
    p = tl.exp(scores - tl.max(scores, axis=1)[:, None])
    out = tl.sum(_bf16(p)[:, :, None] * v[None, :, :], axis=1)  # [G, D]
    out = out / tl.sum(p, axis=1)[:, None]
    tl.store(out_ptr + r * stride_out + heads[:, None] * D + d[None, :], _bf16(out).to(tl.bfloat16))


@triton.jit(do_not_specialize=["R"])  # one build serves every row count
def _norm_gate_up_kernel(
    x_ptr, nw_ptr, w_ptr, out_ptr, R, eps, stride_x, stride_out,
    I: tl.constexpr, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    NK: tl.constexpr, F32: tl.constexpr,
):
    """Program (column block, row block): ``bf16(silu(gate) * up)`` of the normed input; gate
    rows 0..I-1 and up rows I..2I-1 of the packed weight."""
    rows = tl.program_id(1) * BM + tl.arange(0, BM)
    rmask = rows < R
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    rstd = _row_rstd(x_ptr, stride_x, rows, rmask, eps, K, BM, NK)
    acc_g = tl.zeros([BM, BN], dtype=tl.float32)
    acc_u = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        cols = k0 + tl.arange(0, BK)
        xn = _normed_tile(x_ptr, nw_ptr, stride_x, rows, rmask, rstd, cols)
        w_g = tl.load(w_ptr + n[:, None] * K + cols[None, :])
        w_u = tl.load(w_ptr + (n + I)[:, None] * K + cols[None, :])
        acc_g += _mm(xn, tl.trans(w_g), F32)
        acc_u += _mm(xn, tl.trans(w_u), F32)
    gate, up = _bf16(acc_g), _bf16(acc_u)
    act = _bf16(gate / (1.0 + tl.exp(-gate)))  # F.silu on a bf16 tensor
    tl.store(out_ptr + rows[:, None] * stride_out + n[None, :], _bf16(act * up).to(tl.bfloat16),
             mask=rmask[:, None])


@triton.jit(do_not_specialize=["R"])  # one build serves every row count
def _linear_residual_kernel(
    a_ptr, w_ptr, res_ptr, out_ptr, ws_ptr, count_ptr, R, stride_a, stride_res, stride_out,
    ws_split, N: tl.constexpr, K: tl.constexpr, SPLIT: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, F32: tl.constexpr,
):
    """Program (column block, K split, row block): ``out = bf16(res + bf16(a @ w.T))``.

    Each program stores its fp32 partial; the last of the SPLIT programs of a tile (atomic
    counter) sums all partials in split order, writes the tile and resets the counter."""
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    row_block = tl.program_id(2)
    rows = row_block * BM + tl.arange(0, BM)
    rmask = rows < R
    n = pid_n * BN + tl.arange(0, BN)
    KS: tl.constexpr = K // SPLIT
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, KS, BK):  # constant trip count: the loop pipelines
        cols = split * KS + k0 + tl.arange(0, BK)
        a = tl.load(a_ptr + rows[:, None] * stride_a + cols[None, :], mask=rmask[:, None],
                    other=0.0)
        w = tl.load(w_ptr + n[:, None] * K + cols[None, :])
        acc += _mm(a, tl.trans(w), F32)
    tile = ws_ptr + rows[:, None] * N + n[None, :]
    tl.store(tile + split * ws_split, acc, mask=rmask[:, None])
    tl.debug_barrier()  # every thread's partial is written before the counter says so
    counter = count_ptr + row_block * (N // BN) + pid_n
    arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    if arrived == SPLIT - 1:
        total = tl.zeros([BM, BN], dtype=tl.float32)
        for s in range(SPLIT):
            total += tl.load(tile + s * ws_split, mask=rmask[:, None], other=0.0,
                             cache_modifier=".cg")
        res = tl.load(res_ptr + rows[:, None] * stride_res + n[None, :], mask=rmask[:, None],
                      other=0.0).to(tl.float32)
        out = _bf16(res + _bf16(total)).to(tl.bfloat16)
        tl.store(out_ptr + rows[:, None] * stride_out + n[None, :], out, mask=rmask[:, None])
        tl.store(counter, 0)


def _row_block(rows: int) -> int:
    return min(BM_MAX, max(16, triton.next_power_of_2(rows)))


class FusedDepthLayers:
    """``DepthDecoder.run_layers`` as 5 Triton launches per layer (see the module docstring).

    Needs ``BreezeModel.fuse_projections_()`` first (packed q/k/v and gate/up weights). The
    split-K workspace holds ``max_rows`` rows; a larger call (an uncaptured eager fallback)
    gets its own workspace for that call.
    """

    def __init__(self, depth: torch.nn.Module, max_rows: int, tiles: Tiles | None = None) -> None:
        cfg = depth.cfg
        self.depth = depth
        self.tiles = t = tiles or Tiles()
        self.hidden, self.inter = cfg.hidden_size, cfg.intermediate_size
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.eps = cfg.rms_norm_eps
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        checks = (
            (self.hidden % (t.split_k * 16) == 0 and self.hidden % t.split_bn == 0
             and self.hidden % min(t.qkv_bk, self.hidden) == 0, "hidden_size"),
            (self.inter % (t.split_k * 16) == 0 and self.inter % t.gate_bn == 0,
             "intermediate_size"),
            (self.head_dim // 2 % t.qkv_split == 0 and self.head_dim // 2 // t.qkv_split >= 16,
             "head_dim"),
        )
        for ok, name in checks:
            if not ok:
                raise ValueError(f"fused depth kernels: depth {name} does not fit {t}")
        layers = depth.model.layers
        if any(layer.self_attn.qkv_weight is None or layer.mlp.gate_up_weight is None
               for layer in layers):
            raise ValueError("fused depth kernels need BreezeModel.fuse_projections_() first")
        self.norm_chunk = min(256, self.hidden)  # RMSNorm prologue: hidden / 256 loads per row
        self.max_rows = max_rows
        device = depth.model.norm.weight.device
        self.workspace, self.counters = self._workspace(max_rows, device)
        if device.type == "cuda":
            self.warm()

    @torch.inference_mode()
    def warm(self) -> None:
        """Builds every kernel variant (one per row-block size) now: a Triton JIT build in the
        middle of serving stalls every stream for seconds (seen on the H200 without graphs)."""
        depth = self.depth
        weight = depth.model.norm.weight
        pos = torch.zeros(1, dtype=torch.long, device=weight.device)
        for rows in sorted({min(r, self.max_rows) for r in (1, 17, 33)}):
            x = torch.zeros(rows, depth.cfg.backbone_hidden_size, dtype=weight.dtype,
                            device=weight.device)
            cos, sin = depth.rope.cos_sin(pos.expand(rows), weight.dtype)
            self(x, cos, sin, depth.new_cache(rows), pos)

    def _workspace(self, rows: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        blocks = triton.cdiv(rows, 16)  # row blocks hold >= 16 rows
        t = self.tiles
        workspace = torch.empty(t.split_k, rows, self.hidden, dtype=torch.float32, device=device)
        counters = torch.zeros(blocks * (self.hidden // t.split_bn), dtype=torch.int32,
                               device=device)
        return workspace, counters

    def __call__(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: torch.Tensor,
        pos: torch.Tensor,
    ) -> torch.Tensor:
        """Same contract as ``DepthDecoder.run_layers``: ``x [R, backbone_hidden]`` ->
        final-normed ``[R, d]``; ``cache [L, 2, R, KVH, P, D]`` written at ``pos``."""
        depth, t = self.depth, self.tiles
        rows = x.shape[0]
        workspace, counters = (
            (self.workspace, self.counters) if rows <= self.max_rows
            else self._workspace(rows, x.device)
        )
        bm = _row_block(rows)
        row_blocks = triton.cdiv(rows, bm)
        launch = {"num_warps": t.num_warps, "num_stages": t.num_stages}
        h = depth.model.inputs_embeds_projector(x).contiguous()
        cos, sin = cos[0].contiguous(), sin[0].contiguous()  # one position for every row
        d, hd = self.hidden, self.head_dim
        q = torch.empty(rows, self.heads * hd, dtype=h.dtype, device=h.device)
        attn = torch.empty_like(q)
        act = torch.empty(rows, self.inter, dtype=h.dtype, device=h.device)
        qkv_grid = ((self.heads + 2 * self.kv_heads) * t.qkv_split, row_blocks)
        for layer, layer_cache in zip(depth.model.layers, cache):
            c = layer_cache.stride()  # [2, R, KVH, P, D]
            _norm_qkv_rope_kernel[qkv_grid](
                h, layer.input_layernorm.weight, layer.self_attn.qkv_weight, cos, sin, pos, q,
                layer_cache, rows, self.eps, h.stride(0), q.stride(0), c[0], c[1], c[2], c[3],
                H=self.heads, KVH=self.kv_heads, D=hd, K=d, SUB=t.qkv_split, BM=bm,
                BK=min(t.qkv_bk, d), NK=self.norm_chunk, F32=_DOT_F32, **launch,
            )
            _short_attention_kernel[(rows, self.kv_heads)](
                q, layer_cache, pos, attn, self.scale, q.stride(0), attn.stride(0),
                c[0], c[1], c[2], c[3], G=self.heads // self.kv_heads, D=hd,
                P=layer_cache.shape[3], num_warps=4,
            )
            h_attn = torch.empty_like(h)
            self._linear_residual(attn, layer.self_attn.o_proj.weight, h, h_attn, workspace,
                                  counters, bm, row_blocks)
            _norm_gate_up_kernel[(self.inter // t.gate_bn, row_blocks)](
                h_attn, layer.post_attention_layernorm.weight, layer.mlp.gate_up_weight, act,
                rows, self.eps, h_attn.stride(0), act.stride(0), I=self.inter, K=d, BM=bm,
                BN=t.gate_bn, BK=min(t.gate_bk, d), NK=self.norm_chunk, F32=_DOT_F32, **launch,
            )
            h = torch.empty_like(h_attn)
            self._linear_residual(act, layer.mlp.down_proj.weight, h_attn, h, workspace,
                                  counters, bm, row_blocks)
        return depth.model.norm(h)

    def _linear_residual(self, a, weight, residual, out, workspace, counters, bm, row_blocks):  # type: ignore[no-untyped-def]
        t = self.tiles
        n, k = weight.shape
        _linear_residual_kernel[(n // t.split_bn, t.split_k, row_blocks)](
            a, weight, residual, out, workspace, counters, a.shape[0], a.stride(0),
            residual.stride(0), out.stride(0), workspace.stride(0), N=n, K=k, SPLIT=t.split_k,
            BM=bm, BN=t.split_bn, BK=min(t.split_bk, k // t.split_k), F32=_DOT_F32,
            num_warps=t.num_warps, num_stages=t.num_stages,
        )
