"""torch.compile of the depth decoder's repeated units: one step of its layers, and the sampler.

Owns: the one place that calls ``torch.compile``. NOTE(compile): we use Inductor's default mode
with a dynamic batch dimension rather than max-autotune or hand-written Triton: the depth frame
is launch-bound at our batch sizes (180 layer-steps and 16 sampling passes per frame), so what
pays is fusing RMSNorm, RoPE, SiLU-mul, residual adds and the sampler's elementwise chain
(temperature, masks, counter hash, Gumbel noise) into fewer kernels; GEMMs stay on cuBLAS.
max-autotune measured 529 s of compile per batch size, and compiling the whole unrolled frame
(16 steps x 12 layers in one graph) took minutes too; start-up is part of the product. So we
compile the two units the frame repeats — ``DepthDecoder.run_layers`` (position is a tensor, so
one graph serves all 16 steps) and ``sample`` — once each, with a dynamic batch, and capture
the result in the depth CUDA graph. The backbone layers can be compiled the same way
(``compile_backbone``), each around its uncompiled paged attention. Must not: change numerics
beyond Inductor's fusion (the GPU tests compare graphs with eager).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial

import torch

from breezert.layers.sampling import sample
from breezert.models.breeze import BreezeModel
from breezert.stages.depth import depth_frames
from breezert.stages.text_encode import encode_text

logger = logging.getLogger("breezert.compile")


def _raise_cache_limit(limit: int) -> None:
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, limit)


def depth_fn(
    model: BreezeModel, max_k: int | None, compile_depth: bool
) -> Callable[..., dict[str, torch.Tensor]]:
    """``depth_frames`` bound to ``model`` and ``max_k``; its repeated units compiled on CUDA
    when asked."""
    if not compile_depth or model.lm_head.weight.device.type != "cuda":
        return partial(depth_frames, model, max_k=max_k)
    _raise_cache_limit(64)
    depth = model.depth_decoder
    if not getattr(depth, "is_compiled", False):
        depth.run_layers = torch.compile(depth.run_layers, dynamic=True, fullgraph=True)
        depth.is_compiled = True
        logger.info("compiled the depth step (inductor, default mode, dynamic batch)")
    sampler = torch.compile(sample, dynamic=True, fullgraph=True)
    return partial(depth_frames, model, max_k=max_k, sampler=sampler)


def compile_backbone_layers(model: BreezeModel) -> None:
    """Compiles each backbone layer (dynamic batch); paged attention runs uncompiled between
    the two fused regions (norm + qkv + q/k-norm + RoPE, and o_proj + residual + MLP)."""
    _raise_cache_limit(128)
    for layer in model.backbone_model.layers:
        layer.compile(dynamic=True)


def text_encode_fn(
    model: BreezeModel, compile_text_encoder: bool
) -> Callable[..., dict[str, torch.Tensor]]:
    """``encode_text`` bound to ``model``; compiled whole (26 layers, dynamic token count) on
    CUDA when asked. The encoder sits on the first-packet path and runs ~70 launches per layer
    uncompiled; the compile costs start-up time, so it is a switch to measure, off by default."""
    fn = partial(encode_text, model)
    if not compile_text_encoder or model.lm_head.weight.device.type != "cuda":
        return fn
    _raise_cache_limit(64)
    return torch.compile(fn, dynamic=True, fullgraph=True)
