"""Host time of one engine step at 16..256 running streams, before and after a change, in one run.

Runs the real ``Engine`` (scheduler, deadline predictor and policies, commit, outputs, metrics)
on the tiny CPU model with its worker simulated (``bench/sched_sim.py``: the H200's stage times on
a deterministic clock, so every tree steps through the same states), a closed loop of N streams
over ``texts_en.tsv`` with a listener reporting every 100 ms, and times each step on this thread's
CPU clock (other processes on a shared machine do not count): ``Scheduler.schedule`` (admission,
ranking, the pick, the plan), ``Scheduler.commit``, and the whole ``Engine.step`` less the
simulated worker (plan, commit, outputs, metrics, step record), plus the listener reports and
arrivals of the loop per step. Median and p95 over the steps after the opening burst.

Each tree is measured in its own process (``PYTHONPATH=<tree>/runtime``), the two alternating
per stream count: ``before`` is a git revision exported to a temporary directory (default: the
commit before the vectorized scheduler), ``after`` this checkout. A digest of every plan is
recorded per tree: equal digests say the two trees made the same decisions.

Usage (repo root, CPU): ``PYTHONPATH=runtime python bench/host_step.py [--before REV]
[--streams 16,64,128,256] [--steps 400] [--repeats 1] [--admission]
[--out bench/results/host-step-DATE.json]``. ``--repeats N``: N runs of each tree per stream
count, the trees alternating; the run with the median p50 is kept, every run's p50 and p95
beside it.
``--admission``: ``after`` runs with admission by real-time capacity on (``admission_capacity``
so high that every stream is admitted, as ``before``: the same plans, so the difference is what
the admission checks cost; its learning is O(1) a step and is left off to keep the plans).

Owns: the timing loop and the side-by-side record. Must not: be read as a GPU measurement (the
worker's own host work, building tensors from a plan, is not in it).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

import numpy as np

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
BEFORE_REV = "9c6c021"
"""The last commit with the per-request scheduler and predictor."""


def measure(streams: int, steps: int, warm: int, admission: bool = False) -> dict:
    """One closed loop of ``streams`` streams in this process's ``breezert``."""
    sys.path.insert(0, str(BENCH))
    import sched_sim as sim
    from breezert_bench.workload import load_texts, make_workload

    texts = load_texts(str(REPO.parent / "shared" / "bench" / "texts_en.tsv"))
    n = streams
    overrides = {"scheduler": {  # configs/h200-capacity.toml's batch limits at n streams
        "max_running_requests": n, "max_queued_requests": 32, "max_decode_requests": n,
        "max_decode_rows": 2 * n, "max_depth_requests": n, "max_depth_rows": 2 * n,
        "max_codec_requests": n}, "cache": {"num_blocks": 400 * n}}
    if admission:
        overrides["scheduler"].update(admission_capacity=1e6, admission_learn_window_s=0)
    clock = sim.SimClock((0.0, 0.0))  # model time only: the same states in every tree
    engine, worker = sim.build_engine(overrides, clock)
    times: dict[str, list[float]] = {"schedule": [], "commit": [], "step_host": [],
                                     "loop_calls": []}
    spent = {"worker": 0.0, "loop": 0.0}  # within the current step / loop iteration
    running: list[int] = []
    digest = hashlib.sha256()
    sched = engine.scheduler

    def clocked(fn, key: str, into_list: bool = True):  # type: ignore[no-untyped-def]
        def call(*args):  # type: ignore[no-untyped-def]
            start = time.thread_time()
            try:
                return fn(*args)
            finally:
                if into_list:
                    times[key].append(time.thread_time() - start)
                else:
                    spent[key] += time.thread_time() - start
        return call

    schedule = clocked(sched.schedule, "schedule")

    stages: list[str] = []
    plans: list = []  # digested after the run: the digest's own time is no tree's

    def recorded_schedule(now: float):  # type: ignore[no-untyped-def]
        plan = schedule(now)
        stages.append("idle" if plan is None else plan.stage.value)
        if plan is not None:
            plans.append(plan)
        return plan

    sched.schedule = recorded_schedule  # type: ignore[method-assign]
    sched.commit = clocked(sched.commit, "commit")  # type: ignore[method-assign]
    worker.execute = clocked(worker.execute, "worker", False)  # type: ignore[method-assign]
    engine.add_request = clocked(engine.add_request, "loop", False)  # type: ignore
    engine.report_playback = clocked(engine.report_playback, "loop", False)  # type: ignore
    step = engine.step

    def timed_step():  # type: ignore[no-untyped-def]
        running.append(sched.num_running)
        start = time.thread_time()
        out = step()
        times["step_host"].append(time.thread_time() - start - spent["worker"])
        times["loop_calls"].append(spent["loop"])
        spent["worker"] = spent["loop"] = 0.0
        return out

    engine.step = timed_step  # type: ignore[method-assign]
    sim.run_point(engine, clock, make_workload(texts, 6 * n, 0), n, "hs",
                  max_steps=warm + steps)

    for plan in plans:
        digest.update(repr((plan.stage.value, list(zip(plan.request_ids, plan_slots(plan))),
                            plan.finished_request_ids)).encode())

    def stats(values: list[float]) -> dict:
        ms = np.asarray(values) * 1000
        return {"p50_ms": round(float(np.median(ms)), 4),
                "p95_ms": round(float(np.percentile(ms, 95)), 4),
                "mean_ms": round(float(ms.mean()), 4)}
    sel = slice(warm, warm + steps)
    host, loop = times["step_host"][sel], times["loop_calls"][sel]
    by_stage: dict[str, list[float]] = {}
    for stage, seconds in zip(stages[sel], host, strict=True):
        by_stage.setdefault(stage, []).append(seconds)
    return {"streams": n, "steps": len(host), "warm_steps": warm,
            "running_p50": float(np.median(running[sel])), "running_min": min(running[sel]),
            "schedule": stats(times["schedule"][sel]), "commit": stats(times["commit"][sel]),
            "engine_step_host": stats(host),
            "engine_step_host_plus_loop_calls": stats(
                [h + c for h, c in zip(host, loop, strict=True)]),
            "engine_step_host_by_stage": {stage: {"steps": len(v), **stats(v)}
                                          for stage, v in sorted(by_stage.items())},
            "plan_digest": digest.hexdigest()[:16]}


def plan_slots(plan) -> list[int]:  # type: ignore[no-untyped-def]
    """The slot of each of ``plan``'s items: a DECODE or DEPTH batch's array in a tree whose
    plans carry arrays (``DecodeBatch``, ``DepthBatch``), one object per item before."""
    slots = getattr(plan.items, "slots", None)
    return [item.slot for item in plan.items] if slots is None else slots.tolist()


def median_run(runs: list[dict]) -> dict:
    """Of one tree's repeated runs at one stream count (the same plans each time), the one
    whose ``engine_step_host`` p50 is the median, with every run's p50 and p95 beside it (a
    shared machine's load can slow one run of a few seconds)."""
    assert len({run["plan_digest"] for run in runs}) == 1, "a tree's repeats made other plans"
    ordered = sorted(runs, key=lambda run: run["engine_step_host"]["p50_ms"])
    return {**ordered[(len(ordered) - 1) // 2],
            "repeats_engine_step_host": [run["engine_step_host"] for run in runs]}


def export_tree(rev: str, dest: Path) -> Path:
    """``runtime/`` of ``rev`` under ``dest``."""
    data = subprocess.run(["git", "-C", str(REPO), "archive", rev, "runtime"],
                          capture_output=True, check=True).stdout
    with tarfile.open(fileobj=BytesIO(data)) as tar:
        tar.extractall(dest, filter="data")
    return dest


def run_child(tree: Path, streams: int, steps: int, admission: bool = False) -> dict:
    """This script's ``--child`` mode on ``tree``'s ``breezert`` (the simulated worker and
    configs are this checkout's, the texts the shared ones)."""
    env = dict(os.environ, PYTHONPATH=str(tree / "runtime"))
    proc = subprocess.run([sys.executable, str(BENCH / "host_step.py"), "--child",
                           "--streams", str(streams), "--steps", str(steps),
                           *(["--admission"] if admission else [])],
                          env=env, capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, style in (("before", "--"), ("after", "-")):
        runs = doc["trees"][label]["runs"]
        xs = [r["streams"] for r in runs]
        for key, color in (("engine_step_host", "C0"), ("schedule", "C1")):
            ax.plot(xs, [r[key]["p50_ms"] for r in runs], style, color=color, marker="o",
                    label=f"{label}: {key} p50")
            ax.fill_between(xs, [r[key]["p50_ms"] for r in runs],
                            [r[key]["p95_ms"] for r in runs], color=color, alpha=0.08)
    ax.axhline(1.0, color="k", lw=0.8, ls=":", label="target: 1 ms at 256 streams")
    ax.set_xlabel("running streams")
    ax.set_ylabel("host ms per step (CPU time; band to p95)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_title(f"Engine host time per step, {doc['trees']['before']['rev']} vs "
                 f"{doc['git_commit']}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", default=BEFORE_REV, help="git revision measured as 'before'")
    p.add_argument("--streams", default="16,64,128,256")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--out", default=None)
    p.add_argument("--admission", action="store_true",
                   help="'after' with admission by real-time capacity on (every stream admitted)")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs of each tree per stream count, alternating; the median one is kept")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    streams = [int(s) for s in args.streams.split(",")]
    if args.child:
        for n in streams:
            print(json.dumps(measure(n, args.steps, warm=4 * n, admission=args.admission)),
                  flush=True)
        return
    from breezert_bench.provenance import provenance

    trees = {"before": {"rev": args.before, "runs": []},
             "after": {"rev": "this checkout (git_commit)", "runs": []}}
    with tempfile.TemporaryDirectory() as tmp:
        paths = {"before": export_tree(args.before, Path(tmp) / "before"), "after": REPO}
        for n in streams:  # the trees alternate, so that a change in the machine's load
            repeats: dict[str, list[dict]] = {label: [] for label in paths}  # falls on both
            for _ in range(args.repeats):
                for label, path in paths.items():
                    repeats[label].append(
                        run_child(path, n, args.steps, args.admission and label == "after"))
                    print(label, json.dumps(repeats[label][-1]), flush=True)
            for label, runs in repeats.items():
                trees[label]["runs"].append(median_run(runs))
    for b, a in zip(trees["before"]["runs"], trees["after"]["runs"], strict=True):
        a["same_plans_as_before"] = a["plan_digest"] == b["plan_digest"]
    doc = {"schema": "breezert-host-step/1", **provenance(device="cpu"),
           "options": vars(args), "trees": trees}
    stamp = time.strftime("%Y%m%d")
    out = Path(args.out or REPO / "bench" / "results" / f"host-step-{stamp}.json")
    out.write_text(json.dumps(doc, indent=1) + "\n")
    plot(doc, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
