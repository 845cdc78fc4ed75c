"""The two distributions' import boundaries: ``breezert-agent`` in remote mode and the
``breezert`` core run without torch; what needs the engine says which extra brings it.

Owns: those boundaries, checked in fresh interpreters where ``import torch`` fails. Must not:
need network access, a GPU or a LiveKit server.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
NO_TORCH = "import sys\nsys.modules['torch'] = None  # any import of torch now fails\n"


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", NO_TORCH + code], capture_output=True,
                          text=True, cwd=ROOT, timeout=120, check=False)


def test_remote_tts_runs_without_torch() -> None:
    code = (
        "import asyncio\n"
        "from livekit.agents import APIConnectionError, APIConnectOptions, Plugin\n"
        "NO_RETRY = APIConnectOptions(max_retry=0)\n"
        "from breezert_agent import TTS\n"
        "from breezert_agent.client import RemoteRuntimeClient\n"
        "tts = TTS(base_url='http://127.0.0.1:9')  # discard port: nothing listens\n"
        "assert isinstance(tts.client, RemoteRuntimeClient)\n"
        "assert [p.package for p in Plugin.registered_plugins] == ['breezert_agent']\n"
        "async def turn():\n"
        "    try:\n"
        "        await tts.synthesize('Hi.', conn_options=NO_RETRY).collect()\n"
        "    except APIConnectionError:\n"
        "        pass\n"
        "    else:\n"
        "        raise AssertionError('no server listens there')\n"
        "    await tts.aclose()\n"
        "asyncio.run(turn())\n"
        "assert 'breezert.async_engine' not in sys.modules\n"
    )
    result = _run(code)
    assert result.returncode == 0, result.stderr


def test_in_process_tts_without_torch_names_the_extra() -> None:
    code = (
        "import asyncio\n"
        "from breezert_agent import TTS\n"
        "client = TTS().client  # constructing loads nothing\n"
        "try:\n"
        "    asyncio.run(client.get_engine())\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    result = _run(code)
    assert result.returncode == 0, result.stderr
    assert "pip install 'breezert-agent[local]'" in result.stdout


def test_cli_without_torch_names_the_extra(tmp_path: Path) -> None:
    code = (
        "from breezert.cli import main\n"
        f"raise SystemExit(main(['init-random', '--out', {str(tmp_path / 'tiny')!r}]))\n"
    )
    result = _run(code)
    assert result.returncode == 2
    assert "pip install 'breezert[engine]'" in result.stderr
