"""torch.compile of the depth decoder's repeated units (one step of its layers, the sampler) and
the switch to the fused Triton kernels.

Owns: the one place that calls ``torch.compile`` and that swaps in the fused Triton kernels:
the depth layers (``graph.fused_depth``, kernels/fused_depth.py) and the backbone DECODE step
(``graph.fused_decode``, kernels/fused_decode.py). NOTE(compile): Inductor runs in default mode
with a dynamic batch dimension, not max-autotune (the frame is launch-bound, so what pays is
fusing the elementwise chains; compile time is start-up time: bench/README.md). It compiles the
two units the frame repeats, ``DepthDecoder.run_layers`` (position is a tensor, so one graph
serves all 16 steps) and ``sample``, once each; the depth CUDA graph captures the result.
Must not: change numerics beyond Inductor's fusion (the GPU tests compare graphs with eager).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial

import torch

from breezert.layers.sampling import sample
from breezert.models.breeze import BreezeModel
from breezert.stages.backbone import backbone_decode, backbone_prefill
from breezert.stages.depth import depth_frames
from breezert.stages.text_encode import encode_text

logger = logging.getLogger("breezert.compile")


def check_pdl_supported(device: torch.device) -> None:
    """``graph.pdl`` needs Hopper or later (the kernels' wait is a compute-capability 9.0
    instruction): refused up front, naming the switch, instead of a kernel build error."""
    if device.type != "cuda":
        return  # EngineConfig refuses CUDA-only switches on a CPU model
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        raise ValueError(
            f"graph.pdl needs a GPU of compute capability 9.0 or later (Hopper); "
            f"{torch.cuda.get_device_name(device)} is {major}.{minor}: set graph.pdl = false")


def _raise_cache_limit(limit: int) -> None:
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, limit)


def depth_fn(
    model: BreezeModel, max_k: int | None, compile_depth: bool, fused_depth: bool = False,
    max_rows: int = 64, pdl: bool = False, fused_draw: bool = False,
) -> Callable[..., dict[str, torch.Tensor]]:
    """``depth_frames`` bound to ``model`` and ``max_k``; on CUDA its layer step runs the fused
    Triton kernels (``fused_depth``, workspace for ``max_rows`` rows, launch shapes per row
    bucket, chained by programmatic dependent launch with ``pdl``) or is compiled
    (``compile_depth``), and ``compile_depth`` compiles the sampler; ``fused_draw`` draws the 15
    depth codes with ``kernels/depth_draw.py`` (one launch each). On the CPU the frame's
    Gumbel noise is made in one call (``noise_per_frame``); CUDA keeps one per draw."""
    if model.lm_head.weight.device.type != "cuda":
        return partial(depth_frames, model, max_k=max_k, noise_per_frame=True)
    depth = model.depth_decoder
    if fused_depth and not getattr(depth, "is_fused", False):
        from breezert.kernels.fused_depth import FusedDepthLayers  # Triton

        depth.run_layers = FusedDepthLayers(depth, max_rows, pdl=pdl)
        depth.is_fused = True
        logger.info("depth layers run the fused Triton kernels (%d-row workspace)", max_rows)
    if compile_depth:
        _raise_cache_limit(64)
        if not fused_depth and not getattr(depth, "is_compiled", False):
            depth.run_layers = torch.compile(depth.run_layers, dynamic=True, fullgraph=True)
            depth.is_compiled = True
            logger.info("compiled the depth step (inductor, default mode, dynamic batch)")
    draw = {}
    if fused_draw:
        from breezert.kernels.depth_draw import depth_draw_triton  # Triton

        draw = {"depth_draw": depth_draw_triton}
    if not compile_depth:
        return partial(depth_frames, model, max_k=max_k, **draw)
    sampler = torch.compile(sample, dynamic=True, fullgraph=True)
    return partial(depth_frames, model, max_k=max_k, sampler=sampler, **draw)


def decode_fn(
    model: BreezeModel, kv: torch.Tensor, fused_decode: bool, max_rows: int,
) -> Callable[..., dict[str, torch.Tensor]]:
    """The DECODE stage's function: the backbone over the paged cache, with the fused Triton
    decode step on CUDA when asked (split-K workspace for ``max_rows`` rows). NOTE(pdl): its
    kernels launch without programmatic dependent launch (slower there: bench/README.md)."""
    if not fused_decode or model.lm_head.weight.device.type != "cuda":
        return partial(backbone_decode, model, kv)
    from breezert.kernels.fused_decode import DECODE_TILES, FusedBackboneDecode  # needs Triton

    logger.info("backbone DECODE runs the fused Triton kernels (%d-row workspace)", max_rows)
    fused = FusedBackboneDecode(model, max_rows, DECODE_TILES)
    return partial(backbone_decode, model, kv, backbone=fused)


def prefill_fn(
    model: BreezeModel, kv: torch.Tensor, fused_prefill: bool, max_tokens: int,
) -> Callable[..., dict[str, torch.Tensor]]:
    """The PREFILL stage's function: the backbone over the paged cache, with the fused Triton
    prefill step on CUDA when asked for steps of up to ``max_tokens`` tokens (longer ones run
    the eager backbone; the DECODE step's launch shapes, without PDL as there)."""
    if not fused_prefill or model.lm_head.weight.device.type != "cuda":
        return partial(backbone_prefill, model, kv)
    from breezert.kernels.fused_decode import DECODE_TILES  # needs Triton
    from breezert.kernels.fused_prefill import FusedBackbonePrefill

    logger.info("backbone PREFILL runs the fused Triton kernels up to %d tokens", max_tokens)
    fused = FusedBackbonePrefill(model, max_tokens, DECODE_TILES)
    return partial(backbone_prefill, model, kv, backbone=fused)


def text_encode_fn(
    model: BreezeModel, fused_text_encoder: bool = False, pdl: bool = False,
    fused_max_tokens: int = 128,
) -> Callable[..., dict[str, torch.Tensor]]:
    """``encode_text`` bound to ``model``; on CUDA its layers run the fused Triton kernels
    (``fused_text_encoder``, batches of up to ``fused_max_tokens`` tokens, wider GEMM tiles past
    128; longer ones eager), chained by programmatic dependent launch with
    ``pdl``. The encoder sits on the first-packet path and runs ~70 launches per layer unfused."""
    fn = partial(encode_text, model)
    encoder = model.text_encoder
    if (fused_text_encoder and model.lm_head.weight.device.type == "cuda"
            and not getattr(encoder, "is_fused", False)):
        from breezert.kernels.fused_text_encoder import FusedTextEncoder  # needs Triton

        encoder.encode = FusedTextEncoder(encoder, max_tokens=fused_max_tokens, pdl=pdl,
                                          wide_tiles=True)
        encoder.is_fused = True
        logger.info("text encoder layers run the fused Triton kernels (up to %d tokens)",
                    fused_max_tokens)
    return fn
