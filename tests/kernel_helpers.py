"""Helpers of the fused-kernel tests (CPU interpreter and GPU): random weights shaped like
trained ones, and running a check in a fresh interpreter process."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="triton is not installed")


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


def run_in_interpreter(module: str, call: str) -> None:
    """Runs ``call`` (names of test module ``module``) in a fresh Python with
    ``TRITON_INTERPRET=1``: Triton reads the switch once, at its first import, which another
    test may already have done in this process."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    code = f"from {module} import *; {call}"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
