"""KV pool sizing from free device memory (``kv_blocks_for_memory``): pure arithmetic, no CUDA."""

from __future__ import annotations

import pytest

from breezert.config import EngineConfig
from breezert.errors import InvalidConfig
from breezert.models.config import BreezeConfig
from breezert.worker.kv_cache import kv_block_bytes, kv_blocks_for_memory

pytestmark = pytest.mark.unit

GIB = 2**30
H200_TOTAL = 150_121_242_624  # what torch.cuda.mem_get_info reports on an H200 (139.8 GiB)


def _full_block_bytes(block_size: int = 16) -> int:
    bb = BreezeConfig.preset("full").backbone
    return kv_block_bytes(bb.num_layers, block_size, bb.num_kv_heads, bb.head_dim, 2)  # bf16


def _capacity_config() -> EngineConfig:
    return EngineConfig.from_dict({"scheduler": {"max_running_requests": 256}})


def test_256_streams_fit_in_free_memory_instead_of_asking_for_224_gib() -> None:
    cfg = _capacity_config()
    block = _full_block_bytes()
    worst = cfg.worst_case_num_blocks()
    assert worst * block == 224 * GIB  # what the H200 run tried to allocate, and failed
    weights = 9 * GIB
    blocks = kv_blocks_for_memory(
        free_bytes=H200_TOTAL - weights, total_bytes=H200_TOTAL, block_bytes=block,
        memory_fraction=0.9, worst_case=worst, min_blocks=cfg.min_request_num_blocks())
    # the pool plus its scratch block fill 90 % of the device with the weights, no more
    used = weights + (blocks + 1) * block
    assert used <= 0.9 * H200_TOTAL < used + block
    assert blocks == 68_361  # 116.8 GiB of KV: about half the worst case
    assert blocks < worst
    # 256 requests of ~6.5 s (a 100-token prompt, 750 frames allowed, CFG, one lookahead)
    # all hold their blocks at once
    per_request = 2 * 2 * -(-(100 + 750) // 16)
    assert 256 * per_request <= blocks


def test_the_worst_case_caps_the_pool_when_memory_is_plentiful() -> None:
    cfg = EngineConfig.from_dict({"scheduler": {"max_running_requests": 64}})
    worst = cfg.worst_case_num_blocks()
    blocks = kv_blocks_for_memory(
        free_bytes=H200_TOTAL - 9 * GIB, total_bytes=H200_TOTAL,
        block_bytes=_full_block_bytes(), memory_fraction=0.9, worst_case=worst,
        min_blocks=cfg.min_request_num_blocks())
    assert blocks == worst == 32768


def test_memory_another_process_holds_counts_against_the_budget() -> None:
    block = 1 * GIB // 1024  # 1 MiB
    alone = kv_blocks_for_memory(free_bytes=70 * GIB, total_bytes=80 * GIB, block_bytes=block,
                                 memory_fraction=0.5, worst_case=10**9, min_blocks=1)
    shared = kv_blocks_for_memory(free_bytes=50 * GIB, total_bytes=80 * GIB, block_bytes=block,
                                  memory_fraction=0.5, worst_case=10**9, min_blocks=1)
    assert alone == 30 * 1024 - 1  # 40 GiB budget - 10 GiB in use, minus the scratch block
    assert shared == 10 * 1024 - 1


def test_too_little_memory_for_one_request_is_a_clear_config_error() -> None:
    cfg = _capacity_config()
    with pytest.raises(InvalidConfig, match=r"cache\.gpu_memory_fraction=0\.065.*room for 50 "
                                            r"KV blocks.*one request needs up to 256"):
        kv_blocks_for_memory(
            free_bytes=H200_TOTAL - 9 * GIB, total_bytes=H200_TOTAL,
            block_bytes=_full_block_bytes(), memory_fraction=0.065,
            worst_case=cfg.worst_case_num_blocks(), min_blocks=cfg.min_request_num_blocks())


def test_gpu_memory_fraction_is_validated_by_the_config() -> None:
    with pytest.raises(InvalidConfig, match="cache.gpu_memory_fraction"):
        EngineConfig.from_dict({"cache": {"gpu_memory_fraction": 1.5}})
    assert EngineConfig().cache.gpu_memory_fraction == 0.9


def test_start_up_sizes_the_pool_from_measured_free_memory(monkeypatch) -> None:
    """``resolve_num_blocks`` on a (faked) CUDA device: free memory measured after the weights,
    the config's fraction, the model's block size; a configured ``num_blocks`` wins; on CPU the
    worst case."""
    import types

    import torch

    from breezert import runtime_setup

    bb = BreezeConfig.preset("full").backbone
    weight = torch.zeros(1, dtype=torch.bfloat16)
    ckpt = types.SimpleNamespace(
        device=torch.device("cuda", 0), config=types.SimpleNamespace(backbone=bb),
        model=types.SimpleNamespace(lm_head=types.SimpleNamespace(weight=weight)))
    measured = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: measured.append("emptied"))
    monkeypatch.setattr(torch.cuda, "mem_get_info",
                        lambda device: measured.append(device) or (H200_TOTAL - 9 * GIB,
                                                                   H200_TOTAL))
    cfg = _capacity_config()
    assert runtime_setup.resolve_num_blocks(cfg, ckpt) == 68_361
    assert measured == ["emptied", torch.device("cuda", 0)]
    half = cfg.model_copy(update={"cache": cfg.cache.model_copy(
        update={"gpu_memory_fraction": 0.5})})
    assert runtime_setup.resolve_num_blocks(half, ckpt) == (
        (int(0.5 * H200_TOTAL) - 9 * GIB) // _full_block_bytes() - 1)
    fixed = cfg.model_copy(update={"cache": cfg.cache.model_copy(update={"num_blocks": 4096})})
    assert runtime_setup.resolve_num_blocks(fixed, ckpt) == 4096
    ckpt.device = torch.device("cpu")
    assert runtime_setup.resolve_num_blocks(cfg, ckpt) == cfg.worst_case_num_blocks()
