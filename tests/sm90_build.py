"""Builds the project's Triton kernels for the H200 (sm_90) on a machine without a GPU.

Triton compiles for a named target without a device: a stand-in driver names sm_90, and every
launch is turned into a build only (``JITFunction.run`` with ``warmup=True``). The fused modules
run on ``meta`` tensors (shapes without memory, torch ops without arithmetic), so the full-size
modules cost nothing to make and every launch they would issue on the GPU is built with its real
shapes and constexprs. What a build says (``cuobjdump --dump-resource-usage`` of the cubin):
registers per thread, shared memory per block, local memory (spills). Checked against Hopper's
limits, a build catches before a device session what the interpreter cannot: an ``OutOfResources``
at launch (the first fused text encoder asked for 264 KB of shared memory, 227 KB per block, and
failed every GPU test), an operation the compiler refuses, and a kernel variant that a module's
``warm()`` leaves to be built in the middle of serving.

Owns: the stand-in driver and the build-only launch (``build_only``), reading a build's resources
(``resources``), and the list of module variants the engine can select (``VARIANTS``).
Must not: run anything (no kernel is launched), or be imported by the runtime.

``python -m tests.sm90_build [--json PATH]`` prints every variant's kernels and their resources.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import re
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from tests.kernel_helpers import random_bf16_fused_

# Hopper (sm_90) per-block limits: shared memory a block may opt into, and the register file.
MAX_SHARED_BYTES = 227 * 1024
MAX_BLOCK_REGISTERS = 64 * 1024
MAX_THREADS = 1024
# Per SM: shared memory (1 KB of it reserved per resident block), registers, warps, blocks.
SM_SHARED_BYTES, SM_RESERVED_PER_BLOCK = 228 * 1024, 1024
SM_REGISTERS, SM_WARPS, SM_BLOCKS = 64 * 1024, 64, 32


@dataclass(frozen=True)
class Built:
    """One compiled kernel variant and what it needs per block."""

    kernel: str
    variant: str
    registers: int  # per thread
    shared_bytes: int  # per block (Triton's dynamic shared memory)
    local_bytes: int  # per thread: register spills and local arrays
    num_warps: int
    num_stages: int
    shape: str = ""  # the kernel's integer constexprs, e.g. "BM=16 BN=32 BK=256"
    stack_bytes: int = 0  # per thread: the ABI stack frame, where ptxas puts most spills

    @property
    def blocks_per_sm(self) -> int:
        """Blocks of this kernel one SM holds at once (registers go out per warp in units of
        256). Below 2, a programmatic dependent launch cannot place the next kernel's blocks
        beside this one's on a full grid."""
        warp_registers = -(-self.registers * 32 // 256) * 256
        return min(SM_SHARED_BYTES // (self.shared_bytes + SM_RESERVED_PER_BLOCK),
                   SM_REGISTERS // max(warp_registers * self.num_warps, 1),
                   SM_WARPS // self.num_warps, SM_BLOCKS)

    def problems(self) -> list[str]:
        """Why this build would fail to launch on an H200 (empty: it launches)."""
        threads = 32 * self.num_warps
        out = []
        if self.shared_bytes > MAX_SHARED_BYTES:
            out.append(f"{self.shared_bytes} B of shared memory > {MAX_SHARED_BYTES}")
        if self.registers * threads > MAX_BLOCK_REGISTERS:
            out.append(f"{self.registers} registers x {threads} threads > {MAX_BLOCK_REGISTERS}")
        if threads > MAX_THREADS:
            out.append(f"{threads} threads > {MAX_THREADS}")
        return out


class _Sm90Driver:
    """What ``JITFunction.run`` asks of the active driver before a build-only launch."""

    def __init__(self, arch: int) -> None:
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, 32)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> object:
        return self.target

    def get_active_torch_device(self) -> torch.device:
        return torch.device("meta")


@contextlib.contextmanager
def build_only(arch: int = 90) -> Iterator[list[object]]:
    """Inside: every Triton launch builds its kernel for ``sm_{arch}`` and returns without
    running; yields the list of ``CompiledKernel`` objects the launches returned, in order (a
    variant built earlier comes back as the same object)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("build_only needs Triton's compiler, not its interpreter")
    from triton.runtime import jit
    from triton.runtime.driver import driver

    launched: list[object] = []
    run = jit.JITFunction.run

    def build(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        launched.append(kernel)
        return kernel

    jit.JITFunction.run = build
    previous = driver._active  # None without a GPU: reset_active() would look for one
    driver.set_active(_Sm90Driver(arch))
    try:
        yield launched
    finally:
        jit.JITFunction.run = run
        driver._active = previous


def resources(kernel: object, variant: str) -> Built:
    """Registers, shared, local and stack memory of a ``CompiledKernel`` from its cubin."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    meta = kernel.metadata  # type: ignore[attr-defined]
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])  # type: ignore[attr-defined]
        cubin.flush()
        report = subprocess.run([str(tool), "--dump-resource-usage", cubin.name],
                                capture_output=True, text=True, check=True).stdout
    usage = dict(re.findall(r"(REG|LOCAL|STACK):(\d+)", report))
    src = kernel.src  # type: ignore[attr-defined]
    shape = " ".join(f"{src.fn.arg_names[path[0]]}={value}"
                     for path, value in sorted(src.constants.items())
                     if len(path) == 1 and type(value) is int
                     and src.fn.arg_names[path[0]].isupper())
    return Built(meta.name, variant, int(usage["REG"]), int(meta.shared), int(usage["LOCAL"]),
                 meta.num_warps, meta.num_stages, shape, int(usage.get("STACK", 0)))


# ----------------------------------------------------------------------------- the variants

Warm = Callable[[], None] | None


def _engine_graph(profile: str = "h200-latency") -> object:
    from breezert.config import EngineConfig

    path = Path(__file__).resolve().parents[1] / "configs" / f"{profile}.toml"
    return EngineConfig.from_file(path).graph


def _depth_rows(graph: object) -> list[int]:
    """Every row count a depth bucket can hold, with CFG (two rows a request) or without."""
    return sorted({r for b in graph.depth_batch_buckets for r in (b, 2 * b)})  # type: ignore[attr-defined]


def _depth(tiles: str, pdl: bool, qkv_split_k: int, prenorm: bool = False,
           o_inline: bool = False, down_inline: bool = False,
           ) -> tuple[Warm, Callable[[], None]]:
    from breezert.kernels.fused_depth import TILES_BY_ROWS, FusedDepthLayers, prenorm_every_bucket
    from breezert.kernels.gemm import Tiles
    from breezert.models.config import BreezeConfig
    from breezert.models.depth import DepthDecoder

    graph = _engine_graph("h200-capacity" if prenorm else "h200-latency")  # prenorm: 512 rows
    max_rows = 2 * max(graph.depth_batch_buckets)  # CFG: two rows a request
    with torch.device("meta"):
        depth = random_bf16_fused_(DepthDecoder(BreezeConfig.full().depth))
    table = TILES_BY_ROWS if tiles == "by-rows" else ((max_rows, Tiles()),)
    if prenorm:  # every bucket with its norms apart (as served at 256-512 rows)
        assert tiles == "by-rows", "prenorm variants run the by-rows table"
        table = prenorm_every_bucket()
    table = tuple((limit, replace(t, qkv_split_k=qkv_split_k, o_inline=t.o_inline or o_inline,
                                  down_inline=t.down_inline or down_inline))
                  for limit, t in table)
    fused = FusedDepthLayers(depth, max_rows, table, warm=False, pdl=pdl)
    pos = torch.zeros(1, dtype=torch.long, device="meta")

    def serve() -> None:
        for rows in _depth_rows(graph):
            x = torch.zeros(rows, depth.cfg.backbone_hidden_size, dtype=torch.bfloat16,
                            device="meta")
            cos, sin = depth.rope.cos_sin(pos.expand(rows), torch.bfloat16)
            fused(x, cos, sin, depth.new_cache(rows), pos)

    return fused.warm, serve


def _decode(pdl: bool) -> tuple[Warm, Callable[[], None]]:
    from breezert.kernels.fused_decode import FusedBackboneDecode
    from breezert.kernels.gemm import Tiles
    from breezert.layers.attention import GatherKV
    from breezert.models.breeze import BreezeModel
    from breezert.models.config import BreezeConfig

    graph = _engine_graph()
    cfg = BreezeConfig.full()
    with torch.device("meta"):
        model = BreezeModel(cfg)
    model.backbone_model = random_bf16_fused_(model.backbone_model)
    max_rows = max(graph.decode_batch_buckets)
    fused = FusedBackboneDecode(model, max_rows, Tiles(pdl=pdl))
    bb = cfg.backbone

    def serve() -> None:  # every (rows, context) bucket the DECODE graphs capture
        kv = torch.zeros(bb.num_layers, 2, 16, bb.num_kv_heads, bb.head_dim,
                         dtype=torch.bfloat16, device="meta")
        for rows in graph.decode_batch_buckets:
            for context in graph.decode_context_buckets:
                zeros = torch.zeros(rows, dtype=torch.long, device="meta")
                read = torch.zeros(rows, context, dtype=torch.long, device="meta")
                mask = torch.zeros(rows, 1, 1, context, dtype=torch.bool, device="meta")
                embeds = torch.zeros(rows, bb.hidden_size, dtype=torch.bfloat16, device="meta")
                fused(embeds, zeros, GatherKV(kv, zeros, read, mask))

    return fused.warm, serve


def _prefill() -> tuple[Warm, Callable[[], None]]:
    from breezert.kernels.fused_decode import DECODE_TILES
    from breezert.kernels.fused_prefill import FusedBackbonePrefill
    from breezert.layers.attention import GatherKV
    from breezert.models.breeze import BreezeModel
    from breezert.models.config import BreezeConfig

    graph = _engine_graph()
    cfg = BreezeConfig.full()
    with torch.device("meta"):
        model = BreezeModel(cfg)
    model.backbone_model = random_bf16_fused_(model.backbone_model)
    limit = graph.fused_prefill_max_tokens  # type: ignore[attr-defined]
    fused = FusedBackbonePrefill(model, limit, DECODE_TILES, warm=False)
    bb = cfg.backbone

    def serve() -> None:  # every (tokens, keys) bucket the PREFILL graphs capture up to the limit
        kv = torch.zeros(bb.num_layers, 2, 16, bb.num_kv_heads, bb.head_dim,
                         dtype=torch.bfloat16, device="meta")
        for tokens in (t for t in graph.prefill_token_buckets if t <= limit):  # type: ignore[attr-defined]
            for keys in (k for k in graph.decode_context_buckets if k >= tokens):  # type: ignore[attr-defined]
                rows = torch.zeros(tokens, dtype=torch.long, device="meta")
                read = torch.zeros(keys, dtype=torch.long, device="meta")
                mask = torch.zeros(tokens, keys, dtype=torch.bool, device="meta")
                embeds = torch.zeros(tokens, bb.hidden_size, dtype=torch.bfloat16, device="meta")
                fused(embeds, rows, GatherKV(kv, rows, read, mask))

    return fused.warm, serve


def _text_encoder(pdl: bool, wide: bool = False) -> tuple[Warm, Callable[[], None]]:
    """``wide``: up to 1024 tokens with ``wide_tiles`` (every count to 128, then the counts
    where a row-block or key-block size changes)."""
    from breezert.kernels.fused_text_encoder import FusedTextEncoder
    from breezert.models.config import TextEncoderConfig
    from breezert.models.text_encoder import T5Gemma2TextEncoder

    with torch.device("meta"):
        enc = random_bf16_fused_(T5Gemma2TextEncoder(TextEncoderConfig()))
    fused = FusedTextEncoder(enc, max_tokens=1024 if wide else 128, warm=False, pdl=pdl,
                             wide_tiles=wide)
    counts = [*range(1, 129), *((129, 200, 256, 257, 400, 512, 513, 800, 1024) if wide else ())]

    def serve() -> None:  # every token count up to the fused limit (buckets past it run eager)
        for tokens in counts:
            ids = torch.zeros(tokens, dtype=torch.long, device="meta")
            fused(ids, ids, ids)

    return fused.warm, serve


def _snake() -> tuple[Warm, Callable[[], None]]:
    from breezert.kernels.snake import bias_residual_triton, keep_tail_triton, snake_cat_cl_triton

    def serve() -> None:  # with and without a history (the kernels' shapes are arguments), the
        # serving codec's histories read from and written to the arena by slot, a conv's bias
        # added first, a residual unit's skip, in every codec precision's dtype (bf16 and fp16
        # serve a 16-bit decoder and state); rows 8-14 and 1920-1974 samples wide: the
        # decoder's narrowest and widest at one frame; 96, 192 and 1536 channels: 32, 64 and 128
        # channels a program (``channel_block``)
        for dtype, (t, h), channels in itertools.product(
                (torch.float32, torch.bfloat16, torch.float16), ((8, 6), (1920, 54)),
                (96, 192, 1536)):
            # channels-last, as a conv's output
            x = torch.zeros(4, t, channels, dtype=dtype, device="meta").transpose(1, 2)
            alpha = torch.zeros(channels, dtype=dtype, device="meta")
            snake_cat_cl_triton(x, alpha, alpha, None)
            snake_cat_cl_triton(x, alpha, alpha, None, bias=alpha)
            snake_cat_cl_triton(x, alpha, alpha,
                                torch.zeros(4, channels, h, dtype=dtype, device="meta"))
            arena = torch.zeros(5, channels, h, dtype=dtype, device="meta")
            rows = torch.zeros(4, dtype=torch.long, device="meta")
            for log_alpha in (alpha, None):
                full = snake_cat_cl_triton(x, log_alpha, log_alpha, arena, rows)
            for frames in (rows, None):
                keep_tail_triton(full, arena, rows, frames, 1)
            bias_residual_triton(x, x, alpha)

    return None, serve


def _codec_attention() -> tuple[Warm, Callable[[], None]]:
    from breezert.kernels.codec_attention import ring_attention
    from breezert.models.config import CodecConfig

    cfg = CodecConfig()

    def serve() -> None:  # every codec precision's dtype, one frame and a 16-frame piece
        h, d, ring = cfg.num_heads, cfg.head_dim, cfg.sliding_window - 1
        saved = torch.backends.cuda.matmul.allow_tf32
        for dtype, tf32 in ((torch.float32, False), (torch.float32, True), (torch.bfloat16, False),
                            (torch.float16, False)):
            torch.backends.cuda.matmul.allow_tf32 = tf32  # the codec's tf32 precision
            arena = torch.zeros(5, cfg.num_layers, 2, cfg.num_kv_heads, ring, d, dtype=dtype,
                                device="meta")
            for t in (1, 16):
                q = torch.zeros(4, t, h, d, dtype=dtype, device="meta").transpose(1, 2)
                k = torch.zeros(4, t, cfg.num_kv_heads, d, dtype=dtype,
                                device="meta").transpose(1, 2)
                rows = torch.zeros(4, dtype=torch.long, device="meta")
                rope = torch.zeros(4, 1, t, d, dtype=dtype, device="meta")
                ring_attention(q, k, k, rope, rope, arena[:, 3], rows, rows, rows,
                               cfg.sliding_window)
        torch.backends.cuda.matmul.allow_tf32 = saved

    return None, serve


def _depth_draw() -> tuple[Warm, Callable[[], None]]:
    from breezert.kernels.depth_draw import depth_draw_triton
    from breezert.models.config import DepthConfig

    vocab = DepthConfig().vocab_size

    def serve() -> None:  # cond rows alone and guided, the settings as the frame's columns
        for num, rows in ((1, 1), (256, 512)):
            logits = torch.zeros(rows, vocab, device="meta")
            sampling = torch.zeros(num, 6, device="meta")
            flags = torch.zeros(num, dtype=torch.bool, device="meta")
            longs = torch.zeros(num, dtype=torch.long, device="meta")
            depth_draw_triton(logits, num, flags, sampling[:, 0], sampling[:, 3], longs,
                              sampling[:, 5], longs, longs)

    return None, serve


VARIANTS: dict[str, Callable[[], tuple[Warm, Callable[[], None]]]] = {
    "depth by-rows": lambda: _depth("by-rows", False, 1),
    "depth by-rows pdl": lambda: _depth("by-rows", True, 1),
    "depth by-rows qkv-split-2": lambda: _depth("by-rows", False, 2),
    "depth by-rows qkv-split-4 pdl": lambda: _depth("by-rows", True, 4),
    "depth one-shape": lambda: _depth("one", False, 1),
    "depth by-rows prenorm pdl": lambda: _depth("by-rows", True, 1, prenorm=True),
    "depth by-rows prenorm inline pdl": lambda: _depth(  # o_proj's and down's splits inline
        "by-rows", True, 1, prenorm=True, o_inline=True, down_inline=True),
    "decode": lambda: _decode(False),
    "decode pdl": lambda: _decode(True),
    "prefill": _prefill,
    "text encoder": lambda: _text_encoder(False),
    "text encoder pdl": lambda: _text_encoder(True),
    "text encoder pdl wide": lambda: _text_encoder(True, wide=True),
    "snake": _snake,
    "codec attention": _codec_attention,
    "depth draw": _depth_draw,
}
"""Each module variant a config or a tuning run can select -> ``(warm, serve)``: its start-up
build (None: a plain function, built when the stage's graphs are captured), and every shape the
engine's buckets launch it with."""


@dataclass
class VariantReport:
    variant: str
    builds: list[Built]
    not_warmed: list[str] | None
    """Kernels that serving launched in a variant ``warm()`` had not built (None: no warm)."""


@torch.inference_mode()
def build_variant(name: str) -> VariantReport:
    with build_only() as launched:
        warm, serve = VARIANTS[name]()
        if warm is not None:
            warm()
        warmed = {id(k) for k in launched}
        served_from = len(launched)
        serve()
        kernels = {id(k): k for k in launched}
        late = {id(k) for k in launched[served_from:]} - warmed
    builds = [resources(k, name) for k in kernels.values()]
    not_warmed = (sorted({kernels[i].metadata.name for i in late})  # type: ignore[attr-defined]
                  if warm is not None else None)
    return VariantReport(name, builds, not_warmed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write every build's resources here")
    parser.add_argument("variants", nargs="*", default=list(VARIANTS))
    args = parser.parse_args()
    reports = [build_variant(name) for name in args.variants]
    for report in reports:
        print(f"{report.variant}: {len(report.builds)} builds"
              + (f"; not built by warm(): {report.not_warmed}" if report.not_warmed else ""))
        for b in report.builds:
            flags = "; ".join(b.problems())
            print(f"  {b.kernel:32s} regs {b.registers:3d}  smem {b.shared_bytes:6d}  "
                  f"local {b.local_bytes:4d}  stack {b.stack_bytes:4d}  warps {b.num_warps}  "
                  f"stages {b.num_stages}  "
                  f"blocks/SM {b.blocks_per_sm:2d}  {b.shape}"
                  + (f"  FAILS: {flags}" if flags else ""))
    if args.json:
        import triton

        from breezert_bench.provenance import provenance

        doc = {"target": "sm_90 (built, not run)", "triton_version": triton.__version__,
               **provenance(device="cpu"),
               "variants": [{**asdict(r), "builds": [{**asdict(b), "blocks_per_sm": b.blocks_per_sm}
                                                      for b in r.builds]} for r in reports]}
        args.json.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
