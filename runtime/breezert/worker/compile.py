"""torch.compile of the depth decoder step (12 layers + final norm) as one unit.

Owns: the one place that calls ``torch.compile``. NOTE(compile): we use Inductor's default mode
with a dynamic batch dimension rather than max-autotune or hand-written Triton: the step is
launch-bound at our batch sizes (180 layer-steps per frame), so what pays is fusing RMSNorm,
RoPE, SiLU-mul and residual adds into fewer kernels; GEMMs stay on cuBLAS. max-autotune measured
529 s of compile per batch size for little more, and start-up is part of the product. One
dynamic-shape compile serves every depth bucket; the result is then captured in the depth
CUDA graph. Must not: change numerics beyond Inductor's fusion (checked by the GPU tests).
"""

from __future__ import annotations

import logging

import torch

from breezert.models.breeze import BreezeModel

logger = logging.getLogger("breezert.compile")


def compile_depth_layers(model: BreezeModel) -> None:
    """Replaces ``depth_decoder.run_layers`` with a compiled version (in place, idempotent)."""
    depth = model.depth_decoder
    if getattr(depth, "_is_compiled", False):
        return
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    depth.run_layers = torch.compile(depth.run_layers, dynamic=True, fullgraph=True)
    depth._is_compiled = True
    logger.info("depth decoder step compiled (inductor, default mode, dynamic batch)")
