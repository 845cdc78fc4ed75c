"""What the GPU benchmark scripts under bench/ share: CUDA-event timing, run metadata and random
bf16 weights for the layer stacks they time.

Imported by the scripts as a sibling module (they run as ``python bench/NAME.py``, so bench/ is
on ``sys.path``). Must not: import the runtime (each script builds what it measures).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

import torch


def random_bf16_packed(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` with random weights (each ~ N(0, 1/fan_in), from torch's current seed), cast
    to bf16 and in eval mode, every q/k/v and gate/up projection packed (each submodule with a
    ``fuse_``) as serving packs them."""
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, p.shape[-1] ** -0.5)
    module = module.to(torch.bfloat16).eval()
    for sub in module.modules():
        if hasattr(sub, "fuse_"):
            sub.fuse_()
    return module


def median_ms(fn: Callable[[], Any], iters: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of ``fn()`` over ``iters`` runs after ``warmup``, by CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def git_commit() -> str:
    """``BREEZERT_GIT_COMMIT`` (a copied tree's .git may be stale), else ``git rev-parse``."""
    commit = os.environ.get("BREEZERT_GIT_COMMIT")
    if commit:
        return commit
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def gpu_metadata(**extra: Any) -> dict[str, Any]:
    """GPU, torch and CUDA versions, commit and date of a run, plus ``extra``."""
    return {
        "gpu": torch.cuda.get_device_name(), "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda, "git_commit": git_commit(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), **extra,
    }
