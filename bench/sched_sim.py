"""The engine's scheduling on the H200's step times, on any CPU: where a loaded engine's time goes.

Runs the real ``Engine`` (scheduler, predictor, chunk policy, commit, outputs, metrics) with its
worker's ``execute`` replaced by a stage-time model fitted to the H200 runs of the serving
profile (``STEP_MS`` below, from ``bench/results/h200-profile-pdl-decode-off-20261202.json.gz`` and
``h200-first-packet-pdl-20261202.json.gz``), on a clock that advances by the model's time for each
step plus the host time the engine really spends here (scheduling, commit, outputs, playback
reports). The load is the bench's: closed loop of N callers over ``texts_en.tsv`` (a refused
one says its request again after the refusal's wait), the same lengths and seeds, EOS ignored,
a simulated listener reporting its buffer every 100 ms.

Usage (repo root, CPU): ``PYTHONPATH=runtime python bench/sched_sim.py --concurrency 16,64
[--rate 20,40] [--variant 'NAME=scheduler.key=value;...'] [--frames N] [--out X.json]``.
``--rate``: open-loop points too (arrivals every ``1/rate`` s of model time, whatever is in
flight); a request the engine refuses (``EngineOverloaded``) counts as ``refused``, one that
waited past ``max_queue_wait_s`` as ``expired``. ``--frames``: every request that many frames
long instead of its text's length (long streams, as ``steady_trace.py``).

Owns: the stage-time model, the simulated worker and clock, the closed-loop driver. Must not: be
read as a GPU measurement. It shows how scheduling decisions and host time shape first packets
and gaps under a given step-time model, so that the H200's minutes go to the changes that can
win; every change it suggests is measured on the H200 before it becomes a default.
"""

from __future__ import annotations

import argparse
import bisect
import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from breezert_bench.provenance import provenance
from breezert_bench.listener import LATE_EPS_S, RequestResult, summarize
from breezert_bench.variants import parse_variant_spec
from breezert_bench.runner import item_request, refused_wait_s
from breezert_bench.workload import WorkItem, load_texts, make_workload
from breezert.config import EngineConfig, GraphConfig
from breezert.constants import Stage
from breezert.engine import Engine, RequestOutcome
from breezert.errors import EngineOverloaded
from breezert.outputs import AudioChunk, DecodedChunk, StageOutput
from breezert.request import SynthesisRequest
from breezert.sched.plan import StepPlan

SAMPLES_PER_FRAME = 1920
REPO = Path(__file__).resolve().parent.parent

STEP_MS: dict[Stage, tuple[tuple[float, float], ...]] = {
    # (rows, ms) of the engine's own step times (host preparation and GPU, p50), H200, the
    # serving profile (fused kernels, graphs, PDL in depth and text encoder); linear between.
    # DEPTH holds the DECODE graph queued before it (DECODE reads nothing back).
    Stage.DEPTH: ((1, 9.6), (14, 10.0), (44, 12.4), (64, 13.5)),
    Stage.DECODE: ((1, 0.54), (14, 1.2), (48, 2.47), (128, 5.0)),
    Stage.TEXT_ENCODE: ((1, 1.9), (2, 3.0), (16, 9.0)),
    Stage.PREFILL: ((1, 0.6), (2, 0.95), (16, 4.0)),
}
CODEC_MS = (3.3, 0.07, 0.3)
"""CODEC step: base + per frame past the first + per chunk past the first (ms). Fitted to the
engine's CODEC steps at c=1 (3.8 ms p50 over 1-16 frame chunks), c=16 (5.97 ms mean, 2.9 chunks,
~28 frames) and c=64 (8.5 ms mean, 5.4 chunks, ~48 frames)."""


H100_CAPACITY_MS: dict[Stage, tuple[tuple[float, float], ...]] = {
    # the capacity profile's steps on the H100 (bench/results/
    # h100-capacity-headroom-long-20261206-5.json.gz, step times and rows by stage at headroom
    # 0.4 / 0.7 and 40 / 60 req/s): DEPTH with the DECODE before it 17.2 ms at ~75 rows, 19.0 at
    # ~125, 23.4-25.3 at ~145-150; the 64- and 128-row buckets' steps written as cliffs; the
    # 256 and 512 points from the fused depth frame's H100 tuning plus DECODE
    Stage.DEPTH: ((1, 9.0), (64, 13.0), (65, 17.0), (128, 19.0), (129, 23.0), (256, 27.0),
                  (512, 45.0)),
    Stage.DECODE: ((1, 0.3), (512, 0.6)),  # host only: its GPU time is in DEPTH's
    Stage.TEXT_ENCODE: ((1, 0.54), (3, 0.9), (16, 1.5)),
    Stage.PREFILL: ((1, 0.52), (3, 0.96), (16, 1.6)),
}
H100_CAPACITY_CODEC_MS = (3.0, 0.06, 0.4)
"""CODEC on the H100 in the capacity runs: 5.9 ms at ~4 chunks, 9.3-10.8 at 10-16."""
STEP_MODELS = {"h200": (STEP_MS, CODEC_MS),
               "h100-capacity": (H100_CAPACITY_MS, H100_CAPACITY_CODEC_MS)}
"""``--step-model``: the H200 fit of 2 Dec (the latency profile's default) and the H100 fit of
6 Dec's capacity runs (reproduces their served, gapped and s/s at 0.4 and 0.7 within ~5 %,
gapped within ~30 %: bench/README.md, "H100, 6 Dec (fifth session)")."""
PROFILES = {"latency": "h200-latency.toml", "capacity": "h200-capacity.toml"}


@dataclass(frozen=True)
class StageTimes:
    """The stage-time model: ``points`` per stage, ``(rows, ms)`` of a step, linear between two
    points and along the last two past the end; ``codec`` the CODEC step's ``(base, per frame
    past the first, per chunk past the first)`` ms. A variant changes it with the ``sim.*``
    what-if switches (``with_switches``) to ask how fast a stage must get for a target."""

    points: dict[Stage, tuple[tuple[float, float], ...]] = field(
        default_factory=lambda: dict(STEP_MS))
    codec: tuple[float, float, float] = CODEC_MS

    def step_ms(self, plan: StepPlan) -> float:
        """The model's time of one step."""
        if plan.stage is Stage.CODEC:
            items = list(plan.items)  # CODEC rows: this tree's or an older one's (host_step)
            frames = sum(item.num_frames for item in items)
            base, per_frame, per_chunk = self.codec
            return base + per_frame * max(0, frames - 1) + per_chunk * max(0, len(items) - 1)
        points = self.points[plan.stage]
        rows = plan.num_rows
        xs = [x for x, _ in points]
        i = min(max(bisect.bisect_left(xs, rows), 1), len(points) - 1)
        (x0, y0), (x1, y1) = points[i - 1], points[i]
        return y0 + (y1 - y0) * (rows - x0) / (x1 - x0)

    def with_switches(self, switches: dict) -> StageTimes:
        """This model with ``sim.<stage>_ms = [[rows, ms], ...]`` (a stage's points replaced,
        at least two), ``sim.codec_ms = [base, per_frame, per_chunk]`` and ``sim.<stage>_scale
        = f`` (every time of that stage, codec too, times f) applied; other keys ignored."""
        points, codec = dict(self.points), self.codec
        for stage in points:
            if f"{stage.value}_ms" in switches:
                new = tuple((float(r), float(ms)) for r, ms in switches[f"{stage.value}_ms"])
                if len(new) < 2 or [r for r, _ in new] != sorted({r for r, _ in new}):
                    raise SystemExit(f"sim.{stage.value}_ms: two or more [rows, ms] points, "
                                     "rows increasing")
                points[stage] = new
        if "codec_ms" in switches:
            codec = tuple(float(x) for x in switches["codec_ms"])  # type: ignore[assignment]
            if len(codec) != 3:
                raise SystemExit("sim.codec_ms: [base, per_frame, per_chunk]")
        for stage in (*points, Stage.CODEC):
            scale = float(switches.get(f"{stage.value}_scale", 1.0))
            if scale <= 0:
                raise SystemExit(f"sim.{stage.value}_scale: a factor above 0, not {scale}")
            if stage is Stage.CODEC:
                codec = tuple(x * scale for x in codec)  # type: ignore[assignment]
            else:
                points[stage] = tuple((r, ms * scale) for r, ms in points[stage])
        return StageTimes(points, codec)


def step_ms(plan: StepPlan) -> float:
    """The fitted model's time of one step (``StageTimes()``)."""
    return StageTimes().step_ms(plan)


class SimClock:
    """Model time of the steps run so far plus the host time spent inside the engine's calls
    (``host()`` and ``step()`` bracket them; CPU time of this thread, so that other processes on
    a shared machine do not count); the driver's own bookkeeping does not count.

    ``host_model = (a, b)`` replaces the measured host time with ``a + b * running requests``
    ms per engine step (and nothing for the other calls): the run is then deterministic, so
    two scheduling policies can be compared without this machine's timing noise."""

    def __init__(self, host_model: tuple[float, float] | None = None) -> None:
        self.model_s = 0.0
        self.host_s = 0.0
        self.host_model = host_model
        self._since: float | None = None

    def __call__(self) -> float:
        live = (time.thread_time() - self._since
                if self._since is not None and self.host_model is None else 0.0)
        return self.model_s + self.host_s + live

    def host(self, fn, *args):  # type: ignore[no-untyped-def]
        """An engine call other than a step (with a host model it costs nothing)."""
        self._since = time.thread_time()
        try:
            return fn(*args)
        finally:
            if self.host_model is None:
                self.host_s += time.thread_time() - self._since
            self._since = None

    def step(self, engine: Engine, running: int) -> list:
        """``engine.step()`` with ``running`` requests in flight."""
        outputs = self.host(engine.step)
        if self.host_model is not None:
            a, b = self.host_model
            self.host_s += (a + b * running) / 1000
        return outputs


@dataclass
class SimWorker:
    """Stands in for ``ModelRunner.execute``: first codes for DEPTH, silent PCM for CODEC, and
    the model's step time added to the clock."""

    clock: SimClock
    times: StageTimes = field(default_factory=StageTimes)
    steps: dict[str, list[float]] = field(default_factory=dict)

    def execute(self, plan: StepPlan) -> StageOutput:
        ms = self.times.step_ms(plan)
        self.clock.model_s += ms / 1000
        self.steps.setdefault(plan.stage.value, []).append(ms)
        out = StageOutput()
        if plan.stage is Stage.DEPTH:
            out.first_codes = dict.fromkeys(plan.request_ids, 7)
        elif plan.stage is Stage.CODEC:
            out.chunks = [DecodedChunk(item.request_id, item.start_frame, item.num_frames,
                                       np.zeros(item.num_frames * SAMPLES_PER_FRAME, np.float32),
                                       item.is_final)
                          for item in plan.items]  # rows of any tree's CODEC plan
        return out

    def release(self, request_id: str) -> None:
        pass


def build_engine(overrides: dict[str, dict], clock: SimClock, profile: str = "latency",
                 step_model: str = "h200") -> tuple[Engine, SimWorker]:
    """A serving profile's scheduler and cache (``PROFILES``) on the tiny CPU model, its
    worker simulated on a stage-time model (``STEP_MODELS``)."""
    base = EngineConfig.from_file(REPO / "configs" / PROFILES[profile]).model_dump()
    base["model"] = {"preset": "tiny", "device": "cpu", "dtype": "float32"}
    base["graph"] = GraphConfig().model_dump()
    base["cache"]["num_blocks"] = 8192
    for section, values in overrides.items():
        if section != "sim":
            base[section].update(values)
    engine = Engine(EngineConfig.from_dict(base), clock=clock)
    apply_sim_switches(engine, overrides.get("sim", {}))
    points, codec = STEP_MODELS[step_model]
    worker = SimWorker(clock, StageTimes(dict(points), codec).with_switches(
        overrides.get("sim", {})))
    engine.runner = worker  # type: ignore[assignment]
    return engine, worker


@dataclass
class Stream:
    result: RequestResult
    item: WorkItem
    attempt: int = 0
    """How many times its caller was refused before this request (``run_point``)."""
    next_report: float | None = None


def run_point(engine: Engine, clock: SimClock, items, concurrency: int, tag: str,
              feedback_period_s: float = 0.1, max_steps: int | None = None,
              rate: float | None = None) -> list[RequestResult]:
    """Closed loop: ``concurrency`` callers, each with one request in flight, until every
    item has finished (or, with ``max_steps``, until that many engine steps have run, the rest
    left in flight); a refused request (``error`` ``EngineOverloaded``, a record of its own)
    is said again by its caller after the refusal's wait (``runner.refused_wait_s``), as the
    bench's callers do. With ``rate``, open loop: item ``i``
    arrives ``i / rate`` s after the start, whatever is in flight, and a refused one ends."""
    pending = list(items)
    live: dict[str, Stream] = {}
    done: list[RequestResult] = []
    again: list[tuple[float, WorkItem, int]] = []  # refused callers: (when, item, attempt)

    arriving: list[SynthesisRequest] = []
    start, num_arrived = clock(), 0

    def deliver() -> None:
        for request in arriving:
            try:
                clock.host(engine.add_request, request)
            except EngineOverloaded as exc:
                stream = live.pop(str(request.request_id))
                stream.result.status, stream.result.error = "error", "EngineOverloaded"
                done.append(stream.result)
                if rate is None:
                    again.append((clock() + refused_wait_s(exc.retry_after_s), stream.item,
                                  stream.attempt + 1))
        arriving.clear()

    def submit(item: WorkItem, attempt: int = 0) -> None:
        request = item_request(item, tag, attempt)
        result = RequestResult(item.index, str(request.request_id), item.num_frames, clock())
        arriving.append(request)
        live[result.request_id] = Stream(result, item, attempt)

    steps = 0
    while (pending or live or again) and (max_steps is None or steps < max_steps):
        steps += 1
        # A request that replaces a finished one reaches the engine while its next step runs
        # (the serving loop does not wait for arrivals), so it is added after that step.
        deliver()
        if rate is None:
            for entry in [e for e in again if e[0] <= clock()]:
                again.remove(entry)
                submit(entry[1], entry[2])
            while pending and len(live) + len(again) < concurrency:
                submit(pending.pop(0))
        else:  # open loop: each arrival reaches the engine before the step after its time
            while pending and start + num_arrived / rate <= clock():
                submit(pending.pop(0))
                num_arrived += 1
        if steps == 1 or rate is not None:  # the opening burst is there before the first step
            deliver()
        now = clock()
        for stream in live.values():
            if stream.next_report is not None and stream.next_report <= now:
                timeline = stream.result.timeline
                clock.host(engine.report_playback, stream.result.request_id,
                           timeline.buffered_s(now), now, "simulated")
                stream.result.num_feedback_reports += 1
                stream.next_report += feedback_period_s
        outputs = clock.step(engine, len(live))
        if not engine.last_step_ran and not outputs:
            clock.model_s += 0.0005  # idle: the loop waits for work
        for out in outputs:
            if isinstance(out, AudioChunk):
                stream = live[out.request_id]
                stream.result.add_chunk(out.created_time, out.duration_s, out.num_frames,
                                        out.created_time)
                if stream.next_report is None:
                    stream.next_report = out.created_time + feedback_period_s
            elif isinstance(out, RequestOutcome):
                stream = live.pop(out.request_id)
                if out.status.value != "finished":
                    stream.result.status = "error"
                    stream.result.error = "expired" if out.overloaded else out.status.value
                done.append(stream.result)
    return done


def summary(results: list[RequestResult], concurrency: int, wall_s: float,
            worker: SimWorker, host_s: float) -> dict:
    ok = [r for r in results if r.is_ok and r.chunk_times]
    ordered = sorted(ok, key=lambda r: r.submit_time)
    burst, after = ordered[:concurrency], ordered[concurrency:]

    def ttfb_ms(rs: list[RequestResult]) -> dict:
        s = summarize((r.chunk_times[0] - r.submit_time) * 1000 for r in rs)
        return {k: (round(v, 1) if isinstance(v, float) else v) for k, v in s.items()}

    audio = sum(sum(r.chunk_durations_s) for r in ok)
    late = [r for r in ok if r.timeline.has_underrun]
    late_chunks: dict[int, int] = {}
    for r in late:
        for k, lateness in enumerate(r.timeline.lateness_s):
            if lateness > LATE_EPS_S:
                late_chunks[k] = late_chunks.get(k, 0) + 1
    steps = {stage: {"count": len(ms), "mean_ms": round(sum(ms) / len(ms), 2),
                     "share": round(sum(ms) / 1000 / wall_s, 3)}
             for stage, ms in worker.steps.items()}
    return {
        "requests": len(results), "ok": len(ok),
        "refused": sum(r.error == "EngineOverloaded" for r in results),
        "expired": sum(r.error == "expired" for r in results), "ttfb_ms": ttfb_ms(ok),
        "burst_ttfb_ms": ttfb_ms(burst), "after_ttfb_ms": ttfb_ms(after),
        "underrun_requests": len(late),
        "burst_underruns": sum(r.timeline.has_underrun for r in burst),
        "max_extra_buffer_ms": round(max((r.timeline.extra_buffer_s for r in ok), default=0)
                                     * 1000, 1),
        "total_extra_buffer_s": round(sum(r.timeline.extra_buffer_s for r in ok), 2),
        "max_stall_ms": round(max((r.timeline.longest_stall_s for r in ok), default=0) * 1000,
                              1),
        "late_chunks_by_index": dict(sorted(late_chunks.items())),
        "audio_s_per_s": round(audio / wall_s, 1), "wall_s": round(wall_s, 2),
        "model_busy": round(sum(sum(ms) for ms in worker.steps.values()) / 1000 / wall_s, 3),
        "host_share": round(host_s / wall_s, 3),
        "host_ms_per_step": round(1000 * host_s / max(1, sum(len(ms) for ms in
                                                              worker.steps.values())), 3),
        "steps": steps,
    }


WHAT_IF_SWITCHES = tuple(
    [f"sim.{stage.value}_ms" for stage in STEP_MS] + ["sim.codec_ms"]
    + [f"sim.{stage.value}_scale" for stage in (*STEP_MS, Stage.CODEC)])
"""The stage-time model changed for a variant (``StageTimes.with_switches``), e.g.
``--variant 'fast-te=sim.text_encode_ms=[[1, 1.9], [16, 3.0]]'``."""
SIM_SWITCHES = ("sim.predict_memo", *WHAT_IF_SWITCHES)
"""``sim.predict_memo = false`` recomputes every stage-time prediction (as before 2 Dec). The
per-request host paths once compared here (shared keys, a pass cache) gave way to the
vectorized ranking over the ``StreamTable``; ``bench/host_step.py`` measures a step's host time
against the per-request code."""


def parse_variant(spec: str) -> tuple[str, dict[str, dict]]:
    """The bench's ``--variant`` syntax (``NAME=section.key=value;...``, TOML values) plus the
    simulator's own ``sim.*`` switches."""
    variant = parse_variant_spec(spec)
    unknown = [f"sim.{key}" for key in variant.overrides.get("sim", {})
               if f"sim.{key}" not in SIM_SWITCHES]
    if unknown:
        raise SystemExit(f"unknown simulator switch {', '.join(unknown)}: {SIM_SWITCHES}")
    return variant.name, {section: dict(values) for section, values in variant.overrides.items()}


def apply_sim_switches(engine: Engine, switches: dict) -> None:
    if not switches.get("predict_memo", True) and engine.predictor is not None:
        model = engine.predictor.time_model
        model.predict = model._predict  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", default="16,64")
    p.add_argument("--num-requests", type=int, default=300)
    p.add_argument("--warmup", type=int, default=16)
    p.add_argument("--texts", default=str(REPO.parent / "shared" / "bench" / "texts_en.tsv"))
    p.add_argument("--variant", action="append", default=[],
                   help="NAME=section.key=value;... as in breezert-bench, TOML values, plus "
                        "sim.* switches (default: one variant, the profile)")
    p.add_argument("--host-model", default=None, metavar="A,B",
                   help="host ms per engine step = A + B x running requests instead of the "
                        "host time measured here (deterministic runs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rate", default="", help="open-loop points, requests per second")
    p.add_argument("--frames", type=int, default=None,
                   help="frames of every measured request (default: its text's length)")
    p.add_argument("--profile", choices=sorted(PROFILES), default="latency",
                   help="the configs/ profile whose scheduler runs")
    p.add_argument("--step-model", choices=sorted(STEP_MODELS), default="h200",
                   help="the stage-time model the simulated worker charges")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    texts = load_texts(args.texts)
    variants = [parse_variant(v) for v in args.variant] or [("profile", {})]
    runs = []
    points = [(int(c), None) for c in args.concurrency.split(",") if c] + [
        (0, float(r)) for r in args.rate.split(",") if r]
    for name, overrides in variants:
        for concurrency, rate in points:
            clock = SimClock(tuple(float(x) for x in args.host_model.split(","))
                             if args.host_model else None)
            engine, worker = build_engine(overrides, clock, args.profile, args.step_model)
            run_point(engine, clock, make_workload(texts, args.warmup, args.seed + 1),
                      concurrency or args.warmup, "warm")
            worker.steps.clear()
            start, host0 = clock(), clock.host_s
            items = make_workload(texts, args.num_requests, args.seed)
            if args.frames:
                items = [replace(item, num_frames=args.frames) for item in items]
            results = run_point(engine, clock, items, concurrency, "run", rate=rate)
            wall = clock() - start
            run = {"variant": name, "overrides": overrides, "concurrency": concurrency,
                   "rate_rps": rate,
                   "step_ms": {st.value: v for st, v in worker.times.points.items()},
                   "codec_ms": worker.times.codec,
                   **summary(results, concurrency, wall, worker, clock.host_s - host0),
                   "counters": engine.metrics.snapshot().get("counters", {})}
            runs.append(run)
            t = run["ttfb_ms"]
            point = f"r={rate:g}/s" if rate is not None else f"c={concurrency}"
            print(f"{name} {point}: {run['ok']} ok, {run['refused']} refused, {run['expired']} "
                  f"expired; TTFB p50 {t['p50']} p95 {t['p95']} ms, "
                  f"underruns {run['underrun_requests']} (burst {run['burst_underruns']}, "
                  f"late chunks by index {run['late_chunks_by_index']}), "
                  f"{run['audio_s_per_s']} audio s/s, model busy {run['model_busy']}, "
                  f"host {run['host_share']} ({run['host_ms_per_step']} ms a step)", flush=True)
    doc = {"schema": "breezert-sched-sim/1", **provenance(device="cpu"),
           "step_ms": {s.value: v for s, v in STEP_MODELS[args.step_model][0].items()},
           "codec_ms": STEP_MODELS[args.step_model][1],
           "options": vars(args), "runs": runs}
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
