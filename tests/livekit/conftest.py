"""Real-room fixtures: a LiveKit server (``--dev``, loopback only), the agent worker process, rooms.

Owns: finding (or building, through the Makefile) the pinned ``livekit-server``, starting it on
free loopback ports and stopping it; starting ``room_worker.py`` against it; a ``Room`` helper
that dispatches the agent into a fresh room, joins it with ``livekit.rtc`` and records the agent's
audio (``listening.Recording``); serves the repository to the browser participant (``browser.py``);
runs ``bench/room.py`` small against the built server (``run_room_bench``).
A server that ``make`` could not build fails the tests under ``CI=true`` with the build log's
last lines, and skips them elsewhere (``tests/components.missing``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from livekit import api, rtc

from breezert_agent.models import LISTENER_SETTLE_S
from breezert_bench.ports import free_port
from tests.components import missing
from tests.livekit.browser import serve_repository
from tests.livekit.listening import Recording
from tests.livekit.machine import agent_priority

REPO = Path(__file__).resolve().parents[2]
SERVER_BIN = REPO / ".cache" / "livekit" / "livekit-server"
BUILD_LOG = REPO / ".cache" / "livekit" / "build.log"
WORKER = Path(__file__).with_name("room_worker.py")
API_KEY, API_SECRET = "devkey", "secret"
AGENT_NAME = "breezert-test"


def built_binary(path: Path, build_log: Path, target: str, override_env: str) -> Path:
    """``path`` as ``make target`` builds it (``$override_env`` names another); builds it when it
    was never tried; when it cannot be built, ``components.missing`` with ``build_log`` (a
    failure under ``CI=true``, a skip elsewhere)."""
    override = os.environ.get(override_env)
    if override:
        return Path(override)
    if not path.exists() and not build_log.exists() and shutil.which("make"):
        subprocess.run(["make", "-s", "-C", str(REPO), target], check=False, timeout=1800)
    if not path.exists():
        missing(f"{target} could not be built", target, build_log)
    return path


ROOM_TEXTS = ["Hello, thanks for calling.", "Your order ships today.", "One moment please.",
              "Is there anything else?"]


def run_room_bench(tmp_path: Path, *args: str,
                   timeout_s: float = 110) -> tuple[subprocess.CompletedProcess[str], float]:
    """``bench/room.py`` with ``args`` (the caller's ``--out`` among them) against the built
    server, on four short texts (``ROOM_TEXTS``), the agent's torch on one thread: the finished
    process and its wall time in seconds."""
    server = built_binary(SERVER_BIN, BUILD_LOG, "livekit-server", "BREEZERT_LIVEKIT_SERVER")
    texts = tmp_path / "texts.tsv"
    texts.write_text("id\ttext\n" + "".join(f"{i}\t{t}\n" for i, t in enumerate(ROOM_TEXTS)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "runtime"), str(REPO / "bench"),
                                                        str(REPO)]),
           "BREEZERT_ROOM_THREADS": "1"}
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "room.py"), "--server-bin", str(server),
         "--texts", str(texts), *args],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    return done, time.monotonic() - started


def _server_binary() -> Path:
    """The built server (``make livekit-server``; ``BREEZERT_LIVEKIT_SERVER`` overrides)."""
    return built_binary(SERVER_BIN, BUILD_LOG, "livekit-server", "BREEZERT_LIVEKIT_SERVER")


@dataclass
class Server:
    http_port: int
    log_path: Path
    udp_port: int = 0  # its WebRTC media (rtc.udp_port): every participant's RTP goes through it

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.http_port}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def token(self, identity: str, room: str) -> str:
        grants = api.VideoGrants(room_join=True, room=room, can_publish=True,
                                 can_subscribe=True, can_publish_data=True)
        return (api.AccessToken(API_KEY, API_SECRET).with_identity(identity)
                .with_grants(grants).to_jwt())


def _keep_last_log(log_path: Path, name: str) -> None:
    """Copy a finished process's log to ``$TMPDIR/name`` (the last run's, for a look after a
    failure) and remove its temporary folder, so runs of the suite leave no folders behind."""
    with contextlib.suppress(OSError):
        shutil.copy(log_path, Path(tempfile.gettempdir()) / name)
    shutil.rmtree(log_path.parent, ignore_errors=True)


class _PortLost(RuntimeError):
    """livekit-server exited because a port chosen for it was taken before it bound it."""


def _start_server(binary: Path,
                  extra_config: str) -> tuple[subprocess.Popen[bytes], int, int, Path]:
    """One ``livekit-server --dev`` on fresh free ports, answering HTTP: its process, HTTP and
    media UDP ports, and log. Raises ``_PortLost`` when a port was taken before the server bound
    it."""
    http, tcp, udp = free_port(), free_port(), free_port(socket.SOCK_DGRAM)
    config = (f"port: {http}\nrtc:\n  tcp_port: {tcp}\n  udp_port: {udp}\n"
              "  use_external_ip: false\n  enable_loopback_candidate: true\n"
              "logging:\n  level: info\n" + extra_config)
    log_path = Path(tempfile.mkdtemp(prefix="breezert-livekit-")) / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [str(binary), "--dev", "--bind", "127.0.0.1", "--node-ip", "127.0.0.1",
             "--config-body", config], stdout=log, stderr=subprocess.STDOUT,
            preexec_fn=agent_priority,
        )
    deadline = time.monotonic() + 30
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{http}/", timeout=1) as reply:
                if reply.status == 200:
                    return proc, http, udp, log_path
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            _stop(proc, 10)
            text = log_path.read_text(errors="replace")
            _keep_last_log(log_path, "breezert-livekit-server.log")
            if "address already in use" in text:
                raise _PortLost(f"livekit-server lost a port: {text[-300:]}")
            raise RuntimeError(f"livekit-server did not start: {text[-2000:]}")
        time.sleep(0.1)


@contextlib.contextmanager
def run_server(extra_config: str = "") -> Iterator[Server]:
    """A ``livekit-server --dev`` on free loopback ports; ``extra_config`` is more YAML for its
    config (the SIP tests add ``redis:``). A port taken between its choice and the server's bind
    (another process may bind any free port) means three more tries on fresh ports."""
    binary = _server_binary()
    for attempt in range(4):
        try:
            proc, http, udp, log_path = _start_server(binary, extra_config)
            break
        except _PortLost:
            if attempt == 3:
                raise
    try:
        yield Server(http, log_path, udp)
    finally:
        _stop(proc, 10)
        _keep_last_log(log_path, "breezert-livekit-server.log")


@pytest.fixture(scope="session")
def livekit_server() -> Iterator[Server]:
    with run_server() as server:
        yield server


def _stop(proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@dataclass
class Worker:
    state_dir: Path
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    http_port: int = 0
    _events: list[dict[str, Any]] = field(default_factory=list, repr=False)
    _events_read: int = field(default=0, repr=False)  # bytes of events.jsonl parsed

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def all_events(self) -> list[dict[str, Any]]:
        """Every event so far. Read incrementally: the file only grows (one line per event,
        thousands over a session of playout reports), and parsing all of it on each 50 ms
        poll took a tenth of a core from the agent on a two-core box."""
        path = self.state_dir / "events.jsonl"
        if path.exists():
            with open(path, "rb") as file:
                file.seek(self._events_read)
                data = file.read()
            complete = data.rfind(b"\n") + 1  # a line being written is read next time
            self._events.extend(json.loads(line) for line in data[:complete].splitlines()
                                if line)
            self._events_read += complete
        return list(self._events)

    def events(self, room: str) -> list[dict[str, Any]]:
        return [row for row in self.all_events() if row["room"] == room]

    def rooms(self) -> set[str]:
        """Rooms whose job this worker took (a ``job`` event)."""
        return {row["room"] for row in self.all_events() if row["type"] == "job"}

    def metrics(self) -> dict[str, Any]:
        return json.loads((self.state_dir / "metrics.json").read_text())

    async def wait_event(self, room: str, kind: str, timeout_s: float = 20.0,
                         **match: Any) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for event in self.events(room):
                if event["type"] == kind and all(event.get(k) == v for k, v in match.items()):
                    return event
            await asyncio.sleep(0.05)
        raise AssertionError(f"no {kind} {match} event from the worker in {timeout_s} s; "
                             f"events: {self.events(room)[-8:]}\nlog: {self.log_tail()}")

    async def wait_metrics(self, predicate: Any, timeout_s: float = 10.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        snapshot: dict[str, Any] = {}
        while time.monotonic() < deadline:
            with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
                snapshot = self.metrics()
                if predicate(snapshot):
                    return snapshot
            await asyncio.sleep(0.05)
        raise AssertionError(f"worker metrics never matched: {snapshot.get('engine')}")

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def info(self) -> dict[str, Any]:
        """LiveKit's own view of this worker (its ``/worker`` page): ``active_jobs``,
        ``worker_load``."""
        assert self.http_port, "a worker started by spawn_workers"
        with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/worker",
                                    timeout=2) as reply:
            return dict(json.loads(reply.read()))


def worker_env(server: Server, state_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(LIVEKIT_URL=server.ws_url, LIVEKIT_API_KEY=API_KEY, LIVEKIT_API_SECRET=API_SECRET,
               BREEZERT_TEST_STATE=str(state_dir), BREEZERT_TEST_WORKER_PORT=str(free_port()),
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO / "runtime"), str(REPO),
                                                      env.get("PYTHONPATH", "")) if p))
    return env


@contextlib.contextmanager
def run_worker(server: Server, **extra_env: str) -> Iterator[Worker]:
    """One ``room_worker.py`` registered with ``server``; ``extra_env`` adds to its environment."""
    with spawn_workers(server, 1, env=extra_env) as (worker,):
        yield worker


@contextlib.contextmanager
def spawn_workers(server: Server, count: int, env: dict[str, str] | None = None,
                  tag: str = "worker") -> Iterator[list[Worker]]:
    """Starts ``count`` ``room_worker.py`` processes at once (``env`` added to each one's) and
    waits until every one registered; stops them after (a killed one is left as it is). Their
    logs are copied to ``$TMPDIR/breezert-livekit-<tag>[-i].log``."""
    workers: list[Worker] = []
    logs = []
    try:
        for _ in range(count):
            state_dir = Path(tempfile.mkdtemp(prefix="breezert-worker-"))
            log_path = state_dir / "worker.log"
            logs.append(open(log_path, "wb"))
            full_env = {**worker_env(server, state_dir), **(env or {}),
                        # free on IPv4 and IPv6: the worker's health server binds every
                        # address, and a port free on 127.0.0.1 alone was taken on another once
                        "BREEZERT_TEST_WORKER_PORT": str(free_port(family=socket.AF_INET6))}
            proc = subprocess.Popen([sys.executable, str(WORKER), "start"], cwd=REPO,
                                    env=full_env, stdout=logs[-1], stderr=subprocess.STDOUT,
                                    preexec_fn=agent_priority)
            workers.append(Worker(state_dir, log_path, proc,
                                  int(full_env["BREEZERT_TEST_WORKER_PORT"])))
        deadline = time.monotonic() + 120
        for worker in workers:
            assert worker.proc is not None
            while "registered worker" not in worker.log_path.read_text(errors="replace"):
                if worker.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"agent worker did not register: {worker.log_tail()}")
                time.sleep(0.1)
        yield workers
    finally:
        for worker in workers:
            if worker.proc is not None and worker.proc.poll() is None:
                _stop(worker.proc, 20)
        for i, (worker, log) in enumerate(zip(workers, logs)):
            log.close()
            suffix = f"-{i}" if count > 1 else ""
            shutil.copy(worker.log_path,
                        Path(tempfile.gettempdir()) / f"breezert-livekit-{tag}{suffix}.log")
            shutil.rmtree(worker.state_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def agent_worker(livekit_server: Server) -> Iterator[Worker]:
    """The room tests' worker, one for the session: its engine is warm for every module's
    first turn, which the real-time checks count (the dispatch and SIP tests start their own
    under other agent names or servers)."""
    with run_worker(livekit_server) as worker:
        yield worker


# ----------------------------------------------------------------------------- one room


class Room:
    """A fresh room with the agent dispatched into it and this test as a participant, handed out
    subscribed and settled (``auto_subscribe``) or before any subscription.

    ``worker`` is the worker that will take the job, or a ``WorkerGroup`` (whichever of them
    the dispatcher picks); ``dispatched_at`` is when the dispatch was asked for."""

    def __init__(self, server: Server, worker: Worker | WorkerGroup, *,
                 auto_subscribe: bool = True, agent_name: str = AGENT_NAME) -> None:
        self.server, self.worker = server, worker
        self.agent_name = agent_name
        self.dispatched_at = 0.0
        self.name = f"room-{uuid.uuid4().hex[:8]}"
        self.room = rtc.Room()
        self.auto_subscribe = auto_subscribe
        self.recording = Recording()
        self.agent_track: rtc.RemoteAudioTrack | None = None
        self._subscribed = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._n = 0

    async def __aenter__(self) -> Room:
        self.room.on("track_subscribed", self._on_track)
        await self.room.connect(self.server.ws_url, self.server.token("listener", self.name),
                                rtc.RoomOptions(auto_subscribe=self.auto_subscribe))
        async with api.LiveKitAPI(self.server.http_url, API_KEY, API_SECRET) as lkapi:
            self.dispatched_at = time.monotonic()
            await lkapi.agent_dispatch.create_dispatch(
                api.CreateAgentDispatchRequest(agent_name=self.agent_name, room=self.name))
        await self.worker.wait_event(self.name, "ready", timeout_s=30)
        if self.auto_subscribe:
            await asyncio.wait_for(self._subscribed.wait(), 10)
            # the agent holds a turn said within LISTENER_SETTLE_S of a subscription (the
            # held-turn test's subject): a room is handed out settled, so that a test's first
            # turn measures what a settled room's turn takes, not that hold
            await asyncio.sleep(LISTENER_SETTLE_S)
        return self

    async def __aexit__(self, *exc: object) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.room.disconnect()

    def _on_track(self, track: rtc.Track, publication: rtc.RemoteTrackPublication,
                  participant: rtc.RemoteParticipant) -> None:
        if track.kind == rtc.TrackKind.KIND_AUDIO and self.agent_track is None:
            self.agent_track = track  # type: ignore[assignment]
            self._tasks.append(asyncio.create_task(self._record(track)))
            self._subscribed.set()

    async def _record(self, track: rtc.Track) -> None:
        stream = rtc.AudioStream(track, sample_rate=48000, num_channels=1)
        async for event in stream:
            now = time.monotonic()
            samples = np.frombuffer(event.frame.data, dtype=np.int16).astype(np.float32)
            self.recording.times.append(now)
            self.recording.durations.append(event.frame.duration)
            self.recording.rms.append(float(np.sqrt(np.mean(samples * samples)))
                                      if samples.size else 0.0)

    async def subscribe(self) -> None:
        """Subscribes to the agent's audio (for ``auto_subscribe=False``)."""
        for participant in self.room.remote_participants.values():
            for publication in participant.track_publications.values():
                if publication.kind == rtc.TrackKind.KIND_AUDIO:
                    publication.set_subscribed(True)
        await asyncio.wait_for(self._subscribed.wait(), 10)

    async def playout_counters(self, since: dict[str, int] | None = None) -> dict[str, int]:
        """The jitter buffer's sample counters for the agent's audio at this participant (the
        subscriber's inbound-rtp stats, as the browser's ``getStats`` gives them): received
        (samples decoded from packets), concealed, silent (concealed as silence), inserted (to
        slow playout), removed (to speed it up); less ``since`` (an earlier call's result)."""
        stats = await self.room.get_rtc_stats()
        # both lists: with the server's single peer connection the inbound stream is reported
        # in the publisher's (livekit 1.1.21 against livekit-server v1.13.5)
        audio = [s.inbound_rtp.inbound for s in [*stats.subscriber_stats, *stats.publisher_stats]
                 if s.WhichOneof("stats") == "inbound_rtp" and s.inbound_rtp.stream.kind == "audio"]
        counters = {"received": sum(a.total_samples_received for a in audio),
                    "concealed": sum(a.concealed_samples for a in audio),
                    "silent": sum(a.silent_concealed_samples for a in audio),
                    "inserted": sum(a.inserted_samples_for_deceleration for a in audio),
                    "removed": sum(a.removed_samples_for_acceleration for a in audio)}
        return counters if since is None else {k: counters[k] - since[k] for k in counters}

    async def send(self, topic: str, body: dict[str, Any]) -> float:
        sent = time.monotonic()
        await self.room.local_participant.publish_data(json.dumps(body), reliable=True,
                                                       topic=topic)
        return sent

    async def say(self, text: str) -> tuple[str, float]:
        self._n += 1
        message_id = f"say-{self._n}"
        return message_id, await self.send("test.say", {"id": message_id, "text": text})

    async def interrupt(self) -> float:
        return await self.send("test.interrupt", {})


class WorkerGroup:
    """Several workers of one agent name, read as one (``Room`` waits on whichever took the
    job); ``owner`` tells which did."""

    def __init__(self, workers: list[Worker]) -> None:
        self.workers = workers

    def owner(self, room: str) -> Worker | None:
        return next((w for w in self.workers if room in w.rooms()), None)

    def events(self, room: str) -> list[dict[str, Any]]:
        owner = self.owner(room)
        return owner.events(room) if owner is not None else []

    async def wait_event(self, room: str, kind: str, timeout_s: float = 20.0,
                         **match: Any) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while self.owner(room) is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        owner = self.owner(room)
        if owner is None:
            raise AssertionError(f"no worker took the job of {room} in {timeout_s} s")
        return await owner.wait_event(room, kind, max(deadline - time.monotonic(), 0.1),
                                      **match)


@pytest.fixture(scope="module")
def web_root() -> Iterator[str]:
    """The repository over HTTP on loopback, for the browser participant (``browser.py``)."""
    with serve_repository() as url:
        yield url


@pytest.fixture
async def room_factory(livekit_server: Server,
                       agent_worker: Worker) -> AsyncIterator[Any]:
    async with contextlib.AsyncExitStack() as stack:
        async def make(**kwargs: Any) -> Room:
            return await stack.enter_async_context(Room(livekit_server, agent_worker, **kwargs))

        yield make
