"""Helpers of the fused-kernel tests (CPU interpreter and GPU): random weights shaped like
trained ones, the smallest backbone the fused kernels take, a backbone step in fp32 as the
reference, relative error, and running a check in a fresh interpreter process."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from breezert.layers.attention import GatherKV, KVRun, decode_meta_on_device
from breezert.models.backbone import Qwen3Backbone
from breezert.models.config import BackboneConfig
from breezert.worker.kv_cache import PagedKVCache
from tests.components import needs

REPO = Path(__file__).resolve().parents[1]
# the Makefile adds triton on Linux x86_64 only (no other wheels): a failure there under CI=true
needs_triton = needs("triton", make_target="install",
                     provided=platform.system() == "Linux" and platform.machine() == "x86_64")


def random_bf16_fused_(model: nn.Module) -> nn.Module:
    """Random weights (norm weights near 1, others ~ 1/sqrt(fan_in)), cast to bf16, q/k/v and
    gate/up packed as ``BreezeModel.fuse_projections_()`` packs them."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
    model = model.to(torch.bfloat16).eval()
    for module in model.modules():
        if hasattr(module, "fuse_"):
            module.fuse_()
    return model


def fp32_copy(module: nn.Module, cls: type[nn.Module]) -> nn.Module:
    """A ``cls(module.cfg)`` with ``module``'s weights in fp32, on the current device: the
    reference math of a GPU test."""
    copy = cls(module.cfg)
    copy.load_state_dict({k: v.float() for k, v in module.state_dict().items()})
    return copy.eval()


SMALL_BACKBONE = BackboneConfig(hidden_size=128, intermediate_size=256, num_layers=2,
                               num_heads=4, num_kv_heads=2, head_dim=32)
"""The smallest Qwen3 backbone the fused DECODE and PREFILL kernels accept (tensor-core tiles
need >= 16 per dot axis)."""


def small_backbone() -> Qwen3Backbone:
    """``SMALL_BACKBONE`` with seeded random bf16 weights, projections packed."""
    torch.manual_seed(0)
    return random_bf16_fused_(Qwen3Backbone(SMALL_BACKBONE))


def small_paged_cache(seed: int) -> PagedKVCache:
    """A 16-block (16 tokens a block) bf16 paged cache for ``SMALL_BACKBONE`` on the CPU, filled
    with seeded random values."""
    cfg = SMALL_BACKBONE
    cache = PagedKVCache(cfg.num_layers, 16, 16, cfg.num_kv_heads, cfg.head_dim,
                         dtype=torch.bfloat16, device="cpu")
    torch.manual_seed(seed)
    cache.kv.copy_(torch.randn_like(cache.kv.float()).to(torch.bfloat16))
    return cache


def decode_meta(cache: PagedKVCache, runs: list[KVRun], num_rows: int,
                context: int) -> dict[str, torch.Tensor]:
    """One DECODE step's metadata as its graph builds it (``decode_meta_on_device``): ``runs``
    (one new token each) in rows ``0..``, padded to ``num_rows`` rows (their block table all
    scratch block) and ``context`` keys."""
    blocks = -(-context // cache.block_size)
    tables = torch.full((num_rows, blocks), cache.num_blocks, dtype=torch.long)
    positions = torch.zeros(num_rows, dtype=torch.long)
    for i, run in enumerate(runs):
        ids = list(run.block_ids)[:blocks]
        tables[i, : len(ids)] = torch.tensor(ids)
        positions[i] = run.start
    return decode_meta_on_device(tables.to(cache.kv.device), positions.to(cache.kv.device),
                                 torch.arange(context, device=cache.kv.device),
                                 cache.block_size, cache.scratch_row)


def fp32_backbone_step(backbone: Qwen3Backbone, kv: torch.Tensor, meta: dict[str, torch.Tensor],
                       embeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``backbone``'s step over ``kv`` in fp32 (weights, cache and inputs upcast; ``meta``: the
    ``GatherKV`` tensors and ``positions``): the hidden states, and the fp32 cache with the new
    k/v written."""
    with torch.device(embeds.device):
        ref = Qwen3Backbone(backbone.cfg)
    ref.load_state_dict({k: v.float() for k, v in backbone.state_dict().items()})
    kv32 = kv.float()
    view = GatherKV(kv32, meta["write_rows"], meta["read_rows"], meta["mask"])
    out = ref.eval()(embeds.float(), meta["positions"], view)
    del ref
    if embeds.is_cuda:
        torch.cuda.empty_cache()
    return out, kv32


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|a - b| / |b|`` (Frobenius norms, in fp32)."""
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def sm90_build_env(tmp_path: Path) -> dict[str, str]:
    """The environment of a process that builds kernels for sm_90 here (no GPU): compiled, not
    interpreted; its own Triton cache under ``tmp_path`` (built here, not from an old cache);
    the runtime, the repo and ``bench/`` importable."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")
    env["PYTHONPATH"] = os.pathsep.join(str(REPO / p) for p in ("runtime", ".", "bench"))
    return env


def run_compile_only(tmp_path: Path, script: str, *args: str, timeout_s: float = 300) -> str:
    """``bench/<script> --compile-only ARGS`` in a process that builds for sm_90 here
    (``sm90_build_env``); asserts it exited 0 and returns what it printed."""
    proc = subprocess.run([sys.executable, str(REPO / "bench" / script), "--compile-only", *args],
                          cwd=REPO, env=sm90_build_env(tmp_path), capture_output=True, text=True,
                          timeout=timeout_s)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


def run_in_interpreter(module: str, call: str) -> None:
    """Runs ``call`` (names of test module ``module``) in a fresh Python with
    ``TRITON_INTERPRET=1``: Triton reads the switch once, at its first import, which another
    test may already have done in this process."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    code = f"from {module} import *; {call}"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
