"""asyncio facade over ``Engine``: the engine loop on its own thread, one output queue per request.

Owns: the engine thread, the prepare thread (the text front end runs there and hands each
prepared request or segment to the engine itself; reference encoding runs on a worker thread:
never on an event loop), routing each step's outputs to the awaiting
request's queue on its event loop, turning a cancelled or abandoned consumer into
``Engine.abort``, and the process-wide shared engines (``AsyncEngine.shared``: one per config,
built and warmed up once). Implements ``breezert.engine_client.EngineClient``. Must not: call
the GPU or make scheduling decisions; everything goes through ``Engine``'s thread-safe methods.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from itertools import islice
from typing import Any

import numpy as np

from breezert.config import EngineConfig
from breezert.engine import Engine, EngineOutput, RequestOutcome
from breezert.engine_client import EngineCapacity, Submitted
from breezert.errors import BreezeRTError, EngineOverloaded, RequestAborted, RequestFailed
from breezert.options import SynthesisOptions
from breezert.outputs import AudioChunk, SegmentStarted
from breezert.profiles import resolve_config
from breezert.runtime_setup import freeze_startup_heap, thaw_startup_heap
from breezert.request import Reference, RequestStatus, SynthesisRequest
from breezert.sched.load import EngineLoad
from breezert.text import Split
from breezert.worker.warmup import Progress

logger = logging.getLogger("breezert.async_engine")

_shared: dict[str, AsyncEngine] = {}
"""``AsyncEngine.shared``'s engines, keyed by their resolved config as JSON."""
_shared_lock = threading.Lock()

INJECT_STALL_ENV = "BREEZERT_INJECT_STALL_MS"
"""Test hook (never set in serving): ``stream`` holds each request's second chunk until its first
has played out and then this many ms more, so a listener's audio stops that long mid-turn, as
behind an engine stalled with nothing buffered; the real-time tests prove with it that they go
red when the agent's audio is late (``make test-stall``, tests/stall_proof.py)."""


def injected_stall_s() -> float:
    """``INJECT_STALL_ENV`` in seconds (0: no stall), read per request."""
    return float(os.environ.get(INJECT_STALL_ENV) or 0) / 1000


_NUM_PREPARE_THREADS = 1
"""Prepare threads per engine. One: requests are prepared (and so queued) in the order they
arrive, and the tokenizer never runs on two threads at once (a ``tokenizers`` object shared
across threads can fail with "Already borrowed")."""


@dataclass
class _Route:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[EngineOutput | SegmentStarted | BaseException]
    is_streaming: bool = False
    """A ``stream`` reads it (and drops it when it ends)."""
    request: Any = None
    """The scheduler's request (read on the engine thread only: its segments' frame counts)."""
    next_segment: int = 0
    """First segment whose start has not been routed yet."""


class AsyncEngine:
    """Runs ``Engine.step`` in a background thread; ``synthesize`` streams ``AudioChunk``s.

    One ``AsyncEngine`` serves any number of event loops and requests; create it once per
    process (``AsyncEngine.from_config``) and share it.
    """

    def __init__(self, engine: Engine, *, idle_wait_s: float = 0.05) -> None:
        self.engine = engine
        self._idle_wait_s = idle_wait_s
        self._routes: dict[str, _Route] = {}
        self._routes_lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._fatal: BaseException | None = None
        self._closing = False  # aclose() in progress: submit is refused (under _routes_lock)
        self._prepare_pool = ThreadPoolExecutor(_NUM_PREPARE_THREADS,
                                                thread_name_prefix="breezert-prepare")
        """Runs the text front end (``Engine.frontend``) for ``submit`` and ``append``."""

    @staticmethod
    def from_config(config: EngineConfig, *, progress: Progress | None = None,
                    **kwargs: Any) -> AsyncEngine:
        """Builds the engine (weights, KV cache, graph capture); ``progress`` hears each
        start-up phase and graph bucket (``breezert.worker.warmup.Progress``)."""
        return AsyncEngine(Engine(config, progress=progress), **kwargs)

    # ------------------------------------------------------------ shared engines
    @classmethod
    def shared(
        cls, config: str | os.PathLike[str] | EngineConfig | None = None, *, warmup: bool = True
    ) -> AsyncEngine:
        """The process-wide engine for ``config``, built (and warmed up) by the first call.

        ``config``: an ``EngineConfig``, a TOML path, a packaged profile name, or ``None`` for
        the embedded ``cpu-tiny`` profile (``breezert.profiles.resolve_config``). Thread-safe
        and blocking (a second caller waits instead of loading twice); every caller with an
        equal config gets the same engine, and the first caller's ``warmup`` decides.
        """
        cfg = resolve_config(config)
        key = cfg.model_dump_json()
        with _shared_lock:  # held while loading: one model load per config and process
            engine = _shared.get(key)
            if engine is None:
                start_time = time.monotonic()
                engine = cls.from_config(cfg)
                if warmup:
                    engine.warm_up()
                freeze_startup_heap()  # it lives as long as the process
                _shared[key] = engine
                logger.info(
                    "shared engine loaded",
                    extra={"preset": cfg.model.preset, "device": cfg.model.device,
                           "load_s": round(time.monotonic() - start_time, 3)},
                )
        return engine

    @classmethod
    def has_shared(cls, config: str | os.PathLike[str] | EngineConfig | None = None) -> bool:
        """Whether ``shared(config)`` would return an engine already built (no load)."""
        return resolve_config(config).model_dump_json() in _shared

    @classmethod
    async def aclose_shared(
        cls, config: str | os.PathLike[str] | EngineConfig | None = None
    ) -> None:
        """Closes the shared engine of ``config`` (as ``shared`` takes it) and forgets it, so
        that the next ``shared(config)`` builds a new one; a no-op when none was built.

        ``shared`` froze the heap with the engine in it: it is thawed, so that the collector
        frees what of the engine sits in reference cycles, and frozen again (one full pass)
        while other engines are still shared."""
        key = resolve_config(config).model_dump_json()
        with _shared_lock:
            engine = _shared.pop(key, None)
        if engine is None:
            return
        await engine.aclose()
        del engine
        with _shared_lock:
            thaw_startup_heap()
            if _shared:
                freeze_startup_heap()

    def warm_up(self, *, max_steps: int = 10_000) -> None:
        """Runs one two-segment request through every stage on the calling thread, so that
        lazy initialisation and graph capture happen now rather than in a user's first request.

        Blocking; only before the engine thread starts (``shared`` calls it).
        """
        if self._thread is not None and self._thread.is_alive():
            raise BreezeRTError("warm_up runs before the engine thread starts")
        request_id = f"warmup-{os.getpid()}-{time.monotonic_ns()}"
        self.engine.add_request(SynthesisRequest(
            text=["Warm up.", "Ready."], options=SynthesisOptions(seed=0), max_frames=2,
            request_id=request_id))
        for _ in range(max_steps):
            if not self.engine.has_work():
                return
            self.engine.step()
        self.engine.abort(request_id)

    # --------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Starts the engine thread (idempotent)."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="breezert-engine", daemon=True)
        self._thread.start()

    async def aclose(self) -> None:
        """Aborts every request, stops the engine thread and waits for it. A ``submit`` racing
        with it is refused; once it returns, ``submit`` may start the engine again."""
        with self._routes_lock:
            self._closing = True
            request_ids = list(self._routes)
        for request_id in request_ids:
            self.engine.abort(request_id)
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
            self._thread = None
        with self._routes_lock:
            self._closing = False

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._fatal is None

    # ---------------------------------------------------------------- requests
    async def synthesize(self, request: SynthesisRequest) -> AsyncIterator[AudioChunk]:
        """Streams the request's chunks. Raises ``RequestFailed`` / ``RequestAborted`` on those
        outcomes; leaving the loop early or cancelling the consumer aborts the request."""
        submitted = await self.submit(request)
        async for chunk in self.stream(submitted.request_id):
            if isinstance(chunk, AudioChunk):
                yield chunk

    async def submit(self, request: SynthesisRequest, *, split: Split = Split.NONE) -> Submitted:
        """Opens the request's output route, then prepares its text on the prepare thread
        (tokenizer, templates, ``split``; each prompt built once), which queues it and wakes the
        engine itself: the engine starts on it without waiting for this event loop. Use
        ``stream`` to read it.

        Raises ``InvalidRequest`` / ``EngineOverloaded`` at once. Cancelled while the prepare
        thread has it: the request is not queued, or aborted as soon as that thread queued it.
        """
        request_id = request.request_id
        assert request_id is not None  # set by SynthesisRequest.__post_init__
        self._open_route(request_id)
        handed = self._prepare_pool.submit(self._prepare_and_add, request, split)
        try:
            return await asyncio.wrap_future(handed)
        except asyncio.CancelledError:  # not queued yet: it will not be; queued: abort it
            with self._routes_lock:
                self._routes.pop(request_id, None)
            handed.add_done_callback(lambda _: self.abort(request_id))
            raise
        except BaseException:
            with self._routes_lock:
                self._routes.pop(request_id, None)
            raise

    def _check_open(self) -> None:
        if self._fatal is not None:
            raise BreezeRTError(f"engine stopped after a fatal error: {self._fatal}")

    def _open_route(self, request_id: str) -> None:
        """Opens the request's route on the calling event loop and starts the engine thread."""
        self._check_open()
        route = _Route(asyncio.get_running_loop(), asyncio.Queue())
        with self._routes_lock:
            if self._closing:
                raise BreezeRTError("the engine is shutting down (aclose in progress)")
            self.start()
            if request_id in self._routes:
                raise BreezeRTError(f"request_id={request_id!r} is already streaming")
            self._routes[request_id] = route

    def _prepare_and_add(self, request: SynthesisRequest, split: Split) -> Submitted:
        """Prepare thread: the text front end, then ``Engine.add_request`` and the engine's
        wake-up (the caller's route is open)."""
        prepared = self.engine.frontend.prepare(request, split)
        request_id = prepared.request.request_id
        self._check_open()
        with self._routes_lock:  # the caller cancelled, or aclose began: queue nothing
            if self._closing or request_id not in self._routes:
                raise BreezeRTError(f"request_id={request_id!r} was withdrawn before it was "
                                    "queued")
        self.engine.add_request(prepared)
        request = self.engine.scheduler.get_request(request_id)
        with self._routes_lock:
            route = self._routes.get(request_id)
        if route is not None:
            route.request = request
        is_queued = request is not None and request.status is RequestStatus.WAITING
        if is_queued:  # counted in metrics()["counters"]["queued_requests"]
            self.engine.metrics.incr("queued_requests")
            logger.info(
                "request %s queued: no running slot (max_running_requests=%d; an open turn "
                "holds its slot until its input closes), KV blocks or real-time capacity "
                "(admission_capacity) for it yet", request_id, self.max_running_requests)
        self._wake.set()  # last: a woken engine thread would wait for this one's GIL
        return Submitted(request_id, prepared.text.owners, prepared.text.num_prompt_tokens,
                         is_queued)

    async def stream(
        self, request_id: str, *, segments: bool = False
    ) -> AsyncGenerator[AudioChunk | SegmentStarted, None]:
        """Yields the chunks of a submitted request until it finishes; with ``segments``, a
        ``SegmentStarted`` before the first audio of each text segment too."""
        with self._routes_lock:
            route = self._routes.get(request_id)
            if route is not None:
                route.is_streaming = True
        if route is None:
            raise BreezeRTError(f"request_id={request_id!r} was not submitted here")
        finished = False
        stall_s = injected_stall_s()
        try:
            while True:
                item = await route.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if isinstance(item, RequestOutcome):
                    finished = True
                    _raise_for(item)
                    return
                if segments or not isinstance(item, SegmentStarted):
                    yield item
                if stall_s and isinstance(item, AudioChunk):  # the test hook, once
                    await asyncio.sleep(item.duration_s + stall_s)
                    stall_s = 0.0
        finally:
            with self._routes_lock:
                self._routes.pop(request_id, None)
            if not finished:  # consumer cancelled or stopped early: free everything now
                self.engine.abort(request_id)
                self._wake.set()

    async def encode_reference(self, samples: np.ndarray, sample_rate: int,
                               ref_text: str) -> Reference:
        """``Engine.frontend.encode_reference`` on a worker thread, so the event loop keeps
        running. Raises ``InvalidRequest`` naming the field (bad audio, no encoder, empty
        text)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            None, self.engine.frontend.encode_reference, samples, sample_rate, ref_text)

    async def append(self, request_id: str, text: str, *, split: Split = Split.NONE) -> int:
        """Adds ``text`` to a running turn: the prepare thread cuts it as ``split`` says, hands
        the segments to the engine and wakes it; returns how many segments it became. Raises
        ``InvalidRequest`` when the turn is not running. Cancelled while the prepare thread has
        it: the text is dropped unless that thread already handed it over."""
        withdrawn = threading.Event()
        handed = self._prepare_pool.submit(self._prepare_and_append, request_id, text, split,
                                           withdrawn)
        try:
            return await asyncio.wrap_future(handed)
        except asyncio.CancelledError:
            withdrawn.set()
            raise

    def _prepare_and_append(self, request_id: str, text: str, split: Split,
                            withdrawn: threading.Event) -> int:
        """Prepare thread: the text front end, then ``Engine.append_segments`` and the engine's
        wake-up, unless the caller withdrew it meanwhile."""
        prepared = self.engine.prepare_append(request_id, text, split)
        if withdrawn.is_set():
            return 0
        self.engine.append_segments(request_id, prepared)
        self._wake.set()
        return len(prepared.segments)

    def close_input(self, request_id: str) -> None:
        self.engine.close_input(request_id)
        self._wake.set()

    def abort(self, request_id: str) -> None:
        with self._routes_lock:  # a route no stream reads would be held forever: drop it
            route = self._routes.get(request_id)
            if route is not None and not route.is_streaming:
                del self._routes[request_id]
        self.engine.abort(request_id)
        self._wake.set()

    def report_playback(
        self, request_id: str, buffered_s: float, measured_at: float, source: str
    ) -> None:
        self.engine.report_playback(request_id, buffered_s, measured_at, source)

    @property
    def max_running_requests(self) -> int:
        return self.engine.config.scheduler.max_running_requests

    @property
    def num_waiting(self) -> int:
        """Requests queued for a running slot now."""
        return self.engine.scheduler.num_waiting

    def is_live(self, request_id: str) -> bool:
        """Whether the request is still queued or running (not finished, failed or aborted)."""
        return self.engine.scheduler.get_request(request_id) is not None

    def metrics(self) -> dict[str, Any]:
        return self.engine.metrics.snapshot()

    def capacity(self) -> EngineCapacity:
        """``Engine.capacity``: slots, KV blocks and codec slots in use now."""
        return self.engine.capacity()

    def load(self) -> EngineLoad:
        """``Engine.load``: how full the engine is now (``EngineLoad.fraction``, 1 = full)."""
        return self.engine.load()

    @classmethod
    def shared_engines(cls) -> list[AsyncEngine]:
        """Every engine ``shared`` has built in this process (and not closed). Does not wait
        for one being built (``shared`` holds its lock while loading)."""
        return list(_shared.values())  # a copy under the GIL: no lock

    # ------------------------------------------------------------ engine thread
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._wake.clear()  # before the step: a wake-up during it is not lost
                self._route_step(self.engine.step())
                if not self.engine.last_step_ran:  # nothing runnable: sleep until woken
                    self._wake.wait(self._idle_wait_s)
            # NOTE: aclose() aborts every request just before it stops the loop; no step returns
            # those outcomes, so route them here or their consumers wait forever.
            for output in self.engine.drain():
                self._route(output)
        except BaseException as exc:  # fatal: fail every open request loudly
            logger.exception(
                "engine loop died; last plan: %r; scheduler: %r",
                self.engine.last_plan, self.engine.scheduler.stats(),
            )
            self._fatal = exc
            with self._routes_lock:
                routes = list(self._routes.items())
            for request_id, route in routes:
                failure = RequestFailed(request_id, f"engine stopped: {exc}")
                with contextlib.suppress(RuntimeError):  # that consumer's loop is closed
                    route.loop.call_soon_threadsafe(route.queue.put_nowait, failure)

    def _route_step(self, outputs: list[EngineOutput]) -> None:
        """Routes a step's outputs; the outcomes that end them go out once their requests'
        slots are freed, so that a caller who hears one and sends more does not meet the
        release here, and the chunks before them are not held back by it."""
        first_outcome = len(outputs)
        while first_outcome and isinstance(outputs[first_outcome - 1], RequestOutcome):
            first_outcome -= 1
        for output in islice(outputs, first_outcome):
            self._route(output)
        if first_outcome < len(outputs):
            self.engine.release_finished()
            for output in islice(outputs, first_outcome, None):
                self._route(output)

    def _route(self, output: EngineOutput) -> None:
        with self._routes_lock:
            route = self._routes.get(output.request_id)
        if route is not None:
            try:
                if isinstance(output, AudioChunk) and output.segment_index >= route.next_segment:
                    route.loop.call_soon_threadsafe(_put_all, route.queue,
                                                    [*_segment_starts(route, output), output])
                else:
                    route.loop.call_soon_threadsafe(route.queue.put_nowait, output)
            except RuntimeError:  # the consumer's loop is closed
                with self._routes_lock:
                    self._routes.pop(output.request_id, None)
                self.engine.abort(output.request_id)


def _put_all(queue: asyncio.Queue[Any], items: list[Any]) -> None:
    for item in items:
        queue.put_nowait(item)


def _segment_starts(route: _Route, chunk: AudioChunk) -> list[SegmentStarted]:
    """The starts of the segments ``chunk`` reaches first (engine thread, after a step).

    Segment ``k`` starts after the frames of segments ``0..k-1``, which have all ended since
    the chunk carries later frames; their counts stay on the request after it finishes."""
    segments = list(route.request.segments) if route.request is not None else []
    starts = []
    for index in range(route.next_segment, chunk.segment_index + 1):
        start = chunk.frame_start  # no frame counts to go by: the chunk's start (a stand-in)
        if index <= len(segments):
            start = sum(seg.num_frames for seg in segments[:index])
        start = min(max(start, chunk.frame_start), chunk.frame_end)
        starts.append(SegmentStarted(chunk.request_id, index, start))
    route.next_segment = chunk.segment_index + 1
    return starts


def _raise_for(outcome: RequestOutcome) -> None:
    if outcome.status is RequestStatus.FAILED and outcome.overloaded:
        raise EngineOverloaded(f"request {outcome.request_id}: {outcome.error}",
                               outcome.retry_after_s, "waited")
    if outcome.status is RequestStatus.FAILED:
        raise RequestFailed(outcome.request_id, outcome.error or "unknown error")
    if outcome.status is RequestStatus.ABORTED:
        raise RequestAborted(outcome.request_id)
