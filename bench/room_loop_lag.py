"""What stalls an event loop in a process of many LiveKit rooms, one thread and loop each.

    PYTHONPATH=runtime:bench:. .venv/bin/python bench/room_loop_lag.py \
        --rooms 1,4,8,16 --engine 0,1 --switch-ms 5,0.5,0.1 --seconds 12 \
        --out bench/results/cpu-room-loop-lag-DATE.json

The agent worker of the room benchmark (``bench/room_agent.py``) runs every room's job as a
thread with its own asyncio loop in one process (livekit-agents' THREAD executor), beside the
engine's step loop on a thread of its own. This script rebuilds that process without the
agent: ``livekit-server --dev`` on loopback (``room_procs.livekit_server``), then for each
point of the sweep a fresh child process with K room threads, each one loop with one connected
``rtc.Room`` publishing an ``rtc.AudioSource`` track (24 kHz mono, ``queue_size_ms=200`` as
RoomIO makes it) into which it captures frames of ``--frame-ms`` (50: RoomIO's) on a real-time
schedule, plus ``--idle`` loops that only run (the job threads livekit keeps warm), and
optionally a synthetic engine thread: Python work that holds the GIL, cut every ~30 us by a
small torch op that releases it (~4 us), for ``duty`` of each 10 ms period, sleeping the rest
(as the step loop waits on the GPU). ``--processes P`` spreads the rooms over P processes (the
engine thread then in one of its own), ``--reports-hz`` adds a listener per room, in a process
of its own, sending a playout report's worth of data that often (variant ``listener``: 10).
``--pace ahead`` captures back to back instead of on a real-time schedule, so each
track's 200 ms queue stays full and a capture is always in flight (RoomIO behind a TTS faster
than real time). ``--fanout per-loop`` is an experiment on livekit's side, not a fix the
project ships: ``FfiQueue.put`` replaced in the child by one that wakes each loop once per event,
outside the queue's lock (``per_loop_put``).
``--monitor WARN_MS`` puts livekit-agents' own loop monitor
(``livekit.agents.telemetry.loop_monitor``: a heartbeat and a watchdog thread per loop, ticking
every 20 ms at livekit's default warn threshold of 100 ms) on every room and idle loop, as each
job thread has it; idle loops otherwise sleep.

Measured per point, over every room loop: the loop lag (a 10 ms heartbeat: how late it fires),
each ``capture_frame``'s duration (and its parts, ``FfiProbe``), the share of real time each
track got audio, and, from wrappers around the process's one ``FfiQueue`` and each loop's
``call_soon_threadsafe`` (livekit's code is not changed: the wrappers only time it), how long
each ``put`` on an FFI callback thread took and to how many subscribers, how long each
``subscribe`` waited for the queue's lock, the CPU of every thread by name and of the machine,
and the collector's full passes. Each process sets the point's ``sys.setswitchinterval``
first, imports torch and freezes its start-up heap (as ``AsyncEngine.shared`` does).

Owns: this measurement (the child processes, their threads, the sweep and its JSON). Must not:
change livekit's packages or the agent (``--fanout per-loop`` swaps a method on the child's own
queue object); the server is ``bench/room_procs.py``'s.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
for _path in (REPO / "runtime", REPO / "bench", REPO):
    if str(_path) not in sys.path:
        sys.path.append(str(_path))

from breezert_bench.listener import summarize  # noqa: E402
from room_procs import (  # noqa: E402
    API_KEY,
    API_SECRET,
    default_server_bin,
    livekit_server,
    python_argv,
    pythonpath,
)

SAMPLE_RATE = 24000
QUEUE_MS = 200  # RoomIO's AudioSource (livekit-agents 1.8.9)
HEARTBEAT_S = 0.010
ENGINE_PERIOD_S = 0.010
STALL_S = 0.100  # livekit-agents' loop monitor warns at this lag


# ----------------------------------------------------------------------------- child: one point


class FfiProbe:
    """Times the process's ``FfiQueue`` and ``FfiClient.request`` by wrapping the instances'
    methods (livekit's code is not changed): ``put`` (on an FFI callback thread, under the
    queue's lock: its lock wait and its fan-out), ``subscribe`` (how long a loop waited for
    that lock), and per ``capture_frame`` when its request returned (``capture_requests``) and
    when the put of its callback began and ended (``capture_puts``), so its duration splits into
    request, native side (plus the callback thread's GIL wait and parse) and fan-out plus loop
    wake-up (``capture_split``)."""

    def __init__(self, fanout: str = "livekit") -> None:
        from livekit.rtc._ffi_client import FfiClient

        self.puts: list[tuple[float, int]] = []  # (seconds, subscribers)
        self.put_cpu_s = 0.0  # CPU time of the callback threads inside put
        self.subscribes: list[float] = []
        self.wakes: list[float] = []  # call_soon_threadsafe from another thread, seconds
        self.stalls: list[float] = []  # blocks livekit's loop monitor reported (``--monitor``)
        self.recording = False
        self.capture_requests: dict[int, tuple[int, float]] = {}  # thread -> (async id, end)
        self.capture_puts: dict[int, tuple[float, float]] = {}  # async id -> (start, end)
        client = FfiClient.instance
        queue = client.queue
        put, subscribe, request = queue.put, queue.subscribe, client.request
        if fanout == "per-loop":
            put = per_loop_put(queue)
        elif fanout != "livekit":
            raise ValueError(f"fanout {fanout!r}: expected livekit or per-loop")

        def timed_put(item: Any) -> None:
            start, cpu = time.monotonic(), time.thread_time()
            put(item)
            if self.recording:
                end = time.monotonic()
                self.puts.append((end - start, len(queue._subscribers)))
                self.put_cpu_s += time.thread_time() - cpu
                if item.WhichOneof("message") == "capture_audio_frame":
                    self.capture_puts[item.capture_audio_frame.async_id] = (start, end)

        def timed_subscribe(*args: Any, **kwargs: Any) -> Any:
            start = time.monotonic()
            result = subscribe(*args, **kwargs)
            if self.recording:
                self.subscribes.append(time.monotonic() - start)
            return result

        def marked_request(req: Any) -> Any:
            resp = request(req)
            if req.WhichOneof("message") == "capture_audio_frame":
                self.capture_requests[threading.get_ident()] = (
                    resp.capture_audio_frame.async_id, time.monotonic())
            return resp

        queue.put = timed_put  # type: ignore[method-assign]
        queue.subscribe = timed_subscribe  # type: ignore[method-assign]
        client.request = marked_request  # type: ignore[method-assign]

    def watch_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """Times every ``call_soon_threadsafe`` on ``loop`` from another thread (the fan-out's
        unit: a put makes one per subscriber, each writes the loop's self-pipe)."""
        call = loop.call_soon_threadsafe

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.monotonic()
            handle = call(*args, **kwargs)
            if self.recording:
                self.wakes.append(time.monotonic() - start)
            return handle

        loop.call_soon_threadsafe = timed  # type: ignore[method-assign]

    def capture_split(self, begin: float, end: float) -> tuple[float, float, float] | None:
        """The last ``capture_frame`` of this thread (``begin``..``end``) as (request, request
        to its callback's put, put to the loop's return) seconds; ``None`` if unmatched."""
        mark = self.capture_requests.get(threading.get_ident())
        put = self.capture_puts.pop(mark[0], None) if mark else None
        if mark is None or put is None:
            return None
        return mark[1] - begin, put[0] - mark[1], end - put[0]


def per_loop_put(queue: Any) -> Any:
    """An experiment, not livekit's code: ``FfiQueue.put`` that reads its subscribers under the
    lock, filters them on the callback thread as livekit does, and wakes each loop once per
    event (one ``call_soon_threadsafe`` that fills all of that loop's queues), outside the
    lock: what the fan-out costs when a put neither holds the lock through its wake-ups nor
    writes a loop's self-pipe once per subscriber."""

    def deliver(queues: list[Any], item: Any) -> None:
        for target in queues:
            target.put_nowait(item)

    def put(item: Any) -> None:
        with queue._lock:
            subscribers = list(queue._subscribers)
        by_loop: dict[Any, list[Any]] = {}
        for target, loop, filter_fn in subscribers:
            if filter_fn is not None:
                try:
                    if not filter_fn(item):
                        continue
                except Exception:
                    pass  # livekit delivers on a filter's error
            by_loop.setdefault(loop, []).append(target)
        for loop, queues in by_loop.items():
            try:
                loop.call_soon_threadsafe(deliver, queues, item)
            except RuntimeError:  # a closed loop, as livekit logs and goes on
                pass

    return put


def engine_loop(duty: float, stop: threading.Event, stats: dict[str, float]) -> None:
    """A step loop on the CPU: per ``ENGINE_PERIOD_S``, ``duty`` of it in Python (GIL held)
    cut by small torch ops (GIL released in each), then a sleep (GIL released: the GPU)."""
    import torch

    torch.set_num_threads(1)
    x = torch.zeros(64)
    steps = 0
    busy = 0.0
    began, cpu = time.monotonic(), time.thread_time()
    while not stop.is_set():
        start = time.perf_counter()
        until = start + duty * ENGINE_PERIOD_S
        while time.perf_counter() < until:
            total = 0
            for i in range(300):  # ~25 us of bytecode
                total += i * i
            x = x + 1.0  # releases the GIL inside the op
        busy += time.perf_counter() - start
        steps += 1
        if duty < 1.0:
            time.sleep((1.0 - duty) * ENGINE_PERIOD_S)
    stats.update(steps=steps, busy_s=busy, wall_s=time.monotonic() - began,
                 cpu_s=time.thread_time() - cpu)


def token(identity: str, room: str) -> str:
    from livekit import api

    grants = api.VideoGrants(room_join=True, room=room, can_publish=True, can_subscribe=True)
    return api.AccessToken(API_KEY, API_SECRET).with_identity(identity).with_grants(
        grants).to_jwt()


class LoopThread(threading.Thread):
    """One loop on its own thread, in one of three roles: ``room`` (the agent's side: joins
    ``room`` and captures into its track), ``idle`` (a loop and nothing else: a warm job
    thread) or ``reporter`` (the listener's side: joins ``room`` and sends a data packet of a
    playout report's size every ``1 / reports_hz`` s, as variant ``listener`` does)."""

    def __init__(self, spec: dict[str, Any], index: int, role: str, room: str | None,
                 connect_lock: threading.Lock, ready: threading.Barrier,
                 go: threading.Event, window: list[float], probe: FfiProbe) -> None:
        super().__init__(name=f"loop-{index}", daemon=True)
        self.spec, self.index, self.role, self.room_name = spec, index, role, room
        self.probe = probe
        self.connect_lock, self.ready, self.go, self.window = connect_lock, ready, go, window
        self.lags: list[float] = []
        self.captures: list[float] = []
        self.capture_late: list[float] = []
        self.capture_splits: list[tuple[float, float, float]] = []
        self.dropped = 0  # frames dropped behind schedule (pace realtime)
        self.cpu_s = 0.0  # this loop thread's CPU time in the window
        self.error: str | None = None

    def run(self) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        self.probe.watch_loop(loop)
        if self.spec["monitor"] and self.role != "reporter":
            from livekit.agents.telemetry import loop_monitor

            warn = self.spec["monitor"] / 1000
            monitor = loop_monitor.start_monitoring(
                loop, name=f"job-{self.index}", emit_spans=False,
                thresholds=loop_monitor.LoopMonitorThresholds(warn=warn, error=max(warn, 0.5)))
            if monitor is not None:
                monitor._on_report = lambda report: self.probe.stalls.append(report.duration)
        try:
            loop.run_until_complete(self.main())
        except BaseException as exc:  # reported in the result
            self.error = repr(exc)
            self.ready.abort()

    async def main(self) -> None:
        from livekit import rtc

        room = source = None
        if self.room_name is not None:
            room = rtc.Room()
            await asyncio.to_thread(self.connect_lock.acquire)  # as bench/room_agent.py
            try:
                await room.connect(
                    self.spec["url"], token(f"{self.role}-{self.index}", self.room_name),
                    rtc.RoomOptions(auto_subscribe=self.role == "room"))
            finally:
                self.connect_lock.release()
        if self.role == "room":
            assert room is not None
            source = rtc.AudioSource(SAMPLE_RATE, 1, queue_size_ms=QUEUE_MS)
            track = rtc.LocalAudioTrack.create_audio_track("agent", source)
            await room.local_participant.publish_track(track, rtc.TrackPublishOptions(
                source=rtc.TrackSource.SOURCE_MICROPHONE))
        await asyncio.to_thread(self.ready.wait)
        await asyncio.to_thread(self.go.wait)
        start, end = self.window
        await asyncio.sleep(max(start - time.monotonic(), 0.0))
        cpu = time.thread_time()
        # an idle loop sleeps (a warm job thread: only livekit's monitor, if on, wakes it); a
        # reporter's loop runs the heartbeat too, unrecorded
        tasks = [asyncio.create_task(self.heartbeat(end) if self.role != "idle"
                                     else asyncio.sleep(max(end - time.monotonic(), 0.0)))]
        if source is not None:
            tasks.append(asyncio.create_task(self.capture(source, start, end)))
        if self.role == "reporter":
            tasks.append(asyncio.create_task(self.report(room, end)))
        await asyncio.gather(*tasks)
        self.cpu_s = time.thread_time() - cpu
        if room is not None:
            await room.disconnect()

    async def heartbeat(self, end: float) -> None:
        while True:
            due = time.monotonic() + HEARTBEAT_S
            await asyncio.sleep(HEARTBEAT_S)
            now = time.monotonic()
            if now > end:
                return
            self.lags.append(now - due)

    async def report(self, room: Any, end: float) -> None:
        period = 1.0 / self.spec["reports_hz"]
        body = json.dumps({"type": "playout", "trackSid": "TR_x" * 4, "at": 0.0,
                           **{f"counter{i}": 12345.678 for i in range(12)}})
        while time.monotonic() < end:
            await room.local_participant.publish_data(body, reliable=False,
                                                      topic="breezert.playout")
            await asyncio.sleep(period)

    async def capture(self, source: Any, start: float, end: float) -> None:
        from livekit import rtc

        frame_s = self.spec["frame_ms"] / 1000
        samples = int(SAMPLE_RATE * frame_s)
        tone = [int(3000 * math.sin(2 * math.pi * 220 * i / SAMPLE_RATE))
                for i in range(samples)]
        pcm = b"".join(v.to_bytes(2, "little", signed=True) for v in tone)
        frame = rtc.AudioFrame(pcm, SAMPLE_RATE, 1, samples)
        due = start
        while time.monotonic() < end:
            if self.spec["pace"] == "realtime":
                # each frame at its time; one more than a frame late is dropped (the schedule
                # moves on), so a capture never waits for room in the source's queue
                await asyncio.sleep(max(due - time.monotonic(), 0.0))
                while time.monotonic() - due > frame_s:
                    self.dropped += 1
                    due += frame_s
            begin = time.monotonic()
            self.capture_late.append(max(begin - due, 0.0))
            await source.capture_frame(frame)
            done = time.monotonic()
            self.captures.append(done - begin)
            if (split := self.probe.capture_split(begin, done)) is not None:
                self.capture_splits.append(split)
            due += frame_s


def thread_cpu() -> dict[int, tuple[str, float]]:
    """CPU seconds so far of each thread of this process, with its name (Linux; ``{}``
    elsewhere): Python's threads read ``python``, livekit's native ones their own names."""
    ticks = os.sysconf("SC_CLK_TCK")
    out: dict[int, tuple[str, float]] = {}
    for task in Path("/proc/self/task").glob("*"):
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        out[int(task.name)] = (name, (int(fields[11]) + int(fields[12])) / ticks)
    return out


def machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine so far (``/proc/stat``; zeros elsewhere)."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return 0.0, 0.0
    idle = fields[3] + fields[4]  # idle + iowait
    return float(sum(fields) - idle), float(sum(fields))


def cpu_by_name(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]],
                seconds: float) -> dict[str, float]:
    """CPU seconds per second between two ``thread_cpu`` readings, summed by thread name."""
    shares: dict[str, float] = {}
    for tid, (name, cpu) in after.items():
        shares[name] = shares.get(name, 0.0) + cpu - before.get(tid, (name, 0.0))[1]
    return {k: round(v / seconds, 3) for k, v in sorted(shares.items(), key=lambda kv: -kv[1])
            if v > 0}


def run_point(spec: dict[str, Any]) -> dict[str, Any]:
    """One process of a point (the child): sets up its loops (and the engine thread), prints
    ``READY``, measures the window from the ``GO <monotonic start>`` line on stdin and returns
    its raw samples (``merge`` summarises the processes of a point)."""
    sys.setswitchinterval(spec["switch_ms"] / 1000)
    import torch  # noqa: F401  (the agent's process holds it, engine or not)
    from livekit import agents, rtc  # noqa: F401

    from breezert.runtime_setup import freeze_startup_heap

    freeze_startup_heap()  # as AsyncEngine.shared does once the engine is built
    probe = FfiProbe(spec["fanout"])
    gc_passes: list[tuple[int, float]] = []  # (generation, seconds) in the window
    gc_started: list[float] = [0.0]

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            gc_started[0] = time.monotonic()
        elif probe.recording:
            gc_passes.append((info["generation"], time.monotonic() - gc_started[0]))

    gc.callbacks.append(on_gc)
    roles = ([("room", f"{spec['tag']}-r{i}") for i in range(spec["rooms"])]
             + [("idle", None)] * spec["idle"]
             + [("reporter", name) for name in spec.get("report_rooms", [])])
    connect_lock, go = threading.Lock(), threading.Event()
    ready = threading.Barrier(len(roles) + 1)
    window = [0.0, 0.0]
    threads = [LoopThread(spec, i, role, room, connect_lock, ready, go, window, probe)
               for i, (role, room) in enumerate(roles)]
    setup = time.monotonic()
    for thread in threads:
        thread.start()
    ready.wait(timeout=120)
    setup_s = time.monotonic() - setup
    stop, engine_stats = threading.Event(), {}
    engine = None
    if spec["duty"] > 0:
        engine = threading.Thread(target=engine_loop, args=(spec["duty"], stop, engine_stats),
                                  name="engine", daemon=True)
        engine.start()
    print("READY", flush=True)
    window[0] = float(sys.stdin.readline().split()[1])
    window[1] = window[0] + spec["seconds"]
    time.sleep(max(window[0] - time.monotonic() - 0.1, 0.0))
    probe.recording = True
    cpu0, threads0, machine0 = time.process_time(), thread_cpu(), machine_busy()
    go.set()
    time.sleep(max(window[1] - time.monotonic(), 0.0))
    probe.recording = False
    cpu_s, threads1, machine1 = time.process_time() - cpu0, thread_cpu(), machine_busy()
    for thread in threads:
        thread.join(timeout=30)
    stop.set()
    if engine is not None:
        engine.join(timeout=5)
    rooms = threads[:spec["rooms"]]
    idle = threads[spec["rooms"]:spec["rooms"] + spec["idle"]]
    ms = 1000.0

    def raw(values: Any) -> list[float]:
        return [round(v * ms, 3) for v in values]

    engine_wall = max(engine_stats.get("wall_s", 0.0), 1e-9)
    return {
        "setup_s": round(setup_s, 2), "process_cpu_s": cpu_s,
        "cpu_by_thread_name": cpu_by_name(threads0, threads1, 1.0),
        "machine": [machine1[0] - machine0[0], machine1[1] - machine0[1]],
        "threads_alive_end": sum(t.is_alive() for t in threads),
        "errors": [t.error for t in threads if t.error],
        "captures": sum(len(t.captures) for t in rooms), "rooms": len(rooms),
        "dropped": sum(t.dropped for t in rooms),
        "lag_max_per_room_ms": [round(max(t.lags, default=0.0) * ms, 1) for t in rooms],
        "loops_cpu_s": sum(t.cpu_s for t in rooms + idle), "put_cpu_s": probe.put_cpu_s,
        "engine_cpu_s": engine_stats.get("cpu_s", 0.0) / engine_wall * spec["seconds"],
        "engine_steps_per_s": engine_stats.get("steps", 0) / engine_wall,
        "engine_busy_share": engine_stats.get("busy_s", 0.0) / engine_wall,
        "raw": {
            "lag": raw(lag for t in rooms for lag in t.lags),
            "capture": raw(c for t in rooms for c in t.captures),
            "capture_late": raw(c for t in rooms for c in t.capture_late),
            **{f"split_{name}": raw(s[i] for t in rooms for s in t.capture_splits)
               for i, name in enumerate(("request", "to_put", "put_to_loop"))},
            # the FFI probe of a reporters' process times the listener side: left out
            **{k: [] if spec.get("report_rooms") else v for k, v in {
                "put": raw(p for p, _ in probe.puts),
                "put_subscribers": [n for _, n in probe.puts],
                "subscribe": raw(probe.subscribes), "wake": raw(probe.wakes)}.items()},
            "gc_full": raw(t for g, t in gc_passes if g == 2),
            "monitor_stalls": raw(probe.stalls),
        },
    }


def stats(values: list[float]) -> dict[str, Any]:
    out = summarize(values)
    return {k: (round(v, 2) if isinstance(v, float) else v) for k, v in out.items()}


def merge(spec: dict[str, Any], parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One point's summary from its processes' results (``run_point``)."""
    seconds = spec["seconds"]

    def cat(key: str) -> list[float]:
        return [v for part in parts for v in part["raw"][key]]

    lags, subscribers = cat("lag"), cat("put_subscribers")
    room_count = sum(part["rooms"] for part in parts)
    names: dict[str, float] = {}
    for part in parts:
        for name, cpu in part["cpu_by_thread_name"].items():
            names[name] = names.get(name, 0.0) + cpu
    busy, total = parts[0]["machine"]
    loops, puts, engine = (sum(part[k] for part in parts)
                           for k in ("loops_cpu_s", "put_cpu_s", "engine_cpu_s"))
    engines = [part for part in parts if part["engine_steps_per_s"]]
    return {
        **spec, "setup_s": max(part["setup_s"] for part in parts),
        "errors": [e for part in parts for e in part["errors"]],
        "threads_alive_end": sum(part["threads_alive_end"] for part in parts),
        "lag_ms": stats(lags),
        "lag_over_100ms": sum(lag >= STALL_S * 1000 for lag in lags),
        "lag_max_per_room_ms": [v for part in parts for v in part["lag_max_per_room_ms"]],
        "capture_ms": stats(cat("capture")),
        "capture_late_ms": stats(cat("capture_late")),
        # each capture_frame split: its FFI request (subscribe included); from the request's
        # return to the put of its callback (the native side, the callback thread's wait for
        # the GIL, the protobuf parse); from that put's start to the loop's return (the
        # fan-out to every subscriber under the lock, the loop's wake-up)
        "capture_split_ms": {name: stats(cat(f"split_{name}"))
                             for name in ("request", "to_put", "put_to_loop")},
        # audio each room got into its source per second of the window (< 1: the track
        # starved; its listener hears gaps); pace realtime: the frames dropped behind schedule
        "frames_dropped": sum(part["dropped"] for part in parts),
        "realtime_share": round(sum(part["captures"] for part in parts) * spec["frame_ms"]
                                / 1000 / max(room_count * seconds, 1e-9), 3),
        "ffi_put_ms": stats(cat("put")),
        "ffi_puts_per_s": round(len(subscribers) / seconds, 1),
        "ffi_put_subscribers_mean": round(sum(subscribers) / max(len(subscribers), 1), 1),
        "ffi_subscribe_wait_ms": stats(cat("subscribe")),
        "call_soon_threadsafe_ms": stats(cat("wake")),
        "gc_full_passes_ms": cat("gc_full"),
        # the blocks livekit's loop monitor logged (``--monitor``; rooms and idle loops; at
        # most 5 a minute per loop, its log limit)
        "monitor_stalls_ms": stats(cat("monitor_stalls")),
        # CPU seconds per second: of the Python threads (each holds the GIL while it runs
        # Python, torch ops aside): the loops, the FFI callbacks' puts, the engine thread; of
        # every thread of the point's processes by name; of the whole machine (the server too)
        "python_cpu_share": {"loops": round(loops / seconds, 3),
                             "ffi_put": round(puts / seconds, 3),
                             "engine": round(engine / seconds, 3),
                             "total": round((loops + puts + engine) / seconds, 3)},
        "process_cpu_share": round(sum(part["process_cpu_s"] for part in parts) / seconds, 3),
        "cpu_share_by_thread_name": {k: round(v / seconds, 3) for k, v in sorted(
            names.items(), key=lambda kv: -kv[1])},
        "machine_busy_cores": round(busy / max(total, 1.0) * (os.cpu_count() or 1), 2),
        "engine": {"steps_per_s": round(engines[0]["engine_steps_per_s"], 1) if engines
                   else None,
                   "busy_share": round(engines[0]["engine_busy_share"], 3) if engines
                   else None},
    }


# ----------------------------------------------------------------------------- parent: sweep


def child_specs(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """The processes of a point: ``processes`` share its rooms and idle loops evenly; with
    more than one, the engine thread runs in a process of its own (the engine served apart
    from the rooms), else beside them."""
    count = spec["processes"]
    parts = [{**spec, "tag": f"{spec['tag']}-{i}",
              "rooms": spec["rooms"] // count + (i < spec["rooms"] % count),
              "idle": spec["idle"] // count + (i < spec["idle"] % count),
              "duty": spec["duty"] if count == 1 else 0.0} for i in range(count)]
    if count > 1 and spec["duty"] > 0:
        parts.append({**spec, "tag": f"{spec['tag']}-engine", "rooms": 0, "idle": 0})
    if spec["reports_hz"] > 0:  # the listeners' side, in a process of its own
        parts.append({**spec, "tag": f"{spec['tag']}-reporters", "rooms": 0, "idle": 0,
                      "duty": 0.0, "report_rooms": [f"{part['tag']}-r{i}" for part in parts
                                                    for i in range(part["rooms"])]})
    return parts


def run_processes(spec: dict[str, Any], log_dir: Path) -> dict[str, Any]:
    """Runs one point in fresh processes (``child_specs``), all measuring the same window;
    its summary, or the error a process died with."""
    env = {**os.environ, "PYTHONPATH": pythonpath()}
    procs = []
    for part in child_specs(spec):
        log = log_dir / f"{part['tag']}.log"
        with open(log, "wb") as err:
            procs.append((subprocess.Popen(
                [*python_argv(), __file__, "--point", json.dumps(part)], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=err, env=env, text=True), log))
    try:
        for proc, log in procs:
            line = proc.stdout.readline() if proc.stdout else ""
            while line and not line.startswith("READY"):
                line = proc.stdout.readline() if proc.stdout else ""
            if not line:
                raise RuntimeError(log.read_text(errors="replace")[-1500:])
        start = time.monotonic() + 1.0  # the engine thread's first ops before the window
        for proc, _ in procs:
            assert proc.stdin is not None
            proc.stdin.write(f"GO {start}\n")
            proc.stdin.flush()
        parts = []
        for proc, log in procs:
            out, _ = proc.communicate(timeout=spec["seconds"] + 120)
            results = [line for line in out.splitlines() if line.startswith("RESULT ")]
            if not results:
                raise RuntimeError(f"rc {proc.returncode}: "
                                   + log.read_text(errors="replace")[-1500:])
            parts.append(json.loads(results[0][len("RESULT "):]))
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        return {**spec, "failed": str(exc)}
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return merge(spec, parts)


def floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v]


def ints(text: str) -> list[int]:
    return [int(v) for v in floats(text)]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--point", help=argparse.SUPPRESS)  # the child: one point's spec (JSON)
    p.add_argument("--server-bin", type=Path, default=default_server_bin())
    p.add_argument("--rooms", default="1,4,8,16", help="room loops per point (comma list)")
    p.add_argument("--idle", default="0", help="idle loops besides the rooms (comma list)")
    p.add_argument("--engine", default="0,1", help="engine duty cycles, 0 = none (comma list)")
    p.add_argument("--switch-ms", default="5,0.5,0.1", help="sys.setswitchinterval (ms)")
    p.add_argument("--frame-ms", default="50", help="capture frame length (ms, comma list)")
    p.add_argument("--monitor", default="0",
                   help="livekit's loop monitor on every room and idle loop: its warn threshold "
                        "in ms (100: livekit's default, a 20 ms tick; 250: a 50 ms tick; 0: "
                        "off); comma list")
    p.add_argument("--reports-hz", default="0",
                   help="data packets a second from a listener in every room (comma list; "
                        "variant listener: 10)")
    p.add_argument("--pace", default="realtime",
                   help="realtime (each frame at its time, late ones dropped) or ahead (back to "
                        "back: the source's queue stays full, as RoomIO's behind a fast TTS); "
                        "comma list")
    p.add_argument("--fanout", default="livekit",
                   help="livekit (FfiQueue.put as shipped) or per-loop (an experiment: one "
                        "call_soon_threadsafe per loop and event, outside the lock); comma list")
    p.add_argument("--processes", default="1",
                   help="processes sharing the rooms (comma list; > 1: the engine apart)")
    p.add_argument("--seconds", type=float, default=12.0, help="measured window per point")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--label", default="", help="a name for this sweep in the JSON")
    p.add_argument("--out", type=Path, help="JSON to write (merged into when it exists)")
    args = p.parse_args(argv)
    if args.point:
        result = run_point(json.loads(args.point))
        print("RESULT " + json.dumps(result), flush=True)
        os._exit(0)  # livekit's native threads may call into a finalizing interpreter

    from breezert_bench.provenance import provenance
    from breezert_bench.report import write_json

    axes = {"rooms": ints(args.rooms), "idle": ints(args.idle), "duty": floats(args.engine),
            "switch_ms": floats(args.switch_ms), "frame_ms": ints(args.frame_ms),
            "monitor": ints(args.monitor), "processes": ints(args.processes),
            "reports_hz": floats(args.reports_hz), "pace": args.pace.split(","),
            "fanout": args.fanout.split(","), "repeat": list(range(args.repeats))}
    doc: dict[str, Any] = {"points": []}
    if args.out and args.out.exists():
        doc = json.loads(args.out.read_text())
    sweep = {**provenance(device="cpu", script="bench/room_loop_lag.py", cores=os.cpu_count(),
                          argv=sys.argv[1:]), "label": args.label}
    doc.setdefault("sweeps", []).append(sweep)
    with tempfile.TemporaryDirectory(prefix="room-loop-lag-") as tmp, \
            livekit_server(args.server_bin, Path(tmp)) as (url, _):
        for n, values in enumerate(itertools.product(*axes.values())):
            spec = {"url": url, "tag": f"p{n}-{os.getpid()}", **dict(zip(axes, values)),
                    "seconds": args.seconds}
            result = run_processes(spec, Path(tmp))
            result.pop("url", None)
            result["sweep"] = len(doc["sweeps"]) - 1
            doc["points"].append(result)
            lag, cap, put = (result.get(k, {}) for k in ("lag_ms", "capture_ms", "ffi_put_ms"))
            print(f"K={spec['rooms']:2d} P={spec['processes']} idle={spec['idle']:2d} "
                  f"rep={spec['reports_hz']:g} duty={spec['duty']:.2f} "
                  f"switch={spec['switch_ms']:4}ms frame={spec['frame_ms']}ms "
                  f"mon={spec['monitor']} {spec['pace']} {spec['fanout']}  "
                  f"lag p50/p99/max "
                  f"{lag.get('p50')}/{lag.get('p99')}/{lag.get('max')}  capture p50/p99 "
                  f"{cap.get('p50')}/{cap.get('p99')}  rt {result.get('realtime_share')}  "
                  f"put p50/p99 {put.get('p50')}/{put.get('p99')} "
                  f"wake p50/p99 {result.get('call_soon_threadsafe_ms', {}).get('p50')}/"
                  f"{result.get('call_soon_threadsafe_ms', {}).get('p99')} "
                  f"(subs {result.get('ffi_put_subscribers_mean')})  "
                  f"py {result.get('python_cpu_share', {}).get('total')}  "
                  f"{result.get('failed', '')[:300]}", flush=True)
            if args.out:
                write_json(doc, args.out)


if __name__ == "__main__":
    main()
