"""Hand-fused depth-decoder layer step: 5 Triton launches per layer instead of ~19.

Owns: the kernels and ``FusedDepthLayers``, a drop-in for ``DepthDecoder.run_layers`` on CUDA.
Per layer and step (R rows, R <= 512 in our buckets):
  1. input RMSNorm + packed q/k/v GEMM + RoPE, q to a buffer and k/v into the frame cache
     (optionally split-K, ``Tiles.qkv_split_k``: the last program of a tile runs the epilogue);
  2. short-cache attention (<= 16 keys; one program per row x KV head, its query group at once);
  3. o_proj, split-K, + residual;
  4. post-attention RMSNorm + packed gate/up GEMM + SiLU(gate) * up;
  5. down_proj, split-K, + residual.
Launch shapes come per row bucket (``TILES_BY_ROWS``, tuned on the H200), all with the same K
split, so a row's bits never depend on how many rows run beside it. The 256- and 512-row
buckets run each RMSNorm apart (``Tiles.prenorm``) and read the GEMMs' input rows through TMA:
the same bits, two more launches a layer.
NOTE(kernels): Triton rather than torch.compile: the frame is launch- and tail-bound under
Inductor (bench/README.md), and 1024-wide outputs (o_proj, down) fill few SMs. Split-K gives
those GEMMs ~128 programs; the last-arriving program of each output tile (an atomic counter)
sums the partials in a fixed order, so results are deterministic and do not depend on which
program finishes last. Norms, RoPE and SiLU run in the GEMM prologues/epilogues at the same
bf16 rounding points as the eager modules.
Must not: sample, mix CFG branches or allocate per step beyond its outputs (the split-K
workspace and counters are preallocated, so CUDA graphs capture it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
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
    norm_dot2,
    pdl_launch,
    pdl_wait,
    rope,
    row_block,
    warm_row_counts,
)

# Launch shapes per row bucket, tuned on the H200 by bench/tune_fused_depth.py (bench/README.md):
# 16-row blocks for q/k/v (more programs), TMA weight tiles, deeper gate/up tiles. Every
# bucket splits o_proj/down in 4 along K, so a row's bits do not depend on its bucket (tests/gpu:
# a row alone == in crowds of 16..512).
TILES_BY_ROWS: tuple[tuple[int, Tiles], ...] = (
    (64, Tiles(qkv_split=2, gate_bk=128, split_k=4, num_stages=3, gate_warps=8, gate_stages=3,
               split_stages=4, qkv_bm=16, tma=True)),
    (128, Tiles(qkv_split=2, gate_bn=128, split_k=4, split_bn=64, split_bk=128, num_stages=3,
                gate_warps=8, gate_stages=4, split_warps=8, split_stages=4, qkv_bm=16, tma=True)),
    # 256 and 512 rows: the norms apart (``Tiles.prenorm``), tuned with them. H200
    # (bench/results/h200-tune-fused-depth-20261206-10.json, PDL): 12.9 and 20.5 ms a frame (the
    # 20.5 with 128-deep q/k/v K tiles, kept at 256 here: K tiles were not bit-checked)
    # against 16.7 and 30.5 with the norms in each GEMM's prologue (the table before, 128-row
    # gate/up and split-K blocks); H100 (h100-tune-fused-depth-20261206-9.json): 14.4 and 24.3
    # against 17.1 and 31.1. At 512 rows o_proj's 4 K splits are summed inside each program
    # (``Tiles.o_inline``) and down's K steps are 64 deep. split_k stays 4 everywhere, so a row's
    # bits do not change (tests/gpu: switch_changes_no_bit, H100 and H200, 6 Dec).
    # The 512-row bucket launches without PDL inside a PDL frame (``Tiles.skip_pdl``): on the
    # H100 its frame took 24.5 ms with PDL against 23.1 without, twice (7 Dec, twelfth and
    # fourteenth sessions: h100-tune-fused-depth-20261207-12.json and -14.json); not yet
    # timed on an H200.
    (256, Tiles(qkv_split=2, gate_bn=128, split_k=4, split_bn=64, split_bk=128, num_stages=3,
                gate_warps=8, gate_stages=4, split_warps=8, split_stages=4, qkv_bm=64,
                gate_bm=128, split_bm=128, tma=False, prenorm=True)),
    (512, Tiles(qkv_split=2, gate_bn=128, split_k=4, split_bn=64, split_bk=64, num_stages=3,
                gate_warps=8, gate_stages=4, split_warps=4, split_stages=3, qkv_bm=64,
                gate_bm=128, split_bm=64, tma=True, prenorm=True, o_inline=True,
                skip_pdl=True)),
)


def prenorm_every_bucket() -> tuple[tuple[int, Tiles], ...]:
    """``TILES_BY_ROWS`` with every bucket's norms apart (``Tiles.prenorm``): the same bits as
    the table itself (the tests' and benchmarks' prenorm path at every size)."""
    return tuple((limit, replace(tiles, prenorm=True)) for limit, tiles in TILES_BY_ROWS)


@triton.jit
def _qkv_store(a_lo, a_hi, t, d, rows, rmask, cos_ptr, sin_ptr, pos_ptr, q_ptr, cache_ptr,
               stride_q, c_kv, c_row, c_head, c_pos,
               H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr):
    """The q/k/v epilogue of head ``t``'s columns ``d`` (both halves, bf16 values): RoPE on q
    and k, then q to its buffer and k/v into the frame cache at ``pos``."""
    HALF: tl.constexpr = D // 2
    if t < H + KVH:  # q and k heads get RoPE
        out_lo, out_hi = rope(
            a_lo, a_hi, tl.load(cos_ptr + d).to(tl.float32)[None, :],
            tl.load(cos_ptr + HALF + d).to(tl.float32)[None, :],
            tl.load(sin_ptr + d).to(tl.float32)[None, :],
            tl.load(sin_ptr + HALF + d).to(tl.float32)[None, :],
        )
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
    tl.store(dst, out_lo.to(tl.bfloat16), mask=rmask[:, None])  # already bf16 values
    tl.store(dst + HALF, out_hi.to(tl.bfloat16), mask=rmask[:, None])


@triton.jit(do_not_specialize=["R"])  # one build serves every row count
def _norm_qkv_rope_kernel(
    x_ptr, nw_ptr, w_ptr, cos_ptr, sin_ptr, pos_ptr, q_ptr, cache_ptr, ws_ptr, count_ptr,
    R, eps, stride_x, stride_q, c_kv, c_row, c_head, c_pos, ws_split,
    H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, K: tl.constexpr, SUB: tl.constexpr,
    BM: tl.constexpr, BK: tl.constexpr, NK: tl.constexpr, F32: tl.constexpr,
    TMA: tl.constexpr = False, PDL: tl.constexpr = False, SPLIT: tl.constexpr = 1,
    PRENORM: tl.constexpr = False,
):
    """Program (head t x slice j, K split, row block): q heads 0..H-1, then k heads, then v
    heads. Slice j covers columns j*C.. of both halves of the head (C = D / 2 / SUB), so RoPE's
    rotate-half pairs stay inside one program. With ``SPLIT`` > 1 each program reduces 1/SPLIT
    of K into an fp32 partial; the last of a tile's SPLIT programs (atomic counter) sums them in
    split order, runs the epilogue and resets the counter (as ``linear_residual_kernel``).
    ``PRENORM``: ``x_ptr`` is a TMA descriptor of rows already normed (``Tiles.prenorm``)."""
    pdl_wait(PDL)
    pid = tl.program_id(0)
    t = pid // SUB
    HALF: tl.constexpr = D // 2
    C: tl.constexpr = HALF // SUB
    j0 = (pid % SUB) * C  # this slice's first column within each half
    d = j0 + tl.arange(0, C)  # columns within the lower half
    row_block = tl.program_id(2)
    rows = row_block * BM + tl.arange(0, BM)
    rmask = rows < R
    a0 = t * D + j0  # first weight row of the slice's lower half
    KS: tl.constexpr = K // SPLIT
    split = tl.program_id(1)  # 0 without a split: all of K
    acc_lo, acc_hi = norm_dot2(x_ptr, nw_ptr, w_ptr, stride_x, rows, rmask, eps, row_block * BM,
                               a0, a0 + HALF, split * KS, K, KS, BM, C, BK, NK, F32, TMA,
                               PRENORM)
    if SPLIT == 1:
        _qkv_store(bf16(acc_lo), bf16(acc_hi), t, d, rows, rmask, cos_ptr, sin_ptr, pos_ptr,
                   q_ptr, cache_ptr, stride_q, c_kv, c_row, c_head, c_pos, H, KVH, D)
    else:
        N: tl.constexpr = (H + 2 * KVH) * D
        tile = ws_ptr + rows[:, None] * N + t * D + d[None, :]  # partials: [SPLIT, R, N]
        tl.store(tile + split * ws_split, acc_lo, mask=rmask[:, None])
        tl.store(tile + split * ws_split + HALF, acc_hi, mask=rmask[:, None])
        tl.debug_barrier()  # every thread's partial is written before the counter says so
        counter = count_ptr + row_block * tl.num_programs(0) + pid
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT - 1:
            lo = tl.zeros([BM, C], dtype=tl.float32)
            hi = tl.zeros([BM, C], dtype=tl.float32)
            for s in range(SPLIT):
                lo += tl.load(tile + s * ws_split, mask=rmask[:, None], other=0.0,
                              cache_modifier=".cg")
                hi += tl.load(tile + s * ws_split + HALF, mask=rmask[:, None], other=0.0,
                              cache_modifier=".cg")
            _qkv_store(bf16(lo), bf16(hi), t, d, rows, rmask, cos_ptr, sin_ptr, pos_ptr,
                       q_ptr, cache_ptr, stride_q, c_kv, c_row, c_head, c_pos, H, KVH, D)
            tl.store(counter, 0)


@triton.jit
def _short_attention_kernel(
    q_ptr, cache_ptr, pos_ptr, out_ptr, scale, stride_q, stride_out, c_kv, c_row, c_head, c_pos,
    G: tl.constexpr, D: tl.constexpr, P: tl.constexpr, PDL: tl.constexpr = False,
):
    """Program (row, KV head): its G query heads against cache slots 0..pos (<= P keys)."""
    pdl_wait(PDL)
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
    out = tl.sum(bf16(p)[:, :, None] * v[None, :, :], axis=1)  # [G, D]
    out = out / tl.sum(p, axis=1)[:, None]
    tl.store(out_ptr + r * stride_out + heads[:, None] * D + d[None, :], bf16(out).to(tl.bfloat16))


class FusedDepthLayers:
    """``DepthDecoder.run_layers`` as 5 Triton launches per layer (see the module docstring).

    Needs ``BreezeModel.fuse_projections_()`` first (packed q/k/v and gate/up weights).
    """

    def __init__(self, depth: torch.nn.Module, max_rows: int,
                 tiles: Tiles | Sequence[tuple[int, Tiles]] | None = None,
                 warm: bool = True, pdl: bool = False) -> None:
        """``tiles``: one ``Tiles`` for every row count, or ``(max rows, Tiles)`` buckets in
        increasing order (the last also serves more rows); default ``TILES_BY_ROWS``.
        ``pdl``: every launch with programmatic dependent launch (``gemm.pdl_launch``), but
        in buckets with ``Tiles.skip_pdl``."""
        cfg = depth.cfg
        self.depth = depth
        self.hidden, self.inter = cfg.hidden_size, cfg.intermediate_size
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.eps = cfg.rms_norm_eps
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        device = depth.model.norm.weight.device
        check_bf16(depth.model.norm.weight, "depth")
        table = ((max_rows, tiles),) if isinstance(tiles, Tiles) else (tiles or TILES_BY_ROWS)
        table = tuple((limit, replace(t, pdl=(t.pdl or pdl) and not t.skip_pdl))
                      for limit, t in table)
        if len({t.qkv_split_k for _, t in table}) > 1:  # it sets the sum order
            raise ValueError("fused depth kernels: every row bucket needs the same qkv_split_k")
        self._buckets = [(limit, FusedGemms(t, min(limit, max_rows), self.hidden, device))
                         for limit, t in table]
        for _, gemms in self._buckets:
            self._check(gemms)
        layers = depth.model.layers
        if any(layer.self_attn.qkv_weight is None or layer.mlp.gate_up_weight is None
               for layer in layers):
            raise ValueError("fused depth kernels need BreezeModel.fuse_projections_() first")
        self.max_rows = max_rows
        self.qkv_cols = (self.heads + 2 * self.kv_heads) * self.head_dim
        self.qkv_programs = max((self.heads + 2 * self.kv_heads) * t.qkv_split
                                for _, t in table)
        self.qkv_workspace, self.qkv_counters = self._qkv_workspace(max_rows, device)
        if warm and device.type == "cuda":
            self.warm()

    def _qkv_workspace(self, rows: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        """fp32 partials and tile counters of the split-K q/k/v GEMM (``Tiles.qkv_split_k``)."""
        split = max(t.qkv_split_k for t in (g.tiles for _, g in self._buckets))
        if split == 1:
            empty = torch.zeros(1, dtype=torch.int32, device=device)
            return empty.float(), empty
        workspace = torch.empty(split, rows, self.qkv_cols, dtype=torch.float32, device=device)
        counters = torch.zeros(triton.cdiv(rows, 16) * self.qkv_programs, dtype=torch.int32,
                               device=device)  # row blocks hold >= 16 rows
        return workspace, counters

    def _check(self, gemms: FusedGemms) -> None:
        t, attn_width = gemms.tiles, self.heads * self.head_dim
        gemms.check("depth hidden_size", norm_k=self.hidden, split=(self.hidden, attn_width))
        gemms.check("depth intermediate_size", gate_up=(self.inter, self.hidden),
                    split=(self.hidden, self.inter))
        qkv_bk = min(t.qkv_bk, self.hidden // t.qkv_split_k)
        if (self.hidden % (qkv_bk * t.qkv_split_k) or qkv_bk & (qkv_bk - 1) or qkv_bk < 16
                or t.qkv_split_k < 1):
            raise ValueError(f"fused depth kernels: depth hidden_size does not fit {t}")
        if self.head_dim // 2 % t.qkv_split or self.head_dim // 2 // t.qkv_split < 16:
            raise ValueError(f"fused depth kernels: depth head_dim does not fit {t}")

    def gemms_for(self, rows: int) -> FusedGemms:
        """The launcher (tiles and workspace) of the first bucket that holds ``rows``."""
        return next((g for limit, g in self._buckets if rows <= limit), self._buckets[-1][1])

    @property
    def counters(self) -> torch.Tensor:
        """Every bucket's split-K tile counters (all 0 between calls)."""
        return torch.cat([g.counters for _, g in self._buckets] + [self.qkv_counters])

    @torch.inference_mode()
    def warm(self) -> None:
        """Builds every kernel variant (one per row-block size) now: a Triton JIT build in the
        middle of serving stalls every stream for seconds (seen on the H200 without graphs)."""
        depth = self.depth
        weight = depth.model.norm.weight
        pos = torch.zeros(1, dtype=torch.long, device=weight.device)
        counts, low = set(), 0
        for limit, _ in self._buckets:  # each bucket's tiles at each row-block size it meets
            counts |= {min(rows, self.max_rows) for rows in warm_row_counts(limit)
                       if rows > low}
            counts.add(min(low + 1, self.max_rows))
            low = limit
        for rows in sorted(counts):
            x = torch.zeros(rows, depth.cfg.backbone_hidden_size, dtype=weight.dtype,
                            device=weight.device)
            cos, sin = depth.rope.cos_sin(pos.expand(rows), weight.dtype)
            self(x, cos, sin, depth.new_cache(rows), pos)

    def __call__(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: torch.Tensor,
        pos: torch.Tensor,
    ) -> torch.Tensor:
        """Same contract as ``DepthDecoder.run_layers``: ``x [R, backbone_hidden]`` ->
        final-normed ``[R, d]``; ``cache [L, 2, R, KVH, P, D]`` written at ``pos``."""
        depth, rows = self.depth, x.shape[0]
        gemms = self.gemms_for(rows)
        t = gemms.tiles
        bm = row_block(rows, t.qkv_bm)
        h = depth.model.inputs_embeds_projector(x).contiguous()
        cos, sin = cos[0].contiguous(), sin[0].contiguous()  # one position for every row
        d, hd = self.hidden, self.head_dim
        q = torch.empty(rows, self.heads * hd, dtype=h.dtype, device=h.device)
        attn = torch.empty_like(q)
        split = t.qkv_split_k
        qkv_grid = ((self.heads + 2 * self.kv_heads) * t.qkv_split, split, triton.cdiv(rows, bm))
        qkv_bk = min(t.qkv_bk, d // split)
        workspace, counters = (
            (self.qkv_workspace, self.qkv_counters) if rows <= self.max_rows or split == 1
            else self._qkv_workspace(rows, h.device)
        )
        for layer, layer_cache in zip(depth.model.layers, cache):
            c = layer_cache.stride()  # [2, R, KVH, P, D]
            qkv_weight = gemms.weight(layer.self_attn.qkv_weight, hd // 2 // t.qkv_split, qkv_bk)
            _norm_qkv_rope_kernel[qkv_grid](
                gemms.normed_input(h, layer.input_layernorm.weight, self.eps, bm, qkv_bk),
                layer.input_layernorm.weight, qkv_weight, cos, sin, pos, q,
                layer_cache, workspace, counters, rows, self.eps, h.stride(0), q.stride(0),
                c[0], c[1], c[2], c[3], workspace.stride(0) if split > 1 else 0,
                H=self.heads, KVH=self.kv_heads, D=hd, K=d, SUB=t.qkv_split, BM=bm,
                BK=qkv_bk, NK=min(256, d), F32=DOT_F32, TMA=t.tma, SPLIT=split,
                PRENORM=t.prenorm, **t.launch("qkv"),
            )
            _short_attention_kernel[(rows, self.kv_heads)](
                q, layer_cache, pos, attn, self.scale, q.stride(0), attn.stride(0),
                c[0], c[1], c[2], c[3], G=self.heads // self.kv_heads, D=hd,
                P=layer_cache.shape[3], num_warps=4, **pdl_launch(t.pdl),
            )
            h = gemms.linear_residual(attn, layer.self_attn.o_proj.weight, h, inline=t.o_inline)
            act = gemms.norm_gate_up(h, layer.post_attention_layernorm.weight,
                                     layer.mlp.gate_up_weight, self.eps)
            h = gemms.linear_residual(act, layer.mlp.down_proj.weight, h, inline=t.down_inline)
        return depth.model.norm(h)
