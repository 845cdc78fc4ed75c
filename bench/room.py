"""The room benchmark (issue 34): real LiveKit calls against the in-process engine.

    python bench/room.py --server-bin .cache/livekit/livekit-server --listeners 4 --turns 3 \
        --variants listener,agent-queue,none,predictor-off --out bench/results/room-cpu.json

Starts ``livekit-server --dev`` on loopback, one agent worker process (``bench/room_agent.py``:
the plugin's ``[local]`` mode, one engine for every room) per engine setting, and N listener
participants (``bench/room_listener.py``), one room each, in processes of
``--rooms-per-process`` rooms. Every listener plays the agent's track on its own real-time
clock, reads its receiver's stats every 100 ms and, in variant ``listener``, reports them to the
agent as ``examples/playout_reporter.js`` does. Turns run closed-loop (each room speaks its
``--turns`` turns back to back, ``--think-s`` apart) and, with ``--rate``, open-loop (Poisson
arrivals over all rooms; an arrival for a room still speaking waits for it: ``room_wait_s``)
and, with ``--wave-gap-s``, in waves (every room starts its k-th turn at once, k x the gap into
the run: the closed loop's opening wave, which decides its gaps, ``--turns`` times; each wave's
figures under ``summary.by_wave``). Turn ``i`` of a run has the same text, frame limit and seed
in every variant (``breezert_bench.workload``).

With ``--browser-listeners M``, the last M rooms of every run get a headless-Chromium listener
(``bench/room_browser.py``: livekit-client on ``bench/web/index.html``, reporting through
``examples/playout_reporter.js`` itself in variant ``listener``) instead of a Python one: same
dispatch, trigger and turn record, first audio and gaps measured by an AudioWorklet on the
played track with the Python listener's energy rule. Each turn says its ``listener_kind``, and
each run's summary gives first audio and gaps per kind (``by_listener_kind``) beside the
overall ones. Without Chromium or livekit-client the option is an error that names the missing
piece (``make chromium``, ``make livekit-web``).

Variants run one after another; ``listener``, ``agent-queue`` and ``none`` share one worker (the
Predictor on), ``predictor-off`` gets its own (``scheduler.use_predictor = false``), so each
engine setting is built once. The JSON holds every turn and, per run, first audio heard, gaps
heard and the first audio's path itemised; the PNG draws them.

The engine apart (``--engine server``): one ``bench/room_engine.py`` per engine setting (the
app ``breezert serve`` runs, over one engine, on loopback) and as many agent workers as the
largest N needs at ``--rooms-per-worker`` rooms each (4), each reaching the engine with the
plugin's ``TTS(base_url=...)``; a worker declines a room past its share and LiveKit's server
offers it to another (``bench/room_agent.py``, ``_take_within_cap``). This is how a deployment
with many calls runs, and what keeps the agents' loops on time: livekit 1.1.21 hands every FFI
event of a process to every room of that process (``bench/room_engine.py`` has the figures).
With ``--engines K``, K such engines (engine i on GPU i on CUDA), agent i on engine i mod K: the
scale-out of issue 36 with the engines apart (``--dispatch``: ``rooms``, ``engine``, ``cpu``).

Scale-out (issue 36): ``--workers K`` starts K such workers per engine setting under one agent
name, each with its own engine (worker i sees only GPU i through ``CUDA_VISIBLE_DEVICES`` when
the engine runs on CUDA; on CPU nothing is pinned), and LiveKit's dispatcher spreads the rooms
over them by the load each reports: ``--dispatch engine`` (the plugin's ``engine_load``, as
shipped), ``cpu`` (LiveKit's default CPU load) or ``none`` (load 0, the default: one worker
takes every room); several modes, comma-separated, each get their own workers. Every run
records K and the mode, which worker served each room and turn (the agent's pid in its stamps),
per worker its rooms and peak concurrent turns, the audio heard per second over all rooms and
the placement check (``bench/room_scaleout.py`` says what counts as a call on a full worker);
with K > 1 or a dispatch mode, a second table and ``<out>-scaleout.png`` draw them. Before each
run the parent waits (up to 30 s) until every worker reports no job left from the run before.

Owns: which workers serve which runs, the listener processes (of either kind) and their
schedule, the summary and the plot (the server's and workers' processes: ``bench/room_procs.py``;
the scale-out figures: ``bench/room_scaleout.py``). Must not: reach into the agent's process
(all it learns comes through the room and the files the agent writes in its state folder).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

REPO = Path(__file__).resolve().parents[1]
for _path in (REPO / "runtime", REPO):  # as a script: bench/ (breezert_bench) is sys.path[0]
    if str(_path) not in sys.path:
        sys.path.append(str(_path))

from breezert_bench.chromium import listener_page_missing, serve_repository  # noqa: E402
from breezert_bench.listener import summarize  # noqa: E402
from breezert_bench.provenance import provenance  # noqa: E402
from breezert_bench.report import write_json  # noqa: E402
from breezert_bench.workload import (  # noqa: E402
    default_texts_path,
    frames_for_text,
    load_texts,
    poisson_offsets,
    request_seed,
)
from room_procs import (  # noqa: E402
    AGENT_NAME,
    API_KEY,
    API_SECRET,
    EngineServer,
    Worker,
    agent_workers,
    default_server_bin,
    engine_servers,
    gpu_env,
    jobs_when_idle,
    livekit_server,
    pinned_gpus,
    python_argv,
    pythonpath,
    split_cpus,
    stop,
    summed_counters,
)
from room_scaleout import (  # noqa: E402
    audio_rate,
    engine_placement,
    placement,
    scaleout_plot,
    scaleout_table,
)

VARIANTS = ("listener", "agent-queue", "none", "predictor-off")
ENGINES = ("in-process", "server")
"""Where the engine runs (``--engine``): in each agent worker, or apart
(``bench/room_engine.py``)."""
DISPATCH = ("none", "engine", "cpu")
"""How the workers report load to LiveKit's dispatcher (``bench/room_agent.py``): ``none`` (0:
each takes every room), ``engine`` (the plugin's ``engine_load``), ``cpu`` (LiveKit's default)."""
DISPATCH_APART = ("rooms", "engine", "cpu")
"""The same with the engine apart, each worker capped at ``--rooms-per-worker``: ``rooms`` (load
0), ``engine`` (its engine's load from ``/readyz``), ``cpu`` (LiveKit's default)."""
OPUS_FRAME_S = 0.020
"""The Opus packet length LiveKit's encoder uses: the first sample of a turn waits up to this
long for its packet to fill (an estimate in the itemisation, not a measurement)."""
HARNESS_LAG_LIMIT_S = 0.010
"""The listener processes' loop lag (p95 over heard turns) past which a run's heard figures
measure the benchmark's own processes more than the path: their stamps and late gaps lag by
it (6 Dec, fifth session: 10-52 ms on a loaded machine, late frames in nearly every turn,
against 4-5 ms and one late gap the session before). The run is still reported, flagged."""
FALLBACK_TEXTS = ["Hello there, thanks for calling, how can I help you today?",
                  "Your order has shipped and should arrive on Thursday afternoon.",
                  "Let me check that for you, it will only take a moment."]


# ----------------------------------------------------------------------------- schedule


def schedule(mode: str, num_rooms: int, turns: int, rate: float | None,
             seed: int, wave_gap_s: float | None = None) -> list[tuple[float, int, int]]:
    """The run's turns as (offset s, room, workload index). Closed loop: offsets are 0 (each
    room's turns go back to back); waves: every room's k-th turn is due at k x ``wave_gap_s``
    (all rooms start each turn together, as closed loop's first turn does); open loop: Poisson
    arrivals at ``rate``, rooms in turn."""
    count = num_rooms * turns
    if mode == "closed":
        return [(0.0, i % num_rooms, i) for i in range(count)]
    if mode == "waves":
        assert wave_gap_s is not None and wave_gap_s > 0
        return [((i // num_rooms) * wave_gap_s, i % num_rooms, i) for i in range(count)]
    assert rate is not None
    return [(offset, i % num_rooms, i) for i, offset in enumerate(poisson_offsets(rate, count,
                                                                                  seed))]


def run_group(spec: dict[str, Any], out: Path) -> None:
    """Child process: one group of listener rooms (spec from the parent, see ``run_listeners``);
    prints READY once every room is joined, waits for ``GO <monotonic start>`` on stdin, runs
    the schedule and writes the turns to ``out``, then leaves at once: in the interpreter's
    teardown livekit's native threads may call back into a finalizing Python and abort the
    process (rc -6, "panic in a function that cannot unwind", after DONE: a fresh clone's
    listener-feedback group, 4 Dec), which would fail a run whose results are all written."""
    asyncio.run(_group(spec, out))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


async def _group(spec: dict[str, Any], out: Path) -> None:
    from room_browser import BrowserListenerRoom
    from room_listener import ListenerRoom, LoopLag

    loop_lag = LoopLag()
    lag_task = asyncio.create_task(loop_lag.run())
    common = {"url": spec["url"], "api_url": spec["api_url"], "api_key": API_KEY,
              "api_secret": API_SECRET, "agent_name": spec["agent_name"],
              "variant": spec["variant"], "report": spec["variant"] == "listener",
              "prebuffer_s": spec["prebuffer_s"], "energy_rms": spec["energy_rms"]}
    kind = spec.get("kind", "python")
    rooms: list[Any] = [
        BrowserListenerRoom(room=name, web_root=spec["web_root"], **common)
        if kind == "browser" else ListenerRoom(room=name, loop_lag=loop_lag, **common)
        for name in spec["rooms"]]

    async def join(room: Any) -> dict[str, Any]:
        try:
            return await room.join(spec["join_timeout_s"])
        except Exception as exc:  # the run goes on; the room's turns count as not heard
            return {"room": room.name, "join_error": f"{type(exc).__name__}: {exc}"}

    if spec.get("join_in_turn"):  # each room's agent in before the next room asks for one
        ready = [await join(room) for room in rooms]
    else:
        ready = await asyncio.gather(*(join(room) for room in rooms))
    not_joined = {r["room"]: r["join_error"] for r in ready if "join_error" in r}
    if len(not_joined) == len(rooms):
        raise RuntimeError(f"no room of the group joined: {ready[0]['join_error']}")
    print("READY", json.dumps(ready), flush=True)
    line = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    start = float(line.split()[1])
    texts, seed, think_s = spec["texts"], spec["seed"], spec["think_s"]
    by_room: dict[int, list[tuple[float, int]]] = {}
    for offset, room, index in spec["schedule"]:
        by_room.setdefault(room, []).append((offset, index))

    async def speak(room: ListenerRoom, items: list[tuple[float, int]]) -> list[dict[str, Any]]:
        if room.name in not_joined:
            return [{"room": room.name, "index": index,
                     "error": f"not joined: {not_joined[room.name]}",
                     "listener_kind": kind} for _, index in items]
        records = []
        for offset, index in items:
            due = start + offset
            await asyncio.sleep(max(due - time.monotonic(), 0.0))
            text = texts[index % len(texts)]
            wait = max(time.monotonic() - due, 0.0) if spec["mode"] != "closed" else None
            record = await room.turn(text, frames_for_text(text), request_seed(seed, index))
            records.append({**record, "index": index, "room_wait_s": wait,
                            "listener_kind": kind})
            if spec["mode"] == "closed":
                await asyncio.sleep(think_s)
        return records

    results = await asyncio.gather(*(speak(rooms[r], items) for r, items in by_room.items()))
    turns = [record for records in results for record in records]
    await asyncio.gather(*(room.close() for room in rooms),  # a page's counts are read there
                         return_exceptions=True)
    meta = [{"room": room.name, "reports_sent": room.reports_sent, "frames": room.frames,
             "listener_kind": kind} for room in rooms]
    lag_task.cancel()
    out.write_text(json.dumps({"turns": turns, "rooms": meta, "ready": ready}))
    print("DONE", flush=True)


def await_ready(stdout: IO[str] | None, log: Path) -> list[Any]:
    """The rooms a listener group joined, from its ``READY`` line; lines before it that are not
    ours are skipped (on a GPU machine livekit's native library prints "Nvidia Decoder is
    supported." to stdout first, H200 4 Dec). A group that exits first raises with what it
    printed and the end of its log (``log``: its stderr), so the result says why."""
    skipped: list[str] = []
    for line in iter(stdout.readline if stdout else str, ""):
        if line.startswith("READY "):
            return list(json.loads(line.split(" ", 1)[1]))
        skipped.append(line)
    tail = log.read_text(errors="replace")[-1500:] if log.exists() else ""
    raise RuntimeError(f"a listener group did not get ready: {''.join(skipped)[-300:]!r}; "
                       f"its log ({log}) ends: {tail}")


def listener_groups(num_rooms: int, browsers: int, per: int) -> list[tuple[str, list[int]]]:
    """The run's listener processes as (kind, rooms): the last ``browsers`` rooms are browser
    listeners, all in one process (each its own Chromium), the others Python listeners in
    processes of ``per`` rooms."""
    python, per = num_rooms - browsers, max(1, per)
    groups = [("python", list(range(start, min(start + per, python))))
              for start in range(0, python, per)]
    return groups + ([("browser", list(range(python, num_rooms)))] if browsers else [])


def run_listeners(*, url: str, api_url: str, agent: str, variant: str, mode: str,
                  num_rooms: int,
                  turns: int, rate: float | None, args: argparse.Namespace,
                  texts: Sequence[str], log_dir: Path, tag: str,
                  web_root: str | None = None) -> dict[str, Any]:
    """One run: ``num_rooms`` listener rooms in processes of ``--rooms-per-process`` (the last
    ``--browser-listeners`` of them in Chromium, the page served from ``web_root``), started
    together once all joined; returns their turns and rooms."""
    plan = schedule(mode, num_rooms, turns, rate, args.seed, args.wave_gap_s)
    names = [f"{tag}-r{i}" for i in range(num_rooms)]
    procs = []
    for kind, members in listener_groups(num_rooms, args.browser_listeners,
                                         args.rooms_per_process):
        group_start = members[0]
        spec = {"url": url, "api_url": api_url, "variant": variant, "mode": mode,
                "kind": kind, "web_root": web_root,
                "agent_name": f"{AGENT_NAME}-{agent}",
                "rooms": [names[i] for i in members], "texts": list(texts), "seed": args.seed,
                "think_s": args.think_s, "prebuffer_s": args.prebuffer_ms / 1000,
                "energy_rms": args.energy_rms, "join_timeout_s": args.join_timeout_s,
                "join_in_turn": args.join_in_turn,
                "schedule": [(o, members.index(r), i) for o, r, i in plan if r in members]}
        out = log_dir / f"{tag}-g{group_start}.json"
        spec_path = log_dir / f"{tag}-g{group_start}.spec.json"
        spec_path.write_text(json.dumps(spec))
        log = open(log_dir / f"{tag}-g{group_start}.log", "wb")
        proc = subprocess.Popen([*python_argv(), __file__, "--listen-group", str(spec_path),
                                 "--group-out", str(out)], cwd=REPO, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=log, text=True,
                                env={**os.environ, "PYTHONPATH": pythonpath()})
        procs.append((proc, out, log))
    ready: list[Any] = []
    try:
        for proc, _, log in procs:
            ready.extend(await_ready(proc.stdout, Path(log.name)))
        start = time.monotonic() + 0.5
        for proc, _, _ in procs:
            assert proc.stdin is not None
            proc.stdin.write(f"GO {start}\n")
            proc.stdin.flush()
        turns_out: list[dict[str, Any]] = []
        rooms_out: list[dict[str, Any]] = []
        for proc, out, _ in procs:
            proc.wait(timeout=args.run_timeout_s)
            if proc.returncode != 0 or not out.exists():
                raise RuntimeError(f"a listener group failed (rc {proc.returncode}; log in "
                                   f"{log_dir})")
            data = json.loads(out.read_text())
            turns_out.extend(data["turns"])
            rooms_out.extend(data["rooms"])
        return {"turns": turns_out, "rooms": rooms_out, "ready": ready,
                "wall_s": time.monotonic() - start}
    finally:
        stop(*(proc for proc, _, _ in procs), timeout_s=5)
        for _, _, log in procs:
            log.close()


# ----------------------------------------------------------------------------- summary


def itemise(turn: dict[str, Any], prebuffer_s: float) -> dict[str, Any] | None:
    """One turn's first audio, split along its path (seconds; ``None`` where a stamp is
    missing). Measured: the data message's trip, the agent's steps, the engine's TTFB, the
    source's queue when the turn started, the transport (the first frame into the agent's
    source to the turn's first sound at the listener), the audio's quiet lead-in (that first
    sound to its first energetic frame: the model's audio, not the path) and the speaker's
    prebuffer; estimated within the transport: the jitter buffer (the receiver's mean delay
    over the stats interval after the first audio), Opus framing (one packet) and the SFU and
    network (what is left)."""
    agent, heard = turn.get("agent"), turn.get("heard")
    if not agent or not heard:
        return None

    def diff(a: Any, b: Any) -> float | None:
        return a - b if a is not None and b is not None else None

    wire = diff(heard["first_arrival"], agent.get("playback_started"))
    # results before the first-sound stamp (4 Dec) count the whole wire as transport
    lead_in = diff(heard["first_arrival"], heard.get("first_sound_arrival", heard["first_arrival"]))
    transport = diff(wire, lead_in)
    jitter = turn.get("jitter_buffer_s")
    queued = agent.get("source_queued_s")
    rest = None
    if transport is not None and jitter is not None:
        rest = transport - jitter - OPUS_FRAME_S - (queued or 0.0)
    heard_after_say = diff(heard["first_heard"], agent.get("said"))
    ttfb = diff(agent.get("first_audio"), agent.get("opened"))
    return {
        "heard_after_say": heard_after_say,
        "heard_after_trigger": diff(heard["first_heard"], turn.get("sent")),
        "data_trip": diff(agent.get("received"), turn.get("sent")),
        "say_to_request": diff(agent.get("opened"), agent.get("said")),
        "engine_ttfb": ttfb,
        "agent_pipeline": diff(agent.get("playback_started"), agent.get("first_audio")),
        "wire": wire,
        "transport": transport,
        "source_queue": queued,
        "opus_framing_est": OPUS_FRAME_S,
        "jitter_buffer_est": jitter,
        "sfu_network_est": rest,
        "content_lead_in": lead_in,
        "speaker_prebuffer": prebuffer_s,
        "beyond_engine_ttfb": diff(heard_after_say, ttfb),
        "path_beyond_engine_ttfb": diff(diff(heard_after_say, ttfb), lead_in),
    }


ITEMS = ("say_to_request", "engine_ttfb", "agent_pipeline", "source_queue", "opus_framing_est",
         "sfu_network_est", "jitter_buffer_est", "content_lead_in", "speaker_prebuffer")
"""The first audio's path after the agent's ``say``, in order (what the plot stacks)."""


SOURCE_DRY_MIN_S = 0.02
"""An agent-side dry spell shorter than this (two of RoomIO's 10 ms frames) is not counted."""


def source_dry_s(audio_in: Sequence[Sequence[float]] | None) -> float | None:
    """The longest time a turn's agent had none of its audio left to play (None: not
    recorded): playback starts as the first piece arrives and runs in real time; a piece that
    arrives after everything before it has played leaves the agent's source dry until then
    (``audio_in``: [seconds after the first piece, its length] per piece, as
    ``bench/room_agent.py`` records them)."""
    if not audio_in:
        return None
    played_until, longest = 0.0, 0.0
    for at, length in audio_in:
        if at > played_until:
            longest = max(longest, at - played_until)
            played_until = at
        played_until += length
    return round(longest, 4)


def heard_quiet_gap(turn: dict[str, Any]) -> bool:
    """Whether the turn's listener heard a quiet gap (NetEq filled a hole)."""
    return any(g["kind"] == "quiet" for g in (turn.get("heard") or {}).get("gaps", []))


def source_dry_summary(turns: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Turns whose agent ran out of audio mid-turn (``source_dry_s`` >= ``SOURCE_DRY_MIN_S``),
    the longest, how many of the turns with a quiet gap heard had one (a quiet gap whose agent
    never ran dry lies past the agent: its source, WebRTC, the listener), and how many dry
    turns had the agent's own event loop stalled for at least half the dry spell (the agent,
    not the engine, was late)."""
    recorded = []  # (the turn, its agent's record, its longest dry spell)
    for turn in turns:
        agent = turn.get("agent") or {}
        dry = source_dry_s(agent.get("audio_in"))
        if dry is not None:
            recorded.append((turn, agent, dry))
    with_dry = [(agent, dry) for _, agent, dry in recorded if dry >= SOURCE_DRY_MIN_S]
    quiet = [dry for turn, _, dry in recorded if heard_quiet_gap(turn)]
    return {"recorded": len(recorded), "turns_with": len(with_dry),
            "longest_s": max((dry for _, _, dry in recorded), default=None),
            "quiet_gap_turns": len(quiet),
            "quiet_gap_turns_dry": sum(dry >= SOURCE_DRY_MIN_S for dry in quiet),
            "dry_turns_agent_loop_stalled": sum(
                (agent.get("loop_lag_max_s") or 0.0) >= dry / 2 for agent, dry in with_dry)}


def heard_summary(turns: Sequence[dict[str, Any]], prebuffer_s: float) -> dict[str, Any]:
    """What the callers of ``turns`` heard: first audio after the agent's say and after the
    trigger, gaps by kind (quiet, late) and the speech concealed in the turns."""
    heard = [t for t in turns if "heard" in t]
    items = [i for i in (itemise(t, prebuffer_s) for t in turns) if i is not None]

    def gaps(kind: str) -> dict[str, Any]:
        runs = [[g for g in t["heard"]["gaps"] if g["kind"] == kind] for t in heard]
        lengths = [g["length_s"] for r in runs for g in r]
        return {"turns_with": sum(1 for r in runs if r), "count": len(lengths),
                "total_s": round(sum(lengths), 4), "longest_s": max(lengths, default=0.0)}

    return {"turns": len(turns), "heard": len(heard),
            "first_heard_after_say": summarize(i["heard_after_say"] for i in items
                                               if i.get("heard_after_say") is not None),
            "first_heard_after_trigger": summarize(i["heard_after_trigger"] for i in items
                                                   if i.get("heard_after_trigger") is not None),
            "gaps_quiet": gaps("quiet"), "gaps_late": gaps("late"),
            "concealed_in_turns_s": round(sum(t.get("concealed_s") or 0.0 for t in heard), 4),
            "agent_source_dry": source_dry_summary(turns),
            "agent_gc_full": gc_full_summary(turns)}


def gc_full_summary(turns: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The agent processes' full collector passes inside turns (``gc_full`` in the agent's
    stamps): turns with one, the longest pass, and how many of the turns with a quiet gap
    heard had one (a pass holds the GIL: every room of that process stops feeding its
    source while it runs)."""
    recorded = [(t, t["agent"]["gc_full"]) for t in turns
                if (t.get("agent") or {}).get("gc_full") is not None]
    quiet = [gc_full for t, gc_full in recorded if heard_quiet_gap(t)]
    return {"recorded": len(recorded),
            "turns_with": sum(g["count"] > 0 for _, g in recorded),
            "longest_s": max((g["longest_s"] for _, g in recorded), default=None),
            "quiet_gap_turns": len(quiet),
            "quiet_gap_turns_with_pass": sum(g["count"] > 0 for g in quiet)}


def harness_lagged(loop_lag: dict[str, Any]) -> bool:
    """Whether the listener processes' loop lag (its summary) passed ``HARNESS_LAG_LIMIT_S``
    at p95."""
    return loop_lag["p95"] is not None and loop_lag["p95"] > HARNESS_LAG_LIMIT_S


def summarize_run(run: dict[str, Any], prebuffer_s: float,
                  wave_rooms: int | None = None) -> dict[str, Any]:
    """A run's figures (``heard_summary`` and more); ``wave_rooms``: a run in waves of that many
    rooms, whose ``by_wave`` gives each wave's own (the k-th turns of all rooms)."""
    turns = run["turns"]
    heard = [t for t in turns if "heard" in t]
    items = [i for i in (itemise(t, prebuffer_s) for t in turns) if i is not None]
    kinds = sorted({t.get("listener_kind", "python") for t in turns})

    def stat(key: str) -> dict[str, Any]:
        return summarize(i[key] for i in items if i.get(key) is not None)

    # the listener process's own lateness up to each first audio (its stamps lag by it)
    loop_lag = summarize(t["loop_lag_max_s"] for t in heard if t.get("loop_lag_max_s") is not None)
    agent_reports: dict[str, int] = {}
    for t in turns:
        for source, n in (t.get("agent") or {}).get("reports", {}).items():
            agent_reports[source] = agent_reports.get(source, 0) + n
    return {
        **heard_summary(turns, prebuffer_s),
        "errors": [t["error"] for t in turns if "error" in t],
        "by_listener_kind": {kind: {
            **heard_summary([t for t in turns if t.get("listener_kind", "python") == kind],
                            prebuffer_s),
            "rooms": sum(1 for r in run["rooms"] if r.get("listener_kind", "python") == kind),
            "reports_sent": sum(r["reports_sent"] for r in run["rooms"]
                                if r.get("listener_kind", "python") == kind)}
            for kind in kinds},
        "beyond_engine_ttfb": stat("beyond_engine_ttfb"),
        "path_beyond_engine_ttfb": stat("path_beyond_engine_ttfb"),
        "itemised_p50": {k: summarize(i[k] for i in items if i.get(k) is not None)["p50"]
                         for k in ("data_trip", *ITEMS, "transport", "wire")},
        "min_energetic_rms": min((t["heard"]["min_rms"] for t in heard), default=None),
        "room_wait": summarize(t["room_wait_s"] for t in turns
                               if t.get("room_wait_s") is not None),
        "listener_loop_lag_max": loop_lag,
        "harness_lagged": harness_lagged(loop_lag),
        "join_s": summarize(r["join_s"] for r in run.get("ready", []) if "join_s" in r),
        "rooms_not_joined": sum("join_error" in r for r in run.get("ready", [])),
        "subscribes_nudged": sum(bool(r.get("subscribe_nudged")) for r in run.get("ready", [])),
        "reports_sent": sum(r["reports_sent"] for r in run["rooms"]),
        "agent_reports_by_source": agent_reports,
        "engine_ttfb": stat("engine_ttfb"),
        **audio_rate(run),
        **({"by_wave": wave_summaries(turns, wave_rooms, prebuffer_s)} if wave_rooms else {}),
    }


def wave_summaries(turns: Sequence[dict[str, Any]], num_rooms: int,
                   prebuffer_s: float) -> list[dict[str, Any]]:
    """``heard_summary`` of each wave of a run in waves: wave k holds the turns of workload
    indexes k x ``num_rooms`` .. (k + 1) x ``num_rooms`` - 1 (``schedule``'s numbering)."""
    waves: dict[int, list[dict[str, Any]]] = {}
    for turn in turns:
        waves.setdefault(turn["index"] // num_rooms, []).append(turn)
    return [{"wave": k, **heard_summary(waves[k], prebuffer_s)} for k in sorted(waves)]


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def _part_row(label: str, rooms: str, part: dict[str, Any], reports: str) -> tuple[str, ...]:
    """A line under a run in ``text_table`` for part of its turns (``heard_summary`` of one
    listener kind or one wave): heard and gaps; the run's own line has the rest."""
    heard = part["first_heard_after_say"]
    return (label, rooms, "", str(part["heard"]), f"{_ms(heard['p50'])}/{_ms(heard['p95'])}",
            "", "", "", f"{part['gaps_quiet']['count']} ({part['gaps_quiet']['turns_with']})",
            f"{part['gaps_late']['count']} ({part['gaps_late']['turns_with']})", reports, "")


def text_table(runs: Sequence[dict[str, Any]]) -> str:
    header = ("variant", "N", "load", "turns", "heard p50/p95 ms", "TTFB p50",
              "beyond TTFB p50", "path beyond p50", "quiet gaps (turns)", "late gaps (turns)",
              "reports", "loop lag p95 ms")
    rows = [header]
    for run in runs:
        if "summary" not in run:
            rows.append((run["variant"], str(run["listeners"]), run["load"], "FAILED",
                         *[""] * (len(header) - 4)))
            continue
        s = run["summary"]
        heard = s["first_heard_after_say"]
        turns = f"{s['heard']}/{s['turns']}" + (f" ({s['rooms_not_joined']} rooms not joined)"
                                                 if s.get("rooms_not_joined") else "")
        rows.append((run["variant"], str(run["listeners"]), run["load"], turns,
                     f"{_ms(heard['p50'])}/{_ms(heard['p95'])}", _ms(s["engine_ttfb"]["p50"]),
                     _ms(s["beyond_engine_ttfb"]["p50"]),
                     _ms(s.get("path_beyond_engine_ttfb", {}).get("p50")),
                     f"{s['gaps_quiet']['count']} ({s['gaps_quiet']['turns_with']})",
                     f"{s['gaps_late']['count']} ({s['gaps_late']['turns_with']})",
                     str(s["reports_sent"]),
                     _ms(s.get("listener_loop_lag_max", {}).get("p95"))
                     + (" LAGGED" if s.get("harness_lagged") else "")))
        by_kind = s.get("by_listener_kind", {})
        for kind, k in by_kind.items() if len(by_kind) > 1 else ():
            rows.append(_part_row(f"  {kind} listeners", str(k["rooms"]), k,
                                  str(k["reports_sent"])))
        for w in s.get("by_wave", ()):  # a run in waves: each wave on its own line
            rows.append(_part_row(f"  wave {w['wave']}", "", w, ""))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows)


def plot(doc: dict[str, Any], path: Path) -> Path | None:
    """First audio heard (p50/p95) and gaps per run, and the first audio's path at p50."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    runs = [run for run in doc["runs"] if "summary" in run]
    if not runs:
        return None
    labels = [f"{r['variant']}\nN={r['listeners']} {r['load']}" for r in runs]
    xs = list(range(len(runs)))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(8, 1.3 * len(runs)), 9))
    p50 = [(r["summary"]["first_heard_after_say"]["p50"] or 0) * 1000 for r in runs]
    p95 = [(r["summary"]["first_heard_after_say"]["p95"] or 0) * 1000 for r in runs]
    top.bar([x - 0.2 for x in xs], p50, 0.4, label="first audio heard p50")
    top.bar([x + 0.2 for x in xs], p95, 0.4, label="p95")
    for x, r in zip(xs, runs):
        g = r["summary"]["gaps_quiet"]["count"] + r["summary"]["gaps_late"]["count"]
        top.annotate(f"{g} gaps", (x, max(p95[x], p50[x])), ha="center", va="bottom",
                     fontsize=8)
    top.set_ylabel("ms after the agent's say()")
    top.set_xticks(xs, labels, fontsize=7)
    top.legend(fontsize=8)
    top.set_title("Room benchmark: first audio heard and gaps heard (quiet + late)")
    bottom_acc = [0.0] * len(runs)
    for key in ITEMS:
        values = [(r["summary"]["itemised_p50"].get(key) or 0) * 1000 for r in runs]
        values = [max(v, 0.0) for v in values]
        bottom.bar(xs, values, 0.6, bottom=bottom_acc, label=key)
        bottom_acc = [a + v for a, v in zip(bottom_acc, values)]
    bottom.set_ylabel("ms (p50 of each part; *_est: estimated)")
    bottom.set_xticks(xs, labels, fontsize=7)
    bottom.legend(fontsize=7, ncol=4)
    bottom.set_title("First audio's path after say(), p50 per part")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--server-bin", type=Path, default=default_server_bin())
    p.add_argument("--config", default=None,
                   help="engine profile name or TOML (default: the embedded cpu-tiny)")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json for random weights")
    p.add_argument("--set", default="", help="more engine overrides: section.key=value;...")
    p.add_argument("--source-queue-ms", type=int, default=None,
                   help="the agent's RoomIO AudioSource queue (default RoomIO's 200 ms)")
    p.add_argument("--publish", default="",
                   help="the agent track's publish options, e.g. dtx=0,red=0 (default: the SDK's)")
    p.add_argument("--texts", type=Path, default=None,
                   help="id<TAB>text file (default: ../shared/bench/texts_en.tsv when present)")
    p.add_argument("--listeners", default="2", help="N, comma-separated (e.g. 16,64)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--engine", choices=ENGINES, default="in-process",
                   help="in-process: each agent worker builds its engine (the plugin's [local] "
                        "mode); server: one engine apart (bench/room_engine.py, the app of "
                        "breezert serve) that agent workers of --rooms-per-worker rooms reach "
                        "with TTS(base_url=...)")
    p.add_argument("--engines", type=int, default=1,
                   help="--engine server: engine servers per engine setting (K; engine i pinned "
                        "to GPU i on CUDA); agent worker i uses engine i mod K")
    p.add_argument("--engine-cpus", type=int, default=0,
                   help="--engine server: the engine servers keep to this many of the CPUs "
                        "(the last ones) and the harness (livekit-server, agents, listeners) to "
                        "the rest, so a crowded harness cannot slow the engine's own steps "
                        "(0: all share every CPU)")
    p.add_argument("--rooms-per-worker", type=int, default=4,
                   help="--engine server: rooms an agent worker process takes at most (the "
                        "workers: as many as the largest N needs); past 8, whole workers "
                        "stalled (bench/README.md, 6 Dec, tenth session)")
    p.add_argument("--workers", type=int, default=1,
                   help="agent worker processes under one agent name, each with its own engine "
                        "(pinned to GPU i on CUDA); LiveKit's dispatcher spreads the rooms")
    p.add_argument("--dispatch", default="none",
                   help="comma-separated, each its own workers: none (load 0: every worker "
                        "takes every room), engine (the plugin's engine_load), cpu (LiveKit's "
                        "default CPU load)")
    p.add_argument("--turns", type=int, default=3, help="turns per room per run")
    p.add_argument("--rate", type=float, default=None,
                   help="open-loop arrivals per second over all rooms (default: closed only)")
    p.add_argument("--no-closed", action="store_true",
                   help="no closed-loop run (open loop or waves only)")
    p.add_argument("--wave-gap-s", type=float, default=None,
                   help="also a run in waves: every room starts its k-th turn at k x this many "
                        "seconds (the closed loop's opening wave, --turns times; longer than a "
                        "turn, or a late turn starts late: room_wait_s)")
    p.add_argument("--think-s", type=float, default=0.3, help="closed loop: pause between turns")
    p.add_argument("--rooms-per-process", type=int, default=16)
    p.add_argument("--browser-listeners", type=int, default=0,
                   help="M of each run's rooms get a headless-Chromium listener (livekit-client, "
                        "bench/web/index.html) instead of a Python one; needs Chromium on PATH "
                        "(make chromium) and livekit-client (make livekit-web)")
    p.add_argument("--prebuffer-ms", type=float, default=20.0)
    p.add_argument("--energy-rms", type=float, default=200.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--agent-timeout-s", type=float, default=600.0,
                   help="how long the agent worker may take to build its engine and register")
    p.add_argument("--run-timeout-s", type=float, default=600.0)
    p.add_argument("--join-timeout-s", type=float, default=120.0,
                   help="a room's wait for the agent's bench.ready and track")
    p.add_argument("--join-in-turn", action="store_true",
                   help="a listener process's rooms join one after another, each once its agent "
                        "is in (default: all at once). LiveKit Agents 1.8.9's availability check "
                        "can admit one job too many when several are requested at once (its "
                        "load is read before a concurrent job's launch, the job count after)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--listen-group", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--group-out", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    unknown = [v for v in args.variants.split(",") if v not in VARIANTS]
    if unknown:
        p.error(f"--variants: unknown {unknown} (choose from {', '.join(VARIANTS)})")
    if args.workers < 1:
        p.error("--workers must be >= 1")
    if args.rooms_per_worker < 1:
        p.error("--rooms-per-worker must be >= 1")
    if args.engine == "server":
        if args.workers != 1:
            p.error("--engine server sizes its own workers (--rooms-per-worker): leave "
                    "--workers out")
        if args.dispatch == "none":
            args.dispatch = "rooms"
        unknown = [d for d in args.dispatch.split(",") if d not in DISPATCH_APART]
        if unknown:
            p.error(f"--dispatch with --engine server: unknown {unknown} (choose from "
                    f"{', '.join(DISPATCH_APART)})")
        if args.engines < 1:
            p.error("--engines must be >= 1")
        if args.engine_cpus:
            try:
                args.cpu_split = split_cpus(args.engine_cpus)
            except ValueError as exc:
                p.error(str(exc))
    else:
        unknown = [d for d in args.dispatch.split(",") if d not in DISPATCH]
        if unknown:
            p.error(f"--dispatch: unknown {unknown} (choose from {', '.join(DISPATCH)})")
        if args.engines != 1:
            p.error("--engines needs --engine server")
        if args.engine_cpus:
            p.error("--engine-cpus needs --engine server")
    if args.no_closed and args.rate is None and args.wave_gap_s is None:
        p.error("--no-closed needs --rate or --wave-gap-s")
    if args.wave_gap_s is not None and args.wave_gap_s <= 0:
        p.error("--wave-gap-s must be > 0")
    if args.browser_listeners < 0:
        p.error("--browser-listeners must be >= 0")
    if args.listen_group is None and args.browser_listeners:
        too_few = [n for n in str(args.listeners).split(",") if int(n) < args.browser_listeners]
        if too_few:
            p.error(f"--browser-listeners {args.browser_listeners}: more than the rooms of "
                    f"--listeners {','.join(too_few)}")
        lacking = listener_page_missing()
        if lacking is not None:
            p.error(f"--browser-listeners {args.browser_listeners}: {lacking}")
    return args


def worker_plan(args: argparse.Namespace, listeners: Sequence[int]) -> tuple[int, int]:
    """(rooms per agent worker, agent workers) for a run of up to ``max(listeners)`` rooms: in
    process, ``--workers`` sharing the rooms evenly; apart, as many as the largest N needs at
    ``--rooms-per-worker`` each, rounded up to a multiple of ``--engines`` (as many agents for
    each engine)."""
    if args.engine == "server":
        needed = -(-max(listeners) // args.rooms_per_worker)
        return args.rooms_per_worker, -(-needed // args.engines) * args.engines
    return -(-max(listeners) // args.workers), args.workers


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.listen_group is not None:
        run_group(json.loads(args.listen_group.read_text()), args.group_out)
        return 0
    texts_path = args.texts or default_texts_path(REPO)
    texts = load_texts(texts_path) if texts_path else FALLBACK_TEXTS
    listeners = [int(n) for n in str(args.listeners).split(",")]
    variants = args.variants.split(",")
    loads = (([] if args.no_closed else ["closed"]) + (["open"] if args.rate else [])
             + (["waves"] if args.wave_gap_s else []))
    out = args.out or REPO / "bench" / "results" / f"room-{time.strftime('%Y%m%d-%H%M%S')}.json"
    log_dir = Path(tempfile.mkdtemp(prefix="breezert-room-"))
    apart = args.engine == "server"
    per_worker, num_workers = worker_plan(args, listeners)
    doc: dict[str, Any] = {
        "kind": "room-bench",
        "provenance": provenance(device=None, config=args.config, tokenizer=args.tokenizer,
                                 texts=str(texts_path) if texts_path else "built-in",
                                 num_texts=len(texts), set=args.set, publish=args.publish,
                                 source_queue_ms=args.source_queue_ms,
                                 turns=args.turns, workers=num_workers, engine=args.engine,
                                 rooms_per_worker=per_worker if apart else None,
                                 engines=args.engines if apart else None,
                                 engine_cpus=args.engine_cpus or None,
                                 browser_listeners=args.browser_listeners,
                                 dispatch=args.dispatch,
                                 rate=args.rate, prebuffer_ms=args.prebuffer_ms,
                                 energy_rms=args.energy_rms, seed=args.seed,
                                 server=str(args.server_bin), log_dir=str(log_dir)),
        "notes": {
            "first_heard_after_say": "the listener's speaker starts the turn's first energetic "
                                     "frame, less the agent's session.say() (same clock)",
            "gaps_quiet": "quiet frames between energetic ones (NetEq filled a hole)",
            "agent_source_dry": "turns whose agent had none of its audio left mid-turn (each "
                                "piece's arrival at the agent against real-time playback "
                                "from the first): which quiet gaps began before the agent's "
                                "source",
            "agent_gc_full": "turns during which the agent's process ran a full pass of the "
                             "cyclic collector (it holds the GIL: every room of the process "
                             "stops feeding its source), and the longest",
            "gaps_late": "frames that reached the listener process after their due time on "
                         "its speaker clock (includes the benchmark process's own delays)",
            "transport": "the first frame into the agent's AudioSource (playback_started) "
                         "to the turn's first frame of any sound at the listener process",
            "content_lead_in": "that first sound to the first energetic frame: the model's "
                               "quiet lead-in, not the path (wire = transport + lead-in)",
            "path_beyond_engine_ttfb": "beyond_engine_ttfb less the content lead-in",
            "listener_kind": "python: livekit.rtc, frames stamped as the SDK hands them over; "
                             "browser: headless Chromium with livekit-client, edges of an "
                             "AudioWorklet on the played track (10 ms RMS windows), stamped "
                             "by the page; both add the same speaker prebuffer. A browser "
                             "has no late gaps (its jitter buffer conceals: concealed_s), and "
                             "its quiet gaps include the headless fake output's under-runs",
            "estimated": "opus_framing_est (one 20 ms packet), jitter_buffer_est (receiver "
                         "stats over the 100 ms after the first audio), sfu_network_est "
                         "(the rest of the transport)",
        },
        "runs": [],
    }
    groups = [("on", [v for v in variants if v != "predictor-off"]),
              ("off", [v for v in variants if v == "predictor-off"])]
    engine_cpus = ""
    if args.engine_cpus:  # every process started from here on inherits the harness's CPUs
        engine_set, harness_set = args.cpu_split
        os.sched_setaffinity(0, harness_set)
        engine_cpus = ",".join(map(str, engine_set))
    with contextlib.ExitStack() as stack:
        url, api_url = stack.enter_context(livekit_server(args.server_bin, log_dir))
        web_root = (stack.enter_context(serve_repository()) if args.browser_listeners
                    else None)
        for dispatch in args.dispatch.split(","):
            for setting, members in groups:
                if not members:
                    continue
                predictor = f"scheduler.use_predictor={str(setting == 'on').lower()}"
                overrides = ";".join(p for p in (args.set.strip(";"), predictor) if p)
                engine_env = {"BREEZERT_ROOM_SET": overrides, "BREEZERT_ROOM_CPUS": engine_cpus,
                              "BREEZERT_ROOM_WARM_WIDTH": str(max(listeners) if apart
                                                              else per_worker)}
                if args.config:
                    engine_env["BREEZERT_ROOM_CONFIG"] = args.config
                if args.tokenizer:
                    engine_env["BREEZERT_ROOM_TOKENIZER"] = args.tokenizer
                env = {**engine_env, "BREEZERT_ROOM_PUBLISH": args.publish,
                       "BREEZERT_ROOM_SOURCE_QUEUE_MS": str(args.source_queue_ms or ""),
                       "BREEZERT_ROOM_IDLE": str(per_worker),
                       "BREEZERT_ROOM_DISPATCH": dispatch}
                started = time.monotonic()
                # also the agent name's suffix: a fresh name per worker set, so no room goes to
                # the one before it while that one drains
                name = f"predictor-{setting}" + ("" if dispatch == "none" else f"-{dispatch}")
                with contextlib.ExitStack() as setting_stack:
                    engines: list[EngineServer] = []
                    if apart:
                        engines = setting_stack.enter_context(engine_servers(
                            log_dir, name, engine_env, args.agent_timeout_s,
                            gpu_env(pinned_gpus(args.config, overrides, args.engines),
                                    args.engines), args.engines))
                        env["BREEZERT_ROOM_MAX_ROOMS"] = str(per_worker)
                        # the agents run no model; agent i uses engine i mod K
                        own_env = [{"BREEZERT_ROOM_ENGINE_URL": engines[i % len(engines)].url}
                                   for i in range(num_workers)]
                    else:
                        own_env = gpu_env(pinned_gpus(args.config, overrides, args.workers),
                                          args.workers)
                    workers = setting_stack.enter_context(agent_workers(
                        url, log_dir, name, env, args.agent_timeout_s, own_env, num_workers))
                    counted = ([e.state for e in engines] if apart
                               else [w.state for w in workers])
                    print(f"[room] agent {name} registered in {time.monotonic() - started:.0f} s"
                          + (f" ({num_workers} workers)" if num_workers > 1 else "")
                          + (f", engines apart at {', '.join(e.url for e in engines)}"
                             if apart else ""), flush=True)
                    for n in listeners:
                        for variant in members:
                            for load in loads:
                                entry = measure(url=url, api_url=api_url, agent=name,
                                                workers=workers, dispatch=dispatch,
                                                variant=variant, load=load, num_rooms=n,
                                                args=args, texts=texts, log_dir=log_dir,
                                                web_root=web_root, counted=counted,
                                                engines=engines)
                                doc["runs"].append(entry)
                                write_json(doc, out)
    print(text_table(doc["runs"]))
    png = plot(doc, out.with_suffix(".png"))
    if num_workers > 1 or args.dispatch != "none":
        print(scaleout_table(doc["runs"]))
        scaled = scaleout_plot(doc["runs"], out.with_name(out.stem + "-scaleout.png"))
        png = f"{png} and {scaled}" if scaled else png
    print(f"[room] wrote {out}" + (f" and {png}" if png else ""))
    return 0


def measure(*, url: str, api_url: str, agent: str, workers: Sequence[Worker], dispatch: str,
            variant: str, load: str, num_rooms: int, args: argparse.Namespace,
            texts: Sequence[str], log_dir: Path, web_root: str | None,
            counted: Sequence[Path], engines: Sequence[EngineServer] = ()) -> dict[str, Any]:
    """One run on the workers started for it: its entry in the JSON (with ``error`` when a
    listener process died: the run is lost, not the ones after it; the log dir has why).
    ``counted``: the state folders whose engine counters the run's take (the workers', or the
    engine servers'); ``engines``: the engines apart (worker i uses engine i mod K)."""
    tag = f"{variant}-n{num_rooms}-{load}-{random.randrange(16**6):06x}"
    head = {"variant": variant, "listeners": num_rooms, "load": load,
            "num_workers": len(workers), "dispatch": dispatch, "engine": args.engine,
            "num_engines": len(engines) or None}
    held = jobs_when_idle(workers)
    before = summed_counters(counted)
    try:
        run = run_listeners(url=url, api_url=api_url, agent=agent, variant=variant, mode=load,
                            num_rooms=num_rooms, turns=args.turns, rate=args.rate, args=args,
                            texts=texts, log_dir=log_dir, tag=tag, web_root=web_root)
    except RuntimeError as exc:
        print(f"[room] {variant} N={num_rooms} {load}: FAILED {exc}", flush=True)
        return {**head, "error": str(exc)}
    after = summed_counters(counted)
    _check_wiring(run["ready"], variant)
    entry = {**head, "rate": args.rate if load == "open" else None,
             "wall_s": round(run["wall_s"], 2),
             # whether the agents' plugin froze their start-up heap (the A/B's arm)
             "agent_heap_freeze": sorted({m["heap_freeze"] for m in run["ready"]
                                          if "heap_freeze" in m}),
             "engine_counters": {k: v - before.get(k, 0) for k, v in after.items()
                                 if v != before.get(k, 0)},
             "summary": summarize_run(run, args.prebuffer_ms / 1000,
                                      num_rooms if load == "waves" else None),
             "placement": placement(run, {w.pid: w.name for w in workers},
                                    {w.name: w.max_jobs for w in workers}, held),
             "rooms": run["rooms"], "requests": run["turns"]}
    if engines:
        entry["engine_placement"] = engine_placement(
            run, {w.pid: w.name for w in workers},
            {w.name: f"e{i % len(engines)}" for i, w in enumerate(workers)},
            {f"e{i}": e.max_jobs for i, e in enumerate(engines)})
    brief = _brief(entry["summary"])
    if len(workers) > 1 or dispatch != "none":
        brief.update(audio_per_s=entry["summary"]["audio_per_s"],
                     misplaced=entry["placement"]["misplaced"],
                     rooms={n: w["rooms"] for n, w in entry["placement"]["workers"].items()})
    if len(engines) > 1:
        brief.update(engine_rooms={n: e["rooms"] for n, e in
                                   entry["engine_placement"]["engines"].items()},
                     engine_misplaced=entry["engine_placement"]["misplaced"])
    print(f"[room] {variant} N={num_rooms} {load}: {json.dumps(brief)}", flush=True)
    return entry


def _brief(summary: dict[str, Any]) -> dict[str, Any]:
    heard = summary["first_heard_after_say"]
    return {"heard": summary["heard"], "p50_ms": _ms(heard["p50"]), "p95_ms": _ms(heard["p95"]),
            "quiet_gaps": summary["gaps_quiet"]["count"],
            "late_gaps": summary["gaps_late"]["count"],
            "agent_dry_turns": summary["agent_source_dry"]["turns_with"],
            "agent_gc_turns": summary["agent_gc_full"]["turns_with"],
            "errors": len(summary["errors"])}


def _check_wiring(ready: Sequence[dict[str, Any]], variant: str) -> None:
    """Every room's agent ran the variant asked for, on the right engine setting."""
    for message in ready:
        if "join_error" in message:  # no agent answered there: counted as not joined
            continue
        wants_predictor = variant != "predictor-off"
        if message["variant"] != variant or message["use_predictor"] != wants_predictor:
            raise RuntimeError(f"variant {variant}: an agent answered {message}")


if __name__ == "__main__":
    sys.exit(main())
