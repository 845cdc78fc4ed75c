"""EngineConfig: the shipped TOML profiles, validation messages naming fields, env overrides."""

from __future__ import annotations

from pathlib import Path
from typing import get_args

import pytest
from breezert.config import (
    CacheConfig,
    EngineConfig,
    GraphConfig,
    ModelConfig,
    SchedulerConfig,
    ServingConfig,
    apply_env_overrides,
)
from breezert.errors import InvalidConfig
from breezert.models.codec import CODEC_PRECISIONS
from breezert.profiles import EMBEDDED_PROFILE, profile_path
from pydantic import ValidationError

pytestmark = pytest.mark.unit

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("path", [CONFIGS / "tiny.toml", profile_path(EMBEDDED_PROFILE),
                                  CONFIGS / "h200-latency.toml"], ids=lambda p: p.name)
def test_shipped_profiles_load(path: Path) -> None:
    cfg = EngineConfig.from_file(path)
    assert isinstance(cfg.scheduler, SchedulerConfig)


def test_profiles_have_the_promised_settings() -> None:
    tiny = EngineConfig.from_file(profile_path(EMBEDDED_PROFILE))
    assert (tiny.model.preset, tiny.model.device, tiny.graph.enable_cuda_graphs) == (
        "tiny", "cpu", False)
    h200 = EngineConfig.from_file(CONFIGS / "h200-latency.toml")
    assert (h200.model.preset, h200.model.dtype, h200.model.device) == ("full", "bfloat16", "cuda")
    assert h200.graph.enable_cuda_graphs and h200.graph.compile_depth and h200.graph.fused_depth
    assert h200.scheduler.max_running_requests == 64
    assert h200.graph.fused_codec
    assert max(h200.graph.decode_batch_buckets) >= 2 * 64  # CFG rows
    assert h200.cache.num_blocks is None and h200.worst_case_num_blocks() == 32768


def test_defaults_are_valid_and_frozen() -> None:
    cfg = EngineConfig()
    assert cfg.scheduler.default_chunk_schedule == (1, 2, 4, 8, 16)
    with pytest.raises(ValidationError):
        cfg.scheduler.max_running_requests = 3  # type: ignore[misc]


def test_every_field_has_a_description() -> None:
    for model in (ModelConfig, CacheConfig, SchedulerConfig, GraphConfig, ServingConfig):
        for name, info in model.model_fields.items():
            assert info.description, f"{model.__name__}.{name} has no docstring"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cfg.toml"
    path.write_text(text)
    return path


def test_unknown_keys_are_rejected_with_their_path(tmp_path: Path) -> None:
    path = write(tmp_path, "[scheduler]\nmax_runing_requests = 4\n")
    with pytest.raises(InvalidConfig, match=r"scheduler\.max_runing_requests"):
        EngineConfig.from_file(path)
    with pytest.raises(InvalidConfig, match=r"sheduler"):
        EngineConfig.from_file(write(tmp_path, "[sheduler]\n"))


@pytest.mark.parametrize(
    ("toml", "field"),
    [
        ("[scheduler]\nmax_running_requests = 0", "scheduler.max_running_requests"),
        ("[scheduler]\nmax_codec_frames = 65", "scheduler.max_codec_frames"),
        ("[scheduler]\nstarvation_limit_s = -1.0", "scheduler.starvation_limit_s"),
        ("[scheduler]\ndefault_chunk_schedule = [1, 0]", "default_chunk_schedule"),
        ("[scheduler]\nmax_codec_frames = 8\ndefault_chunk_schedule = [1, 16]",
         "default_chunk_schedule"),
        ("[scheduler]\nmax_model_len = 100\ndefault_max_frames = 200", "default_max_frames"),
        ("[scheduler]\nmax_decode_rows = 1", "scheduler.max_decode_rows"),
        ("[model]\ndevice = \"tpu\"", "model.device"),
        ("[model]\npreset = \"huge\"", "model.preset"),
        ("[model]\ncodec_precision = \"fp8\"", "model.codec_precision"),
        ("[cache]\nblock_size = 0", "cache.block_size"),
        ("[graph]\ndecode_batch_buckets = [4, 2]", "decode_batch_buckets"),
        ("[serving]\nport = 70000", "serving.port"),
        ("[model]\ndevice = \"cpu\"\n[graph]\nenable_cuda_graphs = true", "enable_cuda_graphs"),
        ("[model]\ndevice = \"cpu\"\n[graph]\nfused_decode = true", "fused_decode"),
        ("[model]\ndevice = \"cpu\"\n[graph]\nfused_prefill = true", "fused_prefill"),
        ("[model]\ndevice = \"cpu\"\n[graph]\nfused_text_encoder = true", "fused_text_encoder"),
        ("[model]\ndevice = \"cpu\"\n[graph]\npdl = true", "graph.pdl"),
        # deleted with the channels-first fast codec (the fast codec is channels-last): an old
        # config naming it fails, naming it, even beside fused_codec
        ("[graph]\nfused_codec = true\ncodec_channels_last = true", "graph.codec_channels_last"),
        # switches deleted in issue 32: an old config naming one fails, naming it
        *((f"[graph]\n{name} = false", f"graph.{name}") for name in (
            "device_slot_state", "async_uploads", "pdl_decode", "compile_backbone",
            "compile_text_encoder", "fused_sampling", "depth_tiles_by_rows",
            "codec_mixed_sizes", "fused_text_encoder_wide_tiles", "streamed_depth",
            "persistent_depth", "depth_prenorm_rows")),
        ("[scheduler]\nthread_switch_interval_s = 0.001", "scheduler.thread_switch_interval_s"),
    ],
)
def test_invalid_values_name_the_field(tmp_path: Path, toml: str, field: str) -> None:
    with pytest.raises(InvalidConfig, match=field.replace(".", r"\.")) as excinfo:
        EngineConfig.from_file(write(tmp_path, toml + "\n"))
    assert isinstance(excinfo.value, ValueError)
    assert "cfg.toml" in str(excinfo.value)


def test_codec_precision_accepts_every_serving_precision(tmp_path: Path) -> None:
    """The config's choices are the codec's (``CODEC_PRECISIONS``), each one loads from TOML."""
    assert get_args(ModelConfig.model_fields["codec_precision"].annotation) == CODEC_PRECISIONS
    for precision in CODEC_PRECISIONS:
        path = write(tmp_path, f'[model]\ncodec_precision = "{precision}"\n')
        assert EngineConfig.from_file(path).model.codec_precision == precision


def test_invalid_toml_is_reported(tmp_path: Path) -> None:
    with pytest.raises(InvalidConfig, match="invalid TOML"):
        EngineConfig.from_file(write(tmp_path, "[scheduler\n"))


def test_auth_token_is_secret_and_never_echoed(tmp_path: Path) -> None:
    cfg = EngineConfig.from_file(write(tmp_path, '[serving]\nauth_token = "hunter2"\n'))
    assert cfg.serving.auth_token is not None
    assert cfg.serving.auth_token.get_secret_value() == "hunter2"
    assert "hunter2" not in repr(cfg)
    with pytest.raises(InvalidConfig) as excinfo:
        EngineConfig.from_file(write(tmp_path, "[serving]\nauth_token = 12345678\n"))
    assert "12345678" not in str(excinfo.value)


def test_env_override_is_explicit() -> None:
    cfg = EngineConfig.from_file(CONFIGS / "h200-latency.toml")
    assert apply_env_overrides(cfg, {}) is cfg
    assert apply_env_overrides(cfg, {"BREEZERT_NO_CUDA_GRAPH": "0"}) is cfg
    off = apply_env_overrides(cfg, {"BREEZERT_NO_CUDA_GRAPH": "1"})
    assert not off.graph.enable_cuda_graphs and not off.graph.compile_depth
    assert not off.graph.fused_depth and not off.graph.fused_decode
    assert cfg.graph.fused_prefill and not off.graph.fused_prefill
    assert cfg.graph.enable_cuda_graphs  # the input is unchanged
    with pytest.raises(InvalidConfig, match="BREEZERT_NO_CUDA_GRAPH"):
        apply_env_overrides(cfg, {"BREEZERT_NO_CUDA_GRAPH": "maybe"})


def test_auth_token_from_the_environment() -> None:
    cfg = EngineConfig(serving={"host": "0.0.0.0"})  # type: ignore[arg-type]
    assert cfg.serving.binding_problem() is not None
    with_token = apply_env_overrides(cfg, {"BREEZERT_AUTH_TOKEN": " s3cret "})
    assert with_token.serving.auth_token is not None
    assert with_token.serving.auth_token.get_secret_value() == "s3cret"
    assert with_token.serving.binding_problem() is None  # may bind beyond loopback
    assert apply_env_overrides(cfg, {"BREEZERT_AUTH_TOKEN": ""}) is cfg


def test_the_graph_table_lists_every_switch_with_its_default_and_h200_value() -> None:
    """``docs/configuration.md`` is the one table of ``[graph]``: one row per field, no row for
    a field that is gone, and the default and H200 columns of every switch and number as the
    config and ``configs/h200-latency.toml`` have them (bucket lists are shown as ranges)."""
    doc = (CONFIGS.parent / "docs" / "configuration.md").read_text(encoding="utf-8")
    rows = {}
    for line in doc.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = (cells[1], cells[2])
    assert sorted(rows) == sorted(GraphConfig.model_fields)
    default, h200 = GraphConfig(), EngineConfig.from_file(CONFIGS / "h200-latency.toml").graph

    def shown(value: object) -> str:
        if isinstance(value, bool):
            return str(value).lower()
        if isinstance(value, tuple):
            return f"{value[0]} .. {value[-1]}"
        return f"{value:g}" if isinstance(value, float) else str(value)

    for name, (want_default, want_h200) in rows.items():
        assert (shown(getattr(default, name)), shown(getattr(h200, name))) == \
            (want_default, want_h200), name
