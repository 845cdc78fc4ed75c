"""The room benchmark's engine: built from the environment, warmed, served apart from the agents.

    BREEZERT_ROOM_CONFIG=configs/h200-latency.toml python bench/room_engine.py --port 8090

Two ways to reach the engine (``bench/room.py --engine``):

* ``in-process`` (``bench/room_agent.py`` imports ``engine_config`` and ``warm_wide`` from here
  and builds the engine in its worker: every room of that worker shares it);
* ``server`` (this script): ``breezert.server.app``, the app ``breezert serve`` runs, over one
  engine on ``127.0.0.1:--port``; the agents reach it with the plugin's ``TTS(base_url=...)``,
  so each agent process may hold few rooms. livekit 1.1.21 hands every FFI event of a process
  to every room of that process under one lock (``bench/room_loop_lag.py``): 16 rooms in one
  process played 22-43 % of real time on 2 cores, 4 processes of 4 rooms 100 %; on the H100
  (6 Dec) 31 of 32 turns of 16 rooms in one agent never ended.

The engine's environment: ``$BREEZERT_ROOM_CONFIG`` (profile name or TOML; default the embedded
cpu-tiny), ``$BREEZERT_ROOM_TOKENIZER`` (``model.tokenizer`` for random weights),
``$BREEZERT_ROOM_SET`` (``section.key=value;...``), ``$BREEZERT_ROOM_THREADS`` (torch's CPU
threads), ``$BREEZERT_ROOM_CPUS`` (comma-separated CPUs the process keeps to, set before torch
starts a thread: ``room.py --engine-cpus``) and ``$BREEZERT_ROOM_WARM_WIDTH`` (concurrent warm-up
requests before it is ready).
In ``$BREEZERT_ROOM_STATE`` it writes ``engine_ready.json`` once it serves (build seconds,
``use_predictor``, ``max_jobs``: the engine's ``max_running_requests``) and ``metrics.json``
(the engine's counters) every second.

Owns: the engine's config from the environment, its warm-up, and serving it. Must not: know
LiveKit (the agents do) or change the server app (it runs ``create_app`` as shipped).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
for _path in (REPO / "runtime", REPO):  # as a script: bench/ (breezert_bench) is sys.path[0]
    if str(_path) not in sys.path:
        sys.path.append(str(_path))

from breezert_bench.report import write_json  # noqa: E402 (a file replaced whole)

WARM_TEXT = "Thanks for calling, your order ships today and should arrive by Friday."


def engine_config() -> Any:
    """The engine's config from the environment (see the module doc)."""
    from breezert_bench.variants import parse_variant_spec, variant_config
    from breezert.profiles import resolve_config

    config = resolve_config(os.environ.get("BREEZERT_ROOM_CONFIG") or None)
    if tokenizer := os.environ.get("BREEZERT_ROOM_TOKENIZER"):
        config = config.model_copy(update={
            "model": config.model.model_copy(update={"tokenizer": tokenizer})})
    overrides = os.environ.get("BREEZERT_ROOM_SET", "").strip()
    if overrides:
        config = variant_config(config, parse_variant_spec(f"room={overrides}"))
    return config


def keep_to_cpus() -> None:
    """This process on ``$BREEZERT_ROOM_CPUS`` only, when set (threads started later inherit)."""
    if cpus := os.environ.get("BREEZERT_ROOM_CPUS"):
        for thread in os.listdir("/proc/self/task"):  # any thread an import started too
            os.sched_setaffinity(int(thread), {int(c) for c in cpus.split(",")})


def set_torch_threads() -> None:
    """``$BREEZERT_ROOM_THREADS`` CPU threads for torch, when set."""
    if threads := os.environ.get("BREEZERT_ROOM_THREADS"):
        import torch

        torch.set_num_threads(int(threads))


def warm_wide(engine: Any, width: int) -> None:
    """``width`` concurrent unmeasured requests (as ``breezert_bench``'s warm-up, as wide as the
    load), so the first wave of rooms meets no lazy first-touch cost: on the H200 (4 Dec) the
    first run's 16 opening turns all waited ~1 s (TTFB p50 997 ms, 65 ms a turn later). Runs on
    a thread of its own (the caller's may run an event loop)."""
    if width <= 0:
        return
    from breezert.errors import EngineOverloaded
    from breezert.request import SynthesisOptions, SynthesisRequest

    async def one(i: int) -> None:
        request = SynthesisRequest(text=WARM_TEXT, options=SynthesisOptions(seed=i),
                                   max_frames=16, request_id=f"room-warm-{os.getpid()}-{i}")
        while True:  # a profile that starts a few streams at a time refuses the rest: wait
            try:
                async for _ in engine.synthesize(request):
                    pass
                return
            except EngineOverloaded as exc:
                await asyncio.sleep(max(exc.retry_after_s or 0.0, 0.05))

    async def wave() -> None:
        await asyncio.gather(*(one(i) for i in range(width)))

    failed: list[BaseException] = []
    thread = threading.Thread(target=lambda: _run_catching(wave, failed), name="room-warm")
    thread.start()
    thread.join()
    if failed:
        raise failed[0]


def _run_catching(coro: Any, failed: list[BaseException]) -> None:
    try:
        asyncio.run(coro())
    except BaseException as exc:  # re-raised on the caller's thread
        failed.append(exc)


def write_metrics_forever(state: Path, snapshot: Callable[[], dict[str, Any]]) -> None:
    """``metrics.json`` from ``snapshot()`` (plus ``t``, this process's monotonic time) every
    second, on a daemon thread."""
    def loop() -> None:
        while True:
            try:
                write_json({"t": time.monotonic(), **snapshot()}, state / "metrics.json")
            except (RuntimeError, OSError):  # a counter added mid-copy: next second
                pass
            time.sleep(1.0)

    threading.Thread(target=loop, name="metrics", daemon=True).start()


def ready_record(config: Any, build_s: float, **extra: Any) -> dict[str, Any]:
    """What ``engine_ready.json`` holds (``bench/room_procs.py`` reads ``max_jobs``)."""
    return {"build_s": build_s, "use_predictor": config.scheduler.use_predictor,
            "max_jobs": config.scheduler.max_running_requests, **extra}


async def serve(engine: Any, config: Any, port: int, ready: Callable[[int], None]) -> None:
    """``breezert.server.app`` over ``engine`` on ``127.0.0.1:port`` until SIGTERM/SIGINT, then
    closes the engine; ``ready(bound port)`` once it listens."""
    from aiohttp import web

    from breezert.server.app import create_app

    serving = config.serving.model_copy(update={"host": "127.0.0.1", "port": port})
    app = create_app(engine, serving, warmup=False)  # warm_wide ran before it listens
    runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=1.0, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    ready(runner.addresses[0][1])
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
        await engine.aclose()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, required=True, help="loopback port to serve on")
    args = p.parse_args(argv)
    keep_to_cpus()
    from breezert.async_engine import AsyncEngine

    state = Path(os.environ.get("BREEZERT_ROOM_STATE", ".cache/room-bench-engine"))
    state.mkdir(parents=True, exist_ok=True)
    set_torch_threads()
    config = engine_config()
    started = time.monotonic()
    engine = AsyncEngine.from_config(config)
    warm_wide(engine, int(os.environ.get("BREEZERT_ROOM_WARM_WIDTH", "0")))
    build_s = time.monotonic() - started
    write_metrics_forever(state, lambda: {"counters": dict(engine.engine.metrics.counters)})

    def ready(port: int) -> None:
        write_json(ready_record(config, build_s, url=f"http://127.0.0.1:{port}"),
                   state / "engine_ready.json")
        print(f"room engine serving on http://127.0.0.1:{port} (built in {build_s:.1f} s)",
              flush=True)

    asyncio.run(serve(engine, config, args.port, ready))
    return 0


if __name__ == "__main__":
    sys.exit(main())
