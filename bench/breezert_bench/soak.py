"""``breezert-bench soak``: a bounded mix of normal and faulty traffic against a server on loopback,
then a leak check.

Owns: the traffic mix (HTTP streams and WAV bodies, streams dropped mid-way, WebSocket turns
spoken, cancelled, grown with ``append``, left open then dropped, sockets closed mid-turn, bad
HTTP bodies and WS messages, a burst past capacity), the leak check (``/metrics`` gauges back to
idle; RSS growth of the server) and the JSON report. Starts its own ``breezert serve`` on a
free loopback port unless given ``url``. Must not: import the engine; it is a client only.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from breezert.profiles import EMBEDDED_PROFILE, profile_path
from breezert_bench.ports import free_port

IDLE_GAUGES = {
    "breezert_running_requests": 0, "breezert_queued_requests": 0,
    'breezert_kv_blocks{state="used"}': 0, 'breezert_codec_slots{state="used"}': 0,
    'breezert_slots{state="used"}': 0,
    'breezert_open_turns{kind="websocket"}': 0, 'breezert_open_turns{kind="webrtc"}': 0,
    'breezert_turn_controllers{kind="websocket"}': 0,
    'breezert_turn_controllers{kind="webrtc"}': 0, "breezert_webrtc_peers": 0,
    'breezert_connections{kind="http_stream"}': 0, "breezert_active_streams": 0,
}
"""Gauge -> its value when nothing runs (``breezert_kv_blocks{state="free"}`` must also equal
``breezert_kv_blocks_total``)."""

TEXTS = ("Hello there.", "The quick brown fox jumps over the lazy dog.",
         "Streaming speech, one chunk at a time.", "Testing, one, two, three.")


@dataclass
class SoakOptions:
    url: str | None = None
    """Target server; ``None``: start ``breezert serve`` on a free loopback port."""
    duration_s: float = 30.0
    """Rounds start until this much time has passed (the last one finishes)."""
    concurrency: int = 4
    """Scenarios running at once."""
    config: Path | None = None
    """Profile for the started server (default: the packaged ``cpu-tiny``)."""
    max_frames: int = 25
    """Frames per request of the started server (its ``--max-frames``): keeps turns short."""
    burst_every: int = 5
    """Every this many rounds, a burst past capacity (``burst_size`` HTTP streams at once)."""
    burst_size: int = 48
    max_rss_growth_mb: float = 150.0
    """RSS growth from after the first round to the end that counts as a leak."""
    idle_timeout_s: float = 15.0
    """How long the gauges may take to go back to idle after the traffic."""
    startup_timeout_s: float = 300.0
    token: str | None = None
    seed: int = 0


@dataclass
class _Tally:
    kinds: Counter[str] = field(default_factory=Counter)
    statuses: Counter[str] = field(default_factory=Counter)
    unexpected: list[str] = field(default_factory=list)
    retry_after_missing: int = 0

    def note(self, kind: str, status: str, ok: bool, detail: str = "") -> None:
        self.kinds[kind] += 1
        self.statuses[f"{kind}:{status}"] += 1
        if not ok and len(self.unexpected) < 50:
            self.unexpected.append(f"{kind}: {status} {detail}".strip())


def parse_metrics(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                out[name] = float(value)
    return out


def rss_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


class Soak:
    def __init__(self, options: SoakOptions, url: str, pid: int | None) -> None:
        self.o = options
        self.url = url.rstrip("/")
        self.ws_url = self.url.replace("http", "ws", 1) + "/v1/audio/speech/stream"
        self.pid = pid
        self.tally = _Tally()
        self.headers = {"Authorization": f"Bearer {options.token}"} if options.token else {}
        self._n = 0

    def _text(self) -> str:
        self._n += 1
        return TEXTS[self._n % len(TEXTS)]

    async def metrics(self, http: aiohttp.ClientSession) -> dict[str, float]:
        async with http.get(f"{self.url}/metrics") as r:
            return parse_metrics(await r.text())

    async def rss(self, http: aiohttp.ClientSession) -> int | None:
        if self.pid is not None:
            return rss_of(self.pid)
        value = (await self.metrics(http)).get("process_resident_memory_bytes")
        return int(value) if value is not None else None

    # ------------------------------------------------------------ HTTP scenarios
    async def _post(self, http: aiohttp.ClientSession, kind: str, body: Any, *,
                    read: str = "all", expect: tuple[int, ...] = (200,)) -> None:
        data = body if isinstance(body, (bytes, str)) else json.dumps(body)
        try:
            async with http.post(f"{self.url}/v1/audio/speech", data=data, headers={
                    **self.headers, "Content-Type": "application/json"}) as r:
                if r.status == 503 and "Retry-After" not in r.headers:
                    self.tally.retry_after_missing += 1
                if r.status == 200 and read == "first":
                    await r.content.readany()  # then drop the connection mid-stream
                    r.close()
                else:
                    await r.read()
                self.tally.note(kind, str(r.status), r.status in expect)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            self.tally.note(kind, type(exc).__name__, False, str(exc)[:100])

    async def http_stream(self, http: aiohttp.ClientSession) -> None:
        await self._post(http, "http_stream", {"input": self._text(), "stream": True})

    async def http_wav(self, http: aiohttp.ClientSession) -> None:
        await self._post(http, "http_wav", {"input": self._text(), "voice": "S1"})

    async def http_abort(self, http: aiohttp.ClientSession) -> None:
        await self._post(http, "http_abort", {"input": self._text(), "stream": True},
                         read="first")

    async def bad_inputs(self, http: aiohttp.ClientSession) -> None:
        for body in (b"{not json", b"[1, 2]", {"voice": "S1"}, {"input": ""},
                     {"input": "Hi", "voice": "nobody"}, {"input": "Hi", "speed": 3},
                     {"input": "x" * 50_000}, {"input": "Hi", "seed": "x"}):
            await self._post(http, "bad_http", body, expect=(400, 413, 422))

    async def burst(self, http: aiohttp.ClientSession) -> None:
        """Past capacity: running + queued fill up, the rest must get 503 + Retry-After."""
        await asyncio.gather(*(self._post(http, "burst", {"input": "Burst.", "stream": True},
                                          read="first", expect=(200, 503))
                               for _ in range(self.o.burst_size)))

    # -------------------------------------------------------- WebSocket scenarios
    async def _ws(self, http: aiohttp.ClientSession, kind: str,
                  body: Callable[[aiohttp.ClientWebSocketResponse], Awaitable[str]]) -> None:
        try:
            async with http.ws_connect(self.ws_url, headers=self.headers) as ws:
                ready = json.loads((await asyncio.wait_for(ws.receive(), 10)).data)
                if ready.get("type") != "ready":
                    self.tally.note(kind, "no_ready", False, str(ready))
                    return
                status = await body(ws)
                self.tally.note(kind, status, not status.startswith("unexpected"))
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            self.tally.note(kind, type(exc).__name__, False, str(exc)[:100])

    @staticmethod
    async def _until(ws: aiohttp.ClientWebSocketResponse, *types: str,
                     timeout_s: float = 60.0) -> dict[str, Any]:
        while True:
            msg = await asyncio.wait_for(ws.receive(), timeout_s)
            if msg.type == aiohttp.WSMsgType.BINARY:
                continue
            if msg.type != aiohttp.WSMsgType.TEXT:
                return {"type": f"closed:{msg.type.name}"}
            event = json.loads(msg.data)
            if event.get("type") in types or event.get("type") == "error":
                return event

    async def ws_say(self, http: aiohttp.ClientSession) -> None:
        async def body(ws: aiohttp.ClientWebSocketResponse) -> str:
            await ws.send_json({"type": "say", "text": self._text()})
            done = await self._until(ws, "turn_done")
            return _status(done)
        await self._ws(http, "ws_say", body)

    async def ws_cancel(self, http: aiohttp.ClientSession) -> None:
        async def body(ws: aiohttp.ClientWebSocketResponse) -> str:
            await ws.send_json({"type": "say", "text": self._text()})
            started = await self._until(ws, "first_audio", "turn_done")
            if started.get("type") != "first_audio":
                # refused (overloaded: no turn to cancel, so no turn_done would come) or ended
                # before any audio: judged as ws_say judges its end
                return _status(started)
            await ws.send_json({"type": "cancel"})
            done = await self._until(ws, "turn_done")
            return _status(done)
        await self._ws(http, "ws_cancel", body)

    async def ws_append(self, http: aiohttp.ClientSession) -> None:
        async def body(ws: aiohttp.ClientWebSocketResponse) -> str:
            await ws.send_json({"type": "say", "text": "Streamed", "more": True})
            await ws.send_json({"type": "append", "text": " text from an LLM."})
            await ws.send_json({"type": "end"})
            done = await self._until(ws, "turn_done")
            return _status(done)
        await self._ws(http, "ws_append", body)

    async def ws_idle_turn(self, http: aiohttp.ClientSession) -> None:
        """An open turn (``more: true``, no ``end``) left idle, then the socket dropped."""
        async def body(ws: aiohttp.ClientWebSocketResponse) -> str:
            await ws.send_json({"type": "say", "text": "Waiting for more", "more": True})
            await self._until(ws, "turn_started")
            await asyncio.sleep(1.0)
            return "dropped_open"
        await self._ws(http, "ws_idle_turn", body)

    async def ws_drop_mid_turn(self, http: aiohttp.ClientSession) -> None:
        async def body(ws: aiohttp.ClientWebSocketResponse) -> str:
            await ws.send_json({"type": "say", "text": self._text()})
            await self._until(ws, "first_audio", "turn_done")
            return "dropped"
        await self._ws(http, "ws_drop", body)

    async def ws_bad(self, http: aiohttp.ClientSession) -> None:
        async def body(ws: aiohttp.ClientWebSocketResponse) -> str:
            codes = []
            for raw in ("{nope", "[]", json.dumps({"type": "dance"}),
                        json.dumps({"type": "say"}), json.dumps({"type": "append", "text": "x"}),
                        json.dumps({"type": "say", "text": "   "})):
                await ws.send_str(raw)
                event = await self._until(ws, "error", timeout_s=10)
                codes.append(event.get("code", "?"))
            await ws.send_bytes(b"\x00\x01")
            codes.append((await self._until(ws, "error", timeout_s=10)).get("code", "?"))
            # the socket must still work after all of that
            await ws.send_json({"type": "say", "text": "Still here."})
            done = await self._until(ws, "turn_done")
            return "errors_then_" + _status(done)
        await self._ws(http, "ws_bad", body)

    # --------------------------------------------------------------------- run
    def scenarios(self) -> list[Callable[[aiohttp.ClientSession], Awaitable[None]]]:
        return [self.http_stream, self.ws_say, self.http_abort, self.ws_cancel, self.http_wav,
                self.ws_append, self.ws_idle_turn, self.ws_drop_mid_turn, self.bad_inputs,
                self.ws_bad]

    async def run(self) -> dict[str, Any]:
        timeout = aiohttp.ClientTimeout(total=120)
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
            start = time.monotonic()
            rounds = 0
            rss_start = None
            scenarios = self.scenarios()
            while rounds == 0 or time.monotonic() - start < self.o.duration_s:
                batch = [scenarios[(rounds * self.o.concurrency + i) % len(scenarios)]
                         for i in range(self.o.concurrency)]
                if self.o.burst_every and rounds % self.o.burst_every == self.o.burst_every - 1:
                    batch.append(self.burst)
                await asyncio.gather(*(scenario(http) for scenario in batch))
                rounds += 1
                if rounds == 1:
                    rss_start = await self.rss(http)  # after one warm round: allocator warm
            traffic_s = time.monotonic() - start
            gauges, idle_after = await self._wait_idle(http)
            rss_end = await self.rss(http)
        return self._report(rounds, traffic_s, gauges, idle_after, rss_start, rss_end)

    async def _wait_idle(self, http: aiohttp.ClientSession) -> tuple[dict[str, float], float]:
        start = time.monotonic()
        while True:
            gauges = await self.metrics(http)
            if not _leaks(gauges) or time.monotonic() - start > self.o.idle_timeout_s:
                return gauges, time.monotonic() - start
            await asyncio.sleep(0.1)

    def _report(self, rounds: int, traffic_s: float, gauges: dict[str, float], idle_after: float,
                rss_start: int | None, rss_end: int | None) -> dict[str, Any]:
        leaks = _leaks(gauges)
        growth = None
        if rss_start is not None and rss_end is not None:
            growth = rss_end - rss_start
            if growth > self.o.max_rss_growth_mb * 2**20:
                leaks.append(f"RSS grew {growth / 2**20:.1f} MiB (limit "
                             f"{self.o.max_rss_growth_mb:g} MiB)")
        if self.tally.retry_after_missing:
            leaks.append(f"{self.tally.retry_after_missing} 503 responses without Retry-After")
        t = self.tally
        return {
            "url": self.url, "started_server": self.pid is not None,
            "requests": sum(t.kinds.values()), "rounds": rounds,
            "duration_s": round(traffic_s, 1), "by_kind": dict(sorted(t.kinds.items())),
            "statuses": dict(sorted(t.statuses.items())),
            "rss_start_bytes": rss_start, "rss_end_bytes": rss_end, "rss_growth_bytes": growth,
            "idle_after_s": round(idle_after, 2),
            "gauges_end": {k: gauges.get(k) for k in
                           [*IDLE_GAUGES, 'breezert_kv_blocks{state="free"}',
                            "breezert_kv_blocks_total"]},
            "unexpected": t.unexpected, "leaks": leaks, "ok": not leaks and not t.unexpected,
            "options": {"duration_s": self.o.duration_s, "concurrency": self.o.concurrency,
                        "max_frames": self.o.max_frames, "burst_size": self.o.burst_size,
                        "burst_every": self.o.burst_every,
                        "max_rss_growth_mb": self.o.max_rss_growth_mb},
        }


def _status(event: dict[str, Any]) -> str:
    """A turn's end: its ``turn_done`` status, ``overloaded`` (fine during a burst), or
    ``unexpected ...``."""
    if event.get("type") == "turn_done":
        return str(event.get("status"))
    if event.get("type") == "error" and event.get("code") == "overloaded":
        return "overloaded"
    return f"unexpected {event}"


def _leaks(gauges: dict[str, float]) -> list[str]:
    leaks = [f"{name} = {gauges.get(name)} (idle: {idle})" for name, idle in IDLE_GAUGES.items()
             if gauges.get(name, idle) != idle]
    free, total = gauges.get('breezert_kv_blocks{state="free"}'), gauges.get(
        "breezert_kv_blocks_total")
    if free is not None and free != total:
        leaks.append(f"KV blocks free {free} of {total}")
    if "breezert_running_requests" not in gauges:
        leaks.append("the server exports no capacity gauges (breezert_running_requests)")
    return leaks


@contextlib.contextmanager
def started_server(options: SoakOptions):  # type: ignore[no-untyped-def]
    """``breezert serve`` on a free loopback port; yields (url, pid), terminates it after."""
    port = free_port()
    config = options.config if options.config is not None else profile_path(EMBEDDED_PROFILE)
    cmd = [sys.executable, "-m", "breezert.cli", "serve", "--host", "127.0.0.1", "--port",
           str(port), "--max-frames", str(options.max_frames), "--no-access-log"]
    cmd += ["--config", str(config)]
    log = open(os.devnull, "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        yield f"http://127.0.0.1:{port}", proc.pid
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()


async def _wait_ready(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as http:
        while True:
            with contextlib.suppress(aiohttp.ClientError):
                async with http.get(f"{url}/readyz") as r:
                    if r.status == 200:
                        return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} was not ready after {timeout_s:g} s")
            await asyncio.sleep(0.2)


def run_soak(options: SoakOptions) -> dict[str, Any]:
    """Runs the soak; the report's ``leaks`` lists every leak found (empty: none)."""
    if options.url is not None:
        asyncio.run(_wait_ready(options.url, options.startup_timeout_s))
        return asyncio.run(Soak(options, options.url, None).run())
    with started_server(options) as (url, pid):
        asyncio.run(_wait_ready(url, options.startup_timeout_s))
        return asyncio.run(Soak(options, url, pid).run())
