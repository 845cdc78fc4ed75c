"""Where a loaded engine's step time goes: GPU work, and the host around it, at N streams.

Usage (GPU machine, repo root): ``PYTHONPATH=runtime:bench python bench/steady_trace.py
--config configs/h200-capacity.toml --texts .benchdata/texts_en.tsv --tokenizer
.benchdata/tokenizer.json --streams 64,256 [--steps 300] [--set SECTION.KEY=VALUE] [--out X.json]``.
On a machine without CUDA it runs too (``--config`` a CPU profile): ``gpu`` is then the time
inside the stage functions' calls (``GraphRunner.__call__``, eager there), ``prep`` and ``post``
the host work before and after them.

Issue 31 measured the 256-stream profile busy only 76 % of the wall on the H200 (4 Dec): a
quarter of the time the GPU waited for the host. This run says which host work that is. For each
``--streams`` N it builds the engine once (graphs captured), keeps N requests running (EOS
ignored; ``--lengths text``, the default: each as long as its text's speech and replaced by the
next text when it ends, so contexts and the PREFILL steps are serving's; ``long``: 3,000-frame
requests, as up to 6 Dec, whose contexts pass 1,024 tokens), steps them on this thread
(``Engine.step``, no event loop: what the serving engine's own thread costs, without the
server's loop competing for the interpreter) until each of the first N has had its
first chunk and ``--settle`` more steps ran, then records ``--steps`` steps. Each step is split
into
- ``schedule``: ``Scheduler.schedule`` (the plan),
- ``prep``: from ``ModelRunner.execute``'s call to the stage's first ``GraphRunner`` call (the
  runner's and the stage's Python: slot admission, input packing, uploads),
- ``launch``: inside the ``GraphRunner`` calls on the host (input copies and graph launches, or
  the eager work),
- ``gpu``: the step's work on the GPU, from its first ``GraphRunner`` call reaching the GPU to its
  last kernel (CUDA events on its stream); a step that reads nothing back (DECODE) goes on
  running on the GPU after ``execute`` returns, so its span may reach into the next step's host
  work,
- ``post``: from the later of the GPU's end and the last call's return to ``execute`` returning
  (device-to-host copies, unpacking),
- ``commit``: ``Scheduler.commit`` and the engine's outputs;
and ``idle_before``, the GPU's idle time between the previous step's last kernel and this step's
first (the host work the GPU waited for). 5 Dec's first H200 run (commit cea60fc) recorded the
GPU's start when ``execute`` was called and cut the GPU span at ``execute``'s return: the 8.7 ms
it showed as DEPTH's ``prep`` at 256 streams was the DECODE step before it still running on the
GPU (~11 ms at 512 rows, 5.0 at 128; ``bench/README.md``).
Host times come from ``perf_counter``; GPU times from events against a base event recorded on an
idle device, so both share one time line (to the launch latency, a few us). Prints per stage and
overall: mean of each part, the GPU's busy share and the idle between steps; writes JSON with the
GPU, torch version, commit and date. ``--launch-probe``: after the runs, each captured graph's
launch on the host (the time inside ``replay()``) beside its GPU time (and the DEPTH graphs'
kernel counts): what a launch costs the host.

Owns nothing the runtime uses. Must not: be read as the served throughput (no listeners, no
event loop; ``breezert-bench`` measures that).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from breezert.constants import FRAME_S
from breezert.engine import Engine
from breezert.options import SynthesisOptions
from breezert.outputs import AudioChunk
from breezert.request import SynthesisRequest
from breezert.worker.cuda_graphs import GraphRunner
from breezert_bench.provenance import provenance
from breezert_bench.variants import config_with_overrides
from breezert_bench.workload import BUILTIN_TEXTS, load_texts, make_workload

PARTS = ("schedule", "prep", "gpu", "post", "commit")
EXTRA = ("launch", "idle_before")


class StepSpans:
    """Wraps one engine's schedule, execute and commit; records each step's host and GPU spans
    (seconds on the host's ``perf_counter`` line) while ``recording``."""

    def __init__(self, engine: Engine) -> None:
        self.cuda = torch.cuda.is_available() and engine.config.model.device.startswith("cuda")
        self.records: list[dict[str, Any]] = []
        self.recording = False
        self._current: dict[str, Any] = {}
        self._base_host = 0.0
        self._base_event: Any = None
        self._wrap(engine.scheduler, "schedule", "schedule")
        self._wrap(engine.runner, "execute", "execute")
        self._wrap(engine.scheduler, "commit", "commit")
        self._wrap(engine, "_outputs", "outputs")
        self._wrap_runner_calls()  # on the CPU they stand for the GPU's work

    def start(self) -> None:
        """Aligns the GPU's clock with the host's on an idle device, then records."""
        if self.cuda:
            torch.cuda.synchronize()
            self._base_event = torch.cuda.Event(enable_timing=True)
            self._base_event.record()
        self._base_host = time.perf_counter()
        self.records.clear()
        self.recording = True

    def _wrap_runner_calls(self) -> None:
        call = GraphRunner.__call__
        spans = self

        def timed(runner: GraphRunner, key: Any, inputs: Any) -> Any:
            if spans.recording and spans.cuda and "first_call" not in spans._current:
                spans._current["first_call"] = torch.cuda.Event(enable_timing=True)
                spans._current["first_call"].record()
            t0 = time.perf_counter()
            out = call(runner, key, inputs)
            if spans.recording:
                first = spans._current.get("fn", (t0, t0))[0]
                spans._current["fn"] = (first, time.perf_counter())
            return out

        GraphRunner.__call__ = timed  # type: ignore[method-assign]

    def _wrap(self, owner: Any, name: str, part: str) -> None:
        fn = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.recording:
                return fn(*args, **kwargs)
            if part == "schedule":
                self._current = {}
            end = None
            if part == "execute" and self.cuda:
                end = torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            if end is not None:
                end.record()
            t1 = time.perf_counter()
            cur = self._current
            cur[part] = (t0, t1)
            if part == "schedule" and out is not None:
                cur["stage"], cur["rows"] = out.stage.value, out.num_rows
            if part == "execute":
                cur["end_event"] = end
            if part == "outputs":
                self.records.append(cur)
            return out

        setattr(owner, name, timed)

    def table(self) -> list[dict[str, float]]:
        """Each recorded step: its stage, rows, the parts in ms (module docstring) and the GPU's
        idle time since the previous step's last kernel."""
        if self.cuda:
            torch.cuda.synchronize()
        rows, last_gpu_end = [], None
        for r in self.records:
            if "execute" not in r or "commit" not in r:
                continue
            (s0, s1), (e0, e1), (c0, _) = r["schedule"], r["execute"], r["commit"]
            _, o1 = r["outputs"]
            f0, f1 = r.get("fn", (e0, e0))
            if r.get("end_event") is not None and "first_call" in r:
                g0 = max(self._gpu_time(r["first_call"]), f0)  # queued behind nothing: the call
                g1 = max(self._gpu_time(r["end_event"]), g0)
                gpu = g1 - g0
            else:  # on the CPU the calls are the work
                g0, g1 = f0, f1
                gpu = f1 - f0
            row = {"stage": r["stage"], "rows": r["rows"],
                   "schedule": s1 - s0, "prep": f0 - e0, "gpu": gpu,
                   "post": e1 - max(f1, min(g1, e1)), "commit": o1 - c0,
                   "launch": f1 - f0,
                   "idle_before": 0.0 if last_gpu_end is None else max(0.0, g0 - last_gpu_end),
                   "wall": o1 - s0}
            last_gpu_end = g1
            rows.append({k: (round(v * 1000, 4) if isinstance(v, float) else v)
                         for k, v in row.items()})
        return rows

    def _gpu_time(self, event: Any) -> float:
        """An event's time on the host's ``perf_counter`` line."""
        return self._base_host + self._base_event.elapsed_time(event) / 1000


def summarize(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Means per stage and overall; the GPU's busy share of the recorded wall."""
    by_stage: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for s in steps:
        by_stage[s["stage"]].append(s)
    keys = ("rows",) + PARTS + EXTRA + ("wall",)
    out: dict[str, Any] = {"stages": {}}
    for stage, group in sorted(by_stage.items()):
        out["stages"][stage] = {"steps": len(group),
                                **{k: round(statistics.mean(g[k] for g in group), 4)
                                   for k in keys}}
    wall = sum(s["wall"] for s in steps)
    busy = sum(s["gpu"] for s in steps)
    out["steps"] = len(steps)
    out["wall_ms"] = round(wall, 2)
    out["gpu_busy_share"] = round(busy / wall, 4) if wall else None
    out["host_ms_per_step"] = {k: round(sum(s[k] for s in steps) / len(steps), 4)
                               for k in PARTS + ("launch",) if k != "gpu"}
    # every DEPTH step makes one frame (80 ms of audio) per request it runs
    depth = by_stage.get("depth", [])
    out["frame_period_ms"] = round(wall / len(depth), 3) if depth else None
    # four significant digits: a tiny CPU run makes well under 1 s of audio a second
    out["audio_s_per_s"] = (float(f"{FRAME_S * sum(s['rows'] for s in depth) / (wall / 1000):.4g}")
                            if depth and wall else None)
    out["gpu_share_by_stage"] = {stage: round(sum(g["gpu"] for g in group) / wall, 4)
                                 for stage, group in sorted(by_stage.items())} if wall else {}
    return out


def run_streams(engine: Engine, spans: StepSpans, texts: list[str], streams: int, steps: int,
                settle: int, tag: str, start_timeout_s: float = 120.0,
                lengths: str = "text") -> dict[str, Any]:
    """Keeps ``streams`` requests running, steps until the first ``streams`` started plus
    ``settle`` steps, records ``steps`` steps, then aborts them all and drains.

    ``lengths="text"``: each request is as long as its text's speech (EOS ignored, so random
    weights stop there too) and a finished one is replaced by the next text at once: contexts,
    PREFILL and TEXT_ENCODE steps as in serving. ``"long"``: 3,000-frame requests, never
    replaced (6 Dec and before): the oldest streams' contexts pass 1,024 tokens and DECODE's
    attention dominates."""
    if lengths not in ("text", "long"):
        raise ValueError(f"lengths={lengths!r}: 'text' or 'long'")
    batch = make_workload(texts, max(streams, len(texts)), seed=streams)
    added = 0
    live: set[str] = set()

    def add_next() -> None:
        nonlocal added
        item = batch[added % len(batch)]
        rid = f"{tag}-{added}"
        frames = item.num_frames if lengths == "text" else 3000
        options = SynthesisOptions(seed=item.seed)
        engine.add_request(SynthesisRequest(text=item.text, options=options, ignore_eos=True,
                                            max_frames=frames, request_id=rid))
        live.add(rid)
        added += 1

    def step() -> list[Any]:
        outputs = engine.step()
        for out in outputs:
            if isinstance(out, AudioChunk) and out.is_final and out.request_id in live:
                live.discard(out.request_id)
                add_next()
        return outputs

    for _ in range(streams):
        add_next()
    first = set(live)  # the streams whose first chunks the start waits for
    started: set[str] = set()
    t0 = time.monotonic()
    report = t0 + 10.0
    while len(started) < streams and (now := time.monotonic()) < t0 + start_timeout_s:
        for out in step():
            if isinstance(out, AudioChunk) and out.request_id in first:
                started.add(out.request_id)
        if now >= report:  # a slow start says how far it got, not nothing for minutes
            print(f"  {streams} streams: {len(started)} started after {now - t0:.0f} s",
                  flush=True)
            report = now + 10.0
    if len(started) < streams:
        print(f"  {streams} streams: only {len(started)} started within {start_timeout_s:.0f} s;"
              " recording the steps anyway", flush=True)
    for _ in range(settle):
        step()
    spans.start()
    added_before = added
    for _ in range(steps):
        step()
    spans.recording = False
    table = spans.table()
    for rid in sorted(live):
        engine.abort(rid)
    while engine.has_work():
        engine.step()
    return {"streams": streams, "started": len(started), "lengths": lengths,
            "replaced_while_recording": added - added_before, "summary": summarize(table),
            "steps": table}


def traced_kernels(graph: torch.cuda.CUDAGraph) -> int:
    """Kernels one replay of ``graph`` runs, counted by the profiler (torch keeps no
    ``cudaGraph_t`` after instantiation unless asked to, so the driver cannot list nodes)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA and "emcpy" not in e.name
               and "emset" not in e.name)


def launch_probe(engine: Engine, repeats: int = 3) -> list[dict[str, Any]]:
    """Each captured graph of every stage: the host's time inside ``replay()`` (the launch) and
    the GPU's time from its start to its end, on an idle device, median of ``repeats``; for the
    DEPTH graphs (the largest) the kernels a replay runs. Run last: a replay rewrites the slot
    rows its static inputs name."""
    rows: list[dict[str, Any]] = []
    for stage, worker in engine.runner.stages.items():
        runners = [(name, value) for name, value in vars(worker).items()
                   if isinstance(value, GraphRunner)]
        for name, runner in runners:
            for key in runner.keys:
                graph = runner.captured_graph(key)
                host, gpu = [], []
                for _ in range(repeats):
                    torch.cuda.synchronize()
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                        enable_timing=True)
                    start.record()
                    t0 = time.perf_counter()
                    graph.replay()
                    host.append(time.perf_counter() - t0)
                    end.record()
                    torch.cuda.synchronize()
                    gpu.append(start.elapsed_time(end) / 1000)
                stage_name = getattr(stage, "value", str(stage))
                rows.append({"stage": stage_name, "runner": name,
                             "key": repr(key), "launch_ms": round(statistics.median(host) * 1e3, 4),
                             "gpu_ms": round(statistics.median(gpu) * 1e3, 4),
                             "kernels": traced_kernels(graph) if stage_name == "depth" else None})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="configs/h200-capacity.toml")
    parser.add_argument("--texts", default=None)
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--streams", default="64,256")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--settle", type=int, default=50)
    parser.add_argument("--start-timeout", type=float, default=120.0,
                        help="seconds to wait for every stream's first chunk")
    parser.add_argument("--lengths", choices=("text", "long"), default="text",
                        help="text: each request as long as its text, replaced when it ends "
                             "(serving's contexts); long: 3,000-frame requests (6 Dec and before)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--git-commit", default=None, help="record this commit (no .git)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--launch-probe", action="store_true",
                        help="after the runs: each captured graph's launch (host) and GPU time")
    args = parser.parse_args()
    config = config_with_overrides(args.config, args.set, args.tokenizer, "steady")
    t0 = time.monotonic()
    engine = Engine(config)
    startup_s = time.monotonic() - t0
    spans = StepSpans(engine)
    texts = load_texts(args.texts) if args.texts else list(BUILTIN_TEXTS)
    runs: list[dict[str, Any]] = []
    launches: list[dict[str, Any]] = []

    def save() -> None:  # after each stream count: a timeout keeps what ran
        if args.out:
            Path(args.out).write_text(json.dumps(
                {**provenance(device=config.model.device, git_commit_override=args.git_commit),
                 "config": args.config, "set": args.set, "startup_s": startup_s, "runs": runs,
                 "launches": launches},
                indent=1))

    print(f"engine built in {startup_s:.1f} s", flush=True)
    for n in (int(v) for v in args.streams.split(",")):
        run = run_streams(engine, spans, texts, n, args.steps, args.settle, f"s{n}",
                          args.start_timeout, args.lengths)
        runs.append(run)
        s = run["summary"]
        print(f"{n} streams ({run['started']} started): {s['steps']} steps, "
              f"GPU busy {100 * (s['gpu_busy_share'] or 0):.1f} % of {s['wall_ms']:.1f} ms; "
              f"host per step {s['host_ms_per_step']}; a frame every "
              f"{s['frame_period_ms']} ms, {s['audio_s_per_s']} s of audio a second, GPU share "
              f"by stage {s['gpu_share_by_stage']}", flush=True)
        for stage, st in s["stages"].items():
            print(f"  {stage:12s} x{st['steps']:<4d} rows {st['rows']:6.1f}  " +
                  "  ".join(f"{k} {st[k]:.3f}" for k in PARTS + EXTRA), flush=True)
        save()
    if args.launch_probe and torch.cuda.is_available():
        launches.extend(launch_probe(engine))
        save()
        for row in sorted(launches, key=lambda r: -r["launch_ms"])[:25]:
            print(f"  launch {row['stage']:8s} {row['runner']:18s} {row['key']:24s} "
                  f"host {row['launch_ms']:7.3f} ms  gpu {row['gpu_ms']:7.3f} ms  "
                  f"kernels {row['kernels']}", flush=True)


if __name__ == "__main__":
    main()
