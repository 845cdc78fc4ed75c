"""GPU: the paged KV pool sized from the device's free memory (issue 31).

The 256-stream profile's worst case (224 GiB in bf16) does not fit an H200: start-up measures
the memory left after the full model's weights and allocates the blocks that fit in
``cache.gpu_memory_fraction`` of the device, and a small engine with ``num_blocks`` unset gets
its worst case. Run on a CUDA machine: ``python -m pytest tests/gpu -q`` (skipped without CUDA).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from breezert.config import EngineConfig
from breezert.engine import Engine
from breezert.runtime_setup import load_engine_checkpoint, resolve_num_blocks
from breezert.worker.kv_cache import PagedKVCache, kv_block_bytes

pytestmark = pytest.mark.gpu

CAPACITY = Path(__file__).resolve().parents[2] / "configs" / "h200-capacity.toml"
SLACK = 64 * 2**20  # allocator rounding and the CUDA context's own growth


def test_the_256_stream_kv_pool_fills_the_memory_budget_and_no_more() -> None:
    cfg = EngineConfig.from_file(CAPACITY)
    ckpt = load_engine_checkpoint(cfg.model)
    bb = ckpt.config.backbone
    block = kv_block_bytes(bb.num_layers, cfg.cache.block_size, bb.num_kv_heads, bb.head_dim,
                           ckpt.model.lm_head.weight.element_size())
    blocks = resolve_num_blocks(cfg, ckpt)
    assert cfg.min_request_num_blocks() <= blocks <= cfg.worst_case_num_blocks()
    kv = PagedKVCache(bb.num_layers, blocks, cfg.cache.block_size, bb.num_kv_heads, bb.head_dim,
                      dtype=ckpt.model.lm_head.weight.dtype, device=ckpt.device)
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info(ckpt.device)
    used, budget = total - free, cfg.cache.gpu_memory_fraction * total
    print(f"{blocks} KV blocks ({kv.nbytes / 2**30:.1f} GiB) of the worst case "
          f"{cfg.worst_case_num_blocks()}; {used / 2**30:.1f} of {total / 2**30:.1f} GiB in use")
    assert used <= budget + SLACK
    if blocks < cfg.worst_case_num_blocks():  # capped by memory: the budget is filled
        assert used > budget - block - SLACK
    del kv, ckpt
    torch.cuda.empty_cache()


def test_an_engine_without_num_blocks_gets_its_worst_case_when_it_fits() -> None:
    cfg = EngineConfig.from_dict({
        "model": {"preset": "tiny", "dtype": "float32", "device": "cuda"},
        "scheduler": {"max_running_requests": 256, "max_model_len": 512,
                      "default_max_frames": 400, "max_decode_rows": 512, "max_depth_rows": 512},
        "graph": {"enable_cuda_graphs": False, "compile_depth": False},
    })
    engine = Engine(cfg)
    assert engine.runner.layout.num_blocks == cfg.worst_case_num_blocks() == 256 * 2 * 2 * 32
    assert engine.block_pool.num_blocks == engine.runner.layout.num_blocks
