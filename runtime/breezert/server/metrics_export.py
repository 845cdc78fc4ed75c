"""``/metrics``: the app's ``prometheus_client`` registry in the Prometheus text format (0.0.4).

Owns: the metric names; the engine collector in the registry (the engine's ``metrics()``
snapshot, ``capacity()`` and ``load()``), beside the first-audio histogram
(``ServerState.first_audio``) and ``prometheus_client``'s process collector
(``process_resident_memory_bytes``, CPU, open files); and ``Scrape``, which adds the server's
own figures. Must not: compute anything the engine or server state does not already hold, or
block the event loop with the exposition: the server's figures are read on the loop that
changes them, the rest (the engine's percentiles, ``/proc``, the text) on a worker thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Mapping
from typing import Any

from aiohttp import web
from prometheus_client import ProcessCollector
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from breezert.engine_client import EngineClient
from breezert.server.health import LIFECYCLE, Lifecycle
from breezert.server.state import STATE, ServerState


def setup(app: web.Application) -> None:
    register(app[STATE])
    app.router.add_get("/metrics", metrics)


def register(state: ServerState) -> None:
    """Adds the engine collector and the process collector to ``state.registry``."""
    state.registry.register(EngineCollector(state))
    ProcessCollector(registry=state.registry)


async def metrics(request: web.Request) -> web.Response:
    scrape = Scrape(request.app[STATE], request.app[LIFECYCLE])  # on the loop: server figures
    body = await asyncio.get_running_loop().run_in_executor(None, generate_latest, scrape)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_PLAIN_0_0_4})


class EngineCollector:
    """Reads the engine at each scrape (a ``prometheus_client`` custom collector: nothing is
    copied between scrapes); ``EngineClient``'s metrics, capacity and load are safe from any
    thread."""

    def __init__(self, state: ServerState) -> None:
        self._state = state

    def collect(self) -> Iterator[Metric]:
        engine = self._state.engine
        if engine is not None:  # None while it is being built
            yield from engine_metrics(engine)


class Scrape:
    """One scrape: the server's figures, read when it is made (on the event loop that changes
    them), then the registry's collectors when ``generate_latest`` collects it."""

    def __init__(self, state: ServerState, lifecycle: Lifecycle) -> None:
        self._registry = state.registry
        self._server = list(server_metrics(state, lifecycle))

    def collect(self) -> Iterator[Metric]:
        yield from self._registry.collect()
        yield from self._server


def engine_metrics(engine: EngineClient) -> Iterator[Metric]:
    """The engine's snapshot, capacity and load as metric families."""
    snapshot = engine.metrics()
    yield _ttfb(snapshot)
    yield _gauge("breezert_active_streams", "Requests in the engine (waiting or running).",
                 snapshot.get("active_requests", 0))
    capacity = engine.capacity()
    yield _gauge("breezert_queue_depth", "Requests waiting for an engine slot.", capacity.queued)
    yield _stage_summaries(snapshot.get("stages", {}))
    yield from _counters(snapshot.get("counters", {}))
    yield _gauge("breezert_running_requests", "Requests holding a running slot.",
                 capacity.running)
    yield _gauge("breezert_queued_requests", "Requests waiting for a slot.", capacity.queued)
    yield _gauge("breezert_slots", "Running slots (max_running_requests) by state.",
                 labels=("state",), samples={
                     "free": capacity.free_slots,
                     "used": capacity.max_running - capacity.free_slots})
    yield _gauge("breezert_kv_blocks", "Paged KV-cache blocks by state.", labels=("state",),
                 samples={"free": capacity.kv_blocks_free,
                          "used": capacity.kv_blocks_total - capacity.kv_blocks_free})
    yield _gauge("breezert_kv_blocks_total", "Paged KV-cache blocks in the pool.",
                 capacity.kv_blocks_total)
    yield _gauge("breezert_codec_slots", "Streaming codec state slots (one per running slot) "
                 "by state.", labels=("state",), samples={
                     "free": capacity.max_running - capacity.codec_slots_used,
                     "used": capacity.codec_slots_used})
    load = engine.load()
    yield _gauge("breezert_load", "Engine load, 0..1 (1 = full: /readyz 503).",
                 round(load.fraction, 4))
    if load.realtime_demand is not None and load.realtime_limit is not None:
        yield _gauge("breezert_realtime_audio", "Seconds of audio per second the running streams "
                     "need (demand) and admission lets them need (limit: admission_headroom of "
                     "the learned real-time capacity).", labels=("kind",),
                     samples={"demand": round(load.realtime_demand, 4),
                              "limit": round(load.realtime_limit, 4)})


def server_metrics(state: ServerState, lifecycle: Lifecycle) -> Iterator[Metric]:
    """The server's counters and gauges: connections, turns, readiness."""
    yield _counter("breezert_underruns", "Playout concealment events reported by WebRTC "
                   "receivers while a turn was playing.", state.underruns_total)
    yield _counter("breezert_starved_frames", "Frames sent as silence inside a turn because its "
                   "audio had not arrived yet.", state.starved_frames_total)
    yield _gauge("breezert_connections", "Open client connections by kind.", labels=("kind",),
                 samples={"webrtc": len(state.peers), "websocket": state.num_ws_sessions,
                          "http_stream": state.num_http_streams})
    yield _gauge("breezert_turn_controllers", "Open turn connections (WebSocket sessions and "
                 "WebRTC peers), each with its turn controller.", labels=("kind",),
                 samples={"websocket": len(state.websockets), "webrtc": len(state.peers)})
    yield _gauge("breezert_open_turns", "Turns in progress (said, not yet ended or cancelled) "
                 "by connection kind.", labels=("kind",), samples={
                     "websocket": sum(c.active is not None for c in state.websockets.values()),
                     "webrtc": sum(p.controller.active is not None for p in state.peers)})
    yield _gauge("breezert_webrtc_peers", "Connected WebRTC peers (limit: serving.max_peers).",
                 len(state.peers))
    yield _gauge("breezert_ready", "1 once warmed up and serving (as /readyz).",
                 int(state.is_ready and not lifecycle.draining))
    yield _gauge("breezert_draining", "1 while shutting down (SIGTERM drain).",
                 int(lifecycle.draining))


# ----------------------------------------------------------------------------- families


def _ttfb(snapshot: Mapping[str, Any]) -> Metric:
    hist = snapshot.get("ttfb_histogram", {})
    ttfb = snapshot.get("ttfb_s", {})
    count = ttfb.get("count", 0)
    cumulative, buckets = 0, []
    for bound, n in zip(hist.get("buckets_s", ()), hist.get("counts", ())):
        cumulative += n
        buckets.append((floatToGoString(bound), cumulative))
    buckets.append(("+Inf", count))
    return HistogramMetricFamily(
        "breezert_ttfb_seconds", "Request enqueue to first audio chunk out of the engine.",
        buckets=buckets, sum_value=ttfb.get("mean", 0.0) * count)


def _stage_summaries(stages: Mapping[str, Any]) -> Metric:
    """A summary with quantiles per stage (``SummaryMetricFamily`` has no quantiles)."""
    name = "breezert_stage_step_seconds"
    family = Metric(name, "Engine step time per stage (recent window).", "summary")
    for stage, data in sorted(stages.items()):
        step = data.get("step_s", {})
        for q in ("p50", "p95", "p99"):
            if q in step:
                family.add_sample(name, {"stage": stage, "quantile": f"0.{q[1:]}"}, step[q])
        count = step.get("count", 0)
        family.add_sample(f"{name}_sum", {"stage": stage}, step.get("mean", 0.0) * count)
        family.add_sample(f"{name}_count", {"stage": stage}, count)
    return family


def _counters(counters: Mapping[str, int]) -> Iterator[Metric]:
    finished = CounterMetricFamily("breezert_requests_finished", "Requests by terminal status.",
                                   labels=("status",))
    for key, value in sorted(counters.items()):
        if key.startswith("requests_") and key != "requests_added":
            finished.add_metric((key.removeprefix("requests_"),), value)
    yield finished
    yield _counter("breezert_requests_added", "Requests accepted by the engine.",
                   counters.get("requests_added", 0))
    yield _counter("breezert_chunks_emitted", "Audio chunks out of the engine.",
                   counters.get("chunks_emitted", 0))
    yield _counter("breezert_requests_queued", "Requests that had to wait for a slot "
                   "(max_running_requests were running).", counters.get("queued_requests", 0))


def _counter(name: str, documentation: str, value: float) -> Metric:
    """A counter; the exposition names its sample ``<name>_total``."""
    return CounterMetricFamily(name, documentation, value=value)


def _gauge(name: str, documentation: str, value: float | None = None, *,
           labels: tuple[str, ...] = (), samples: Mapping[str, float] | None = None) -> Metric:
    """A gauge: one ``value``, or one sample per value of its single label."""
    if not labels:
        return GaugeMetricFamily(name, documentation, value=value)
    family = GaugeMetricFamily(name, documentation, labels=labels)
    for label, sample in (samples or {}).items():
        family.add_metric((label,), sample)
    return family


__all__ = ["EngineCollector", "Scrape", "engine_metrics", "register", "server_metrics",
           "setup"]
