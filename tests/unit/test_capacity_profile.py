"""``configs/h200-capacity.toml`` (issue 31): 256 running requests, every stage's graph buckets
covering them (CFG rows included), the KV pool sized from free memory, refusal past capacity; and
the bench's ``NAME=@PROFILE`` variant that runs it side by side with the 64-stream profile."""

from __future__ import annotations

from pathlib import Path

import pytest

from breezert.config import EngineConfig
from breezert.models.config import BreezeConfig
from breezert.worker.kv_cache import kv_block_bytes, kv_blocks_for_memory
from breezert_bench.variants import parse_variant_spec, variant_config

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
CAPACITY = ROOT / "configs" / "h200-capacity.toml"
LATENCY = ROOT / "configs" / "h200-latency.toml"
STREAMS = 256


def test_every_stage_covers_256_requests_and_their_cfg_rows() -> None:
    cfg = EngineConfig.from_file(CAPACITY)
    s, g = cfg.scheduler, cfg.graph
    assert (cfg.model.preset, cfg.model.dtype, cfg.model.device) == ("full", "bfloat16", "cuda")
    assert s.max_running_requests == STREAMS
    # each per-step limit lets every running request into one step ...
    assert s.max_decode_requests == s.max_depth_requests == s.max_codec_requests == STREAMS
    assert s.max_decode_rows == s.max_depth_rows == 2 * STREAMS
    # ... and a captured graph covers that step (no eager fallback past the last bucket)
    assert max(g.decode_batch_buckets) >= 2 * STREAMS  # rows: two CFG branches a request
    assert max(g.depth_batch_buckets) >= STREAMS  # requests: a CFG graph runs two rows each
    assert max(g.codec_buckets) >= STREAMS  # streams
    assert g.enable_cuda_graphs
    assert cfg.serving.max_peers >= STREAMS


def test_the_kv_pool_is_sized_from_free_memory_and_holds_256_streams() -> None:
    cfg = EngineConfig.from_file(CAPACITY)
    # 0.8, not the default 0.9: at 0.9 the 512-row graphs' start-up ran out of memory (H200, 4 Dec)
    assert cfg.cache.num_blocks is None and cfg.cache.gpu_memory_fraction == 0.8
    bb = BreezeConfig.preset("full").backbone
    block = kv_block_bytes(bb.num_layers, cfg.cache.block_size, bb.num_kv_heads, bb.head_dim, 2)
    total, weights = 150_121_242_624, 9 * 2**30  # an H200; about the full model in bf16
    blocks = kv_blocks_for_memory(
        free_bytes=total - weights, total_bytes=total, block_bytes=block,
        memory_fraction=cfg.cache.gpu_memory_fraction, worst_case=cfg.worst_case_num_blocks(),
        min_blocks=cfg.min_request_num_blocks())
    assert blocks < cfg.worst_case_num_blocks()  # the worst case (224 GiB) does not fit
    # 256 requests of the bench's ~6.5 s (a 100-token prompt, 750 frames allowed, CFG, one
    # lookahead segment) all hold their blocks at once
    per_request = 2 * 2 * -(-(100 + cfg.scheduler.default_max_frames) // cfg.cache.block_size)
    assert STREAMS * per_request <= blocks


def test_past_capacity_it_refuses_rather_than_queues_for_seconds() -> None:
    s = EngineConfig.from_file(CAPACITY).scheduler
    assert s.max_queue_wait_s is not None and s.max_queue_wait_s <= 0.5
    assert s.max_queued_requests <= 32
    # past real-time capacity too, not only past the slots: 256 slots at 1 s/s each would be
    # more than the ~150 s of audio per second this profile made on the H200 (4 Dec)
    assert s.admission_capacity is not None and s.admission_learn_window_s > 0
    assert s.admission_headroom * s.admission_capacity < s.max_running_requests
    # and past the frame cycle that keeps every admitted stream ahead of its listener
    assert s.admission_max_cycle_s is not None and s.admission_max_cycle_s <= 0.05
    # and a burst starts a few streams at a time (all of a 256-burst fit both figures above)
    assert s.admission_max_starting is not None and s.admission_max_starting <= 32


def test_it_differs_from_the_latency_profile_only_in_capacity_settings() -> None:
    capacity = EngineConfig.from_file(CAPACITY).model_dump()
    latency = EngineConfig.from_file(LATENCY).model_dump()
    changed = {f"{section}.{key}" for section, values in capacity.items()
               for key, value in values.items() if latency[section][key] != value}
    assert changed == {
        "scheduler.max_running_requests", "scheduler.max_queued_requests",
        "scheduler.max_queue_wait_s", "scheduler.admission_capacity",
        "scheduler.admission_headroom", "scheduler.admission_max_cycle_s",
        "scheduler.admission_max_starting",
        "scheduler.predictor_first_chunk_cover", "scheduler.max_decode_requests",
        "scheduler.max_decode_rows", "scheduler.max_depth_requests", "scheduler.max_depth_rows",
        "scheduler.max_codec_requests", "graph.decode_batch_buckets",
        "graph.depth_batch_buckets", "graph.codec_buckets", "serving.max_peers",
        "cache.gpu_memory_fraction"}


def test_a_profile_variant_runs_the_64_stream_profile_beside_it() -> None:
    """``latency-64=@configs/h200-latency.toml`` (bench/h200_session.sh capacity-256): the
    latency profile's engine sections, the run's model section."""
    base = EngineConfig.from_file(CAPACITY)
    base = base.model_copy(update={"model": base.model.model_copy(
        update={"path": "/models/breeze", "tokenizer": "tok.json"})})
    variant = parse_variant_spec(f"latency-64=@{LATENCY}")
    assert variant.profile == str(LATENCY) and variant.overrides == {}
    config = variant_config(base, variant)
    latency = EngineConfig.from_file(LATENCY)
    assert config.model == base.model
    for section in ("cache", "scheduler", "graph", "serving"):
        assert getattr(config, section) == getattr(latency, section), section
    tuned = variant_config(base, parse_variant_spec(
        f"x=@{LATENCY};scheduler.max_queue_wait_s=0.5"))
    assert tuned.scheduler.max_queue_wait_s == 0.5
    assert tuned.scheduler.max_running_requests == 64
    with pytest.raises(ValueError, match="needs a profile path"):
        parse_variant_spec("x=@")
