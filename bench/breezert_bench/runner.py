"""Drives engines under benchmark load: variants side by side, closed and open loop, the naive
baseline, and a simulated listener that reports its buffer back to the engine.

Owns: engine start-up timing, load generation on one asyncio loop, per-request timeouts and
error counting, metrics/memory capture per run and freeing each variant's engine before the
next. Must not: change engine behaviour beyond config flags (``variants``), parse arguments
(``options``) or format output (``report``).
"""

from __future__ import annotations

import asyncio
import gc
import sys
import time
from collections.abc import Callable
from typing import Any

from breezert.errors import EngineOverloaded
from breezert_bench.listener import RequestResult, summarize, summarize_requests
from breezert_bench.options import (
    BenchOptions, LoadPoint, collect_metadata, collect_remote_metadata, read_texts,
)
from breezert_bench.provenance import load_avg
from breezert_bench.variants import Variant, variant_config
from breezert_bench.workload import WorkItem, make_workload, poisson_offsets, shard_items

SCHEMA = "breezert-bench/1"
SAMPLES_PER_FRAME = 1920  # 80 ms at 24 kHz
REFUSED_MIN_WAIT_S = 0.1  # a refused closed-loop client never retries sooner than this
UNNAMED_RETRY_AFTER_S = 1.0  # a refusal that names no wait


def refused_wait_s(retry_after_s: float | None) -> float:
    """How long a refused closed-loop caller waits before saying its item again: the
    refusal's wait (``UNNAMED_RETRY_AFTER_S`` when it names none), at least
    ``REFUSED_MIN_WAIT_S``. The runner's callers and ``bench/sched_sim.py``'s both."""
    wait = UNNAMED_RETRY_AFTER_S if retry_after_s is None else retry_after_s
    return max(wait, REFUSED_MIN_WAIT_S)


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


class _Gpu:
    """Peak-memory bookkeeping; every method is a no-op on CPU."""

    def __init__(self, device: str) -> None:
        import torch

        self.torch = torch
        self.enabled = device != "cpu" and torch.cuda.is_available()

    def reset_peak(self) -> None:
        if self.enabled:
            self.torch.cuda.synchronize()
            self.torch.cuda.reset_peak_memory_stats()

    def peak_bytes(self) -> int | None:
        return int(self.torch.cuda.max_memory_allocated()) if self.enabled else None

    def allocated_bytes(self) -> int | None:
        return int(self.torch.cuda.memory_allocated()) if self.enabled else None

    def free(self) -> None:
        # compiled code can hold the last variant's modules; drop it with them
        self.torch._dynamo.reset()
        gc.unfreeze()  # the variant's start-up heap was frozen as a server's is; free it now
        gc.collect()
        if self.enabled:
            self.torch.cuda.synchronize()
            self.torch.cuda.empty_cache()


def run_benchmark(
    options: BenchOptions, on_update: Callable[[dict[str, Any]], None] | None = None
) -> dict[str, Any]:
    """Runs every variant at every load point; returns the result document.

    ``on_update`` gets the document after each run (to write partial results).

    Raises:
        InvalidConfig: the base config is invalid (a variant's own bad config is recorded, not
            raised).
    """
    import torch

    from breezert.config import EngineConfig
    from breezert.runtime_setup import resolve_device

    if options.server_url:
        return _run_remote(options, on_update)
    base = EngineConfig.from_file(options.config_path)
    model_updates = {k: v for k, v in (("path", options.model_path), ("device", options.device),
                                       ("tokenizer", options.tokenizer_path)) if v is not None}
    if model_updates:
        base = base.model_copy(update={"model": base.model.model_copy(update=model_updates)})
        base = EngineConfig.from_dict(base.model_dump(), source=str(options.config_path))
    texts, texts_source = read_texts(options.texts_path)
    if texts_source == "builtin":
        log(f"no texts file found (pass --texts): using {len(texts)} built-in sentences; "
            "results are not comparable with texts_en.tsv runs")
    # NOTE(bench): on CPU one intra-op thread by default: the tiny model gains nothing from more,
    # and they stall whenever the event loop or another process holds a core.
    threads = options.torch_threads or (1 if resolve_device(base.model.device).type == "cpu"
                                        else None)
    previous_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return _run_with(options, base, texts, texts_source, on_update)
    finally:
        torch.set_num_threads(previous_threads)


def _run_with(options: BenchOptions, base: Any, texts: list[str], texts_source: str,
              on_update: Callable[[dict[str, Any]], None] | None) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "schema": SCHEMA,
        "metadata": collect_metadata(options, base, texts_source, len(texts)),
        "config": base.model_dump(mode="json"),
        "variants": [],
        "runs": [],
    }
    asyncio.run(_run_all(options, base, texts, doc, on_update or (lambda _doc: None)))
    return doc


def _run_remote(options: BenchOptions,
                on_update: Callable[[dict[str, Any]], None] | None) -> dict[str, Any]:
    """Every load point against the running server at ``options.server_url`` (one variant,
    ``server``): client-side TTFB and gaps, the server's first-audio times beside them."""
    texts, texts_source = read_texts(options.texts_path)
    doc: dict[str, Any] = {
        "schema": SCHEMA, "metadata": collect_remote_metadata(options, texts_source, len(texts)),
        "config": None, "variants": [{"name": "server", "description": options.server_url,
                                      "overrides": {}, "naive": False, "status": "ok"}],
        "runs": [],
    }
    asyncio.run(_remote_points(options, texts, doc, on_update or (lambda _doc: None)))
    return doc


async def _remote_points(options: BenchOptions, texts: list[str], doc: dict[str, Any],
                         on_update: Callable[[dict[str, Any]], None]) -> None:
    import aiohttp

    from breezert_bench.remote import RemoteSpeech

    variant = Variant("server", description=str(options.server_url))
    connector = aiohttp.TCPConnector(limit=0)  # one socket per request in flight
    async with aiohttp.ClientSession(connector=connector) as session:
        target = RemoteSpeech(str(options.server_url), session, options.server_token)
        for load in options.load_points():
            items = make_workload(texts, options.num_requests, options.seed)
            tag = f"server-{load.label}"
            await _warm_up(target, texts, load, options, tag, options.warmup)
            before = await target.server_metrics()
            results = await _run_load(target, items, load, options, tag)
            after = await target.server_metrics()
            run = _run_record(variant, load, results, options, None, None,
                              truncated=len(results) < len(items))
            run["server_metrics_before"], run["server_metrics_after"] = before, after
            doc["runs"].append(run)
            _log_run(run)
            on_update(doc)


async def _run_all(options: BenchOptions, base: Any, texts: list[str], doc: dict[str, Any],
                   on_update: Callable[[dict[str, Any]], None]) -> None:
    for variant in options.variants:
        record: dict[str, Any] = {"name": variant.name, "description": variant.description,
                                  "overrides": variant.overrides, "naive": variant.is_naive,
                                  "profile": variant.profile}
        doc["variants"].append(record)
        if variant.is_naive and options.shard and options.shard[0] != 1:
            record.update(status="skipped", error="the naive baseline runs in shard 1 only")
            on_update(doc)
            continue
        try:
            config = variant_config(base, variant)
        except ValueError as exc:  # e.g. graphs asked for on a CPU profile
            record.update(status="skipped", error=str(exc))
            log(f"{variant.name}: skipped: {exc}")
            on_update(doc)
            continue
        record["config"] = config.model_dump(mode="json")
        runner = _run_naive if variant.is_naive else _run_engine
        try:
            await runner(options, variant, config, texts, record, doc, on_update)
            record.setdefault("status", "ok")
        except Exception as exc:  # a variant that cannot start must not stop the others
            record.update(status="failed", error=f"{type(exc).__name__}: {exc}")
            log(f"{variant.name}: failed: {type(exc).__name__}: {exc}")
        _Gpu(config.model.device).free()
        on_update(doc)


async def _run_engine(options: BenchOptions, variant: Variant, config: Any, texts: list[str],
                      record: dict[str, Any], doc: dict[str, Any],
                      on_update: Callable[[dict[str, Any]], None]) -> None:
    from breezert.async_engine import AsyncEngine
    from breezert.engine import Engine
    from breezert.runtime_setup import freeze_startup_heap

    gpu = _Gpu(config.model.device)
    gpu.reset_peak()
    log(f"{variant.name}: building the engine")
    start = time.monotonic()
    engine = Engine(config)
    freeze_startup_heap()  # as the server and the shared engine do
    record["startup_s"] = time.monotonic() - start
    record["memory_after_startup_bytes"] = gpu.allocated_bytes()
    record["startup_peak_memory_bytes"] = gpu.peak_bytes()
    record.update(_runner_facts(engine))
    log(f"{variant.name}: engine ready in {record['startup_s']:.1f} s")
    async_engine = AsyncEngine(engine)
    try:
        for load in options.load_points():
            run = await _engine_load_point(options, variant, async_engine, config, texts, load, gpu)
            run["startup_s"] = record["startup_s"]
            doc["runs"].append(run)
            _log_run(run)
            on_update(doc)
            if not async_engine.is_running:  # the engine loop died: the rest would only fail
                record.update(status="failed", error="the engine loop stopped (see the log)")
                break
    finally:
        await async_engine.aclose()
        del async_engine, engine


def _runner_facts(engine: Any) -> dict[str, Any]:
    """What the worker resolved at start-up (graphs on, capture seconds per stage, KV size)."""
    runner = getattr(engine, "runner", None)
    layout = getattr(runner, "layout", None)
    return {
        "uses_graphs": getattr(runner, "uses_graphs", None),
        "graph_warmup_s": getattr(runner, "warmup_s", None),
        "graph_warmup_stage_s": dict(getattr(runner, "warmup_stage_s", None) or {}),
        "num_kv_blocks": getattr(layout, "num_blocks", None),
        "kv_cache_bytes": getattr(layout, "kv_cache_bytes", None),
    }


async def _engine_load_point(options: BenchOptions, variant: Variant, async_engine: Any,
                             config: Any, texts: list[str], load: LoadPoint,
                             gpu: _Gpu) -> dict[str, Any]:
    from breezert.metrics import STEP_LOG, EngineMetrics

    items = shard_items(make_workload(texts, options.num_requests, options.seed), options.shard)
    tag = f"{variant.name}-{load.label}"
    warmup_start = time.monotonic()
    await _warm_up(async_engine, texts, load, options, tag,
                   config.scheduler.max_running_requests)
    warmup_s = time.monotonic() - warmup_start
    # NOTE(bench): a fresh metrics object per run; the engine is idle here, so nothing races.
    async_engine.engine.metrics = EngineMetrics(step_log=STEP_LOG)  # for first_packet_path
    gpu.reset_peak()
    with GcPauses() as gc_pauses:
        results = await _run_load(async_engine, items, load, options, tag)
    snapshot = async_engine.metrics()
    run = _run_record(variant, load, results, options, snapshot, gpu.peak_bytes(),
                      truncated=len(results) < len(items))
    run["warmup_s"] = warmup_s
    run["gc_pauses"] = gc_pauses.summary()
    run["first_packet_path"], run["opening_burst"] = _first_packet_figures(
        async_engine.engine, results, int(load.value) if load.mode == "closed" else 0)
    return run


def _gc_note(pauses: dict[str, Any] | None) -> str:
    full = (pauses or {}).get("gen2") or {}
    return (f", {full['count']} full GC passes (max {full['max_ms']:.0f} ms)"
            if full.get("count") else "")


class GcPauses:
    """The garbage collector's passes during a run (``gc.callbacks``), by generation: a full
    pass holds the GIL over the whole heap, so every stream of the process stalls at once."""

    def __init__(self) -> None:
        self._started: float | None = None
        self.ms: dict[int, list[float]] = {0: [], 1: [], 2: []}

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self.ms[info["generation"]].append((time.perf_counter() - self._started) * 1000)
            self._started = None

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)

    def summary(self) -> dict[str, Any]:
        return {f"gen{g}": {"count": len(ms), "max_ms": round(max(ms, default=0.0), 3),
                            "total_ms": round(sum(ms), 3)} for g, ms in self.ms.items()}


def _first_packet_figures(engine: Any, results: list[RequestResult],
                       burst: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Where the run's first packets spent their time, and the step timeline of its opening
    burst of ``burst`` requests (a closed loop's concurrency; 0: none) (``bench/first_packet.py``)."""
    from breezert_bench.first_packet import FirstPacket, first_packet_paths, opening_steps

    steps = engine.step_log()
    firsts = [FirstPacket(r.request_id, r.submit_time, r.chunk_times[0])
              for r in results if r.is_ok]
    paths = first_packet_paths(steps, firsts, log_full=len(steps) == engine.metrics.steps.maxlen)
    if burst <= 1:
        return paths, {}
    opening = opening_steps(steps, firsts, burst)
    opening["ttfb_after_s"] = ttfb_after_burst(results, burst)
    return paths, opening


def ttfb_after_burst(results: list[RequestResult], burst: int) -> dict[str, Any]:
    """TTFB of the requests submitted after a closed loop's opening ``burst`` (the first
    ``burst`` submissions, all at once): at a few hundred requests the burst's own first packets
    are ~5 % of the sample and can decide the p95 alone, so the steady state is read here."""
    later = sorted(results, key=lambda r: r.submit_time)[burst:]
    return summarize(t for r in later if r.is_ok and (t := r.ttfb_s) is not None)


async def _warm_up(target: Any, texts: list[str], load: LoadPoint, options: BenchOptions,
                   tag: str, open_loop_width: int) -> None:
    """``options.warmup`` unmeasured requests, as wide as the load (``open_loop_width`` in
    flight for an open-loop point), so lazy compiles and first-touch costs stay out of the run."""
    if not options.warmup:
        return
    warm = make_workload(texts, options.warmup, options.seed + 1)
    width = int(load.value) if load.mode == "closed" else open_loop_width
    await _closed_loop(target, warm, min(width, len(warm)), options, f"{tag}-warm", None)


async def _run_load(target: Any, items: list[WorkItem], load: LoadPoint, options: BenchOptions,
                    tag: str) -> list[RequestResult]:
    """The measured requests of one load point, closed or open loop, within the run budget."""
    budget_end = (time.monotonic() + options.run_budget_s) if options.run_budget_s else None
    if load.mode == "closed":
        return await _closed_loop(target, items, int(load.value), options, tag, budget_end)
    return await _open_loop(target, items, load.value, options, tag, budget_end)


def _run_record(variant: Variant, load: LoadPoint, results: list[RequestResult],
                options: BenchOptions, snapshot: dict[str, Any] | None, peak: int | None,
                *, truncated: bool) -> dict[str, Any]:
    run: dict[str, Any] = {"variant": variant.name, "load": load.as_dict(),
                           "feedback": options.feedback and not variant.is_naive,
                           "truncated": truncated}
    run.update(summarize_requests(results))
    run["gpu_max_memory_bytes"] = peak
    run["load_avg_1m"] = load_avg()  # other processes on the host skew CPU numbers
    run["frame_step_s_p50"] = _frame_step_p50(snapshot)
    run.update(_step_time_shares(snapshot, run.get("wall_s"), run.get("audio_s_total")))
    run["engine_metrics"] = snapshot
    first = min((r.submit_time for r in results), default=0.0)
    # when each was submitted, from the run's first: the waves of an opening burst show
    run["requests"] = [{**r.compact(), "submit_s": round(r.submit_time - first, 5)}
                       for r in results]
    return run


def _frame_step_p50(snapshot: dict[str, Any] | None) -> float | None:
    """p50 DECODE step + p50 DEPTH step: one frame of one batch."""
    stages = (snapshot or {}).get("stages", {})
    try:
        return float(stages["decode"]["step_s"]["p50"] + stages["depth"]["step_s"]["p50"])
    except (KeyError, TypeError):
        return None


def _step_time_shares(snapshot: dict[str, Any] | None, wall_s: float | None,
                      audio_s: float | None) -> dict[str, float | None]:
    """``step_busy_fraction``: the share of the run's wall time spent inside stage steps (GPU
    work plus the host work of each step; the rest is scheduling and idle time between them);
    ``codec_ms_per_frame``: CODEC step time per decoded frame."""
    stages = (snapshot or {}).get("stages", {})
    if not stages:  # a run against a server: its steps are not visible here
        return {"step_busy_fraction": None, "codec_ms_per_frame": None}
    total = {name: entry["step_s"]["count"] * (entry["step_s"]["mean"] or 0.0)
             for name, entry in stages.items() if entry.get("step_s", {}).get("count")}
    frames = (audio_s or 0.0) / (SAMPLES_PER_FRAME / 24_000)
    return {
        "step_busy_fraction": sum(total.values()) / wall_s if wall_s else None,
        "codec_ms_per_frame": 1000 * total["codec"] / frames if "codec" in total and frames
        else None,
    }


def _log_run(run: dict[str, Any]) -> None:
    ttfb = run["ttfb_s"]
    p50 = "-" if ttfb["p50"] is None else f"{ttfb['p50'] * 1000:.0f}"
    p95 = "-" if ttfb["p95"] is None else f"{ttfb['p95'] * 1000:.0f}"
    log(f"{run['variant']} {run['load']['label']}: {run['num_ok']}/{run['num_requests']} ok, "
         f"{run['num_refused']} refused, TTFB p50 {p50} ms p95 {p95} ms, "
         f"underruns {run['underrun_requests']}, "
         f"wall {run['wall_s']:.1f} s" + _gc_note(run.get("gc_pauses")))
    after = (run.get("opening_burst") or {}).get("ttfb_after_s") or {}
    if after.get("p95") is not None:
        log(f"{run['variant']} {run['load']['label']} after the opening burst: TTFB p50 "
            f"{after['p50'] * 1000:.0f} ms p95 {after['p95'] * 1000:.0f} ms "
            f"({after['count']} requests)")
    path = run.get("first_packet_path") or {}
    parts = {k[: -len("_ms")]: v for k, v in path.items() if k.endswith("_ms")}
    if parts:
        log(f"{run['variant']} {run['load']['label']} first packet, mean ms: "
            + ", ".join(f"{name.removeprefix('own_')} {v['mean']:.1f}"
                        for name, v in parts.items()))


# ------------------------------------------------------------------------------ load generation


async def _closed_loop(async_engine: Any, items: list[WorkItem], concurrency: int,
                       options: BenchOptions, tag: str,
                       budget_end: float | None) -> list[RequestResult]:
    """Keeps ``concurrency`` callers busy until every item has run (or the budget ends).

    A caller whose request was refused (``EngineOverloaded``) waits the refusal's predicted
    wait (in process the engine's figure, at least ``REFUSED_MIN_WAIT_S``; against a server its
    Retry-After, whole seconds) and says the same item again, as a voice agent repeats a refused
    turn; each attempt is a record (``status`` refused, or its outcome). Without the wait a
    closed loop past capacity is refused in a spin; without the retry it spent its items on
    refusals within its opening burst (7 Dec: 300 items in 4-5 s at c=128 on the H100) and
    measured that burst, not the load it names."""
    queue = list(reversed(items))
    results: list[RequestResult] = []

    def in_budget() -> bool:
        return budget_end is None or time.monotonic() < budget_end

    async def worker() -> None:
        while queue and in_budget():
            item = queue.pop()
            attempt = 0
            while True:
                result = await _one_request(async_engine, item, options, tag, attempt)
                results.append(result)
                if result.retry_after_s is None:
                    break
                wait = refused_wait_s(result.retry_after_s)
                if budget_end is not None:
                    wait = min(wait, max(0.0, budget_end - time.monotonic()))
                await asyncio.sleep(wait)
                if not in_budget():
                    break
                attempt += 1

    await asyncio.gather(*(worker() for _ in range(max(1, concurrency))))
    return sorted(results, key=lambda r: r.index)


async def _open_loop(async_engine: Any, items: list[WorkItem], rate_rps: float,
                     options: BenchOptions, tag: str,
                     budget_end: float | None) -> list[RequestResult]:
    """Submits each item at its seeded Poisson arrival time, whatever is still running."""
    offsets = poisson_offsets(rate_rps, len(items), options.seed)
    start = time.monotonic()
    tasks = []
    for item, offset in zip(items, offsets):
        delay = start + offset - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        if budget_end is not None and time.monotonic() >= budget_end:
            break
        tasks.append(asyncio.create_task(_one_request(async_engine, item, options, tag)))
    return sorted(await asyncio.gather(*tasks), key=lambda r: r.index)


def item_request(item: WorkItem, tag: str, attempt: int = 0) -> Any:
    """The ``SynthesisRequest`` of a workload item: its text, seed and fixed length, EOS
    ignored, id ``TAG-INDEX`` (``-ATTEMPT`` when a caller says it again after a refusal). The
    runner's loads, its sequential baseline and ``sched_sim.py`` all submit these."""
    from breezert.options import SynthesisOptions
    from breezert.request import SynthesisRequest

    return SynthesisRequest(text=item.text, options=SynthesisOptions(seed=item.seed),
                            max_frames=item.num_frames, ignore_eos=True,
                            request_id=f"{tag}-{item.index}" + (f"-{attempt}" if attempt else ""))


async def _one_request(async_engine: Any, item: WorkItem, options: BenchOptions,
                       tag: str, attempt: int = 0) -> RequestResult:
    """Submits ``item_request(item, tag, attempt)``, consumes its chunks into a simulated
    listener, never raises."""
    request = item_request(item, tag, attempt)
    result = RequestResult(item.index, str(request.request_id), item.num_frames,
                           submit_time=time.monotonic())
    feedback: asyncio.Task[None] | None = None

    async def consume() -> None:
        nonlocal feedback
        async for chunk in async_engine.stream(request_id):
            result.add_chunk(chunk.created_time, chunk.duration_s, chunk.num_frames,
                             time.monotonic())
            if feedback is None and options.feedback:
                feedback = asyncio.create_task(_feedback_loop(async_engine, result, options))

    try:
        request_id = (await async_engine.submit(request)).request_id
        await asyncio.wait_for(consume(), timeout=options.request_timeout_s)
        server_ttfb = getattr(async_engine, "server_ttfb_s", {})  # a RemoteSpeech target
        result.server_ttfb_s = server_ttfb.pop(request_id, None)
    except asyncio.TimeoutError:
        result.status, result.error = "timeout", "timeout"
    except EngineOverloaded as exc:  # refused past capacity: counted apart from failures
        result.status, result.error = "refused", type(exc).__name__
        result.retry_after_s = (exc.retry_after_s if exc.retry_after_s is not None
                                else UNNAMED_RETRY_AFTER_S)
    except Exception as exc:  # counted, never fatal
        result.status, result.error = "error", type(exc).__name__
    finally:
        if feedback is not None:
            feedback.cancel()
    return result


async def _feedback_loop(async_engine: Any, result: RequestResult,
                         options: BenchOptions) -> None:
    """``report_playback(..., "simulated")`` every ``feedback_period_s`` of the listener's clock."""
    timeline = result.timeline
    assert timeline.start_time is not None
    next_time = timeline.start_time + options.feedback_period_s
    while True:
        await asyncio.sleep(max(0.0, next_time - time.monotonic()))
        now = time.monotonic()
        try:
            async_engine.report_playback(result.request_id, timeline.buffered_s(now), now,
                                         "simulated")
            result.num_feedback_reports += 1
        except Exception:  # a finished request or an engine without feedback: not our failure
            return
        next_time += options.feedback_period_s


async def _run_naive(options: BenchOptions, variant: Variant, config: Any, texts: list[str],
                     record: dict[str, Any], doc: dict[str, Any],
                     on_update: Callable[[dict[str, Any]], None]) -> None:
    """The offline baseline: one request at a time, whole utterance generated then decoded, so
    TTFB = whole synthesis time. One sequential load point (concurrency does not apply)."""
    from breezert.offline import synthesize_whole
    from breezert.runtime_setup import load_engine_checkpoint

    gpu = _Gpu(config.model.device)
    gpu.reset_peak()
    start = time.monotonic()
    ckpt = load_engine_checkpoint(config.model)
    record["startup_s"] = time.monotonic() - start
    record["memory_after_startup_bytes"] = gpu.allocated_bytes()
    sample_rate = ckpt.config.codec.sample_rate
    count = min(options.num_requests, options.naive_requests)
    load = LoadPoint("sequential", 1)

    def one(item: WorkItem, tag: str) -> RequestResult:
        request = item_request(item, tag)
        result = RequestResult(item.index, str(request.request_id), item.num_frames,
                               submit_time=time.monotonic())
        try:
            audio = synthesize_whole(ckpt, request)
            done = time.monotonic()
            result.add_chunk(done, len(audio) / sample_rate, len(audio) // SAMPLES_PER_FRAME,
                             done)
        except Exception as exc:  # counted, never fatal
            result.status, result.error = "error", type(exc).__name__
        return result

    for item in make_workload(texts, min(options.warmup, count), options.seed + 1):
        one(item, f"{variant.name}-warm")
    gpu.reset_peak()
    budget_end = (time.monotonic() + options.run_budget_s) if options.run_budget_s else None
    results = []
    for item in make_workload(texts, count, options.seed):
        if budget_end is not None and time.monotonic() >= budget_end:
            break
        results.append(one(item, variant.name))
        await asyncio.sleep(0)
    run = _run_record(variant, load, results, options, None, gpu.peak_bytes(),
                      truncated=len(results) < count)
    run["startup_s"] = record["startup_s"]
    doc["runs"].append(run)
    _log_run(run)
    on_update(doc)
