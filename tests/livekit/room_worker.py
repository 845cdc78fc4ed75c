"""The agent worker of the real-room tests: a ``livekit.agents`` worker that speaks on command.

    LIVEKIT_URL=ws://127.0.0.1:7880 LIVEKIT_API_KEY=devkey LIVEKIT_API_SECRET=secret \
    BREEZERT_TEST_STATE=/tmp/state python tests/livekit/room_worker.py start

Registers as agent ``breezert-test`` (explicit dispatch only); each dispatched job joins its room,
runs an ``AgentSession`` with no LLM, STT or VAD whose only voice is ``breezert_agent.TTS`` (the
embedded tiny CPU engine, loaded once in ``prewarm``; THREAD executor, so every job shares it),
and obeys data messages from any participant:

* ``test.say``       ``{"id": "...", "text": "..."}``  ``session.say(text)``
* ``test.interrupt`` ``{}``                              ``session.interrupt()``
* ``test.saturate``  ``{"n": 4}``                        hold ``n`` open requests on the engine
* ``test.release``   ``{}``                              abort them

Dispatch tests (``test_dispatch.py``) set, besides: ``BREEZERT_TEST_AGENT_NAME``,
``BREEZERT_TEST_LOAD=engine`` (``breezert_agent.engine_worker_options``: the engine's load as
``load_fnc``, instead of none), ``BREEZERT_TEST_MAX_RUNNING`` / ``BREEZERT_TEST_MAX_QUEUED``
(the engine's limits), ``BREEZERT_TEST_BASE_URLS`` (comma-separated ``breezert serve``
replicas: remote turns, no engine in the worker) and ``BREEZERT_TEST_SEED`` (every turn's
sampling seed).

With ``BREEZERT_TEST_GREETING`` set, it also greets each participant once, as a phone agent
greets a caller: a SIP participant once its call is answered (attribute ``sip.callStatus`` =
``active``: LiveKit SIP answers only after it subscribed to the agent's track), any other on
joining. It says the participant's ``breezert.greeting`` attribute (which a SIP dispatch rule
sets), else the variable's text; the turn's id is ``greet-<identity>``. Such a job first waits
for its caller, whose ``breezert.sample_rate`` attribute (else ``BREEZERT_TEST_SAMPLE_RATE``,
else 24000) is the rate of the plugin's audio and of the RoomIO track (``TTS(sample_rate=)``).

What the tests read back goes to files under ``$BREEZERT_TEST_STATE`` (same machine, so the
``time.monotonic()`` stamps in them compare with the test's own): ``events.jsonl`` (one JSON
object a line: ready, said, playback started, tts metrics, playout reports, interrupted, done)
and ``metrics.json`` (the shared engine's counters, its step time split by ``StepClock``, its
scheduler switches and each room's ``PlayoutFeedback`` state, rewritten every 50 ms).
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

from breezert_agent import TTS, engine_worker_options  # registers the plugin: main thread

AGENT_NAME = os.environ.get("BREEZERT_TEST_AGENT_NAME", "breezert-test")
STATE = Path(os.environ.get("BREEZERT_TEST_STATE", ".cache/livekit-state"))
MAX_FRAMES = int(os.environ.get("BREEZERT_TEST_MAX_FRAMES", "25"))  # 80 ms each: 2 s a sentence
BASE_URLS = [url for url in os.environ.get("BREEZERT_TEST_BASE_URLS", "").split(",") if url]
GREETING = os.environ.get("BREEZERT_TEST_GREETING", "")
SIP_CALL_STATUS = "sip.callStatus"  # livekit.AttrSIPCallStatus of the protocol
GREETING_ATTRIBUTE = "breezert.greeting"
SAMPLE_RATE_ATTRIBUTE = "breezert.sample_rate"
SAMPLE_RATE = int(os.environ.get("BREEZERT_TEST_SAMPLE_RATE", "24000"))
# Every turn's sampling seed (unset: random per turn). The random model ends about 1 % of
# 12-frame segments early (EOS: 3 of 300 measured); a seeded turn ends where it did before.
SEED = int(os.environ["BREEZERT_TEST_SEED"]) if os.environ.get("BREEZERT_TEST_SEED") else None


def engine_config() -> Any:
    """The embedded cpu-tiny profile as shipped: the Predictor on, so the listener's reports
    steer it, with ``predictor_first_chunk_cover`` (``BREEZERT_TEST_PREDICTOR=0``: without the
    Predictor; ``BREEZERT_TEST_FIRST_CHUNK_COVER=0``: the Predictor without the cover).

    The cover is in the profile because CI's two-core boxes run this engine at 0.6-0.9 of real
    time (step time over audio), where a one-frame first chunk runs out before the next chunk is
    made: the holes heard there sat right after it, and runs with the cover heard none there
    (bench/README.md, "the first chunk sized to cover the next"). It follows the measured step
    times, so on a box where a frame and a CODEC step take under 30 ms the first chunk stays one
    frame; on two quiet Xeon cores it took two frames and 37 ms of TTFB at the median
    (``bench/results/livekit-room-cpu-tiny-20261202-*``)."""
    from breezert.profiles import resolve_config

    config = resolve_config(None)
    update: dict[str, Any] = {}
    if os.environ.get("BREEZERT_TEST_PREDICTOR") == "0":
        update["use_predictor"] = update["predictor_first_chunk_cover"] = False
    elif os.environ.get("BREEZERT_TEST_FIRST_CHUNK_COVER") == "0":
        update["predictor_first_chunk_cover"] = False
    for name, variable in (("max_running_requests", "BREEZERT_TEST_MAX_RUNNING"),
                           ("max_queued_requests", "BREEZERT_TEST_MAX_QUEUED")):
        if os.environ.get(variable):
            update[name] = int(os.environ[variable])
    if not update:
        return config
    return config.model_copy(update={"scheduler": config.scheduler.model_copy(update=update)})


_lock = threading.Lock()
_prewarm_lock = threading.Lock()
_rooms: dict[str, dict[str, Any]] = {}  # room name -> playout state, for metrics.json
_engine: Any = None
_clock: StepClock | None = None  # the shared engine's (set once, in the first prewarm)
_switches: dict[str, bool] = {}  # its scheduler switches, for metrics.json (set with it)
SWITCHES = ("use_predictor", "predictor_first_chunk_cover")
_writer: threading.Thread | None = None


def emit(room: str, kind: str, **fields: Any) -> None:
    line = json.dumps({"t": time.monotonic(), "room": room, "type": kind, **fields})
    with _lock, open(STATE / "events.jsonl", "a", encoding="utf-8") as out:
        out.write(line + "\n")


_FULL_SNAPSHOT_S = 1.0  # between full engine snapshots in metrics.json
_full: dict[str, Any] = {}  # the last full AsyncEngine.metrics(), and when it was taken
_full_time = 0.0


def _engine_counters(now: float) -> dict[str, Any] | None:
    """The engine's counters and active requests (a dict copy) on every write, over its full
    ``AsyncEngine.metrics()`` taken once a second (rtf, ttfb_s for bench/sip_first_audio.py):
    the full one costs ~5 ms of the GIL, which the engine thread needs, and 20 a second from
    three writers took ~30 % of it (2.0 s turns heard as 2.1-4.5 s)."""
    global _full, _full_time
    if _engine is None:
        return None
    if now - _full_time >= _FULL_SNAPSHOT_S:
        _full, _full_time = _engine.metrics(), now
    metrics = _engine.engine.metrics
    counters = dict(metrics.counters)
    return {**_full, "counters": counters,
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
    now = time.monotonic()
    snapshot = {"t": now, "engine": _engine_counters(now), "rooms": dict(_rooms),
                "engine_time": _clock.snapshot() if _clock else None, "scheduler": _switches}
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
    STATE.mkdir(parents=True, exist_ok=True)
    if BASE_URLS:  # remote turns: no engine here
        return
    import torch
    from breezert.async_engine import AsyncEngine

    torch.set_num_threads(1)  # a tiny CPU model gains nothing from intra-op threads (as bench)

    with _prewarm_lock:  # THREAD executor: every idle job thread prewarms; one engine
        if _engine is None:
            _engine = proc.userdata["breezert_engine"] = AsyncEngine.shared(engine_config())
            _clock = StepClock(_engine.engine)
            scheduler = _engine.engine.config.scheduler
            _switches.update({name: getattr(scheduler, name) for name in SWITCHES})
        else:
            proc.userdata["breezert_engine"] = _engine
    _start_metrics_writer()


def _start_metrics_writer() -> None:
    """One writer for the process. With the THREAD executor ``prewarm`` runs for every job
    runner the worker starts (one per job, plus the idle ones), and a writer each made the
    idle worker's CPU grow by ~10 % of a core per finished call (all rewriting one file)."""
    global _writer
    with _lock:
        if _writer is None:
            _writer = threading.Thread(target=_metrics_writer, name="metrics-writer",
                                       daemon=True)
            _writer.start()


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
    emit(ctx.job.room.name, "job", pid=os.getpid())  # dispatch latency: from the test's call
    await ctx.connect()
    name = ctx.room.name
    rate = SAMPLE_RATE
    if GREETING:  # a call: its dispatch rule may choose the plugin's rate
        caller = await ctx.wait_for_participant()
        rate = int(caller.attributes.get(SAMPLE_RATE_ATTRIBUTE, rate))
    if BASE_URLS:
        tts = TTS(base_url=BASE_URLS, max_frames=MAX_FRAMES, sample_rate=rate, seed=SEED)
        _record_replicas(name, tts)
    else:
        tts = TTS(config=engine_config(), max_frames=MAX_FRAMES, sample_rate=rate, seed=SEED)
    ctx.add_shutdown_callback(tts.aclose)
    tts.on("error", lambda event: emit(name, "tts_error", message=str(event.error),
                                       recoverable=event.recoverable))
    recorder = _Recorder(name, tts)
    session: AgentSession = AgentSession(tts=tts)
    says: list[str] = []
    held: list[str] = []  # test.saturate's requests

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

    async def saturate(n: int) -> None:
        held.extend(await _hold(name, n))
        emit(name, "saturated", held=len(held), load=_engine.load().fraction)

    def on_data(packet: rtc.DataPacket) -> None:
        if packet.topic == "test.say":
            body = json.loads(packet.data)
            emit(name, "say_received", id=body["id"])
            asyncio.create_task(say(body["id"], body["text"]))
        elif packet.topic == "test.interrupt":
            emit(name, "interrupt")
            session.interrupt()
        elif packet.topic == "test.saturate":
            asyncio.create_task(saturate(json.loads(packet.data)["n"]))
        elif packet.topic == "test.release":
            for request_id in held:
                _engine.abort(request_id)
            held.clear()
            emit(name, "released", load=_engine.load().fraction)

    ctx.room.on("data_received", on_data)
    await session.start(
        agent=Agent(instructions="Speaks only what the test says."), room=ctx.room,
        room_options=room_io.RoomOptions(
            audio_input=False, text_input=False, close_on_disconnect=True,
            audio_output=room_io.AudioOutputOptions(sample_rate=rate)),
    )
    attached = tts.attach_audio_output(session.output.audio)
    tts.listen_room(ctx.room)

    def on_playback_started(event: Any) -> None:  # a turn's first frame into rtc.AudioSource
        emit(name, "playback_started", id=says[-1] if says else None,
             at=event.created_at - (time.time() - time.monotonic()))  # time.time() -> monotonic

    session.output.audio.on("playback_started", on_playback_started)

    def publish_state() -> None:
        _rooms[name] = recorder.state()

    async def state_loop() -> None:
        while True:
            publish_state()
            await asyncio.sleep(0.05)

    state_task = asyncio.create_task(state_loop())
    ctx.add_shutdown_callback(lambda: _stop(state_task, name))
    emit(name, "ready", attached=attached, sample_rate=rate)
    if GREETING:
        _greet_on_answer(ctx.room, name, say)


def _greet_on_answer(room: rtc.Room, name: str, say: Any) -> None:
    """Says ``GREETING`` once to each participant as it answers (see the module docstring)."""
    greeted: set[str] = set()

    def maybe_greet(participant: rtc.Participant) -> None:
        # attribute changes come for the agent itself too (lk.agent.state): never greet it
        if not isinstance(participant, rtc.RemoteParticipant) or participant.identity in greeted:
            return
        is_sip = participant.kind == rtc.ParticipantKind.PARTICIPANT_KIND_SIP
        if is_sip and participant.attributes.get(SIP_CALL_STATUS) != "active":
            return
        greeted.add(participant.identity)
        text = participant.attributes.get(GREETING_ATTRIBUTE) or GREETING
        emit(name, "greet", identity=participant.identity, sip=is_sip)
        asyncio.create_task(say(f"greet-{participant.identity}", text))

    room.on("participant_connected", maybe_greet)
    room.on("participant_attributes_changed", lambda _changed, who: maybe_greet(who))
    for participant in list(room.remote_participants.values()):
        maybe_greet(participant)


async def _stop(task: asyncio.Task[None], name: str) -> None:
    task.cancel()
    emit(name, "shutdown")


async def _hold(room: str, n: int) -> list[str]:
    """``n`` open requests on the engine that said one frame: each holds a running slot and
    costs no steps after that (what open turns waiting for their next text do)."""
    from breezert.request import SynthesisRequest

    return [(await _engine.submit(SynthesisRequest(
        text=["Hold."], max_frames=1, input_closed=False,
        request_id=f"hold-{room}-{i}-{time.monotonic_ns()}"))).request_id for i in range(n)]


def _record_replicas(room: str, tts: TTS) -> None:
    """Remote turns: which replica served each turn (``replica`` events)."""
    client = tts.client
    open_turn = client.open_turn

    async def recorded(*args: Any, **kwargs: Any) -> Any:
        turn = await open_turn(*args, **kwargs)
        emit(room, "replica", request_id=turn.request_id, url=turn.base_url)
        return turn

    client.open_turn = recorded  # type: ignore[method-assign]


def _no_load() -> float:
    return 0.0


def _load_options() -> dict[str, Any]:
    if os.environ.get("BREEZERT_TEST_LOAD") == "engine":
        return engine_worker_options(engine_config())
    # the CPU-load gate would mark the worker full on two shared cores and refuse jobs
    return {"load_fnc": _no_load, "job_executor_type": JobExecutorType.THREAD}


if __name__ == "__main__":
    cli.run_app(
        WorkerOptions(
            entrypoint_fnc=entrypoint,
            prewarm_fnc=prewarm,
            agent_name=AGENT_NAME,
            port=int(os.environ.get("BREEZERT_TEST_WORKER_PORT", "0")),
            initialize_process_timeout=120.0,
            **_load_options(),
        )
    )
