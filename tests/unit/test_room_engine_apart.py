"""The room benchmark's engine apart (``bench/room_engine.py``, ``bench/room.py --engine``)
without a server: the engine's config from the environment the agents and the engine server
share, the command lines ``bench/room.py`` refuses, and the server app under the device
bundle's import stand-ins.

Owns: those. Must not: start LiveKit, an agent or an engine (``tests/livekit/test_room_bench.py``
runs the whole thing).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bench_scripts import bench_script

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
room_engine = bench_script("room_engine")
room = bench_script("room")


def test_the_engine_config_takes_profile_tokenizer_and_overrides_from_the_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BREEZERT_ROOM_CONFIG", "cpu-tiny")
    monkeypatch.setenv("BREEZERT_ROOM_TOKENIZER", "/data/tokenizer.json")
    monkeypatch.setenv("BREEZERT_ROOM_SET",
                       "scheduler.use_predictor=false;scheduler.max_running_requests=5")
    config = room_engine.engine_config()
    assert config.model.tokenizer == "/data/tokenizer.json"
    assert config.scheduler.use_predictor is False
    record = room_engine.ready_record(config, 1.5, url="http://127.0.0.1:1")
    assert record == {"build_s": 1.5, "use_predictor": False, "max_jobs": 5,
                      "url": "http://127.0.0.1:1"}


def test_unset_it_is_the_embedded_default(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("BREEZERT_ROOM_CONFIG", "BREEZERT_ROOM_TOKENIZER", "BREEZERT_ROOM_SET"):
        monkeypatch.delenv(name, raising=False)
    from breezert.profiles import resolve_config

    assert room_engine.engine_config() == resolve_config(None)


@pytest.mark.parametrize("argv, message", [
    (["--engine", "server", "--workers", "2"], "sizes its own workers"),
    (["--engine", "server", "--dispatch", "engine,none"], "unknown ['none']"),
    (["--dispatch", "rooms"], "unknown ['rooms']"),  # the cap needs the engine apart
    (["--engines", "2"], "--engines needs --engine server"),
    (["--engine", "server", "--engines", "0"], "--engines must be >= 1"),
    (["--engine", "server", "--rooms-per-worker", "0"], "--rooms-per-worker must be >= 1"),
    (["--engine", "gpu"], "invalid choice"),
    (["--engine-cpus", "2"], "--engine-cpus needs --engine server"),
    (["--engine", "server", "--engine-cpus", "100000"], "--engine-cpus 100000: this process has"),
    (["--engine", "server", "--engine-cpus", "-1"], "--engine-cpus -1: this process has"),
])
def test_room_refuses_an_engine_apart_it_cannot_size(
        argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        room.parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_engine_cpus_split_this_process_s_cpus_between_engine_and_harness() -> None:
    from room_procs import split_cpus

    cpus = sorted(os.sched_getaffinity(0))
    with pytest.raises(ValueError, match=f"this process has {len(cpus)} CPUs"):
        split_cpus(len(cpus))  # the harness would get none
    if len(cpus) > 1:  # CI and the device machines: 2 and 16
        engine, harness = split_cpus(1)
        assert engine == cpus[-1:] and harness == cpus[:-1]
        args = room.parse_args(["--engine", "server", "--engine-cpus", "1"])
        assert args.cpu_split == (engine, harness)


def test_the_engine_server_keeps_every_thread_to_its_cpus() -> None:
    """``keep_to_cpus`` before torch: a thread already running (as an import may start one)
    is moved too, and threads started after it inherit the set."""
    cpu = sorted(os.sched_getaffinity(0))[0]
    script = (
        "import os, sys, threading\n"
        f"sys.path.insert(0, {str(REPO / 'bench')!r})\n"
        "import room_engine\n"
        "seen, go = {}, threading.Event()\n"
        "def early():\n"
        "    go.wait(); seen['early'] = os.sched_getaffinity(0)\n"
        "t = threading.Thread(target=early); t.start()\n"
        "room_engine.keep_to_cpus(); go.set(); t.join()\n"
        "late = threading.Thread(target=lambda: seen.update(late=os.sched_getaffinity(0)))\n"
        "late.start(); late.join()\n"
        "print(sorted(os.sched_getaffinity(0)), sorted(seen['early']), sorted(seen['late']))\n")
    env = {**os.environ, "BREEZERT_ROOM_CPUS": str(cpu)}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=60, check=True).stdout.split("]")
    assert [part.strip(" [\n") for part in out[:3]] == [str(cpu)] * 3


def test_with_the_engine_apart_the_workers_are_what_the_largest_n_needs() -> None:
    apart = room.parse_args(["--engine", "server", "--listeners", "16,64"])
    assert room.worker_plan(apart, [16, 64]) == (4, 16)
    three = room.parse_args(["--engine", "server", "--rooms-per-worker", "3"])
    assert room.worker_plan(three, [2, 7]) == (3, 3)  # 7 rooms: the last worker holds one
    # as many agents for each engine: 16 needed, 3 engines -> 18
    three_engines = room.parse_args(["--engine", "server", "--engines", "3"])
    assert room.worker_plan(three_engines, [64]) == (4, 18)
    assert three_engines.dispatch == "rooms"  # the default with the engine apart
    # in process: the given workers, the rooms spread evenly over them
    assert room.worker_plan(room.parse_args(["--workers", "4"]), [16, 62]) == (16, 4)


def test_the_bundles_stand_ins_let_the_engine_server_build_its_app() -> None:
    """The device machine lacks aiortc, aioice and PyAV (``make room-bundle`` carries import
    stand-ins for them): with the stand-ins first on the path, as they are there, breezert's
    server app still imports and builds, and a WebRTC peer is refused by name."""
    code = ("import aiortc, av, breezert.server.app as a\n"
            "from breezert.config import EngineConfig\n"
            "assert aiortc.STAND_IN and av.STAND_IN\n"
            "a.create_app(None, EngineConfig().serving, warmup=False)\n"
            "try:\n    aiortc.RTCPeerConnection()\nexcept RuntimeError as exc:\n"
            "    print(exc)\n")
    shims = REPO / "bench" / "room_bundle" / "shims"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(shims), str(REPO / "runtime")])})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "aiortc is a stand-in" in done.stdout


def test_an_agents_engine_load_reads_the_servers_readyz_and_is_full_when_unreadable() -> None:
    """``bench/room_agent.py``'s ``RemoteEngineLoad`` (dispatch ``engine`` with the engine
    apart): the ``/readyz`` load's fraction, from a 200 or a 503 alike; 1 (full: send no rooms)
    for a body without a load, one that is not JSON, or no server at all."""
    import http.server
    import threading

    agent = bench_script("room_agent")
    answers = iter([
        (200, b'{"status": "ready", "load": {"running": 2, "queued": 0, "max_running": 8,'
              b' "max_queued": 4}}'),
        (503, b'{"status": "full", "load": {"running": 8, "queued": 1, "max_running": 8,'
              b' "max_queued": 4}}'),
        (503, b'{"status": "warming_up"}'),
        (503, b"<html>proxy</html>"),
    ])

    class Readyz(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            assert self.path == "/readyz"
            status, body = next(answers)
            self.send_response(status)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Readyz)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        load = agent.RemoteEngineLoad(f"http://127.0.0.1:{server.server_port}/")
        assert [load.read() for _ in range(4)] == [0.25, 1.0, 1.0, 1.0]
    finally:
        server.shutdown()
        server.server_close()
    assert load.read() == 1.0  # nothing listens any more
    assert load.load() == agent.FULL_LOAD  # before its first poll it reports full
