"""The agent worker of the real-room tests: a ``livekit.agents`` worker that speaks on command.

    LIVEKIT_URL=ws://127.0.0.1:7880 LIVEKIT_API_KEY=devkey LIVEKIT_API_SECRET=secret \
    BREEZERT_TEST_STATE=/tmp/state python tests/livekit/room_worker.py start

Registers as agent ``breezert-test`` (explicit dispatch only); each dispatched job joins its room,
runs an ``AgentSession`` with no LLM, STT or VAD whose only voice is ``breezert_agent.TTS`` (the
embedded tiny CPU engine, loaded once in ``prewarm``; THREAD executor, so every job shares it),
and obeys data messages from any participant:

* ``test.say``       ``{"id": "...", "text": "..."}``  ``session.say(text)``
* ``test.interrupt`` ``{}``                              ``session.interrupt()``

What the tests read back goes to files under ``$BREEZERT_TEST_STATE`` (same machine, so the
``time.monotonic()`` stamps in them compare with the test's own): ``events.jsonl`` (one JSON
object a line: ready, said, tts metrics, playout reports, interrupted, done) and ``metrics.json``
(the shared engine's counters, its step time split by ``StepClock`` and each room's
``PlayoutFeedback`` state, rewritten every 50 ms).
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from livekit import rtc
from livekit.agents import (
    Agent,
    AgentSession,
    JobContext,
    JobExecutorType,
    JobProcess,
    WorkerOptions,
    cli,
    room_io,
)

from breezert_agent import TTS  # registers the plugin: import it on the main thread

AGENT_NAME = "breezert-test"
STATE = Path(os.environ.get("BREEZERT_TEST_STATE", ".cache/livekit-state"))
MAX_FRAMES = int(os.environ.get("BREEZERT_TEST_MAX_FRAMES", "25"))  # 80 ms each: 2 s a sentence



def engine_config() -> Any:
    """The embedded cpu-tiny profile with the Predictor on, so the listener's reports steer it
    (``BREEZERT_TEST_PREDICTOR=0``: the profile as shipped)."""
    from breezert.profiles import resolve_config

    config = resolve_config(None)
    if os.environ.get("BREEZERT_TEST_PREDICTOR", "1") == "0":
        return config
    scheduler = config.scheduler.model_copy(update={"use_predictor": True})
    return config.model_copy(update={"scheduler": scheduler})


_lock = threading.Lock()
_rooms: dict[str, dict[str, Any]] = {}  # room name -> playout state, for metrics.json
_engine: Any = None
_clock: StepClock | None = None  # the shared engine's (set once, in the first prewarm)


def emit(room: str, kind: str, **fields: Any) -> None:
    line = json.dumps({"t": time.monotonic(), "room": room, "type": kind, **fields})
    with _lock, open(STATE / "events.jsonl", "a", encoding="utf-8") as out:
        out.write(line + "\n")


def _engine_counters() -> dict[str, Any] | None:
    """The engine's counters and active requests: a dict copy, no quantiles (a full
    ``AsyncEngine.metrics()`` costs ~5 ms of the GIL, which the engine thread needs)."""
    if _engine is None:
        return None
    metrics = _engine.engine.metrics
    counters = dict(metrics.counters)
    return {"counters": counters,
            "active_requests": counters.get("requests_added", 0) - metrics.num_finished}


class StepClock:
    """Where the engine thread's time goes while it steps: its own CPU time, waiting for a core
    (the kernel's runqueue delay, ``/proc/thread-self/schedstat``) and the rest, waiting for
    the GIL, which this process's agent event loops hold at times. Wraps ``Engine.step`` of the
    shared engine (only steps that ran count); read on the engine thread, a few microseconds."""

    def __init__(self, engine: Any) -> None:
        self.steps, self.wall_s, self.cpu_s, self.runqueue_s = 0, 0.0, 0.0, 0.0
        self._engine, self._step = engine, engine.step
        engine.step = self._timed

    def _timed(self) -> Any:
        wall, cpu, queued = time.perf_counter(), time.thread_time(), _runqueue_s()
        outputs = self._step()
        if self._engine.last_step_ran:
            self.steps += 1
            self.wall_s += time.perf_counter() - wall
            self.cpu_s += time.thread_time() - cpu
            self.runqueue_s += _runqueue_s() - queued
        return outputs

    def snapshot(self) -> dict[str, float]:
        return {"steps": self.steps, "wall_s": self.wall_s, "cpu_s": self.cpu_s,
                "runqueue_s": self.runqueue_s}


def _runqueue_s() -> float:
    """This thread's time spent runnable but not running, seconds (Linux schedstat)."""
    with open("/proc/thread-self/schedstat", encoding="ascii") as stat:
        return int(stat.read().split()[1]) / 1e9


def _write_metrics() -> None:
    snapshot = {"t": time.monotonic(), "engine": _engine_counters(), "rooms": dict(_rooms),
                "engine_time": _clock.snapshot() if _clock else None}
    tmp = STATE / "metrics.json.tmp"
    tmp.write_text(json.dumps(snapshot, default=str))
    tmp.replace(STATE / "metrics.json")


def _metrics_writer() -> None:
    while True:
        try:
            _write_metrics()
        except Exception:  # a snapshot taken mid-update: the next one is 50 ms away
            pass
        time.sleep(0.05)


def prewarm(proc: JobProcess) -> None:
    global _engine, _clock
    import torch
    from breezert.async_engine import AsyncEngine

    torch.set_num_threads(1)  # a tiny CPU model gains nothing from intra-op threads (as bench)

    STATE.mkdir(parents=True, exist_ok=True)
    engine = proc.userdata["breezert_engine"] = AsyncEngine.shared(engine_config())
    with _lock:  # prewarm runs once per idle executor (two or more): one writer for them all
        is_first, _engine = _engine is None, engine
        if is_first:
            _clock = StepClock(engine.engine)
    if is_first:
        threading.Thread(target=_metrics_writer, name="metrics-writer", daemon=True).start()


class _Recorder:
    """Wraps ``Turn.report_playback`` calls through the plugin's PlayoutFeedback.report."""

    def __init__(self, room: str, tts: TTS) -> None:
        self.room, self.tts = room, tts
        playout = tts.playout
        real = playout.report

        def report(turn: Any, now: float) -> None:
            estimate = playout.estimate(now)
            if estimate is not None:
                listeners = {k: s.delay_s for k, s in playout.listeners.items()}
                emit(room, "report", buffered_s=estimate[0], source=estimate[1],
                     measured_at=now, listeners=listeners)
            real(turn, now)

        playout.report = report  # type: ignore[method-assign]

    def state(self) -> dict[str, Any]:
        playout = self.tts.playout
        return {"num_packets": playout.num_packets, "num_bad_packets": playout.num_bad_packets,
                "num_concealed_samples": playout.num_concealed_samples,
                "listeners": {k: s.delay_s for k, s in playout.listeners.items()}}


async def entrypoint(ctx: JobContext) -> None:
    await ctx.connect()
    name = ctx.room.name
    tts = TTS(config=engine_config(), max_frames=MAX_FRAMES)
    ctx.add_shutdown_callback(tts.aclose)
    recorder = _Recorder(name, tts)
    session: AgentSession = AgentSession(tts=tts)
    says: list[str] = []

    def on_tts_metrics(metrics: Any) -> None:
        emit(name, "tts_metrics", id=says[-1] if says else None, ttfb=metrics.ttfb,
             audio_duration=metrics.audio_duration, request_id=metrics.request_id)

    tts.on("metrics_collected", on_tts_metrics)
    def on_close(_event: Any) -> None:
        emit(name, "session_closed")
        ctx.shutdown("session closed")  # leave the room now, not when the server empties it

    session.on("close", on_close)

    async def say(message_id: str, text: str) -> None:
        says.append(message_id)
        handle = session.say(text)
        emit(name, "said", id=message_id)
        await handle
        emit(name, "done", id=message_id, interrupted=handle.interrupted)

    def on_data(packet: rtc.DataPacket) -> None:
        if packet.topic == "test.say":
            body = json.loads(packet.data)
            emit(name, "say_received", id=body["id"])
            asyncio.create_task(say(body["id"], body["text"]))
        elif packet.topic == "test.interrupt":
            emit(name, "interrupt")
            session.interrupt()

    ctx.room.on("data_received", on_data)
    await session.start(
        agent=Agent(instructions="Speaks only what the test says."), room=ctx.room,
        room_options=room_io.RoomOptions(audio_input=False, text_input=False,
                                         close_on_disconnect=True),
    )
    attached = tts.attach_audio_output(session.output.audio)
    tts.listen_room(ctx.room)

    def publish_state() -> None:
        _rooms[name] = recorder.state()

    async def state_loop() -> None:
        while True:
            publish_state()
            await asyncio.sleep(0.05)

    state_task = asyncio.create_task(state_loop())
    ctx.add_shutdown_callback(lambda: _stop(state_task, name))
    emit(name, "ready", attached=attached)


async def _stop(task: asyncio.Task[None], name: str) -> None:
    task.cancel()
    emit(name, "shutdown")


def _no_load() -> float:
    return 0.0


if __name__ == "__main__":
    cli.run_app(
        WorkerOptions(
            entrypoint_fnc=entrypoint,
            prewarm_fnc=prewarm,
            job_executor_type=JobExecutorType.THREAD,
            agent_name=AGENT_NAME,
            port=int(os.environ.get("BREEZERT_TEST_WORKER_PORT", "0")),
            initialize_process_timeout=120.0,
            # the CPU-load gate would mark the worker full on two shared cores and refuse jobs
            load_fnc=_no_load,
        )
    )
