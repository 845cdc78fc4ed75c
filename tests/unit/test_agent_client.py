"""``breezert_agent.client`` pieces that need no engine: the embedded default config and the
remote URL rules.

Owns: that ``TTS()`` with no arguments runs the packaged ``cpu-tiny`` profile. Must not: load a
model (engine-backed client tests live in tests/integration/test_agent_engine.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

import breezert
from breezert.config import EngineConfig
from breezert.profiles import EMBEDDED_PROFILE, profile_path, resolve_config
from breezert_agent import TTS
from breezert_agent.client import InProcessRuntimeClient, RemoteRuntimeClient

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def test_embedded_profile_is_package_data_and_the_default() -> None:
    path = profile_path(EMBEDDED_PROFILE)
    assert path == Path(breezert.__file__).parent / "profiles" / "cpu-tiny.toml"
    cfg = EngineConfig.from_file(path)
    assert (cfg.model.preset, cfg.model.device, cfg.graph.enable_cuda_graphs) == (
        "tiny", "cpu", False)
    assert resolve_config(None) == cfg  # what TTS() with no arguments loads
    assert resolve_config("cpu-tiny") == cfg  # a packaged profile by name, as --config takes it


def test_config_path_and_object_resolve_alike() -> None:
    path = ROOT / "configs" / "tiny.toml"
    assert resolve_config(str(path)) == resolve_config(EngineConfig.from_file(path))


def test_env_switch_applies_to_the_plugin_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BREEZERT_NO_CUDA_GRAPH", "1")
    cfg = resolve_config(ROOT / "configs" / "h200-latency.toml")
    assert not cfg.graph.enable_cuda_graphs and not cfg.graph.compile_depth


def test_placement_follows_the_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    assert isinstance(TTS().client, InProcessRuntimeClient)  # no load until used or prewarmed
    monkeypatch.setenv("BREEZERT_AUTH_TOKEN", "from-env")
    remote = TTS(base_url="https://tts.example:8443")
    assert isinstance(remote.client, RemoteRuntimeClient)
    assert remote.client.url == "wss://tts.example:8443/v1/audio/speech/stream"
    assert remote.client._auth_token == "from-env"
    with pytest.raises(ValueError, match="frame_size_ms"):
        TTS(frame_size_ms=40)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at most one"):
        TTS(base_url="http://h", config=ROOT / "configs" / "tiny.toml")

