"""The room benchmark's scale-out figures: K agent workers behind LiveKit's dispatcher (issue 36).

    python bench/room_scaleout.py --out bench/results/room-scaleout.json k1.json k2.json k4.json

Owns: which worker served each room and turn (by the pid in the agent's ``bench.ready`` and
``bench.turn`` stamps), per worker its rooms and peak concurrent turns, the placement check,
the aggregate audio rate, the scale-out table and plot, and merging the results of several
``bench/room.py --workers K`` commands (one per K and dispatch mode: each is its own device
call) into one JSON and PNG. Must not: start processes or talk to LiveKit (``bench/room.py``
does); everything here is arithmetic over its records.

The placement check. A worker is *full* while the rooms it holds reach its ``max_jobs``: its
engine's ``max_running_requests`` (one running turn per call: what ``breezert_agent.engine_load``
counts jobs against; under ``--dispatch engine`` its ``load_threshold`` admits exactly that many
jobs, so "at max_running_requests" and "at its load threshold" are one point). What a worker
holds is what it reports: ``max_jobs`` in its ``engine_ready.json``, the jobs it runs before a
run (``jobs`` in its ``metrics.json``) and, with each job, ``jobs_held`` in ``bench.ready``
(the jobs it was running when that one started). A placement counts as *misplaced* when its
worker was full while another worker had room, each other worker's holding taken from its
latest report before that job's start (``jobs_held + 1`` at its latest job start, else its count
before the run). Rooms leave only after a run's last turn, so within a run the counts only grow.
Under ``--dispatch cpu`` (or ``none``) nothing keeps a worker within its engine's places: the
check counts how often a call went past them while another worker had room.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from breezert_bench.report import write_json

Placement = tuple[float, str, int]
"""One room's job: (its start, ``time.monotonic()`` in the worker; the worker; jobs the worker
held before it)."""


def scale_k(run: Mapping[str, Any]) -> int:
    """A run's K: its engines apart (``--engine server --engines K``), else its agent workers
    (each with its engine in process)."""
    return int(run.get("num_engines") or run.get("num_workers", 1))


def count_misplaced(placements: Iterable[Placement], capacity: Mapping[str, int],
                    held_at_start: Mapping[str, int]) -> int:
    """Placements on a full worker while another worker had room (see the module doc).
    ``capacity``: every worker's ``max_jobs``; ``held_at_start``: the jobs each held before the
    run (missing: none)."""
    held = {worker: held_at_start.get(worker, 0) for worker in capacity}
    misplaced = 0
    for _, worker, before in sorted(placements):
        room_elsewhere = any(held[other] < capacity[other] for other in capacity
                             if other != worker)
        if before >= capacity[worker] and room_elsewhere:
            misplaced += 1
        held[worker] = before + 1
    return misplaced


def peak_concurrent(intervals: Iterable[tuple[float, float]]) -> int:
    """The most intervals open at once (one that ends as another starts does not overlap it)."""
    spans = list(intervals)
    events = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])
    open_now = peak = 0
    for _, step in events:
        open_now += step
        peak = max(peak, open_now)
    return peak


def placement(run: Mapping[str, Any], workers: Mapping[int, str], capacity: Mapping[str, int],
              held_at_start: Mapping[str, int]) -> dict[str, Any]:
    """Per worker (``workers``: pid -> name) its rooms, turns, peak concurrent turns (the
    agent's ``say`` to its end), ``max_jobs`` and jobs before the run; the misplaced count; and
    rooms or answered turns whose pid is none of these workers (``unknown``: a wiring fault)."""
    rooms: Counter[str] = Counter()
    placements: list[Placement] = []
    unknown = 0
    for ready in run["ready"]:
        name = workers.get(ready.get("pid", -1))
        if name is None:
            unknown += 1
            continue
        rooms[name] += 1
        placements.append((ready["job_started"], name, int(ready["jobs_held"])))
    spans: dict[str, list[tuple[float, float]]] = {name: [] for name in capacity}
    for turn in run["turns"]:
        agent = turn.get("agent")
        if not agent:  # the agent never answered: the turn's error says so
            continue
        name = workers.get(agent.get("pid", -1))
        if name is None:
            unknown += 1
        elif agent.get("said") is not None and agent.get("done") is not None:
            spans[name].append((agent["said"], agent["done"]))
    by_worker = {name: {"pid": next(p for p, n in workers.items() if n == name),
                        "rooms": rooms[name], "turns": len(spans[name]),
                        "peak_concurrent_turns": peak_concurrent(spans[name]),
                        "max_jobs": capacity[name], "jobs_at_start": held_at_start.get(name, 0)}
                 for name in sorted(capacity)}
    return {"workers": by_worker, "misplaced": count_misplaced(placements, capacity,
                                                               held_at_start),
            "unknown": unknown}


def engine_placement(run: Mapping[str, Any], workers: Mapping[int, str],
                     engine_of: Mapping[str, str], capacity: Mapping[str, int]) -> dict[str, Any]:
    """With the engines apart (``bench/room.py --engine server --engines K``): per engine the
    rooms its agents took and its ``max_jobs`` (``capacity``: its ``max_running_requests``),
    and the rooms placed on an engine that held that many while another engine had room
    (``count_misplaced`` over engines: an engine holds the rooms its agents took before, as
    rooms leave only after a run's last turn). ``workers``: pid -> worker name; ``engine_of``:
    worker name -> its engine's name."""
    held: Counter[str] = Counter()
    placements: list[Placement] = []
    for ready in sorted(run["ready"], key=lambda r: r.get("job_started", 0.0)):
        worker = workers.get(ready.get("pid", -1))
        if worker is None:  # placement() counts it as unknown
            continue
        engine = engine_of[worker]
        placements.append((ready["job_started"], engine, held[engine]))
        held[engine] += 1
    return {"engines": {name: {"rooms": held[name], "max_jobs": capacity[name]}
                        for name in sorted(capacity)},
            "misplaced": count_misplaced(placements, capacity, {})}


def audio_rate(run: Mapping[str, Any]) -> dict[str, float]:
    """Audio heard over every room (seconds) and per second of the run: the aggregate capacity
    the run delivered."""
    audio_s = sum(turn["heard"]["audio_s"] for turn in run["turns"] if "heard" in turn)
    wall_s = run["wall_s"]
    return {"audio_s": round(audio_s, 3),
            "audio_per_s": round(audio_s / wall_s, 3) if wall_s > 0 else 0.0}


# ----------------------------------------------------------------------------- report


def _label(run: Mapping[str, Any]) -> str:
    return f"K={scale_k(run)} N={run['listeners']}\n{run['variant']} {run['load']}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def scaleout_table(runs: Sequence[Mapping[str, Any]]) -> str:
    """One line a run: K, dispatch, N, turns heard, audio s/s, heard p50/p95, gaps, rooms and
    peak concurrent turns per worker, misplaced calls (with the engines apart, also the rooms
    each engine's agents took and the calls misplaced among engines)."""
    header = ("K", "dispatch", "variant", "N", "heard/turns", "audio s/s", "heard p50/p95 ms",
              "gaps q/l", "rooms per worker", "peak turns", "misplaced")
    rows = [header]
    for run in runs:
        if "summary" not in run:
            rows.append((str(scale_k(run)), run.get("dispatch", "none"),
                         run["variant"], str(run["listeners"]), "FAILED", *[""] * 6))
            continue
        s, place = run["summary"], run["placement"]
        heard = s["first_heard_after_say"]
        workers = place["workers"].values()
        rows.append((str(scale_k(run)), run["dispatch"], run["variant"],
                     str(run["listeners"]), f"{s['heard']}/{s['turns']}", f"{s['audio_per_s']:.1f}",
                     f"{_ms(heard['p50'])}/{_ms(heard['p95'])}",
                     f"{s['gaps_quiet']['count']}/{s['gaps_late']['count']}",
                     "/".join(str(w["rooms"]) for w in workers),
                     "/".join(str(w["peak_concurrent_turns"]) for w in workers),
                     str(place["misplaced"])
                     + (f" (engines {'/'.join(str(e['rooms']) for e in apart['engines'].values())}"
                        f": {apart['misplaced']})" if (apart := run.get("engine_placement"))
                        else "")))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows)


def scaleout_plot(runs: Sequence[Mapping[str, Any]], path: Path) -> Path | None:
    """Aggregate audio per second (top) and first audio heard p95 with p50 (bottom) per run, K
    and N on the axis, one bar colour per dispatch mode."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    done = [r for r in runs if "summary" in r]
    if not done:
        return None
    keys = sorted({(scale_k(r), r["listeners"], r["variant"], r["load"]) for r in done})
    modes = sorted({r["dispatch"] for r in done})
    width = 0.8 / len(modes)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(8, 1.4 * len(keys)), 8))
    for m, mode in enumerate(modes):
        xs, rate, p95, p50 = [], [], [], []
        for r in (r for r in done if r["dispatch"] == mode):
            xs.append(keys.index((scale_k(r), r["listeners"], r["variant"], r["load"]))
                      - 0.4 + width * (m + 0.5))
            heard = r["summary"]["first_heard_after_say"]
            rate.append(r["summary"]["audio_per_s"])
            p95.append((heard["p95"] or 0) * 1000)
            p50.append((heard["p50"] or 0) * 1000)
        top.bar(xs, rate, width, label=f"dispatch {mode}")
        bottom.bar(xs, p95, width, label=f"dispatch {mode}: heard p95")
        bottom.scatter(xs, p50, marker="_", color="black", zorder=3,
                       label="p50" if m == 0 else None)
        for x, r, y in zip(xs, (r for r in done if r["dispatch"] == mode), p95):
            s = r["summary"]
            gaps = s["gaps_quiet"]["count"] + s["gaps_late"]["count"]
            bottom.annotate(f"{gaps} gaps\n{r['placement']['misplaced']} misplaced", (x, y),
                            ha="center", va="bottom", fontsize=7)
    labels = [_label({"num_engines": k, "listeners": n, "variant": v, "load": ld})
              for k, n, v, ld in keys]
    for axis in (top, bottom):
        axis.set_xticks(range(len(keys)), labels, fontsize=7)
        axis.legend(fontsize=8)
    top.set_ylabel("audio heard, s per s (all rooms)")
    top.set_title("Scale-out: aggregate capacity per K workers (one engine each)")
    bottom.margins(y=0.15)  # room for the notes above the bars
    bottom.set_ylabel("first audio heard after say(), ms")
    bottom.set_title("First audio heard p95 (bar) and p50 (tick); gaps heard; misplaced calls")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def merge(paths: Sequence[Path]) -> dict[str, Any]:
    """The runs of several room results in one document, without their per-turn records (each
    source keeps them), each run naming its source; provenance per source."""
    runs, sources = [], []
    for path in paths:
        doc = json.loads(path.read_text())
        sources.append({"path": str(path), "provenance": doc.get("provenance")})
        for run in doc["runs"]:
            runs.append({**{k: v for k, v in run.items() if k not in ("requests", "rooms")},
                         "source": path.name})
    runs.sort(key=lambda r: (scale_k(r), r["listeners"], r.get("dispatch", "")))
    return {"kind": "room-scaleout", "sources": sources, "runs": runs,
            "capacity_vs_k1": _capacity_ratios(runs)}


def _capacity_ratios(runs: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, float]]:
    """Per dispatch mode and variant: each K's aggregate audio rate over K=1's (its largest-N
    run each), the issue's ">= 3.6x at 4 GPUs"."""
    best: dict[tuple[str, str, int], float] = {}
    for r in runs:
        if "summary" in r:
            key = (r["dispatch"], r["variant"], scale_k(r))
            best[key] = max(best.get(key, 0.0), r["summary"]["audio_per_s"])
    ratios: dict[str, dict[str, float]] = {}
    for (mode, variant, k), rate in sorted(best.items()):
        base = best.get((mode, variant, 1))
        if base:
            ratios.setdefault(f"{mode} {variant}", {})[f"K={k}"] = round(rate / base, 3)
    return ratios


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", type=Path, nargs="+", help="bench/room.py JSON results")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    doc = merge(args.results)
    write_json(doc, args.out)
    print(scaleout_table(doc["runs"]))
    print("capacity over K=1:", json.dumps(doc["capacity_vs_k1"]))
    png = scaleout_plot(doc["runs"], args.out.with_suffix(".png"))
    print(f"[scaleout] wrote {args.out}" + (f" and {png}" if png else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
