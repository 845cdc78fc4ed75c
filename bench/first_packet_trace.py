"""One request's first packet on the serving engine, step by step on the host and on the GPU.

Usage (GPU machine, repo root; on the CPU ``--config runtime/breezert/profiles/cpu-tiny.toml``, host
times only): ``PYTHONPATH=runtime python bench/first_packet_trace.py --config
configs/h200-latency.toml --texts .benchdata/texts_en.tsv --tokenizer .benchdata/tokenizer.json
[--requests 5] [--set graph.fused_prefill=true] [--out X.json]``. Builds the engine (graphs
captured), warms it with a few requests, then for each of ``--requests`` sentences submits one
request to the idle engine and steps it on this thread (``Engine.step``, no event loop) until its
first chunk. Each step is bracketed by CUDA events on the stream its work runs on, so the run shows,
per step, when the host ran it and when the GPU ran its work (the start event completes when the GPU
reaches the step's first kernel), and so where the GPU sat idle waiting for the host. The last
request runs under ``torch.profiler`` for the kernel census of the whole first packet (launches,
busy time, the top kernels). Prints a table per request and the medians; writes JSON with the GPU,
torch version, commit and date.

Owns nothing the runtime uses. Must not: be read as a loaded engine's first packet (one request
at a time, no event loop beside the engine thread: the c=1 figure of ``breezert-bench`` is that).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from breezert.engine import Engine
from breezert.options import SynthesisOptions
from breezert.outputs import AudioChunk
from breezert.request import SynthesisRequest
from breezert_bench.provenance import provenance
from breezert_bench.variants import config_with_overrides
from breezert_bench.workload import load_texts, make_workload


class StepClock:
    """Wraps the engine's ``runner.execute``: host start/end of each step (ms from ``base``)
    and CUDA events around its work (on the CPU, where the host does the work, its times
    stand for the device's)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._execute = engine.runner.execute
        engine.runner.execute = self._timed  # type: ignore[method-assign]
        self.records: list[dict[str, Any]] = []
        self.base_host = 0.0
        self.base_event: torch.cuda.Event | None = None
        self.cuda = engine.runner.device.type == "cuda"

    def start(self) -> None:
        self.records.clear()
        if self.cuda:
            self.base_event = torch.cuda.Event(enable_timing=True)
            self.base_event.record()
        self.base_host = time.perf_counter()

    def _timed(self, plan: Any) -> Any:
        events = None
        if self.cuda:
            events = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        host_start = time.perf_counter()
        if events:
            events[0].record()
        out = self._execute(plan)
        if events:
            events[1].record()
        self.records.append({"stage": plan.stage.value, "rows": plan.num_rows,
                             "host": (host_start, time.perf_counter()), "gpu": events})
        return out

    def timeline(self) -> list[dict[str, Any]]:
        """Each step: stage, rows, host and GPU start/end in ms from ``start``."""
        if self.cuda:
            torch.cuda.synchronize()
        rows = []
        for r in self.records:
            (h0, h1) = r["host"]
            host = [round((h0 - self.base_host) * 1000, 3), round((h1 - self.base_host) * 1000, 3)]
            device = host
            if r["gpu"] is not None:
                assert self.base_event is not None
                device = [round(self.base_event.elapsed_time(event), 3) for event in r["gpu"]]
            rows.append({"stage": r["stage"], "rows": r["rows"], "host_ms": host,
                         "gpu_ms": device})
        return rows


def first_packet(engine: Engine, clock: StepClock, text: str, seed: int,
                 tag: str) -> tuple[float, list[dict[str, Any]]]:
    """Submits one request to the idle engine and steps it until its first chunk: the TTFB in
    ms (host, from just before ``add_request``) and the step timeline."""
    request = SynthesisRequest(text=text, options=SynthesisOptions(seed=seed), max_frames=40,
                               ignore_eos=True, request_id=tag)
    clock.start()
    engine.add_request(request)
    while True:
        outputs = engine.step()
        if any(isinstance(o, AudioChunk) and o.request_id == tag for o in outputs):
            ttfb = (time.perf_counter() - clock.base_host) * 1000
            break
    steps = clock.timeline()
    engine.abort(tag)
    while engine.has_work():
        engine.step()
    return ttfb, steps


def gpu_idle_ms(steps: list[dict[str, Any]], end_ms: float) -> float:
    """Time between the first step's GPU start and ``end_ms`` with no step's work running."""
    spans = sorted(tuple(s["gpu_ms"]) for s in steps)
    idle, reach = 0.0, spans[0][0] if spans else 0.0
    for start, stop in spans:
        idle += max(0.0, start - reach)
        reach = max(reach, stop)
    return idle + max(0.0, end_ms - reach)


def census(prof: Any, cuda: bool, top: int = 15) -> dict[str, Any]:
    """The kernels of a CUDA run (launches, busy time, the top by time); on the CPU the
    operators instead (calls, self time)."""
    events = list(prof.key_averages())
    if cuda:
        events = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]

    def ms(e: Any) -> float:
        return (e.device_time_total if cuda else e.self_cpu_time_total) / 1000

    ranked = sorted(events, key=ms, reverse=True)
    return {"launches": sum(e.count for e in events), "busy_ms": sum(ms(e) for e in events),
            "top": [{"name": e.key[:100], "count": e.count, "ms": ms(e)} for e in ranked[:top]]}


def plot(paths: list[str], png: str) -> None:
    """Each file's requests as rows of bars: each step's GPU work, coloured by stage."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"text_encode": "tab:blue", "prefill": "tab:orange", "decode": "tab:gray",
              "depth": "tab:green", "codec": "tab:red"}
    docs = [json.loads(Path(path).read_text()) for path in paths]
    fig, axes = plt.subplots(len(docs), 1, figsize=(10, 1.2 + 0.5 * sum(len(d["requests"])
                                                                       for d in docs)),
                             squeeze=False, sharex=True)
    for ax, doc, path in zip(axes[:, 0], docs, paths):
        for i, request in enumerate(doc["requests"]):
            for step in request["steps"]:
                start, end = step["gpu_ms"]
                ax.barh(i, end - start, left=start, color=colors.get(step["stage"], "k"))
            ax.text(request["gpu_end_ms"] + 0.2, i, f"{request['ttfb_ms']:.1f} ms", va="center")
        ax.set_yticks(range(len(doc["requests"])))
        ax.invert_yaxis()
        ax.set_xlabel("ms from submit (GPU work of each step)")
        overrides = ", ".join(doc.get("set") or []) or "as committed"
        ax.set_title(f"{doc['config']} ({overrides}), {doc['gpu']}, torch {doc['torch_version']}, "
                     f"{doc['git_commit']}, {doc['date'][:10]}", fontsize=8)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    fig.legend(handles, list(colors), loc="lower center", ncol=len(colors), fontsize=8)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(png, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--plot", nargs="+", default=None, metavar="JSON",
                        help="only draw these runs' timelines into --png")
    parser.add_argument("--png", default=None)
    parser.add_argument("--config", default="configs/h200-latency.toml")
    parser.add_argument("--texts", default=None)
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--requests", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="a config override (TOML value), e.g. graph.fused_prefill=true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.plot:
        plot(args.plot, args.png or args.plot[0].replace(".json", ".png"))
        return
    if args.texts is None:
        parser.error("--texts is required (unless --plot)")
    config = config_with_overrides(args.config, args.set, args.tokenizer, "trace")
    start = time.monotonic()
    engine = Engine(config)
    startup_s = time.monotonic() - start
    clock = StepClock(engine)
    items = make_workload(load_texts(args.texts), args.warmup + args.requests, seed=0)
    for item in items[: args.warmup]:
        first_packet(engine, clock, item.text, item.seed, f"warm-{item.index}")
    runs = []
    for n, item in enumerate(items[args.warmup:]):
        last = n == args.requests - 1
        if last:
            activities = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * clock.cuda
            with profile(activities=activities) as prof:
                ttfb, steps = first_packet(engine, clock, item.text, item.seed, f"r-{item.index}")
        else:
            ttfb, steps = first_packet(engine, clock, item.text, item.seed, f"r-{item.index}")
        end = steps[-1]["gpu_ms"][1]
        runs.append({"text": item.text, "ttfb_ms": ttfb, "gpu_end_ms": end,
                     "gpu_idle_ms": gpu_idle_ms(steps, end), "steps": steps})
        print(f"request {n}: TTFB {ttfb:.2f} ms, GPU idle {runs[-1]['gpu_idle_ms']:.2f} ms "
              f"of {end:.2f}; {len(item.text)} chars")
        for s in steps:
            print(f"  {s['stage']:12s} rows {s['rows']:3d}  host {s['host_ms'][0]:7.2f} - "
                  f"{s['host_ms'][1]:7.2f}  GPU {s['gpu_ms'][0]:7.2f} - {s['gpu_ms'][1]:7.2f}")
    kernels = census(prof, clock.cuda)
    print(f"census of the last first packet: {kernels['launches']} launches, "
          f"{kernels['busy_ms']:.2f} ms busy")
    for k in kernels["top"]:
        print(f"  {k['ms']:8.3f} ms  x{k['count']:<5d} {k['name']}")
    summary = {key: statistics.median(r[key] for r in runs)
               for key in ("ttfb_ms", "gpu_end_ms", "gpu_idle_ms")}
    print("medians: " + ", ".join(f"{k} {v:.2f}" for k, v in summary.items()))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**provenance(), "config": args.config, "set": args.set,
                       "startup_s": startup_s,
                       "medians": summary, "census": kernels, "requests": runs}, f, indent=2)


if __name__ == "__main__":
    main()
