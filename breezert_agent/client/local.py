"""``InProcessRuntimeClient``: turns on this process's shared ``AsyncEngine``, no network.

Owns: mapping ``TurnOptions`` onto a ``SynthesisRequest`` and one engine stream per turn,
through the runtime's ``EngineClient`` (its text front end tokenizes off the agent's event loop).
Must not: reach past that interface (``AsyncEngine.shared`` only builds the engine), or import
the engine (torch) before the first in-process turn or prewarm.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING

from breezert.engine_client import EngineClient
from breezert.errors import BreezeRTError, InvalidRequest
from breezert.outputs import AudioChunk
from breezert.request import SynthesisRequest

from ..log import logger
from .base import RuntimeClient, SegmentStart, Turn, TurnOptions, log_queued

if TYPE_CHECKING:
    from breezert.config import EngineConfig


class InProcessRuntimeClient(RuntimeClient):
    """Runs turns on the process-wide shared engine of ``config`` (``AsyncEngine.shared``)."""

    def __init__(self, config: str | os.PathLike[str] | EngineConfig | None = None) -> None:
        self._config = config
        self._engine: EngineClient | None = None
        self._loading: threading.Thread | None = None

    def prewarm(self) -> None:
        if self._engine is not None or self._loading is not None:
            return
        self._loading = threading.Thread(
            target=self._load_quietly, name="breezert-prewarm", daemon=True
        )
        self._loading.start()

    def _load_quietly(self) -> None:
        try:
            self._engine = _shared_engine(self._config)
        except Exception:  # the first turn loads again and reports the error properly
            logger.exception("breezert prewarm failed")

    async def get_engine(self) -> EngineClient:
        """The shared engine; loads it off the event loop the first time."""
        if self._engine is None:
            loop = asyncio.get_running_loop()
            self._engine = await loop.run_in_executor(None, _shared_engine, self._config)
        return self._engine

    def _is_loaded(self) -> bool:
        """The engine is there already: ours, or the process's shared one (no load to wait)."""
        if self._engine is not None:
            return True
        try:
            from breezert.async_engine import AsyncEngine
        except ModuleNotFoundError:  # no torch: get_engine reports it
            return False
        return AsyncEngine.has_shared(self._config)

    async def open_turn(
        self,
        texts: Sequence[str],
        options: TurnOptions,
        *,
        request_id: str,
        input_closed: bool,
        timeout: float | None = None,
    ) -> Turn:
        is_loaded, start_time = self._is_loaded(), time.perf_counter()
        engine = await self.get_engine()
        acquire_time = 0.0 if is_loaded else time.perf_counter() - start_time
        request = SynthesisRequest(
            text=list(texts), options=options.voice, chunk_schedule=options.chunk_schedule,
            max_frames=options.max_frames, priority=options.priority, request_id=request_id,
            input_closed=input_closed,
        )
        submitted = await engine.submit(request)
        if submitted.is_queued:
            self.num_queued_turns += 1
            capacity = engine.capacity()  # lengths: no engine lock on the agent's loop
            log_queued(request_id, capacity.queued, capacity.max_running)
        turn = _EngineTurn(engine, request_id)
        turn.connection_reused, turn.acquire_time = is_loaded, acquire_time
        return turn


def _shared_engine(config: str | os.PathLike[str] | EngineConfig | None) -> EngineClient:
    try:
        from breezert.async_engine import AsyncEngine  # torch: only once a turn runs in-process
    except ModuleNotFoundError as exc:
        if exc.name != "torch":
            raise
        raise ImportError("the in-process engine needs torch: pip install "
                          "'breezert-agent[local]', or use TTS(base_url=...)") from exc
    return AsyncEngine.shared(config)


class _EngineTurn(Turn):
    def __init__(self, engine: EngineClient, request_id: str) -> None:
        self._engine = engine
        self.request_id = request_id
        self._is_done = False

    async def append(self, text: str) -> None:
        if self._is_done:
            return
        try:
            await self._engine.append(self.request_id, text)
        except InvalidRequest:
            if self._is_done or not self._engine.is_live(self.request_id):
                return  # the turn already ended (failed or aborted): its stream reports why
            raise

    async def close_input(self) -> None:
        if self._is_done:
            return
        try:
            self._engine.close_input(self.request_id)
        except InvalidRequest:
            if self._engine.is_live(self.request_id):
                raise

    async def abort(self) -> None:
        self._is_done = True
        self._engine.abort(self.request_id)

    def report_playback(self, buffered_s: float, measured_at: float, source: str) -> None:
        if self._is_done:
            return
        try:
            self._engine.report_playback(self.request_id, max(buffered_s, 0.0), measured_at,
                                         source)
        except BreezeRTError:
            pass

    async def audio(self) -> AsyncIterator[bytes | SegmentStart]:
        try:
            async for item in self._engine.stream(self.request_id, segments=True):
                if isinstance(item, AudioChunk):
                    yield item.pcm16()
                else:  # SegmentStarted: exact, from the engine's frame counts
                    yield SegmentStart(item.segment_index, item.start_s)
        finally:
            self._is_done = True
