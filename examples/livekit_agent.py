"""A complete LiveKit voice agent that speaks with BreezeRT.

    export LIVEKIT_URL=wss://... LIVEKIT_API_KEY=... LIVEKIT_API_SECRET=...
    python examples/livekit_agent.py dev          # then join the room from any LiveKit client

Speech-to-text and the LLM are LiveKit Inference model strings (``AGENT_STT``, ``AGENT_LLM``;
swap in any plugin instance); the voice is ``breezert_agent.TTS``.

Engine placement (same API either way):

* in-process (default; ``BREEZERT_CONFIG`` = engine TOML, unset = the embedded tiny CPU model).
  The worker runs jobs as threads of one process (``job_executor_type=JobExecutorType.THREAD``)
  so every job shares the process's one engine and its batch: one model load, one KV pool,
  concurrent calls batched together. ``prewarm`` (the worker's ``prewarm_fnc``) calls
  ``AsyncEngine.shared``, which loads and warms the model once per process; later calls, and
  every ``TTS()`` with the same config, get that engine. With the default PROCESS executor each
  job process would load its own copy of the model.
  The worker reports the engine's real load to LiveKit's dispatcher
  (``breezert_agent.engine_worker_options``: ``load_fnc=engine_load``, full at 0.7 with
  ``load_threshold`` just under it, THREAD executor, one warm executor per job place): a worker takes at most
  ``max_running_requests`` jobs (``BREEZERT_MAX_JOBS`` to change it) and none while its engine's
  running slots are all taken or the Predictor sees a stream falling behind; the dispatcher
  sends the room to another worker.
* remote: ``BREEZERT_URL=http://host:8080`` talks to a ``breezert serve`` over its WebSocket
  (comma-separated URLs: several replicas, each turn to the least loaded by ``/readyz``);
  jobs may then use any executor, and the worker's load is LiveKit's default (CPU).

``BREEZERT_WORKER_PORT``: the worker's health port (LiveKit's default 8081), one per worker
process when several run on one host (``deploy/multi-gpu/start.sh agent``).

Playback feedback: after ``session.start`` the TTS reads the queue of the room output's
``rtc.AudioSource`` (our side only), and ``listen_room`` adds the listener's jitter buffer when
the web client runs ``examples/playout_reporter.js``.
"""

from __future__ import annotations

import logging
import os

from livekit.agents import (
    Agent,
    AgentSession,
    JobContext,
    JobExecutorType,
    JobProcess,
    WorkerOptions,
    cli,
)

from breezert_agent import TTS, engine_worker_options  # registers the plugin: main thread

logger = logging.getLogger("breezert-agent-example")

BREEZERT_URL = os.environ.get("BREEZERT_URL")
BREEZERT_URLS = [url.strip() for url in (BREEZERT_URL or "").split(",") if url.strip()]
BREEZERT_CONFIG = os.environ.get("BREEZERT_CONFIG")
AGENT_STT = os.environ.get("AGENT_STT", "deepgram/nova-3")
AGENT_LLM = os.environ.get("AGENT_LLM", "openai/gpt-4.1-mini")


class Assistant(Agent):
    def __init__(self) -> None:
        super().__init__(
            instructions=(
                "You are a friendly voice assistant. Answer in short, plain sentences "
                "without markdown, lists or emojis."
            )
        )


def prewarm(proc: JobProcess) -> None:
    """Runs once per executor before jobs; with THREAD executors the engine loads only once."""
    if not BREEZERT_URLS:
        from breezert.async_engine import AsyncEngine  # in-process only: remote needs no torch

        proc.userdata["breezert_engine"] = AsyncEngine.shared(BREEZERT_CONFIG)


def make_tts() -> TTS:
    if BREEZERT_URLS:
        return TTS(base_url=BREEZERT_URLS if len(BREEZERT_URLS) > 1 else BREEZERT_URLS[0])
    return TTS(config=BREEZERT_CONFIG)


def worker_options() -> WorkerOptions:
    placement: dict[str, object] = {"job_executor_type": JobExecutorType.THREAD}
    if not BREEZERT_URLS:  # the engine is here: LiveKit's load is its load
        max_jobs = os.environ.get("BREEZERT_MAX_JOBS")
        placement = engine_worker_options(BREEZERT_CONFIG,
                                          max_jobs=int(max_jobs) if max_jobs else None)
    return WorkerOptions(
        entrypoint_fnc=entrypoint,
        prewarm_fnc=prewarm,
        port=int(os.environ.get("BREEZERT_WORKER_PORT", "8081")),
        # loading a full-size checkpoint and capturing its graphs takes longer than the
        # default 10 s
        initialize_process_timeout=300.0,
        **placement,  # type: ignore[arg-type]
    )


async def entrypoint(ctx: JobContext) -> None:
    tts = make_tts()
    ctx.add_shutdown_callback(tts.aclose)  # our streams and sockets; never the shared engine
    session: AgentSession = AgentSession(stt=AGENT_STT, llm=AGENT_LLM, tts=tts)
    await session.start(agent=Assistant(), room=ctx.room)

    if not tts.attach_audio_output(session.output.audio):
        logger.warning("no rtc.AudioSource behind the agent output: no sender-side feedback")
    tts.listen_room(ctx.room)  # listener jitter buffer, when the client runs the reporter

    await session.generate_reply(instructions="Greet the user and offer your help.")


if __name__ == "__main__":
    cli.run_app(worker_options())
