"""The room benchmark's agent worker: ``breezert_agent.TTS`` on an in-process or a remote engine.

    LIVEKIT_URL=ws://127.0.0.1:7880 LIVEKIT_API_KEY=devkey LIVEKIT_API_SECRET=secret \
    BREEZERT_ROOM_CONFIG=configs/h200-latency.toml python bench/room_agent.py start

Registers as ``$BREEZERT_ROOM_AGENT_NAME`` (default ``breezert-bench``, explicit dispatch only).
Each job runs an ``AgentSession`` whose only voice is the plugin's ``TTS``, on THREAD executor
job threads of this process: with ``$BREEZERT_ROOM_ENGINE_URL`` unset, on the process's one
engine (``[local]`` mode, built here: ``bench/room_engine.py`` says from what environment);
with it set, on that ``bench/room_engine.py`` server (``TTS(base_url=...)``, as a deployment
with ``breezert serve`` apart runs). Wired for the feedback variant in the dispatch's metadata
(``{"variant": ...}``):

* ``listener``      the RoomIO source's queue plus the listener's ``breezert.playout`` reports
                    (``TTS.attach_audio_output`` + ``TTS.listen_room``)
* ``agent-queue``   the RoomIO source's queue only (``TTS.attach_audio_output``)
* ``none``          no playback reports: the Predictor's own model of the listener
* ``predictor-off`` no reports; meant for a worker whose engine has ``use_predictor = false``

The engine: ``$BREEZERT_ROOM_CONFIG``, ``$BREEZERT_ROOM_TOKENIZER``, ``$BREEZERT_ROOM_SET``
(``bench/room_engine.py``; remote, only its ``use_predictor`` is read, for the checks); the track's
publish options: ``$BREEZERT_ROOM_PUBLISH`` (``dtx=0,red=0``; default the SDK's); RoomIO's
source queue: ``$BREEZERT_ROOM_SOURCE_QUEUE_MS`` (default RoomIO's 200 ms). Before it reports
ready, the engine runs ``$BREEZERT_ROOM_WARM_WIDTH`` concurrent warm-up requests and the worker
keeps ``$BREEZERT_ROOM_IDLE`` job threads warm (``bench/room.py`` sets both to its largest N
over its number of workers).

How the worker reports its load to LiveKit's dispatcher, ``$BREEZERT_ROOM_DISPATCH``:

* ``none``   (default) load 0: the worker takes every room (one worker, the room benchmark)
* ``engine`` ``breezert_agent.engine_worker_options`` as shipped: ``engine_load`` as load_fnc,
             full at the engine's ``max_running_requests`` jobs (its warm job threads too)
* ``cpu``    LiveKit's default: no ``load_fnc`` (livekit-agents 1.8.9 then measures the
             machine's CPU, ``_DefaultLoadCalc``) and its default ``load_threshold`` (0.7)

With the engine apart (``$BREEZERT_ROOM_ENGINE_URL``) a worker takes at most
``$BREEZERT_ROOM_MAX_ROOMS`` jobs (a request past them is declined, and LiveKit's server offers
it to another worker: each holds few rooms, ``bench/room_engine.py`` says why), and the modes
are ``rooms`` (load 0: the server asks the workers in random order), ``engine`` (the remote
engine's load from its ``/readyz``, ``RemoteEngineLoad``) and ``cpu`` (as above).

Several workers may register under one agent name (``bench/room.py --workers``); each says who
it is in its stamps (its pid) and what it held when a job started (``jobs_held``, the jobs it
was running then, and ``max_jobs``, its engine's ``max_running_requests``, or
``$BREEZERT_ROOM_MAX_ROOMS`` with the engine apart).

Data messages, from the listener (``bench/room_listener.py``): ``bench.say`` ``{"id", "text",
"max_frames", "seed"}`` says ``text``; the agent answers ``bench.ready`` once the session runs and
``bench.turn`` after each turn, with its ``time.monotonic()`` stamps (same machine as the
listener): received, said, engine request opened, first engine audio, playback started (first
frame into RoomIO's ``AudioSource``), the source's queue then, done, plus the plugin's TTFB,
which feedback source the plugin reported, each piece of audio's arrival and length
(``audio_in``: whether the agent itself ran out of audio mid-turn), how late the job's event
loop ran during the turn (``loop_lag_max_s``), the collector's full passes in the worker's
process during the turn (``gc_full``: they hold the GIL, so every room of the process waits)
and the worker's pid.
``$BREEZERT_ROOM_STATE/engine_ready.json`` appears once the engine is built, or at once with
the engine remote (with ``max_jobs``); ``metrics.json`` there holds the jobs the worker runs and
the in-process engine's counters, rewritten every second. Must not: change the plugin's pacing
(it only reads and wraps public objects).
"""

from __future__ import annotations

import asyncio
import gc
import json
import math
import os
import threading
import time
import urllib.error
import urllib.request
from collections import Counter, deque
from pathlib import Path
from typing import Any

from livekit import rtc
from livekit.agents import (
    Agent,
    AgentSession,
    JobContext,
    JobExecutorType,
    JobProcess,
    JobRequest,
    WorkerOptions,
    cli,
    room_io,
)

from breezert_agent import TTS, engine_worker_options  # registers the plugin: main thread
from breezert_agent.client.remote import readiness_url
from breezert_agent.load import FULL_LOAD
from breezert_bench.report import write_json
from breezert.sched.load import EngineLoad
from room_engine import (
    engine_config,
    ready_record,
    set_torch_threads,
    warm_wide,
    write_metrics_forever,
)
from room_listener import LoopLag

AGENT_NAME = os.environ.get("BREEZERT_ROOM_AGENT_NAME", "breezert-bench")
DISPATCH = os.environ.get("BREEZERT_ROOM_DISPATCH", "none")
STATE = Path(os.environ.get("BREEZERT_ROOM_STATE", ".cache/room-bench-agent"))
VARIANTS = ("listener", "agent-queue", "none", "predictor-off")
SAMPLE_RATE = 24000

ENGINE_URL = os.environ.get("BREEZERT_ROOM_ENGINE_URL") or None
"""``bench/room_engine.py``'s server (``bench/room.py --engine server``), else ``None``: the
engine in this process."""
HEAP_FREEZE = os.environ.get("BREEZERT_ROOM_HEAP_FREEZE", "1") != "0"
"""``0``: the plugin's ``TTS.prewarm`` leaves this process's start-up heap to the collector (the
A/B of ``breezert_agent.tts.freeze_startup_heap``; the plugin freezes it, as shipped)."""
if not HEAP_FREEZE:
    import breezert_agent.tts

    breezert_agent.tts._heap_frozen = True  # as if frozen already: the plugin skips it
MAX_ROOMS = int(os.environ.get("BREEZERT_ROOM_MAX_ROOMS") or 0)
"""With the engine apart: the jobs this worker takes at most (``_take_within_cap``)."""

_prewarm_lock = threading.Lock()
_connect_lock = threading.Lock()
_engine: Any = None
_config: Any = None
_jobs_lock = threading.Lock()
_jobs = 0
"""The jobs this worker process runs now (entrypoint entered, shutdown not yet done)."""
_promised = 0
"""Jobs this worker accepted (with the engine apart) whose entrypoint has not begun yet."""


class FullCollections:
    """The process's passes of the cyclic collector over its oldest generation, as
    ``(start, end)`` ``time.monotonic()`` stamps (``gc.callbacks``; passes run one at a time,
    under the GIL, in whichever thread allocated)."""

    def __init__(self) -> None:
        self.passes: deque[tuple[float, float]] = deque(maxlen=10_000)
        self._start: float | None = None
        gc.callbacks.append(self._on_pass)

    def _on_pass(self, phase: str, info: dict[str, int]) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            self._start = time.monotonic()
        elif self._start is not None:
            self.passes.append((self._start, time.monotonic()))
            self._start = None

    def between(self, begin: float, end: float) -> dict[str, Any]:
        """The passes that overlap ``[begin, end]``: how many, their longest and total s."""
        spans = [b - a for a, b in list(self.passes) if b >= begin and a <= end]
        return {"count": len(spans), "longest_s": round(max(spans, default=0.0), 4),
                "total_s": round(sum(spans), 4)}


_full_collections = FullCollections()


def _snapshot() -> dict[str, Any]:
    counters = dict(_engine.engine.metrics.counters) if _engine is not None else {}
    return {"jobs": _jobs, "counters": counters}


def prewarm(proc: JobProcess) -> None:
    global _engine, _config
    with _prewarm_lock:  # THREAD executor: every idle job thread prewarms; one engine
        if _config is not None:
            return
        STATE.mkdir(parents=True, exist_ok=True)
        config = engine_config()
        started = time.monotonic()
        if ENGINE_URL is None:
            from breezert.async_engine import AsyncEngine

            set_torch_threads()
            _engine = AsyncEngine.shared(config)
            warm_wide(_engine, int(os.environ.get("BREEZERT_ROOM_WARM_WIDTH", "0")))
        # the parent waits for this before it dispatches rooms: a job whose thread starts
        # while the engine builds (CUDA graphs: a minute or more) starves its event loop
        extra = {"max_jobs": MAX_ROOMS} if ENGINE_URL is not None else {}
        write_json(ready_record(config, time.monotonic() - started, engine_url=ENGINE_URL,
                                **extra), STATE / "engine_ready.json")
        write_metrics_forever(STATE, _snapshot)
        _config = config


def publish_options(spec: str) -> rtc.TrackPublishOptions:
    """The agent track's publish options from ``$BREEZERT_ROOM_PUBLISH`` (``dtx=0,red=0``:
    booleans of ``rtc.TrackPublishOptions``; unset fields keep the SDK's defaults)."""
    options = rtc.TrackPublishOptions(source=rtc.TrackSource.SOURCE_MICROPHONE)
    for item in filter(None, (part.strip() for part in spec.split(","))):
        key, _, value = item.partition("=")
        if key not in ("dtx", "red") or value not in ("0", "1"):
            raise ValueError(f"BREEZERT_ROOM_PUBLISH item {item!r}: expected dtx|red=0|1")
        setattr(options, key, value == "1")
    return options


def size_room_sources(queue_ms: int) -> None:
    """Every ``rtc.AudioSource`` made in this process after this call buffers ``queue_ms`` (RoomIO
    makes its own with 200 ms, livekit-agents 1.8.9): the source-queue experiment of issue 34,
    from ``$BREEZERT_ROOM_SOURCE_QUEUE_MS``."""
    base = rtc.AudioSource

    class SizedAudioSource(base):  # type: ignore[misc, valid-type]
        def __init__(self, sample_rate: int, num_channels: int, queue_size_ms: int = 1000,
                     loop: Any = None) -> None:
            super().__init__(sample_rate, num_channels, queue_size_ms=queue_ms, loop=loop)

    rtc.AudioSource = SizedAudioSource  # type: ignore[misc]


def _room_source(output: Any) -> rtc.AudioSource | None:
    """The ``rtc.AudioSource`` behind RoomIO's audio output chain."""
    node = output
    while node is not None:
        source = getattr(node, "_audio_source", None)
        if isinstance(source, rtc.AudioSource):
            return source
        node = getattr(node, "next_in_chain", None)
    return None


MAX_AUDIO_IN = 128
"""Pieces of a turn's audio whose arrival the turn's ``bench.turn`` message lists (the engine's
chunks: ~9 a turn of the bench texts; the cap keeps the message small)."""


class _TurnStamps:
    """Wraps the TTS's runtime client so each turn records when its engine request opened,
    when its first audio came back and when each piece of its audio reached the agent, with
    its length (the plugin itself is untouched)."""

    def __init__(self, tts: TTS) -> None:
        from breezert_agent.client.base import SegmentStart

        self.opened: list[float] = []
        self.audio_in: list[list[tuple[float, float]]] = []
        """Per engine request opened (as ``opened``): (arrival, seconds) of each piece of its
        audio; the first is its first audio."""
        client = tts.client
        open_turn = client.open_turn
        bytes_per_s = 2 * client.sample_rate  # PCM16 mono

        async def opened(*args: Any, **kwargs: Any) -> Any:
            arrivals: list[tuple[float, float]] = []
            self.opened.append(time.monotonic())
            self.audio_in.append(arrivals)  # one a request opened, refused ones too
            turn = await open_turn(*args, **kwargs)
            audio = turn.audio

            async def stamped() -> Any:
                async for item in audio():
                    if not isinstance(item, SegmentStart) and len(arrivals) < MAX_AUDIO_IN:
                        arrivals.append((time.monotonic(), len(item) / bytes_per_s))
                    yield item

            turn.audio = stamped
            return turn

        client.open_turn = opened  # type: ignore[method-assign]


def _count_job(ctx: JobContext) -> int:
    """Counts this job among the worker's until it shuts down (no longer as promised, with the
    engine apart); returns how many it held before (the placement check of
    ``bench/room_scaleout.py``)."""
    global _jobs, _promised
    with _jobs_lock:
        held = _jobs
        _jobs += 1
        _promised = max(_promised - 1, 0)

    async def ended() -> None:
        global _jobs
        with _jobs_lock:
            _jobs -= 1

    ctx.add_shutdown_callback(ended)
    return held


async def entrypoint(ctx: JobContext) -> None:
    job_started = time.monotonic()
    variant = json.loads(ctx.job.metadata or "{}").get("variant", "none")
    if variant not in VARIANTS:
        raise ValueError(f"variant {variant!r}: expected one of {VARIANTS}")
    jobs_held = _count_job(ctx)
    # one connect at a time in this process: with the THREAD executor, two jobs connecting at
    # once left one waiting for its ReadyForRoomEventRequest until the FFI gave up (livekit
    # 1.1.21, "timed out waiting for ReadyForRoomEventRequest after ConnectCallback")
    await asyncio.to_thread(_connect_lock.acquire)
    try:
        await ctx.connect()
    finally:
        _connect_lock.release()
    if ENGINE_URL is not None:
        tts = TTS(base_url=ENGINE_URL, sample_rate=SAMPLE_RATE)
    else:
        tts = TTS(config=_config if _config is not None else engine_config(),
                  sample_rate=SAMPLE_RATE)
    ctx.add_shutdown_callback(tts.aclose)
    stamps = _TurnStamps(tts)
    loop_lag = LoopLag()  # this job's loop (a thread of its own): how late it ran in a turn
    lag_task = asyncio.create_task(loop_lag.run())

    async def stop_lag() -> None:
        lag_task.cancel()

    ctx.add_shutdown_callback(stop_lag)
    sources: Counter[str] = Counter()
    playout = tts.playout
    report = playout.report

    def counted(turn: Any, now: float) -> None:
        estimate = playout.estimate(now)
        if estimate is not None:
            sources[estimate[1]] += 1
        report(turn, now)

    playout.report = counted  # type: ignore[method-assign]
    ttfbs: list[float] = []
    tts.on("metrics_collected", lambda metrics: ttfbs.append(metrics.ttfb))
    # no VAD and manual turns: livekit-agents 1.8.9 otherwise runs its local silero VAD and
    # end-of-turn model in every session (the listener sends no audio; they would only cost CPU)
    session: AgentSession = AgentSession(tts=tts, vad=None,
                                         turn_handling={"turn_detection": "manual"})
    session.on("close", lambda _event: ctx.shutdown("session closed"))
    await session.start(
        agent=Agent(instructions="Speaks what the benchmark's listener asks."), room=ctx.room,
        room_options=room_io.RoomOptions(
            audio_input=False, text_input=False, close_on_disconnect=True,
            audio_output=room_io.AudioOutputOptions(
                sample_rate=SAMPLE_RATE,
                track_publish_options=publish_options(os.environ.get("BREEZERT_ROOM_PUBLISH", "")))))
    output = session.output.audio
    if variant in ("listener", "agent-queue"):
        tts.attach_audio_output(output)
    if variant == "listener":
        tts.listen_room(ctx.room)
    source = _room_source(output)
    started: list[tuple[float, float]] = []  # (monotonic, source queue s) per playback start
    offset = time.time() - time.monotonic()

    def on_playback_started(event: Any) -> None:
        queued = source.queued_duration if source is not None else float("nan")
        started.append((event.created_at - offset, queued))

    output.on("playback_started", on_playback_started)

    async def publish(topic: str, body: dict[str, Any], to: str) -> None:
        await ctx.room.local_participant.publish_data(
            json.dumps(body), reliable=True, topic=topic, destination_identities=[to])

    async def say(body: dict[str, Any], sender: str, received: float) -> None:
        tts.update_options(max_frames=int(body["max_frames"]), seed=int(body["seed"]))
        marks = (len(stamps.opened), len(started), len(ttfbs))
        reports_before = dict(sources)
        said = time.monotonic()
        handle = session.say(body["text"], allow_interruptions=False, add_to_chat_ctx=False)
        await handle
        done = time.monotonic()
        await asyncio.sleep(0.05)  # metrics_collected comes just after the handle's end

        def first(values: list[Any], mark: int) -> Any:
            return values[mark] if len(values) > mark else None

        playback = first(started, marks[1])
        # the turn's audio: its first request that brought any (a refused one brings none)
        arrivals = next((a for a in stamps.audio_in[marks[0]:] if a), [])
        await publish("bench.turn", {
            "id": body["id"], "received": received, "said": said,
            "opened": first(stamps.opened, marks[0]),
            "first_audio": arrivals[0][0] if arrivals else None,
            "playback_started": playback[0] if playback else None,
            "source_queued_s": playback[1] if playback else None,
            "ttfb": first(ttfbs, marks[2]), "done": done,
            "loop_lag_max_s": loop_lag.max_between(said, done),
            "gc_full": _full_collections.between(said, done),
            # each piece of audio as it reached the agent: seconds after the first, length
            "audio_in": [[round(t - arrivals[0][0], 4), round(length, 4)]
                         for t, length in arrivals],
            "interrupted": handle.interrupted,
            "reports": {k: v - reports_before.get(k, 0) for k, v in sources.items()},
            "pid": os.getpid(),
        }, sender)

    def on_data(packet: rtc.DataPacket) -> None:
        if packet.topic == "bench.say" and packet.participant is not None:
            received = time.monotonic()
            asyncio.create_task(say(json.loads(packet.data), packet.participant.identity,
                                    received))

    ctx.room.on("data_received", on_data)
    config = _config if _config is not None else engine_config()
    ready = {"variant": variant, "use_predictor": bool(config.scheduler.use_predictor),
             "attached": source is not None, "pid": os.getpid(), "dispatch": DISPATCH,
             "job_started": job_started, "jobs_held": jobs_held,
             "max_jobs": MAX_ROOMS if ENGINE_URL is not None
             else config.scheduler.max_running_requests,
             "publish": os.environ.get("BREEZERT_ROOM_PUBLISH", ""),
             "heap_freeze": HEAP_FREEZE,
             "source_queue_ms": int(os.environ.get("BREEZERT_ROOM_SOURCE_QUEUE_MS") or 200)}
    for participant in ctx.room.remote_participants.values():
        await publish("bench.ready", ready, participant.identity)
    ctx.room.on("participant_connected", lambda p: asyncio.create_task(
        publish("bench.ready", ready, p.identity)))


def _no_load() -> float:
    return 0.0


async def _take_within_cap(request: JobRequest) -> None:
    """With the engine apart: accepts while this worker's jobs (running and promised) are fewer
    than ``MAX_ROOMS``, else declines; LiveKit's server then offers the job to a worker it has
    not asked yet (livekit-server 1.13 ``AgentHandler.JobRequest``). ``terminate=False``: a
    terminating refusal would end the job as done."""
    global _promised
    with _jobs_lock:
        take = _jobs + _promised < MAX_ROOMS
        _promised += int(take)
    if not take:
        await request.reject(terminate=False)
        return
    try:
        await request.accept()
    except BaseException:  # never assigned or launched: the promise is void
        with _jobs_lock:
            _promised = max(_promised - 1, 0)
        raise


class RemoteEngineLoad:
    """Dispatch ``engine`` with the engine apart: the load of the ``bench/room_engine.py``
    server this worker's rooms use, read from its ``/readyz`` every ``period_s`` on a daemon
    thread (the ``load.fraction`` it reports, 1 while it is not ready) and handed to LiveKit as
    ``FULL_LOAD`` times it, as ``breezert_agent.engine_load`` does for an engine in process."""

    def __init__(self, base_url: str, period_s: float = 0.25) -> None:
        self.url, self.period_s = readiness_url(base_url), period_s
        self.fraction = 1.0  # until the first answer: not a place to send rooms

    def start(self) -> RemoteEngineLoad:
        threading.Thread(target=self._poll, name="engine-load", daemon=True).start()
        return self

    def read(self) -> float:
        """The engine's load fraction now (0 idle .. 1 full), 1 when it cannot be read."""
        try:
            try:
                with urllib.request.urlopen(self.url, timeout=2.0) as response:
                    raw = response.read()
            except urllib.error.HTTPError as exc:  # 503: full, warming up or draining
                raw = exc.read()
            body = json.loads(raw or b"{}")
        except (OSError, ValueError):
            return 1.0
        load = EngineLoad.from_json(body.get("load") if isinstance(body, dict) else None)
        return 1.0 if load is None else load.fraction

    def _poll(self) -> None:
        while True:
            self.fraction = min(max(self.read(), 0.0), 1.0)
            time.sleep(self.period_s)

    def load(self) -> float:
        return FULL_LOAD * self.fraction


def load_options() -> dict[str, Any]:
    """The ``WorkerOptions`` fields of ``$BREEZERT_ROOM_DISPATCH`` (see the module doc); every
    mode runs jobs on threads of this process (where its one engine is, when in process)."""
    threads = {"job_executor_type": JobExecutorType.THREAD,
               # a job thread ready for every room of a run (livekit's default keeps
               # min(cores, 4) warm and starts the rest as rooms arrive: on the H200, 4 Dec,
               # the first run of 16 rooms never got ready)
               "num_idle_processes": int(os.environ.get("BREEZERT_ROOM_IDLE", "4"))}
    if ENGINE_URL is not None:
        return {**threads, **remote_load_options()}
    if DISPATCH == "none":
        # the worker must take every room: livekit's CPU-load gate would refuse jobs on a
        # busy box, and one process shares one engine (THREAD executor)
        return {**threads, "load_fnc": _no_load}
    if DISPATCH == "cpu":
        return threads  # load_fnc and load_threshold: LiveKit's defaults
    if DISPATCH == "engine":
        return engine_worker_options(engine_config())
    raise ValueError(f"BREEZERT_ROOM_DISPATCH={DISPATCH!r}: expected none, engine or cpu "
                     "(rooms: with BREEZERT_ROOM_ENGINE_URL)")


def remote_load_options() -> dict[str, Any]:
    """With the engine apart: at most ``MAX_ROOMS`` jobs (``_take_within_cap``), and the load
    LiveKit weighs workers by: ``rooms`` none (0, no threshold of livekit's own: the server asks
    the workers in random order), ``engine`` the remote engine's (``RemoteEngineLoad``, full at
    ``FULL_LOAD``), ``cpu`` LiveKit's default (the machine's CPU, threshold 0.7)."""
    if MAX_ROOMS < 1:
        raise ValueError("BREEZERT_ROOM_ENGINE_URL needs BREEZERT_ROOM_MAX_ROOMS >= 1")
    capped = {"num_idle_processes": MAX_ROOMS, "request_fnc": _take_within_cap}
    if DISPATCH == "rooms":
        return {**capped, "load_fnc": _no_load, "load_threshold": math.inf}
    if DISPATCH == "engine":
        assert ENGINE_URL is not None
        return {**capped, "load_fnc": RemoteEngineLoad(ENGINE_URL).start().load,
                "load_threshold": FULL_LOAD}
    if DISPATCH == "cpu":
        return capped
    raise ValueError(f"BREEZERT_ROOM_DISPATCH={DISPATCH!r} with the engine apart: expected "
                     "rooms, engine or cpu")


if __name__ == "__main__":
    if os.environ.get("BREEZERT_ROOM_SOURCE_QUEUE_MS"):
        size_room_sources(int(os.environ["BREEZERT_ROOM_SOURCE_QUEUE_MS"]))
    cli.run_app(WorkerOptions(
        entrypoint_fnc=entrypoint, prewarm_fnc=prewarm, agent_name=AGENT_NAME,
        port=int(os.environ.get("BREEZERT_ROOM_WORKER_PORT", "0")),
        initialize_process_timeout=float(os.environ.get("BREEZERT_ROOM_INIT_TIMEOUT_S", "600")),
        **load_options()))
