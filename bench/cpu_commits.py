"""Two commits' CPU engines measured in one run, alternately: the tiny model's stage times.

Usage (repo root, CPU): ``python bench/cpu_commits.py --base 94ca6e0 [--head HEAD] [--rounds 5]
[--out bench/results/cpu-commits-<date>.json]``. For code-path changes that keep the same bits
and have no switch (a variant of ``breezert-bench`` cannot show them): each commit is checked
out into a git worktree under ``.cache/cpu-commits/`` and every round runs one child process
per commit (``PYTHONPATH`` at its ``runtime/``), base and head alternating, so both see the
box's load the same way. A child times, on one thread: one DEPTH frame (1 and 4 rows, the
15-step loop with sampling), one CODEC step (1 row, 1 / 4 / 16 frames), one DECODE step (1 row,
64 cached tokens), one whole request through ``Engine`` (25 frames of the packaged
``cpu-tiny`` profile, its chunk schedule) and, on that engine, a request's first chunk (from
``add_request``, with the profile's Predictor and first-chunk cover). Reported per commit: the
best and the median round (each round's figure is already the best of several repeats). Writes
JSON and a PNG beside it.
Must not: change either commit's tree (the worktrees are detached, registered in ``.git`` and
left for reuse; ``git worktree prune`` forgets them once ``.cache/`` is gone).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

from breezert_bench.provenance import provenance

REPO = Path(__file__).resolve().parents[1]
WORKTREES = REPO / ".cache" / "cpu-commits"

CHILD = r"""
import json, time, torch
torch.set_num_threads(1)
from breezert.config import EngineConfig
from breezert.constants import Stage
from breezert.engine import Engine
from breezert.options import SynthesisOptions
from breezert.outputs import AudioChunk
from breezert.profiles import resolve_config
from breezert.request import SynthesisRequest
from breezert.runtime_setup import build_runner, load_engine_checkpoint

def best_ms(fn, n, reps=5):
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        times.append((time.perf_counter() - start) / n * 1e3)
    return min(times)

cfg = EngineConfig.from_dict({"model": {"preset": "tiny", "dtype": "float32", "device": "cpu"},
                              "cache": {"block_size": 16, "num_blocks": 1024},
                              "graph": {"enable_cuda_graphs": False}})
runner = build_runner(cfg, load_engine_checkpoint(cfg.model))
depth, codec = runner.stages[Stage.DEPTH], runner.stages[Stage.CODEC]
decode = runner.stages[Stage.DECODE]
out = {}
with torch.inference_mode():
    for rows in (1, 4):
        inputs = depth.example_inputs(rows, False)
        out[f"depth_frame_{rows}row_ms"] = best_ms(lambda: depth.graphs.fn(**inputs), 10)
    for frames in (1, 4, 16):
        inputs = codec.example_inputs(1, frames)
        out[f"codec_step_{frames}frame_ms"] = best_ms(lambda: codec.graphs.fn(**inputs), 10)
    inputs = decode.example_inputs(1, 64, cached=48)
    out["decode_step_ms"] = best_ms(lambda: decode.graphs.fn(**inputs), 20)
engine = Engine(resolve_config("cpu-tiny"))
seeds = iter(range(1, 1000))
def submit():
    options = SynthesisOptions(seed=next(seeds))
    engine.add_request(SynthesisRequest(text="Hello from the agent.", max_frames=25,
                                        ignore_eos=True, options=options))
def request():
    submit()
    while engine.has_work():
        engine.step()
out["request_25_frames_ms"] = best_ms(request, 2, reps=3)
def first_chunk_s():
    submit()
    start, first = time.perf_counter(), None
    while engine.has_work():
        outputs = engine.step()
        if first is None and any(isinstance(o, AudioChunk) for o in outputs):
            first = time.perf_counter() - start
    return first
out["first_chunk_ms"] = min(first_chunk_s() for _ in range(5)) * 1e3
print(json.dumps(out))
"""


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, check=True, capture_output=True,
                          text=True).stdout.strip()


def worktree(rev: str) -> tuple[Path, str]:
    """A detached worktree of ``rev`` (made once) and its short commit."""
    commit = _git("rev-parse", "--short", rev)
    path = WORKTREES / commit
    if not (path / "runtime").exists():
        WORKTREES.mkdir(parents=True, exist_ok=True)
        _git("worktree", "add", "--detach", "--force", str(path), commit)
    return path, commit


def measure(tree: Path) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree / "runtime"), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, check=True,
                          capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def plot(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(record["base"]["median"])
    base = [record["base"]["median"][n] for n in names]
    head = [record["head"]["median"][n] for n in names]
    fig, ax = plt.subplots(figsize=(10, 4))
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], base, 0.4, label=f"base {record['base']['commit']}")
    ax.bar([i + 0.2 for i in x], head, 0.4, label=f"head {record['head']['commit']}")
    ax.set_xticks(list(x), [n.replace("_ms", "") for n in names], rotation=30, ha="right",
                  fontsize=8)
    ax.set_ylabel("ms (median of rounds)")
    ax.set_yscale("log")
    ax.set_title(f"tiny model on CPU, one thread · {record['cpu']} · "
                 f"torch {record['torch_version']} · {record['date'][:10]}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the commit the change replaces")
    parser.add_argument("--head", default="HEAD")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    sides = {"base": worktree(args.base), "head": worktree(args.head)}
    rounds: dict[str, list[dict[str, float]]] = {"base": [], "head": []}
    for i in range(args.rounds):
        for side, (tree, commit) in sides.items():
            rounds[side].append(measure(tree))
            print(f"round {i + 1}/{args.rounds} {side} {commit}: "
                  + ", ".join(f"{k} {v:.2f}" for k, v in rounds[side][-1].items()), flush=True)
    record = {
        "schema": "breezert.cpu_commits/1",
        **provenance(device="cpu"),  # this checkout's commit; each side's is under base/head
        "threads": 1, "rounds": args.rounds,
    }
    for side, (_, commit) in sides.items():
        names = rounds[side][0].keys()
        record[side] = {
            "commit": commit,
            "best": {n: round(min(r[n] for r in rounds[side]), 3) for n in names},
            "median": {n: round(statistics.median(r[n] for r in rounds[side]), 3)
                       for n in names},
            "rounds": rounds[side],
        }
    record["head_over_base_median"] = {
        n: round(record["head"]["median"][n] / record["base"]["median"][n], 3)
        for n in record["base"]["median"]}
    out = args.out or REPO / "bench" / "results" / (
        f"cpu-commits-{datetime.now(timezone.utc):%Y%m%d}.json")
    out.write_text(json.dumps(record, indent=1) + "\n")
    plot(record, out.with_suffix(".png"))
    print(f"{'':24s} {'base ' + record['base']['commit']:>14s} "
          f"{'head ' + record['head']['commit']:>14s}  head/base")
    for n, ratio in record["head_over_base_median"].items():
        print(f"{n:24s} {record['base']['median'][n]:14.2f} {record['head']['median'][n]:14.2f}"
              f"  {ratio:.2f}")
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
