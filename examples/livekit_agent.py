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
* remote: ``BREEZERT_URL=http://host:8080`` talks to a ``breezert serve`` over its WebSocket;
  jobs may then use any executor.

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

from breezert_agent import TTS  # registers the plugin: import it on the main thread

logger = logging.getLogger("breezert-agent-example")

BREEZERT_URL = os.environ.get("BREEZERT_URL")
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
    if BREEZERT_URL is None:
        from breezert.async_engine import AsyncEngine  # in-process only: remote needs no torch

        proc.userdata["breezert_engine"] = AsyncEngine.shared(BREEZERT_CONFIG)


def make_tts() -> TTS:
    if BREEZERT_URL is not None:
        return TTS(base_url=BREEZERT_URL)
    return TTS(config=BREEZERT_CONFIG)


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
    cli.run_app(
        WorkerOptions(
            entrypoint_fnc=entrypoint,
            prewarm_fnc=prewarm,
            job_executor_type=JobExecutorType.THREAD,
            # loading a full-size checkpoint and capturing its graphs takes longer than the
            # default 10 s
            initialize_process_timeout=300.0,
        )
    )
