"""The depth layer's GEMMs as served, in cuBLAS and as plain Triton GEMMs, per row count.

Usage (GPU machine, repo root): ``PYTHONPATH=runtime:bench python bench/depth_gemm_ceiling.py
[--rows 2,16,64,128,256,512] [--no-pdl] [--out X.json]``. On a CPU (``TRITON_INTERPRET=1``)
``--small`` runs every call once on a small decoder, checks the served and plain calls against
torch (and the prenorm calls against the served bits) and times nothing.

Why: at capacity's batch sizes the depth frame is compute-bound, and the served kernels run it
at ~150 TFLOP/s (256 rows, 17.1 ms a frame on the H100; issues 30 and 31), while the eager
PyTorch layers of ``bench/tune_fused_depth.py`` (cuBLAS GEMMs beside ~20 unfused elementwise
launches a layer) took 30.2 ms at 512 rows against the tuned fused kernels' 31.6. What a
large-row bucket could gain depends on the GEMMs alone, which no run has timed apart.

Per row count R (largest first: a timed-out run keeps capacity's) and per layer GEMM (full
size: q/k/v 1024 -> 1536, o 1024 -> 1024, gate/up 1024 -> 2 x 8192, down 8192 -> 1024, bf16), the
median time of one call, as a CUDA graph of one call per weight over the 12 layers' weights and,
for q/k/v and o, copies of them up to ``FLUSH_BYTES``: in a served frame the other GEMMs' ~600 MB
pass between two reads of one weight, so none may come from L2 here (12 layers of q/k/v are 38
MB and of o 25 MB, under an H100's or H200's 50 MB L2):
- ``served``: the kernels the profiles launch, with the row bucket's ``TILES_BY_ROWS`` shapes
  (and PDL, as ``graph.pdl``): ``norm_gate_up`` (RMSNorm prologue, SiLU(gate) x up epilogue)
  and ``linear_residual`` (split-K, residual epilogue) for o and down; q/k/v runs inside
  ``FusedDepthLayers`` with RoPE and the cache write, so it is timed only there;
- ``prenorm``: the kernels with ``Tiles.prenorm`` (the norm apart, one launch, counted; the
  GEMM's input rows through TMA; the same bits), in each bucket's ``TILES_BY_ROWS`` shapes (at
  256 and 512 rows the served kernels themselves), and a prenorm position beside the served;
- ``prenorm+inline`` (o only): prenorm's o_proj with its K splits summed in one program
  (``Tiles.o_inline``; the same bits);
- ``cublas``: ``torch.mm`` of the same operands, bf16 in and out, no prologue or epilogue;
- ``triton:CONFIG``: a plain Triton GEMM (``PLAIN_CONFIGS``: large tiles through TMA, fp32
  accumulation in K order, as the served kernels accumulate, so a row's bits would not depend
  on its crowd; down also split 4 ways along K with an ordered sum), no prologue or epilogue.
The last two are floors for a large-row bucket's GEMMs: its norms, SiLU and residuals would
come on top, as separate launches or fused into a neighbour. And one served position
(``FusedDepthLayers``: projector, 12 layers, final norm) as the whole. Writes, per R, each
call's us, TFLOP/s and weight TB/s, each kind's sum over a position, and a PNG, with the GPU,
torch version, commit and date (the JSON after each R).

Owns its plain GEMM kernel and nothing the runtime uses.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from breezert.kernels.fused_depth import FusedDepthLayers, prenorm_every_bucket
from breezert.kernels.gemm import DOT_F32, Tiles, bf16, mm
from breezert.layers.norms import rms_norm
from breezert.models.config import BreezeConfig, DepthConfig
from breezert.models.depth import DepthDecoder
from breezert_bench.provenance import provenance
from cuda_bench import graph_ms, random_bf16_packed

POSITIONS = 15  # a frame's depth positions (codebooks 1..15)
FLUSH_BYTES = 192 << 20
"""Each GEMM's graph reads at least this many bytes of weights (copies where 12 layers' are
fewer), about four times a Hopper L2, so a weight is gone from L2 when its turn comes again."""

SMALL = DepthConfig(  # the smallest decoder the fused kernels take (tests/unit)
    hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
    head_dim=32, backbone_hidden_size=64, audio_embed_size=64,
)


PLAIN_CONFIGS = ("128x128x64w4s4", "128x256x64w8s3", "64x128x64w4s4")
"""Plain Triton GEMM shapes tried per GEMM (BMxBNxBK, warps, stages); down also with its K
split 4 ways, as the served kernel splits it (``...k4``)."""
SMALL_PLAIN = ("16x64x32w4s2", "32x128x32w4s2")  # the small decoder's (interpreter) shapes


@triton.jit(do_not_specialize=["M"])
def _plain_gemm_kernel(a_desc, w_desc, c_ptr, ws_ptr, M, stride_c, ws_split,
                       N: tl.constexpr, KS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                       BK: tl.constexpr, SPLIT: tl.constexpr, F32: tl.constexpr):
    """``a [M, K] @ w[N, K].T`` on whole tiles through TMA (``[BM, BK]`` and ``[BN, BK]``
    blocks; rows past M read as zeros), fp32 accumulation in K order: bf16 into ``c``, or with
    ``SPLIT`` > 1 this program's K split as an fp32 partial into ``ws`` (``_sum_splits``)."""
    pid_m, pid_n, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, KS, BK):
        a = a_desc.load([pid_m * BM, split * KS + k0])
        w = w_desc.load([pid_n * BN, split * KS + k0])
        acc += mm(a, tl.trans(w), F32)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    mask = (rows < M)[:, None]
    if SPLIT == 1:
        tl.store(c_ptr + rows[:, None] * stride_c + cols[None, :], bf16(acc).to(tl.bfloat16),
                 mask=mask)
    else:
        tl.store(ws_ptr + split * ws_split + rows[:, None] * N + cols[None, :], acc, mask=mask)


@triton.jit
def _sum_splits(ws_ptr, c_ptr, total, ws_split, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    """The K splits' partials summed in split order, to bf16 (as ``linear_residual`` sums)."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < total
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(SPLIT):
        acc += tl.load(ws_ptr + s * ws_split + i, mask=mask, other=0.0)
    tl.store(c_ptr + i, bf16(acc).to(tl.bfloat16), mask=mask)


class PlainGemm:
    """``torch.mm(a, w.t())`` as one plain Triton GEMM of fixed tiles (``config``, one of
    ``PLAIN_CONFIGS``, ``k4`` appended for 4 K splits); descriptors and workspace made once."""

    def __init__(self, config: str, a: torch.Tensor, weights: list[torch.Tensor]) -> None:
        shape, _, rest = config.partition("w")
        self.bm, self.bn, self.bk = (int(v) for v in shape.split("x"))
        warps, _, rest = rest.partition("s")
        stages, _, split = rest.partition("k")
        self.warps, self.stages, self.split = int(warps), int(stages), int(split or 1)
        self.a = a
        rows, k = a.shape
        n = weights[0].shape[0]
        self.bk = min(self.bk, k // self.split)
        self.a_desc = TensorDescriptor.from_tensor(a, [self.bm, self.bk])
        self.w_descs = [TensorDescriptor.from_tensor(w, [self.bn, self.bk]) for w in weights]
        self.out = torch.empty(rows, n, dtype=a.dtype, device=a.device)
        self.ws = torch.empty(self.split if self.split > 1 else 0, rows, n,
                              dtype=torch.float32, device=a.device)  # split partials
        self.n, self.k = n, k

    def __call__(self, layer: int) -> torch.Tensor:
        rows = self.a.shape[0]
        grid = (triton.cdiv(rows, self.bm), self.n // self.bn, self.split)
        _plain_gemm_kernel[grid](
            self.a_desc, self.w_descs[layer], self.out, self.ws, rows, self.out.stride(0),
            self.ws.stride(0), N=self.n, KS=self.k // self.split, BM=self.bm, BN=self.bn,
            BK=self.bk, SPLIT=self.split, F32=DOT_F32, num_warps=self.warps,
            num_stages=self.stages)
        if self.split > 1:
            total = rows * self.n
            _sum_splits[(triton.cdiv(total, 1024),)](self.ws, self.out, total, self.ws.stride(0),
                                                     SPLIT=self.split, BLOCK=1024)
        return self.out


def plain_gemms(name: str, a: torch.Tensor, weights: list[torch.Tensor],
                configs: tuple[str, ...]) -> dict[str, PlainGemm]:
    """The plain GEMMs of ``configs`` (down's also split 4 ways, ``...k4``) whose tiles divide
    this GEMM's shape, by config."""
    n, k = weights[0].shape
    gemms = {}
    for config in configs + (tuple(c + "k4" for c in configs) if name == "down" else ()):
        gemm = PlainGemm(config, a, weights)
        if n % gemm.bn == 0 and k % (gemm.bk * gemm.split) == 0:
            gemms[config] = gemm
    return gemms


def build(cfg: DepthConfig, device: str) -> DepthDecoder:
    """``cfg``'s decoder with seeded random bf16 weights, projections packed as served."""
    torch.manual_seed(0)
    with torch.device(device):
        return random_bf16_packed(DepthDecoder(cfg))


def prenormed(tiles: Tiles | None) -> tuple[tuple[int, Tiles], ...]:
    """``tiles`` with ``prenorm`` on; None: every bucket of ``TILES_BY_ROWS`` with its norms
    apart (as served at 256 and 512 rows)."""
    if tiles is None:
        return prenorm_every_bucket()
    return ((1 << 20, replace(tiles, prenorm=True)),)


def layer_calls(depth: DepthDecoder, fused: FusedDepthLayers, rows: int,
                plain: tuple[str, ...] = PLAIN_CONFIGS,
                fused_prenorm: FusedDepthLayers | None = None,
                flush_bytes: int = 0) -> dict[str, dict[str, Any]]:
    """Per GEMM: its FLOP at ``rows``, its weight's bytes, ``weights`` (the 12 layers', then
    copies of them up to ``flush_bytes``) and ``calls``, per kind (``served``, ``prenorm``: the
    served kernels with ``Tiles.prenorm``, its norm launch included, ``cublas``,
    ``triton:CONFIG``) a function of the index into ``weights``."""
    cfg, device = depth.cfg, depth.model.norm.weight.device
    gemms = fused.gemms_for(rows)
    pre = fused_prenorm.gemms_for(rows) if fused_prenorm is not None else None
    layers = depth.model.layers
    h = torch.randn(rows, cfg.hidden_size, device=device).to(torch.bfloat16)
    attn = torch.randn(rows, cfg.num_heads * cfg.head_dim, device=device).to(torch.bfloat16)
    act = torch.randn(rows, cfg.intermediate_size, device=device).to(torch.bfloat16)
    eps = cfg.rms_norm_eps

    def flushing(ws: list[torch.Tensor]) -> list[torch.Tensor]:
        size = sum(w.numel() * w.element_size() for w in ws)
        return ws + [w.clone() for _ in range(1, -(-flush_bytes // size)) for w in ws]

    weights = {
        "qkv": (h, flushing([layer.self_attn.qkv_weight for layer in layers])),
        "o": (attn, flushing([layer.self_attn.o_proj.weight for layer in layers])),
        "gate_up": (h, flushing([layer.mlp.gate_up_weight for layer in layers])),
        "down": (act, flushing([layer.mlp.down_proj.weight for layer in layers])),
    }
    wo, wgu, wd = (weights[k][1] for k in ("o", "gate_up", "down"))

    def norm(i: int) -> torch.Tensor:
        return layers[i % len(layers)].post_attention_layernorm.weight

    served = {
        "o": lambda i: gemms.linear_residual(attn, wo[i], h),
        "gate_up": lambda i: gemms.norm_gate_up(h, norm(i), wgu[i], eps),
        "down": lambda i: gemms.linear_residual(act, wd[i], h),
    }
    prenorm = {} if pre is None else {
        "o": lambda i: pre.linear_residual(attn, wo[i], h),
        "gate_up": lambda i: pre.norm_gate_up(h, norm(i), wgu[i], eps),
        "down": lambda i: pre.linear_residual(act, wd[i], h),
    }
    if pre is not None:  # o_proj's splits summed in one program (Tiles.o_inline)
        prenorm["o inline"] = lambda i: pre.linear_residual(attn, wo[i], h, inline=True)
    out: dict[str, dict[str, Any]] = {}
    for name, (a, ws) in weights.items():
        n, k = ws[0].shape
        calls: dict[str, Callable[[int], Any]] = {}
        if name in served:
            calls["served"] = served[name]
        if name in prenorm:
            calls["prenorm"] = prenorm[name]
        if f"{name} inline" in prenorm:
            calls["prenorm+inline"] = prenorm[f"{name} inline"]
        calls["cublas"] = lambda i, a=a, ws=ws: torch.mm(a, ws[i].t())
        calls.update({f"triton:{config}": gemm
                      for config, gemm in plain_gemms(name, a, ws, plain).items()})
        out[name] = {"flop": 2 * rows * n * k, "bytes": ws[0].numel() * ws[0].element_size(),
                     "a": a, "weights": ws, "calls": calls}
    return out


def pick(entry: dict[str, Any], kind: str) -> dict[str, Any]:
    """A GEMM's figures by ``kind`` ("triton": its best plain shape); empty where not run."""
    key = entry.get("triton_best") if kind == "triton" else kind
    return (entry.get(key) if key else None) or {"us": None, "tflops": None}


def untimed(fn: Callable[[], None], iters: int) -> None:
    """The CPU's timer (``--small``): one call, through the interpreter, no time."""
    fn()


def per(ms: float | None, scale: float, amount: float | None = None) -> float | None:
    """``ms * scale`` (``amount`` None) or ``amount / ms * scale``, 4 significant places;
    None where nothing was timed."""
    if ms is None:
        return None
    value = ms * scale if amount is None else amount / ms * scale
    return float(f"{value:.4g}")


def every_weight(call: Callable[[int], Any], count: int) -> Callable[[], None]:
    """One call per weight, in turn (``layer_calls``' index)."""
    def run() -> None:
        for i in range(count):
            call(i)
    return run


def time_or_error(timer: Callable[[Callable[[], None], int], float | None],
                  fn: Callable[[], None], iters: int,
                  label: str) -> tuple[float | None, str | None]:
    """``timer(fn, iters)``, or None and the error where ``fn`` fails to build or launch (printed
    under ``label``; the run's other figures stay). The CPU check's timer lets errors through."""
    try:
        return timer(fn, iters), None
    except Exception as exc:
        if timer is untimed:
            raise
        error = f"{type(exc).__name__}: {str(exc)[:300]}"
        print(f"[gemm] {label} failed: {error}", flush=True)
        return None, error


def measure(depth: DepthDecoder, rows: int, pdl: bool, iters: int,
            tiles: Tiles | None = None,
            timer: Callable[[Callable[[], None], int], float | None] = graph_ms,
            plain: tuple[str, ...] = PLAIN_CONFIGS, flush_bytes: int = FLUSH_BYTES,
            ) -> dict[str, Any]:
    """One row count: every GEMM in every kind of ``layer_calls``, a served and a prenorm
    position (``tiles``: one shape for every row count instead of ``TILES_BY_ROWS``;
    ``timer``: ms of one call of a function, CUDA graphs by default)."""
    cfg, device = depth.cfg, depth.model.norm.weight.device
    fused = FusedDepthLayers(depth, max_rows=rows, tiles=tiles, pdl=pdl,
                             warm=False)  # the timer's first call builds
    fused_prenorm = FusedDepthLayers(depth, max_rows=rows, tiles=prenormed(tiles), pdl=pdl,
                                     warm=False)
    n = cfg.num_layers
    out: dict[str, Any] = {"rows": rows, "gemms": {}}
    gemm_calls = layer_calls(depth, fused, rows, plain, fused_prenorm, flush_bytes)
    for name, gemm in gemm_calls.items():
        count = len(gemm["weights"])  # calls a graph: one a weight
        entry: dict[str, Any] = {"flop": gemm["flop"], "weight_bytes": gemm["bytes"],
                                 "calls_a_graph": count}
        for kind, call in gemm["calls"].items():
            total, error = time_or_error(timer, every_weight(call, count), iters,
                                         f"rows {rows:4d} {name} {kind}")
            if error is not None:
                entry[kind] = {"us": None, "tflops": None, "error": error}
                continue
            ms = None if total is None else total / count
            entry[kind] = {"us": per(ms, 1e3), "tflops": per(ms, 1e-9, gemm["flop"]),
                           "weight_tbps": per(ms, 1e-9, gemm["bytes"])}
        timed = {k: v for k, v in entry.items()
                 if k.startswith("triton:") and v["us"] is not None}
        entry["triton_best"] = min(timed, key=lambda k: timed[k]["us"]) if timed else None
        out["gemms"][name] = entry
        print(f"[gemm] rows {rows:4d} {name:8s} " + "  ".join(
            f"{k} {entry[k]['us']} us ({entry[k]['tflops']} TFLOP/s)"
            for k in ("served", "prenorm", "prenorm+inline", "cublas", entry["triton_best"])
            if k in entry),
            flush=True)
    x = torch.randn(rows, cfg.backbone_hidden_size, device=device).to(torch.bfloat16)
    cache = depth.new_cache(rows)
    pos = torch.zeros(1, dtype=torch.long, device=device)
    cos, sin = depth.rope.cos_sin(pos.expand(rows), torch.bfloat16)

    def position() -> None:
        fused(x, cos, sin, cache, pos)

    def position_prenorm() -> None:
        fused_prenorm(x, cos, sin, cache, pos)

    position_ms, served_error = time_or_error(timer, position, iters,
                                              f"rows {rows:4d} served position")
    prenorm_ms, prenorm_error = time_or_error(timer, position_prenorm, iters,
                                              f"rows {rows:4d} prenorm position")
    errors = {k: e for k, e in (("served", served_error), ("prenorm", prenorm_error)) if e}
    if errors:
        out["position_errors"] = errors
    g = out["gemms"]
    flop = sum(e["flop"] for e in g.values()) * n

    def position_sum(kind: str, names: tuple[str, ...]) -> float | None:
        """ms a position of ``names`` (12 layers each) by ``kind``; "triton": each one's best."""
        times = [pick(g[name], kind)["us"] for name in names]
        return None if None in times else round(sum(times) * n / 1000, 4)

    three, four = ("o", "gate_up", "down"), ("qkv", "o", "gate_up", "down")
    out.update({
        "served_position_ms": per(position_ms, 1.0),
        "served_frame_ms": per(position_ms, POSITIONS),
        "prenorm_position_ms": per(prenorm_ms, 1.0),
        "prenorm_frame_ms": per(prenorm_ms, POSITIONS),
        "prenorm_o_gate_up_down_position_ms": position_sum("prenorm", three),
        "served_o_gate_up_down_position_ms": position_sum("served", three),
        "cublas_o_gate_up_down_position_ms": position_sum("cublas", three),
        "triton_o_gate_up_down_position_ms": position_sum("triton", three),
        "cublas_gemms_position_ms": position_sum("cublas", four),
        "triton_gemms_position_ms": position_sum("triton", four),
        "position_tflops_served": per(position_ms, 1e-9, flop),
    })
    print(f"[gemm] rows {rows:4d} served position {out['served_position_ms']} ms, prenorm "
          f"{out['prenorm_position_ms']} ms; o+gate/up+down served "
          f"{out['served_o_gate_up_down_position_ms']} ms, prenorm "
          f"{out['prenorm_o_gate_up_down_position_ms']}, cuBLAS "
          f"{out['cublas_o_gate_up_down_position_ms']}, plain Triton (best a GEMM) "
          f"{out['triton_o_gate_up_down_position_ms']}; all four GEMMs cuBLAS "
          f"{out['cublas_gemms_position_ms']} ms, plain Triton "
          f"{out['triton_gemms_position_ms']} ms a position", flush=True)
    return out


def check_small() -> dict[str, float]:
    """CPU (interpreter): the served gate/up and down calls against torch at the eager
    modules' rounding points, and every plain GEMM against ``torch.mm``, at 3 and 20 rows (20:
    two row blocks); returns the largest |difference| of each (bf16-small where the harness
    calls what it means to)."""
    depth = build(SMALL, "cpu")
    layer, eps = depth.model.layers[1], SMALL.rms_norm_eps
    tiles = Tiles(qkv_split=1, split_k=2, gate_bm=16, split_bm=16)
    fused = FusedDepthLayers(depth, max_rows=32, tiles=tiles, warm=False)
    fused_prenorm = FusedDepthLayers(depth, max_rows=32, tiles=prenormed(tiles), warm=False)
    worst: dict[str, float] = {}
    for rows in (3, 20):
        gemms, pre = fused.gemms_for(rows), fused_prenorm.gemms_for(rows)
        torch.manual_seed(rows)
        h = torch.randn(rows, SMALL.hidden_size).to(torch.bfloat16)
        act = torch.randn(rows, SMALL.intermediate_size).to(torch.bfloat16)
        with torch.inference_mode():
            gate, up = F.linear(rms_norm(h, layer.post_attention_layernorm.weight, eps),
                                layer.mlp.gate_up_weight).chunk(2, dim=-1)
            expect = {"gate_up": F.silu(gate) * up,
                      "down": h + F.linear(act, layer.mlp.down_proj.weight)}
            got = {"gate_up": gemms.norm_gate_up(h, layer.post_attention_layernorm.weight,
                                                 layer.mlp.gate_up_weight, eps),
                   "down": gemms.linear_residual(act, layer.mlp.down_proj.weight, h)}
            # the prenorm kernels: the served bits
            expect.update({f"{k} prenorm vs served": v for k, v in got.items()})
            got["gate_up prenorm vs served"] = pre.norm_gate_up(
                h, layer.post_attention_layernorm.weight, layer.mlp.gate_up_weight, eps)
            got["down prenorm vs served"] = pre.linear_residual(
                act, layer.mlp.down_proj.weight, h)
            attn = torch.randn(rows, SMALL.num_heads * SMALL.head_dim).to(torch.bfloat16)
            expect["o prenorm+inline vs served"] = gemms.linear_residual(
                attn, layer.self_attn.o_proj.weight, h)
            got["o prenorm+inline vs served"] = pre.linear_residual(
                attn, layer.self_attn.o_proj.weight, h, inline=True)
            for name, gemm in layer_calls(depth, fused, rows, SMALL_PLAIN).items():
                mm_ref = torch.mm(gemm["a"], gemm["weights"][1].t())
                for kind, call in gemm["calls"].items():
                    if kind.startswith("triton:"):
                        got[f"{name} {kind}"] = call(1)
                        expect[f"{name} {kind}"] = mm_ref
        for name, value in got.items():
            diff = (value.float() - expect[name].float()).abs().max().item()
            worst[name] = max(worst.get(name, 0.0), diff)
    return worst


def compile_only(rows: int = 512) -> list[dict[str, Any]]:
    """Builds every plain GEMM shape at the full-size GEMMs for sm_90a here (no GPU,
    ``tests/sm90_build.py``'s stand-in driver): registers, shared memory, spills, wgmma sites,
    and why one would not launch on Hopper."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.sm90_build import build_only, resources

    cfg = BreezeConfig.full().depth
    heads = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    shapes = {"qkv": (heads, cfg.hidden_size), "o": (cfg.hidden_size, cfg.num_heads * cfg.head_dim),
              "gate_up": (2 * cfg.intermediate_size, cfg.hidden_size),
              "down": (cfg.hidden_size, cfg.intermediate_size)}
    builds = []
    for name, (n, k) in shapes.items():
        a = torch.zeros(rows, k, dtype=torch.bfloat16)
        w = torch.zeros(n, k, dtype=torch.bfloat16)
        for config, gemm in plain_gemms(name, a, [w], PLAIN_CONFIGS).items():
            with build_only(90) as built:
                gemm(0)
            r = resources(built[0], f"{name} {config}")
            row = {"gemm": name, "config": config, "registers": r.registers,
                   "shared_bytes": r.shared_bytes, "local_bytes": r.local_bytes,
                   "num_warps": r.num_warps, "problems": r.problems(),
                   "wgmma": built[0].asm["ptx"].count("wgmma.mma_async")}
            builds.append(row)
            print(f"[gemm] {name:8s} {config:18s} {r.registers:3d} registers x "
                  f"{32 * r.num_warps} threads, {r.shared_bytes} B shared, {r.local_bytes} B "
                  f"local, {row['wgmma']} wgmma sites " + "; ".join(row["problems"]),
                  flush=True)
    return builds


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    results = sorted(results, key=lambda r: r["rows"])
    rows = [r["rows"] for r in results]
    for name, style in (("gate_up", "o"), ("down", "s"), ("o", "^"), ("qkv", "v")):
        for kind, line in (("served", "-"), ("prenorm", "-."), ("cublas", "--"),
                           ("triton", ":")):
            ys = [pick(r["gemms"][name], kind)["tflops"] for r in results]
            if any(y is not None for y in ys):
                ax.plot(rows, [float("nan") if y is None else y for y in ys], line,
                        marker=style, label=f"{name} {kind}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("rows (requests x 2 with CFG)")
    ax.set_ylabel("TFLOP/s")
    ax.set_title("depth layer GEMMs: served kernels, cuBLAS, plain Triton (best shape)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="512,256,128,64,16,2",
                        help="row counts, in the order run (largest first: capacity's)")
    parser.add_argument("--no-pdl", action="store_true", help="launch without PDL")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--small", action="store_true",
                        help="CPU: check the served calls on a small decoder, time nothing")
    parser.add_argument("--compile-only", action="store_true",
                        help="build the plain GEMMs for sm_90a here (no GPU) and stop")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.compile_only:
        builds = compile_only()
        sys.exit(1 if any(b["problems"] or not b["wgmma"] for b in builds) else 0)
    if args.small:  # every call of the GPU run once, small, untimed; then the served values
        depth = build(SMALL, "cpu")
        with torch.inference_mode():
            results = [measure(depth, int(r), False, 1, Tiles(qkv_split=1, split_k=2), untimed,
                               SMALL_PLAIN, flush_bytes=0) for r in args.rows.split(",")]
        worst = check_small()
        record = {**provenance(device="cpu"), "timed": False, "max_abs_diff": worst,
                  "results": results}
        print(json.dumps({"max_abs_diff": worst}))
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(record, indent=1))
        sys.exit(0 if all(v < 0.05 for v in worst.values()) else 1)
    if not torch.cuda.is_available():
        sys.exit("depth_gemm_ceiling: timing needs CUDA (use --small on a CPU)")
    depth = build(BreezeConfig.full().depth, "cuda")
    record: dict[str, Any] = {**provenance(), "timed": True, "pdl": not args.no_pdl,
                              "plain_configs": list(PLAIN_CONFIGS), "results": []}
    for rows in args.rows.split(","):  # the JSON after each row count: a timeout keeps them
        with torch.inference_mode():
            record["results"].append(measure(depth, int(rows), not args.no_pdl, args.iters))
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(record, indent=1))
    if args.out:
        plot(record["results"], args.out.with_suffix(".png"))
        print(f"[gemm] wrote {args.out}")


if __name__ == "__main__":
    main()
