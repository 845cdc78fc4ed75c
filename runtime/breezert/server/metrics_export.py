"""``/metrics``: the engine's metrics snapshot and the server's counters as Prometheus text.

Owns: the exposition format (text 0.0.4) and the metric names. Must not: compute anything the
engine or server state does not already hold; it only formats a snapshot.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from aiohttp import web

from breezert.server.health import LIFECYCLE, engine_load
from breezert.server.state import STATE, ServerState

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def setup(app: web.Application) -> None:
    app.router.add_get("/metrics", metrics)


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    text = render(state.engine.metrics(), state, queue_depth(state.engine))
    text += render_capacity(state, request.app.get(LIFECYCLE))
    return web.Response(body=text.encode(), headers={"Content-Type": CONTENT_TYPE})


def capacity(engine: Any) -> dict[str, int] | None:
    """The engine's capacity gauges (``None`` when the engine does not say, e.g. a fake or
    an engine still being built): running/queued requests, free/total slots, KV blocks, codec
    slots. Reads lengths and counters only: safe without the engine lock."""
    inner = getattr(engine, "engine", None)
    scheduler = getattr(inner, "scheduler", None)
    if scheduler is None or not hasattr(scheduler, "stats"):
        return None
    stats = scheduler.stats()
    max_slots = inner.config.scheduler.max_running_requests
    batch = getattr(getattr(inner, "runner", None), "slots", None)
    codec_used = int(batch.num_active) if batch is not None else stats.num_running
    return {
        "running": stats.num_running, "queued": stats.num_waiting,
        "slots_free": stats.num_free_slots, "slots_total": max_slots,
        "kv_blocks_free": stats.num_free_blocks,
        "kv_blocks_used": stats.num_blocks - stats.num_free_blocks,
        "kv_blocks_total": stats.num_blocks,
        "codec_slots_used": codec_used, "codec_slots_free": max_slots - codec_used,
    }


def process_rss_bytes(path: str = "/proc/self/status") -> int | None:
    """This process's resident set size from ``/proc`` (``None`` off Linux)."""
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def render_capacity(state: ServerState, lifecycle: Any = None) -> str:
    """The operator gauges: engine capacity, open turns and peers, readiness, process RSS."""
    out: list[str] = []
    cap = capacity(state.engine)
    if cap is not None:
        _metric(out, "breezert_running_requests", "gauge", "Requests holding a running slot.",
                [((), cap["running"])])
        _metric(out, "breezert_queued_requests", "gauge", "Requests waiting for a slot.",
                [((), cap["queued"])])
        _metric(out, "breezert_slots", "gauge", "Running slots (max_running_requests) by state.",
                [((("state", "free"),), cap["slots_free"]),
                 ((("state", "used"),), cap["slots_total"] - cap["slots_free"])])
        _metric(out, "breezert_kv_blocks", "gauge", "Paged KV-cache blocks by state.",
                [((("state", "free"),), cap["kv_blocks_free"]),
                 ((("state", "used"),), cap["kv_blocks_used"])])
        _metric(out, "breezert_kv_blocks_total", "gauge", "Paged KV-cache blocks in the pool.",
                [((), cap["kv_blocks_total"])])
        _metric(out, "breezert_codec_slots", "gauge", "Streaming codec state slots (one per "
                "running slot) by state.", [((("state", "free"),), cap["codec_slots_free"]),
                                              ((("state", "used"),), cap["codec_slots_used"])])
    ws_turns = sum(c.active is not None for c in state.websockets.values())
    rtc_turns = sum(getattr(p.controller, "active", None) is not None for p in state.peers)
    _metric(out, "breezert_turn_controllers", "gauge", "Open turn connections (WebSocket "
            "sessions and WebRTC peers), each with its turn controller.",
            [((("kind", "websocket"),), len(state.websockets)),
             ((("kind", "webrtc"),), len(state.peers))])
    _metric(out, "breezert_open_turns", "gauge", "Turns in progress (said, not yet ended or "
            "cancelled) by connection kind.",
            [((("kind", "websocket"),), ws_turns), ((("kind", "webrtc"),), rtc_turns)])
    _metric(out, "breezert_webrtc_peers", "gauge", "Connected WebRTC peers (limit: "
            "serving.max_peers).", [((), len(state.peers))])
    _metric(out, "breezert_ready", "gauge", "1 once warmed up and serving (as /readyz).",
            [((), int(state.is_ready and not getattr(lifecycle, "draining", False)))])
    _metric(out, "breezert_draining", "gauge", "1 while shutting down (SIGTERM drain).",
            [((), int(getattr(lifecycle, "draining", False)))])
    load = engine_load(state.engine)
    if load is not None:
        _metric(out, "breezert_load", "gauge", "Engine load, 0..1 (1 = full: /readyz 503).",
                [((), round(load.fraction, 4))])
    rss = process_rss_bytes()
    if rss is not None:
        _metric(out, "process_resident_memory_bytes", "gauge", "Resident memory size in bytes.",
                [((), rss)])
    return "\n".join(out) + "\n"


def queue_depth(engine: Any) -> int | None:
    """Requests waiting for a slot (``None`` when the engine does not say)."""
    scheduler = getattr(getattr(engine, "engine", None), "scheduler", None)
    value = getattr(scheduler, "num_waiting", None)  # a len(): safe without the engine lock
    return int(value) if value is not None else None


def render(snapshot: Mapping[str, Any], state: ServerState, queue: int | None) -> str:
    """Prometheus text for an ``EngineMetrics.snapshot()`` plus the server's counters."""
    out: list[str] = []
    hist = snapshot.get("ttfb_histogram", {})
    ttfb = snapshot.get("ttfb_s", {})
    _histogram(out, "breezert_ttfb_seconds", "Request enqueue to first audio chunk out of the "
               "engine.", hist.get("buckets_s", ()), hist.get("counts", ()),
               ttfb.get("mean", 0.0) * ttfb.get("count", 0), ttfb.get("count", 0))
    first = state.first_audio
    _histogram(out, "breezert_first_audio_seconds", "say to first audio frame sent on the "
               "connection (WebRTC, WebSocket).", first.buckets_s, first.counts, first.total,
               first.count)
    _metric(out, "breezert_underruns_total", "counter", "Playout concealment events reported by "
            "WebRTC receivers while a turn was playing.", [((), state.underruns_total)])
    _metric(out, "breezert_starved_frames_total", "counter", "Frames sent as silence inside a "
            "turn because its audio had not arrived yet.", [((), state.starved_frames_total)])
    _metric(out, "breezert_active_streams", "gauge", "Requests in the engine (waiting or "
            "running).", [((), snapshot.get("active_requests", 0))])
    _metric(out, "breezert_connections", "gauge", "Open client connections by kind.", [
        ((("kind", "webrtc"),), len(state.peers)),
        ((("kind", "websocket"),), state.num_ws_sessions),
        ((("kind", "http_stream"),), state.num_http_streams),
    ])
    if queue is not None:
        _metric(out, "breezert_queue_depth", "gauge", "Requests waiting for an engine slot.",
                [((), queue)])
    _stage_summaries(out, snapshot.get("stages", {}))
    counters = snapshot.get("counters", {})
    requests = [((("status", k.removeprefix("requests_")),), v) for k, v in sorted(counters.items())
                if k.startswith("requests_") and k != "requests_added"]
    _metric(out, "breezert_requests_finished_total", "counter", "Requests by terminal status.",
            requests)
    _metric(out, "breezert_requests_added_total", "counter", "Requests accepted by the engine.",
            [((), counters.get("requests_added", 0))])
    _metric(out, "breezert_chunks_emitted_total", "counter", "Audio chunks out of the engine.",
            [((), counters.get("chunks_emitted", 0))])
    _metric(out, "breezert_requests_queued_total", "counter",
            "Requests that had to wait for a slot (max_running_requests were running).",
            [((), counters.get("queued_requests", 0))])
    return "\n".join(out) + "\n"


def _stage_summaries(out: list[str], stages: Mapping[str, Any]) -> None:
    out.append("# HELP breezert_stage_step_seconds Engine step time per stage (recent window).")
    out.append("# TYPE breezert_stage_step_seconds summary")
    for stage, data in sorted(stages.items()):
        step = data.get("step_s", {})
        for q in ("p50", "p95", "p99"):
            if q in step:
                quantile = f"0.{q[1:]}"
                out.append(f'breezert_stage_step_seconds{{stage="{stage}",quantile="{quantile}"}} '
                           f"{_num(step[q])}")
        count = step.get("count", 0)
        out.append(f'breezert_stage_step_seconds_sum{{stage="{stage}"}} '
                   f"{_num(step.get('mean', 0.0) * count)}")
        out.append(f'breezert_stage_step_seconds_count{{stage="{stage}"}} {count}')


def _histogram(out: list[str], name: str, help_text: str, buckets: Sequence[float],
               counts: Sequence[int], total: float, count: int) -> None:
    out.append(f"# HELP {name} {help_text}")
    out.append(f"# TYPE {name} histogram")
    cumulative = 0
    for bound, n in zip(buckets, counts):
        cumulative += n
        out.append(f'{name}_bucket{{le="{_num(bound)}"}} {cumulative}')
    out.append(f'{name}_bucket{{le="+Inf"}} {count}')
    out.append(f"{name}_sum {_num(total)}")
    out.append(f"{name}_count {count}")


def _metric(out: list[str], name: str, kind: str, help_text: str,
            samples: Iterable[tuple[tuple[tuple[str, str], ...], float]]) -> None:
    out.append(f"# HELP {name} {help_text}")
    out.append(f"# TYPE {name} {kind}")
    for labels, value in samples:
        label_text = ",".join(f'{k}="{v}"' for k, v in labels)
        out.append(f"{name}{{{label_text}}} {_num(value)}" if labels else f"{name} {_num(value)}")


def _num(value: float) -> str:
    return repr(float(value)) if isinstance(value, float) else str(value)


__all__ = ["capacity", "process_rss_bytes", "render", "render_capacity", "setup"]
