"""``deploy/multi-gpu/start.sh``: one process per GPU, each pinned by ``CUDA_VISIBLE_DEVICES``.

Owns: the commands the script would run (``--dry-run``) for both layouts, one per GPU on its own
port, with a config ``breezert serve`` accepts. No GPU is needed (``NUM_GPUS`` stands in).
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from breezert.config import EngineConfig

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "deploy" / "multi-gpu" / "start.sh"


def dry_run(mode: str, num_gpus: int) -> list[str]:
    result = subprocess.run(["bash", str(SCRIPT), mode, "--dry-run"], capture_output=True,
                            text=True, check=True, env={**os.environ, "NUM_GPUS": str(num_gpus)})
    return result.stdout.splitlines()


@pytest.mark.parametrize("mode, port_flag", [("serve", "--port "),
                                             ("agent", "BREEZERT_WORKER_PORT=")])
def test_one_process_per_gpu_on_its_own_port(mode: str, port_flag: str) -> None:
    lines = dry_run(mode, 4)
    gpus = [re.match(r"CUDA_VISIBLE_DEVICES=(\d+) ", line).group(1) for line in lines]  # type: ignore[union-attr]
    ports = [re.search(re.escape(port_flag) + r"(\d+)", line).group(1) for line in lines]  # type: ignore[union-attr]
    assert gpus == ["0", "1", "2", "3"]
    assert len(set(ports)) == 4
    config = re.search(r"(?:--config |BREEZERT_CONFIG=)(\S+)", lines[0]).group(1)  # type: ignore[union-attr]
    assert EngineConfig.from_file(REPO / config).model.device == "cuda"


def test_serve_and_agent_ports_do_not_collide() -> None:
    serve = {re.search(r"--port (\d+)", line).group(1) for line in dry_run("serve", 8)}  # type: ignore[union-attr]
    agent = {re.search(r"PORT=(\d+)", line).group(1) for line in dry_run("agent", 8)}  # type: ignore[union-attr]
    assert not serve & agent


def test_no_gpu_and_no_mode_are_refused() -> None:
    env = {**os.environ, "NUM_GPUS": "0"}
    refused = subprocess.run(["bash", str(SCRIPT), "serve"], env=env, capture_output=True)
    assert refused.returncode == 1
    assert subprocess.run(["bash", str(SCRIPT)], capture_output=True).returncode == 2
