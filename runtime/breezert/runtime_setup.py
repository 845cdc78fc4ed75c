"""Start-up: weights for ``ModelConfig`` and a ``ModelRunner`` sized for ``EngineConfig``.

Owns: choosing the device, loading a checkpoint folder (``DEFAULT_VOICE`` names the embedded
default voice) or building random weights of a preset, resolving the KV block count (from the
device's free memory when unset), and freezing the start-up heap out of the garbage collector
(thawing it for an engine dropped before its process ends). Must not: schedule or run requests.
"""

from __future__ import annotations

import gc
import time
from pathlib import Path

import torch

from breezert.config import EngineConfig, ModelConfig
from breezert.loader import Checkpoint, GenerationDefaults, load_checkpoint
from breezert.random_init import build_random, build_random_codec_encoder
from breezert.tokenizer import BreezeTokenizer, build_byte_tokenizer
from breezert.worker.kv_cache import kv_block_bytes, kv_blocks_for_memory
from breezert.worker.model_runner import ModelRunner
from breezert.worker.warmup import Progress

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_VOICE = "@default"
"""``model.path`` of the embedded default voice (issue 35; the ``cpu-tiny`` profile's, so
``make run``, ``TTS()`` and ``breezert synth`` without ``--model`` speak with it)."""
DEFAULT_VOICE_DIR = Path(__file__).resolve().parent / "voices" / "default"
"""Where the voice's training installs the trained checkpoint (released layout)."""


def resolve_model_path(path: str | None) -> str | None:
    """``model.path`` as a folder: ``DEFAULT_VOICE`` is ``DEFAULT_VOICE_DIR`` when a checkpoint
    is installed there, else ``None`` (random weights of the preset, as before a voice ships)."""
    if path != DEFAULT_VOICE:
        return path
    return str(DEFAULT_VOICE_DIR) if (DEFAULT_VOICE_DIR / "config.json").is_file() else None


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("model.device='cuda' but CUDA is not available; use 'cpu' or 'auto'")
    return torch.device(name)


def load_engine_checkpoint(cfg: ModelConfig, progress: Progress | None = None) -> Checkpoint:
    """The checkpoint at ``cfg.path`` (``resolve_model_path``), or random weights of
    ``cfg.preset`` when it is unset."""
    path = resolve_model_path(cfg.path)
    if progress is not None:
        progress("loading weights", 0, 0, path or f"random {cfg.preset}")
    device = resolve_device(cfg.device)
    dtype = _DTYPES[cfg.dtype]
    if path is not None:
        return load_checkpoint(path, device=device, dtype=dtype)
    config, model, codec = build_random(cfg.preset, seed=cfg.seed, device=device, dtype=dtype)
    from dataclasses import replace

    return Checkpoint(
        path=None, config=replace(config, dtype=cfg.dtype), model=model, codec=codec,
        tokenizer=(BreezeTokenizer.from_file(cfg.tokenizer) if cfg.tokenizer
                   else BreezeTokenizer(build_byte_tokenizer())),
        generation=GenerationDefaults(),
        # the reference-audio encoder (fp32, own seeded generator), so random models clone too
        codec_encoder=build_random_codec_encoder(cfg.preset, seed=cfg.seed, device=device),
    )


def resolve_num_blocks(cfg: EngineConfig, ckpt: Checkpoint) -> int:
    """``cache.num_blocks`` when set; else, on CUDA, the blocks that fit in
    ``cache.gpu_memory_fraction`` of the device now that the weights are loaded
    (``kv_blocks_for_memory``), capped at the worst case; elsewhere the worst case.

    Raises:
        InvalidConfig: not even one request's blocks fit.
    """
    if cfg.cache.num_blocks is not None:
        return cfg.cache.num_blocks
    worst = cfg.worst_case_num_blocks()
    device = ckpt.device
    if device.type != "cuda":
        return worst
    torch.cuda.empty_cache()  # blocks the allocator caches but nothing uses count as free
    free, total = torch.cuda.mem_get_info(device)
    bb = ckpt.config.backbone
    block_bytes = kv_block_bytes(bb.num_layers, cfg.cache.block_size, bb.num_kv_heads,
                                 bb.head_dim, ckpt.model.lm_head.weight.element_size())
    return kv_blocks_for_memory(
        free_bytes=free, total_bytes=total, block_bytes=block_bytes,
        memory_fraction=cfg.cache.gpu_memory_fraction, worst_case=worst,
        min_blocks=cfg.min_request_num_blocks())


def build_runner(cfg: EngineConfig, ckpt: Checkpoint,
                 progress: Progress | None = None) -> ModelRunner:
    """A ``ModelRunner`` with the configured slots and a KV pool of the resolved size, its
    graphs captured (warm-up) when they are enabled; ``progress`` hears each start-up phase
    (``"allocating KV cache"``, then ``"capturing graphs"`` per bucket)."""
    num_blocks = resolve_num_blocks(cfg, ckpt)
    if progress is not None:
        progress("allocating KV cache", 0, 0, f"{num_blocks} blocks of {cfg.cache.block_size} "
                 f"(worst case {cfg.worst_case_num_blocks()})")
    runner = ModelRunner(
        ckpt,
        max_slots=cfg.scheduler.max_running_requests,
        num_blocks=num_blocks,
        block_size=cfg.cache.block_size,
        graph=cfg.graph,
        codec_precision=cfg.model.codec_precision,
        max_model_len=cfg.scheduler.max_model_len,
    )
    if runner.uses_graphs:
        start = time.monotonic()
        runner.warmup_stage_s = runner.warmup(cfg.scheduler.max_codec_frames, progress,
                                              cfg.scheduler.max_codec_step_frames)
        runner.warmup_s = time.monotonic() - start
    return runner


def freeze_startup_heap() -> None:
    """Takes what start-up made (torch, the model, compiled kernels, captured graphs: ~330k
    objects on the CPU profile, more on the GPU) out of the cyclic collector's full passes,
    which otherwise walk all of it, holding the GIL, and stall every stream at once (~80 ms a
    pass on the CPU box, ``bench/gc_pause.py``). For an engine that lives as long as its process
    (the server's, ``AsyncEngine.shared``): what is frozen is never collected, unless
    ``thaw_startup_heap`` gives it back."""
    gc.collect()
    gc.freeze()


def thaw_startup_heap() -> None:
    """Gives what ``freeze_startup_heap`` froze back to the collector, for an engine dropped
    before its process ends (``AsyncEngine.aclose_shared``): the parts of it in reference
    cycles (its scheduler) are freed only then. Everything frozen thaws, not that engine alone."""
    gc.unfreeze()
