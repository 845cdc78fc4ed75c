"""The room benchmark's processes: ``livekit-server --dev`` on loopback, the agent workers and
the engine apart from them.

Owns: starting and stopping the server, the ``bench/room_agent.py`` workers (K of them under
one agent name, each pinned to its GPU on CUDA or given its engine's URL) and the
``bench/room_engine.py`` engine servers (each pinned to its GPU on CUDA), and reading what
each writes in its state folder (``engine_ready.json``, ``metrics.json``: engine counters, the
jobs a worker runs). Must not: run listeners or summarize (``bench/room.py``), or reach into a
process beyond those files.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from breezert_bench.ports import free_port

REPO = Path(__file__).resolve().parents[1]
API_KEY, API_SECRET = "devkey", "secret"
AGENT_NAME = "breezert-bench"


def default_server_bin() -> Path:
    """``$BREEZERT_LIVEKIT_SERVER``, else the build of ``make livekit-server``."""
    return Path(os.environ.get("BREEZERT_LIVEKIT_SERVER",
                               REPO / ".cache" / "livekit" / "livekit-server"))


@contextmanager
def livekit_server(binary: Path, log_dir: Path) -> Iterator[tuple[str, str]]:
    """``livekit-server --dev`` on free loopback ports; yields (ws url, http url)."""
    if not binary.exists():
        raise FileNotFoundError(f"livekit-server not found at {binary} (make livekit-server, "
                                "or --server-bin / $BREEZERT_LIVEKIT_SERVER)")
    http, tcp, udp = free_port(), free_port(), free_port(socket.SOCK_DGRAM)
    config = (f"port: {http}\nrtc:\n  tcp_port: {tcp}\n  udp_port: {udp}\n"
              "  use_external_ip: false\n  enable_loopback_candidate: true\n"
              "logging:\n  level: warn\n")
    log = open(log_dir / "livekit-server.log", "wb")
    proc = subprocess.Popen([str(binary), "--dev", "--bind", "127.0.0.1", "--node-ip",
                             "127.0.0.1", "--config-body", config],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{http}/", timeout=1):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("livekit-server did not start: " + (
                        log_dir / "livekit-server.log").read_text(errors="replace")[-2000:])
                time.sleep(0.1)
        yield f"ws://127.0.0.1:{http}", f"http://127.0.0.1:{http}"
    finally:
        stop(proc)
        log.close()


def stop(*procs: subprocess.Popen[Any], timeout_s: float = 20) -> None:
    """SIGTERM to every process still running, then SIGKILL to those that outlive
    ``timeout_s`` (all of them share the one deadline)."""
    running = [p for p in procs if p.poll() is None]
    for proc in running:
        proc.terminate()
    deadline = time.monotonic() + timeout_s
    for proc in running:
        try:
            proc.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def python_argv() -> list[str]:
    """This interpreter, with ``-S`` where it runs without site-packages (a bundle's own)."""
    return [sys.executable, *(["-S"] if sys.flags.no_site else [])]


def pythonpath() -> str:
    return os.pathsep.join(p for p in (str(REPO / "runtime"), str(REPO / "bench"), str(REPO),
                                       os.environ.get("PYTHONPATH", "")) if p)


@dataclass(frozen=True)
class Worker:
    """One agent worker process: its name (``w<i>``), pid (what its stamps carry), state folder
    and ``max_jobs`` (its engine's ``max_running_requests``, from ``engine_ready.json``)."""

    name: str
    pid: int
    state: Path
    max_jobs: int


@contextmanager
def _ready_processes(log_dir: Path, kind: str, labels: Sequence[str],
                     launch: Callable[[int, Path], tuple[list[str], dict[str, str]]],
                     timeout_s: float, failure: str,
                     log_marker: str | None = None) -> Iterator[list[tuple[int, Path, Any]]]:
    """One Python process per label, all started at once: process ``i`` runs ``launch(i,
    state)``'s (script arguments, environment over ``os.environ``), with its state folder
    ``<kind>-<label>`` in ``$BREEZERT_ROOM_STATE`` and its output in ``<kind>-<label>.log``.
    Waits until each has written ``engine_ready.json`` (and printed ``log_marker``, if given),
    else raises ``RuntimeError(failure + its log's tail)``; yields (pid, state folder, that
    JSON) per process and stops them all on the way out."""
    procs: list[tuple[subprocess.Popen[bytes], Path, Path]] = []
    try:
        for i, label in enumerate(labels):
            state, log_path = log_dir / f"{kind}-{label}", log_dir / f"{kind}-{label}.log"
            state.mkdir(parents=True, exist_ok=True)
            argv, env = launch(i, state)
            full_env = {**os.environ, "BREEZERT_ROOM_STATE": str(state),
                        "PYTHONPATH": pythonpath(), **env}
            with open(log_path, "wb") as log:
                procs.append((subprocess.Popen(
                    [*python_argv(), *argv], cwd=REPO, env=full_env, stdout=log,
                    stderr=subprocess.STDOUT), state, log_path))
        deadline = time.monotonic() + timeout_s
        for proc, state, log_path in procs:
            while (not (state / "engine_ready.json").exists() or log_marker is not None
                   and log_marker not in log_path.read_text(errors="replace")):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(failure + "\n"
                                       + log_path.read_text(errors="replace")[-3000:])
                time.sleep(0.2)
        yield [(proc.pid, state, json.loads((state / "engine_ready.json").read_text()))
               for proc, state, _ in procs]
    finally:
        stop(*(proc for proc, _, _ in procs))


def _labels(name: str, letter: str, count: int) -> list[str]:
    return [f"{name}-{letter}{i}" if count > 1 else name for i in range(count)]


@contextmanager
def agent_workers(url: str, log_dir: Path, name: str, env: dict[str, str], timeout_s: float,
                  own_env: Sequence[dict[str, str]] | None = None,
                  count: int = 1) -> Iterator[list[Worker]]:
    """``count`` ``bench/room_agent.py`` processes under one agent name, registered with the
    server, their engines built (all started at once); worker ``i`` gets ``own_env[i]`` on top
    of ``env`` when given (its GPU, ``gpu_env``, or its engine's URL)."""
    def launch(i: int, state: Path) -> tuple[list[str], dict[str, str]]:
        return [str(REPO / "bench" / "room_agent.py"), "start"], {
            "LIVEKIT_URL": url, "LIVEKIT_API_KEY": API_KEY, "LIVEKIT_API_SECRET": API_SECRET,
            "BREEZERT_ROOM_AGENT_NAME": f"{AGENT_NAME}-{name}",
            "BREEZERT_ROOM_WORKER_PORT": str(free_port(family=socket.AF_INET6)),
            **env, **(own_env[i] if own_env else {})}

    with _ready_processes(log_dir, "agent", _labels(name, "w", count), launch, timeout_s,
                          "the agent worker did not register:",
                          log_marker="registered worker") as procs:
        yield [Worker(f"w{i}", pid, state, int(ready["max_jobs"]))
               for i, (pid, state, ready) in enumerate(procs)]


def split_cpus(engine_cpus: int) -> tuple[list[int], list[int]]:
    """The CPUs this process may use, split into the engine servers' last ``engine_cpus`` and
    the rest (the harness: livekit-server, agents, listeners); raises ``ValueError`` unless both
    sides get at least one."""
    cpus = sorted(os.sched_getaffinity(0))
    if not 0 < engine_cpus < len(cpus):
        raise ValueError(f"--engine-cpus {engine_cpus}: this process has {len(cpus)} CPUs "
                         "(the engines and the harness need at least one each)")
    return cpus[-engine_cpus:], cpus[:-engine_cpus]


def gpu_env(gpus: Sequence[str] | None, count: int) -> list[dict[str, str]] | None:
    """Process ``i`` of ``count`` sees only GPU ``gpus[i % len(gpus)]``; ``None`` without GPUs."""
    return [{"CUDA_VISIBLE_DEVICES": gpus[i % len(gpus)]} for i in range(count)] if gpus else None


@dataclass(frozen=True)
class EngineServer:
    """The ``bench/room_engine.py`` process: its URL (for ``BREEZERT_ROOM_ENGINE_URL``), state
    folder and ``max_jobs`` (its ``max_running_requests``)."""

    url: str
    state: Path
    max_jobs: int


@contextmanager
def engine_servers(log_dir: Path, name: str, env: dict[str, str], timeout_s: float,
                   own_env: Sequence[dict[str, str]] | None = None,
                   count: int = 1) -> Iterator[list[EngineServer]]:
    """``count`` ``bench/room_engine.py`` processes on free loopback ports, their engines
    built and warmed (all started at once); engine ``i`` gets ``own_env[i]`` on top of ``env``
    when given (its GPU: ``gpu_env``; else it sees the GPUs this process sees)."""
    def launch(i: int, state: Path) -> tuple[list[str], dict[str, str]]:
        return ([str(REPO / "bench" / "room_engine.py"), "--port", str(free_port())],
                {**env, **(own_env[i] if own_env else {})})

    with _ready_processes(log_dir, "engine", _labels(name, "e", count), launch, timeout_s,
                          "the engine server did not start:") as procs:
        yield [EngineServer(ready["url"], state, int(ready["max_jobs"]))
               for _, state, ready in procs]


def engine_counters(state: Path) -> dict[str, int]:
    try:
        return dict(json.loads((state / "metrics.json").read_text())["counters"])
    except (OSError, ValueError, KeyError):
        return {}


def jobs_when_idle(workers: Sequence[Worker], timeout_s: float = 30.0) -> dict[str, int]:
    """The jobs each worker runs, from a ``metrics.json`` written after this call began, once
    every one runs none (a run's rooms end their jobs as they leave) or at ``timeout_s``."""
    since, jobs = time.monotonic(), {}
    while True:
        for worker in workers:
            try:
                snapshot = json.loads((worker.state / "metrics.json").read_text())
            except (OSError, ValueError):
                continue
            if snapshot["t"] >= since:
                jobs[worker.name] = int(snapshot.get("jobs", 0))
        if (len(jobs) == len(workers) and not any(jobs.values())
                or time.monotonic() - since > timeout_s):
            return jobs
        time.sleep(0.2)


def pinned_gpus(config: str | None, overrides: str, count: int) -> list[str] | None:
    """The GPU of each of ``count`` workers when the engine runs on CUDA (``model.device =
    "cuda"`` after ``--set``): the i-th of ``$CUDA_VISIBLE_DEVICES`` (else of 0, 1, ...);
    ``None`` on CPU (every worker builds its own engine there, nothing to pin)."""
    from breezert.profiles import resolve_config
    from breezert_bench.variants import parse_variant_spec, variant_config

    resolved = resolve_config(config)
    if overrides.strip(";"):
        resolved = variant_config(resolved, parse_variant_spec(f"room={overrides.strip(';')}"))
    if resolved.model.device != "cuda":
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = visible.split(",") if visible else [str(i) for i in range(count)]
    if len(gpus) < count:
        raise ValueError(f"--workers {count}: only {len(gpus)} GPUs visible ({visible})")
    return gpus[:count]


def summed_counters(states: Sequence[Path], timeout_s: float = 3.0) -> dict[str, int]:
    """The engine counters summed over the state folders (the workers', or the engine
    server's), from ``metrics.json`` snapshots written after this call began (each is rewritten
    every second: an older one can miss a run's last requests, as one did on 8 Dec, 4 of 6
    finished), or the latest there is at ``timeout_s``."""
    since = time.monotonic()
    while time.monotonic() - since <= timeout_s and not all(
            _snapshot_time(state) >= since for state in states):
        time.sleep(0.1)
    total: dict[str, int] = {}
    for state in states:
        for key, value in engine_counters(state).items():
            total[key] = total.get(key, 0) + value
    return total


def _snapshot_time(state: Path) -> float:
    """When ``state``'s ``metrics.json`` was written (the writer's ``time.monotonic()``), or
    ``-inf`` where there is none yet."""
    try:
        return float(json.loads((state / "metrics.json").read_text())["t"])
    except (OSError, ValueError, KeyError):
        return float("-inf")
