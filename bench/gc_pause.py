"""What a full garbage-collector pass costs a serving process, with and without the start-up heap
frozen (``breezert.runtime_setup.freeze_startup_heap``), in one process.

    PYTHONPATH=runtime:bench:. .venv/bin/python bench/gc_pause.py [--config configs/h200-latency.toml]
        [--repeats 5] [--out bench/results/cpu-gc-pause-DATE.json]

Builds the engine of ``--config`` (default: the embedded CPU profile) and warms it up, so the
heap holds what serving holds: torch, the model, compiled kernels, captured graphs. Then times
``gc.collect(2)`` ``--repeats`` times with that heap as it is (how every release before 5 Dec
ran) and after ``freeze_startup_heap`` (how a server's or the shared engine now runs). A full pass runs on its own
whenever enough new objects survive, on whichever thread allocates, and holds the GIL
throughout: every stream's next step waits for it. Writes JSON (with provenance) and a PNG.

Owns: this one measurement. Must not: change the engine; it only reads the collector.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

from breezert_bench.provenance import provenance


def time_full_passes(repeats: int) -> list[float]:
    """Milliseconds of each of ``repeats`` full collections."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        gc.collect(2)
        times.append((time.perf_counter() - start) * 1000)
    return times


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=None, help="engine profile (default: the embedded one)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--git-commit", default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    from breezert.async_engine import AsyncEngine
    from breezert.profiles import resolve_config
    from breezert.runtime_setup import freeze_startup_heap

    config = resolve_config(args.config)
    start = time.monotonic()
    engine = AsyncEngine.from_config(config)
    engine.warm_up()
    startup_s = time.monotonic() - start
    heap = len(gc.get_objects())
    unfrozen = time_full_passes(args.repeats)
    freeze_startup_heap()  # what the server and the shared engine do once built
    frozen_count = gc.get_freeze_count()
    frozen = time_full_passes(args.repeats)
    doc = {
        "schema": "breezert-gc-pause/1",
        **provenance(device=config.model.device, git_commit_override=args.git_commit),
        "config": args.config or "embedded", "startup_s": round(startup_s, 2),
        "objects_tracked": heap, "objects_frozen": frozen_count,
        "full_pass_ms": {"unfrozen": [round(t, 2) for t in unfrozen],
                         "frozen": [round(t, 4) for t in frozen]},
        "median_ms": {"unfrozen": round(statistics.median(unfrozen), 2),
                      "frozen": round(statistics.median(frozen), 4)},
    }
    print(f"{heap} objects tracked ({frozen_count} frozen); full pass "
          f"median {doc['median_ms']['unfrozen']} ms unfrozen, {doc['median_ms']['frozen']} ms "
          f"frozen (max {max(unfrozen):.1f} / {max(frozen):.2f})")
    if args.out:
        out = Path(args.out)
        out.write_text(json.dumps(doc, indent=1))
        _plot(doc, out.with_suffix(".png"))


def _plot(doc: dict, png: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    runs = doc["full_pass_ms"]
    ax.boxplot([runs["unfrozen"], runs["frozen"]], tick_labels=["unfrozen", "frozen"])
    ax.set_ylabel("full collection, ms")
    ax.set_title(f"gc.collect(2) on a warmed engine ({doc['objects_tracked']} objects)\n"
                 f"{doc.get('gpu') or doc.get('cpu')}, {doc.get('git_commit')}, "
                 f"{doc.get('date', '')[:10]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


if __name__ == "__main__":
    main()
