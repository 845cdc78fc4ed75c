"""The LiveKit examples run: ``agent_offline.py`` end to end on the embedded tiny model, and
``livekit_agent.py``'s worker pieces (prewarm, TTS placement) without a LiveKit server; and
``breezert serve``'s modules import no LiveKit while the plugin registers itself at import.

Owns: that both examples keep working as the plugin changes. Must not: need a LiveKit server,
network access or a GPU.
"""

from __future__ import annotations

import asyncio
import math
import runpy
import subprocess
import sys
import wave
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from breezert.async_engine import AsyncEngine
from breezert_agent import engine_load, load_threshold
from breezert_agent.client import InProcessRuntimeClient, RemoteRuntimeClient

pytestmark = pytest.mark.integration

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_agent_offline_says_two_turns_and_writes_a_wav(tmp_path: Path) -> None:
    example = runpy.run_path(str(EXAMPLES / "agent_offline.py"), run_name="agent_offline")
    out = tmp_path / "turns.wav"
    args = example["parse_args"](["--out", str(out), "--max-frames", "4", "--seed", "3"])
    result: dict[str, Any] = asyncio.run(example["run"](args))

    turns = result["turns"]
    assert [t["turn"] for t in turns] == ["say(text)", "say(streamed words)"]
    for turn in turns:
        assert math.isfinite(turn["ttfb_s"]) and 0 < turn["ttfb_s"] < 10
        assert 0 < turn["audio_s"] <= 2 * 4 * 0.08 + 1e-6  # two sentences, 4 frames each
        assert turn["wall_s"] >= turn["audio_s"] - 0.05  # played in real time
    with wave.open(str(out)) as wav:
        assert wav.getframerate() == 24000 and wav.getnchannels() == 1
        assert wav.getnframes() / 24000 == pytest.approx(result["audio_s"], abs=1e-3)
        assert result["audio_s"] == pytest.approx(sum(t["audio_s"] for t in turns), abs=1e-3)


def test_livekit_agent_worker_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BREEZERT_URL", raising=False)
    monkeypatch.delenv("BREEZERT_CONFIG", raising=False)
    example = runpy.run_path(str(EXAMPLES / "livekit_agent.py"), run_name="livekit_agent")
    proc = SimpleNamespace(userdata={})
    example["prewarm"](proc)
    assert proc.userdata["breezert_engine"] is AsyncEngine.shared()  # the process-wide engine
    assert isinstance(example["make_tts"]().client, InProcessRuntimeClient)
    options = example["worker_options"]()  # the dispatcher sees the engine's load
    assert options.load_threshold == load_threshold(8) and options.num_idle_processes == 8
    assert options.load_fnc.func is engine_load  # type: ignore[union-attr]

    monkeypatch.setenv("BREEZERT_URL", "http://127.0.0.1:8080")
    remote = runpy.run_path(str(EXAMPLES / "livekit_agent.py"), run_name="livekit_agent")
    proc = SimpleNamespace(userdata={})
    remote["prewarm"](proc)
    assert proc.userdata == {}  # remote: nothing to load here
    client = remote["make_tts"]().client
    assert isinstance(client, RemoteRuntimeClient)
    assert client.url == "ws://127.0.0.1:8080/v1/audio/speech/stream"

    monkeypatch.setenv("BREEZERT_URL", "http://10.0.0.1:8080, http://10.0.0.2:8080")
    replicas = runpy.run_path(str(EXAMPLES / "livekit_agent.py"), run_name="livekit_agent")
    assert replicas["make_tts"]().client.urls == [
        "ws://10.0.0.1:8080/v1/audio/speech/stream", "ws://10.0.0.2:8080/v1/audio/speech/stream"]
    assert replicas["worker_options"]().load_fnc is not engine_load  # LiveKit's default


def test_the_server_imports_no_livekit_and_the_plugin_registers_at_import() -> None:
    # breezert serve (breezert.audio, breezert.server) must not pull in LiveKit (1 s).
    code = (
        "import sys\n"
        "import breezert.audio, breezert.server.app\n"
        "assert 'livekit.agents' not in sys.modules, 'LiveKit imported by the server'\n"
        "from breezert_agent import TTS\n"
        "from livekit.agents import Plugin\n"
        "assert [p.package for p in Plugin.registered_plugins] == ['breezert_agent']\n"
        "assert 'torch' not in sys.modules, 'the plugin must not import torch'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=EXAMPLES.parent, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
