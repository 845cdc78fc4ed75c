"""LiveKit worker load from the in-process engine: ``engine_load`` and ``engine_worker_options``.

LiveKit Agents 1.8.9 calls ``WorkerOptions.load_fnc`` every 0.5 s and again before it answers
each job offer, and the worker declines a job while its load (plus the jobs it accepted but has
not launched) is not below ``load_threshold``; the server then offers it to another worker,
chosen at random weighted by ``1 - load`` among those that said they are available (status
updates every 2.5 s). The default ``load_fnc`` measures CPU, which says nothing about a GPU
engine; ``engine_load`` reports the engine instead.

Owns: the load figure of a worker whose jobs share this process's engine (the THREAD executor:
the ``load_fnc`` runs in the worker's main process and can only see an engine there). Must not:
import torch or build an engine (it reads the engines ``AsyncEngine.shared`` already built).
"""

from __future__ import annotations

import functools
import os
import sys
from typing import TYPE_CHECKING, Any

from .log import logger

if TYPE_CHECKING:
    from breezert.config import EngineConfig
    from breezert.sched.load import EngineLoad
    from livekit.agents import AgentServer

FULL_LOAD = 0.7
"""What ``engine_load`` reports at capacity: LiveKit's own 0.7, the worker's default
``load_threshold`` in production and the server's default ``agents.target_load``. The server
gives a job to the workers it calls available only while one of them reports less than its
``target_load`` (their "affinity" is ``target_load - load``); a scale that reached 1.0 at
capacity would stop dispatch while every worker still had a place left (seen: three of four
places, load 0.75, no job)."""

_warned = False


def engine_loads() -> list[EngineLoad]:
    """The load of every engine ``AsyncEngine.shared`` built in this process (none before the
    first one is built, and without ever importing torch)."""
    module = sys.modules.get("breezert.async_engine")
    if module is None:
        return []
    return [engine.load() for engine in module.AsyncEngine.shared_engines()]


def engine_load(server: AgentServer | None = None, *, max_jobs: int | None = None,
                full: float = FULL_LOAD) -> float:
    """``load_fnc`` for ``WorkerOptions``: this worker's load, 0 (idle) .. ``full`` (0.7, at
    capacity; see ``FULL_LOAD``).

    ``full`` times the largest of: each shared engine's ``EngineLoad.fraction`` (running +
    queued requests against ``max_running_requests``, 1 when the Predictor sees a request that
    owes audio with negative slack), and, given the ``server`` (LiveKit passes it), the
    worker's jobs against ``max_jobs`` (default: the engine's ``max_running_requests``, one
    running turn per job, so that no call's turn has to queue behind another's). Pair it with
    ``load_threshold=load_threshold(max_jobs)``, or use ``engine_worker_options``.

    Before any engine is built (``prewarm`` builds it: ``AsyncEngine.shared`` or
    ``TTS.prewarm``), only the jobs count, against ``max_jobs`` if given, else 0.
    """
    loads = engine_loads()
    fraction = max((load.fraction for load in loads), default=0.0)
    if not loads and max_jobs is None:
        _warn_once()
    capacity = max_jobs or min((load.max_running for load in loads), default=0)
    if server is not None and capacity > 0:
        fraction = max(fraction, len(server.active_jobs) / capacity)
    return full * min(fraction, 1.0)


def load_threshold(max_jobs: int, full: float = FULL_LOAD) -> float:
    """The ``load_threshold`` that admits exactly ``max_jobs`` jobs under ``engine_load``:
    half a place below ``full``, so that float rounding in LiveKit's sum (jobs plus accepted,
    not yet launched ones) can neither let one more in nor keep the last one out."""
    return full * (max_jobs - 0.5) / max_jobs


def engine_worker_options(
    config: str | os.PathLike[str] | EngineConfig | None = None, *, max_jobs: int | None = None
) -> dict[str, Any]:
    """``WorkerOptions`` fields for a worker whose jobs share one in-process engine of
    ``config`` (as ``TTS(config=...)`` and ``AsyncEngine.shared`` take it):

    * ``load_fnc``: ``engine_load`` with ``max_jobs`` (default: the config's
      ``max_running_requests``), ``load_threshold``: ``load_threshold(max_jobs)`` (just under
      0.7, LiveKit's default);
    * ``job_executor_type``: THREAD (jobs in the worker's process, where the engine and the
      ``load_fnc`` are);
    * ``num_idle_processes``: ``max_jobs``, so that each job finds a warm executor and LiveKit
      counts a job it accepted but has not launched yet as ``1 / max_jobs`` of the load (with
      none running it divides the threshold by this number).

    Reads the config only (no torch). Every job then lives in this one process, and livekit
    1.1.21 shares each FFI event of a process among all its rooms: for more than a few calls a
    worker, serve the engine apart and use ``TTS(base_url=...)`` (``docs/deployment.md``,
    "Many calls on one host").
    """
    from breezert.profiles import resolve_config
    from livekit.agents import JobExecutorType

    jobs = max_jobs or resolve_config(config).scheduler.max_running_requests
    return {"load_fnc": functools.partial(engine_load, max_jobs=jobs),
            "load_threshold": load_threshold(jobs), "job_executor_type": JobExecutorType.THREAD,
            "num_idle_processes": jobs}


def _warn_once() -> None:
    global _warned
    if not _warned:
        _warned = True
        logger.warning(
            "engine_load: no in-process engine is built yet, so the load is 0 until one is: "
            "build it in prewarm_fnc (AsyncEngine.shared(config) or TTS(config=...).prewarm()) "
            "and use the THREAD executor (engine_worker_options sets it)")
