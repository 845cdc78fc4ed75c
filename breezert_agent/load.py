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

LOAD_THRESHOLD = 1.0
"""The ``load_threshold`` to pair with ``engine_load``: its load reaches 1.0 exactly at
capacity (every job place or running slot taken, or the engine behind real time)."""

_warned = False


def engine_loads() -> list[EngineLoad]:
    """The load of every engine ``AsyncEngine.shared`` built in this process (none before the
    first one is built, and without ever importing torch)."""
    module = sys.modules.get("breezert.async_engine")
    if module is None:
        return []
    return [engine.load() for engine in module.AsyncEngine.shared_engines()]


def engine_load(server: AgentServer | None = None, *, max_jobs: int | None = None) -> float:
    """``load_fnc`` for ``WorkerOptions``: this worker's load, 0 (idle) .. 1 (full).

    The largest of: each shared engine's ``EngineLoad.fraction`` (running + queued requests
    against ``max_running_requests``, 1 when the Predictor sees a request that owes audio with
    negative slack), and, given the ``server`` (LiveKit passes it), the worker's jobs against
    ``max_jobs`` (default: the engine's ``max_running_requests``, one running turn per job, so
    that no call's turn has to queue behind another's). Pair it with ``load_threshold=1.0``
    (``LOAD_THRESHOLD``), or use ``engine_worker_options``.

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
    return min(fraction, 1.0)


def engine_worker_options(
    config: str | os.PathLike[str] | EngineConfig | None = None, *, max_jobs: int | None = None
) -> dict[str, Any]:
    """``WorkerOptions`` fields for a worker whose jobs share one in-process engine of
    ``config`` (as ``TTS(config=...)`` and ``AsyncEngine.shared`` take it):

    * ``load_fnc``: ``engine_load`` with ``max_jobs`` (default: the config's
      ``max_running_requests``), ``load_threshold``: 1.0;
    * ``job_executor_type``: THREAD (jobs in the worker's process, where the engine and the
      ``load_fnc`` are);
    * ``num_idle_processes``: ``max_jobs``, so that each job finds a warm executor and LiveKit
      counts a job it accepted but has not launched yet as ``1 / max_jobs`` of the load (with
      none running it divides the threshold by this number).

    Reads the config only (no torch).
    """
    from breezert.profiles import resolve_config
    from livekit.agents import JobExecutorType

    jobs = max_jobs or resolve_config(config).scheduler.max_running_requests
    return {"load_fnc": functools.partial(engine_load, max_jobs=jobs),
            "load_threshold": LOAD_THRESHOLD, "job_executor_type": JobExecutorType.THREAD,
            "num_idle_processes": jobs}


def _warn_once() -> None:
    global _warned
    if not _warned:
        _warned = True
        logger.warning(
            "engine_load: no in-process engine is built yet, so the load is 0 until one is: "
            "build it in prewarm_fnc (AsyncEngine.shared(config) or TTS(config=...).prewarm()) "
            "and use the THREAD executor (engine_worker_options sets it)")
