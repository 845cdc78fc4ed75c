"""Real-room fixtures: a LiveKit server (``--dev``, loopback only), the agent worker process, rooms.

Owns: finding (or building, through the Makefile) the pinned ``livekit-server``, starting it on
free loopback ports and stopping it; starting ``room_worker.py`` against it; a ``Room`` helper
that dispatches the agent into a fresh room, joins it with ``livekit.rtc`` and records the agent's
audio (``listening.Recording``); serves the repository to the browser participant (``browser.py``).
Skips only when the server cannot be built (the reason is printed).
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from livekit import api, rtc

from tests.livekit.browser import serve_repository
from tests.livekit.listening import Recording
from tests.livekit.machine import agent_priority

REPO = Path(__file__).resolve().parents[2]
SERVER_BIN = REPO / ".cache" / "livekit" / "livekit-server"
BUILD_LOG = REPO / ".cache" / "livekit" / "build.log"
WORKER = Path(__file__).with_name("room_worker.py")
API_KEY, API_SECRET = "devkey", "secret"
AGENT_NAME = "breezert-test"


def _free_port(kind: int = socket.SOCK_STREAM) -> int:
    with socket.socket(socket.AF_INET, kind) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _server_binary() -> Path:
    """The built server; builds it through ``make livekit-server`` when it was never tried;
    skips with the build's reason (``.cache/livekit/build.log``) when it cannot be built."""
    override = os.environ.get("BREEZERT_LIVEKIT_SERVER")
    if override:
        return Path(override)
    if not SERVER_BIN.exists() and not BUILD_LOG.exists() and shutil.which("make"):
        subprocess.run(["make", "-s", "-C", str(REPO), "livekit-server"], check=False,
                       timeout=1200)
    if not SERVER_BIN.exists():
        reason = BUILD_LOG.read_text()[-800:] if BUILD_LOG.exists() else "no build log"
        pytest.skip(f"livekit-server could not be built (make livekit-server): {reason}")
    return SERVER_BIN


@dataclass
class Server:
    http_port: int
    log_path: Path

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


@pytest.fixture(scope="session")
def livekit_server() -> Iterator[Server]:
    binary = _server_binary()
    http, tcp, udp = _free_port(), _free_port(), _free_port(socket.SOCK_DGRAM)
    config = (f"port: {http}\nrtc:\n  tcp_port: {tcp}\n  udp_port: {udp}\n"
              "  use_external_ip: false\n  enable_loopback_candidate: true\n"
              "logging:\n  level: info\n")
    log_path = Path(tempfile.mkdtemp(prefix="breezert-livekit-")) / "server.log"
    log = open(log_path, "wb")
    proc = subprocess.Popen(
        [str(binary), "--dev", "--bind", "127.0.0.1", "--node-ip", "127.0.0.1",
         "--config-body", config], stdout=log, stderr=subprocess.STDOUT,
        preexec_fn=agent_priority,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{http}/", timeout=1) as reply:
                    if reply.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"livekit-server did not start: {log_path.read_text()[-2000:]}")
            time.sleep(0.1)
        yield Server(http, log_path)
    finally:
        _stop(proc, 10)
        log.close()


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

    def events(self, room: str) -> list[dict[str, Any]]:
        path = self.state_dir / "events.jsonl"
        if not path.exists():
            return []
        rows = [json.loads(line) for line in path.read_text().splitlines() if line]
        return [row for row in rows if row["room"] == room]

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


def worker_env(server: Server, state_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(LIVEKIT_URL=server.ws_url, LIVEKIT_API_KEY=API_KEY, LIVEKIT_API_SECRET=API_SECRET,
               BREEZERT_TEST_STATE=str(state_dir), BREEZERT_TEST_WORKER_PORT=str(_free_port()),
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO / "runtime"), str(REPO),
                                                      env.get("PYTHONPATH", "")) if p))
    return env


@pytest.fixture(scope="session")
def agent_worker(livekit_server: Server) -> Iterator[Worker]:
    state_dir = Path(tempfile.mkdtemp(prefix="breezert-worker-"))
    log_path = state_dir / "worker.log"
    log = open(log_path, "wb")
    proc = subprocess.Popen([sys.executable, str(WORKER), "start"], cwd=REPO,
                            env=worker_env(livekit_server, state_dir), stdout=log,
                            stderr=subprocess.STDOUT, preexec_fn=agent_priority)
    worker = Worker(state_dir, log_path)
    try:
        deadline = time.monotonic() + 120
        while "registered worker" not in log_path.read_text(errors="replace"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"agent worker did not register: {worker.log_tail()}")
            time.sleep(0.1)
        yield worker
    finally:
        _stop(proc, 20)
        log.close()
        shutil.copy(log_path, Path(tempfile.gettempdir()) / "breezert-livekit-worker.log")
        shutil.rmtree(state_dir, ignore_errors=True)


# ----------------------------------------------------------------------------- one room


class Room:
    """A fresh room with the agent dispatched into it and this test as a participant."""

    def __init__(self, server: Server, worker: Worker, *, auto_subscribe: bool = True) -> None:
        self.server, self.worker = server, worker
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
            await lkapi.agent_dispatch.create_dispatch(
                api.CreateAgentDispatchRequest(agent_name=AGENT_NAME, room=self.name))
        await self.worker.wait_event(self.name, "ready", timeout_s=30)
        if self.auto_subscribe:
            await asyncio.wait_for(self._subscribed.wait(), 10)
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
