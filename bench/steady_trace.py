"""Where a loaded engine's step time goes: GPU work, and the host around it, at N streams.

Usage (GPU machine, repo root): ``PYTHONPATH=runtime:bench python bench/steady_trace.py
--config configs/h200-capacity.toml --texts .benchdata/texts_en.tsv --tokenizer
.benchdata/tokenizer.json --streams 64,256 [--steps 300] [--set SECTION.KEY=VALUE] [--out X.json]``.
On a machine without CUDA it runs too (``--config`` a CPU profile): ``gpu`` is then the time
inside the stage functions' calls (``GraphRunner.__call__``, eager there), ``prep`` and ``post``
the host work before and after them.

Issue 31 measured the 256-stream profile busy only 76 % of the wall on the H200 (4 Dec): a
quarter of the time the GPU waited for the host. This run says which host work that is. For each
``--streams`` N it builds the engine once (graphs captured), adds N long requests (EOS ignored),
steps them on this thread (``Engine.step``, no event loop: what the serving engine's own thread
costs, without the server's loop competing for the interpreter) until every stream has had its
first chunk and ``--settle`` more steps ran, then records ``--steps`` steps. Each step is split
into
- ``schedule``: ``Scheduler.schedule`` (the plan),
- ``prep``: from ``ModelRunner.execute``'s call to the GPU starting the step's first kernel
  (slot admission, input packing, uploads, the launch; the GPU idles through it when it had
  nothing queued),
- ``gpu``: the step's work on the GPU (CUDA events on its stream),
- ``post``: from the GPU's end to ``execute`` returning (device-to-host copies, unpacking),
- ``commit``: ``Scheduler.commit`` and the engine's outputs;
and, on the host's clock alone, ``host_before_calls`` (from ``execute``'s call to the stage's
first ``GraphRunner`` call: the runner's and the stage's Python) and ``host_in_calls`` (from
then to the last such call's return: input copies and graph launches, or the eager work), which
tell a slow ``prep`` from Python apart from one in the launch (5 Dec, H200: DEPTH's prep was 8.7
ms at 256 streams, 3.6 ms at 64).
Host times come from ``perf_counter``; GPU times from events against a base event recorded on an
idle device, so both share one time line (to the launch latency, a few us). Prints per stage and
overall: mean of each part, the GPU's busy share and the idle between steps; writes JSON with the
GPU, torch version, commit and date.

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

from breezert.engine import Engine
from breezert.options import SynthesisOptions
from breezert.outputs import AudioChunk
from breezert.request import SynthesisRequest
from breezert.worker.cuda_graphs import GraphRunner
from breezert_bench.provenance import provenance
from breezert_bench.variants import config_with_overrides
from breezert_bench.workload import BUILTIN_TEXTS, load_texts, make_workload

PARTS = ("schedule", "prep", "gpu", "post", "commit")
EXTRA = ("idle_before", "host_before_calls", "host_in_calls")


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
            events = None
            if part == "execute" and self.cuda:
                events = (torch.cuda.Event(enable_timing=True),
                          torch.cuda.Event(enable_timing=True))
            t0 = time.perf_counter()
            if events:
                events[0].record()
            out = fn(*args, **kwargs)
            if events:
                events[1].record()
            t1 = time.perf_counter()
            cur = self._current
            cur[part] = (t0, t1)
            if part == "schedule" and out is not None:
                cur["stage"], cur["rows"] = out.stage.value, out.num_rows
            if part == "execute":
                cur["events"] = events
            if part == "outputs":
                self.records.append(cur)
            return out

        setattr(owner, name, timed)

    def table(self) -> list[dict[str, float]]:
        """Each recorded step: its stage, rows and the five parts in ms, plus the GPU's idle
        time since the previous step's work ended."""
        if self.cuda:
            torch.cuda.synchronize()
        rows, last_gpu_end = [], None
        for r in self.records:
            if "execute" not in r or "commit" not in r:
                continue
            (s0, s1), (e0, e1), (c0, _) = r["schedule"], r["execute"], r["commit"]
            _, o1 = r["outputs"]
            f0, f1 = r.get("fn", (e0, e0))
            if r["events"] is not None:
                g0 = self._base_host + self._base_event.elapsed_time(r["events"][0]) / 1000
                g1 = self._base_host + self._base_event.elapsed_time(r["events"][1]) / 1000
                g0 = max(g0, e0)  # the event is queued behind no work: it starts at the call
                g1 = min(max(g1, g0), e1)
            else:
                g0, g1 = r.get("fn", (e0, e1))
            calls = {"host_before_calls": f0 - e0, "host_in_calls": f1 - f0}
            row = {"stage": r["stage"], "rows": r["rows"],
                   "schedule": s1 - s0, "prep": g0 - e0, "gpu": g1 - g0, "post": e1 - g1,
                   "commit": o1 - c0,
                   "idle_before": 0.0 if last_gpu_end is None else max(0.0, g0 - last_gpu_end),
                   "wall": o1 - s0, **calls}
            last_gpu_end = g1
            rows.append({k: (round(v * 1000, 4) if isinstance(v, float) else v)
                         for k, v in row.items()})
        return rows


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
                               for k in PARTS if k != "gpu"}
    return out


def run_streams(engine: Engine, spans: StepSpans, texts: list[str], streams: int, steps: int,
                settle: int, tag: str, start_timeout_s: float = 600.0) -> dict[str, Any]:
    """Adds ``streams`` requests, steps until all started plus ``settle`` steps, records
    ``steps`` steps, then aborts them all and drains."""
    items = make_workload(texts, streams, seed=streams)
    ids = [f"{tag}-{i}" for i in range(streams)]
    for rid, item in zip(ids, items):
        engine.add_request(SynthesisRequest(text=item.text, options=SynthesisOptions(seed=item.seed),
                                            ignore_eos=True, max_frames=3000, request_id=rid))
    started: set[str] = set()
    limit = time.monotonic() + start_timeout_s
    while len(started) < streams and time.monotonic() < limit:
        for out in engine.step():
            if isinstance(out, AudioChunk):
                started.add(out.request_id)
    for _ in range(settle):
        engine.step()
    spans.start()
    for _ in range(steps):
        engine.step()
    spans.recording = False
    table = spans.table()
    for rid in ids:
        engine.abort(rid)
    while engine.has_work():
        engine.step()
    return {"streams": streams, "started": len(started), "summary": summarize(table),
            "steps": table}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="configs/h200-capacity.toml")
    parser.add_argument("--texts", default=None)
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--streams", default="64,256")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--settle", type=int, default=50)
    parser.add_argument("--start-timeout", type=float, default=600.0,
                        help="seconds to wait for every stream's first chunk")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--git-commit", default=None, help="record this commit (no .git)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    config = config_with_overrides(args.config, args.set, args.tokenizer, "steady")
    t0 = time.monotonic()
    engine = Engine(config)
    startup_s = time.monotonic() - t0
    spans = StepSpans(engine)
    texts = load_texts(args.texts) if args.texts else list(BUILTIN_TEXTS)
    runs: list[dict[str, Any]] = []

    def save() -> None:  # after each stream count: a timeout keeps what ran
        if args.out:
            Path(args.out).write_text(json.dumps(
                {**provenance(device=config.model.device, git_commit_override=args.git_commit),
                 "config": args.config, "set": args.set, "startup_s": startup_s, "runs": runs},
                indent=1))

    print(f"engine built in {startup_s:.1f} s", flush=True)
    for n in (int(v) for v in args.streams.split(",")):
        run = run_streams(engine, spans, texts, n, args.steps, args.settle, f"s{n}",
                          args.start_timeout)
        runs.append(run)
        s = run["summary"]
        print(f"{n} streams ({run['started']} started): {s['steps']} steps, "
              f"GPU busy {100 * (s['gpu_busy_share'] or 0):.1f} % of {s['wall_ms']:.1f} ms; "
              f"host per step {s['host_ms_per_step']}", flush=True)
        for stage, st in s["stages"].items():
            print(f"  {stage:12s} x{st['steps']:<4d} rows {st['rows']:6.1f}  " +
                  "  ".join(f"{k} {st[k]:.3f}" for k in PARTS + EXTRA), flush=True)
        save()


if __name__ == "__main__":
    main()
